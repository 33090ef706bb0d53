"""Names, vLLM-free (latq-serve reads them before vLLM starts): what latq registers with vLLM, and
vLLM's layer prefixes ↔ the checkpoint's module names, the one place latq maps them
(docs/ARCHITECTURE.md, "Loading": why a prefix is normalised and a module mapped as its tensors)."""
from __future__ import annotations

QUANT_NAME = "latq"    # the quantization method
LOAD_FORMAT = "latq"   # the --load-format of latq's loader (weights.LatqModelLoader)


def checkpoint_module(prefix: str) -> str:
    """The module a vLLM ``prefix`` names, as the checkpoint writes it: its dotted parts, empty ones dropped."""
    return ".".join(part for part in prefix.split(".") if part)


def vllm_module(mapper, module: str, tensor: str) -> str | None:
    """The vLLM layer checkpoint ``module``'s ``tensor`` loads into by the model's ``mapper``; None: dropped."""
    name = mapper.map_name(f"{module}.{tensor}")
    if name is None:
        return None
    if not name.endswith(f".{tensor}"):
        raise ValueError(f"latq: vLLM's weight mapper renames the tensor {module}.{tensor} to {name}, "
                         f"not a tensor {tensor} of a module")
    return checkpoint_module(name[:-len(tensor) - 1])
