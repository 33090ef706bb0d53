"""vLLM general plugin (entry point ``vllm.general_plugins: latq``).

vLLM calls :func:`register` in every process it starts (front end, API server, engine
core, workers), possibly more than once per process; it must stay cheap and idempotent.
Everything heavy is imported lazily: this module imports nothing from vLLM at import time.
Select plugins with vLLM's ``VLLM_PLUGINS`` allow-list (``VLLM_PLUGINS=latq``).
"""
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
