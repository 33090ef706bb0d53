"""vLLM's layer prefixes ↔ the checkpoint's module names: the one place latq maps between them.

vLLM builds a prefix by joining names with dots, and some of its models join onto an empty one
(StableLM, GPT-2, PLaMo 3 name their head ``.lm_head``); the checkpoint knows ``lm_head``. A model's
``hf_to_vllm_mapper`` renames the checkpoint's tensors, and some renamings match only a whole tensor
name (transformers' ``^embed_out\\.`` → ``lm_head.`` for GPT-NeoX): a module is mapped as its tensors are."""
from __future__ import annotations


def checkpoint_module(prefix: str) -> str:
    """The module a vLLM ``prefix`` names, as the checkpoint writes it: its dotted parts, empty ones dropped."""
    return ".".join(part for part in prefix.split(".") if part)


def vllm_module(mapper, module: str, tensor: str) -> str | None:
    """The vLLM layer that checkpoint ``module``'s tensor ``tensor`` loads into (``mapper``: the
    model's ``hf_to_vllm_mapper``); None where the mapper drops it."""
    name = mapper.map_name(f"{module}.{tensor}")
    if name is None:
        return None
    if not name.endswith(f".{tensor}"):
        raise ValueError(f"latq: vLLM's weight mapper renames the tensor {module}.{tensor} to {name}, "
                         f"not a tensor {tensor} of a module")
    return checkpoint_module(name[:-len(tensor) - 1])
