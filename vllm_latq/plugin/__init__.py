"""vLLM general plugin (entry point ``vllm.general_plugins: latq``).

vLLM calls :func:`register` in every process, maybe twice: it stays cheap, idempotent and vLLM-free."""
from __future__ import annotations

QUANT_NAME = "latq"
_registered = False


def register() -> None:
    """Register the ``latq`` quantization method with vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    from .config import LatqConfig

    # Registering again would only overwrite the same class (vLLM logs it at debug level);
    # the flag keeps repeated calls free.
    register_quantization_config(QUANT_NAME)(LatqConfig)
    _registered = True
