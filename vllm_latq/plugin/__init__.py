"""vLLM general plugin (entry point ``vllm.general_plugins: latq``).

vLLM calls :func:`register` in every process, maybe twice: it stays cheap, idempotent and vLLM-free."""
from __future__ import annotations

from .names import LOAD_FORMAT, QUANT_NAME

_registered = False


def register() -> None:
    """Register the ``latq`` quantization method and load format with vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.model_loader import register_model_loader

    from .config import LatqConfig
    from .weights import LatqModelLoader

    # Registering again would only overwrite the same class (vLLM logs it at debug level);
    # the flag keeps repeated calls free.
    register_quantization_config(QUANT_NAME)(LatqConfig)
    register_model_loader(LOAD_FORMAT)(LatqModelLoader)
    _registered = True
