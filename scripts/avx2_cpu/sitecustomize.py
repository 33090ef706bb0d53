"""Imported at start-up by every Python process that ``scripts/as_avx2_cpu.sh`` runs (it puts this
folder first on ``PYTHONPATH``): torch's CPU-feature probes then answer as an AVX2-only CPU's
would, so vLLM loads its AVX2 build (``vllm._C_AVX2``) and takes its AVX2 code paths, which it
chooses by these probes rather than by ``ATEN_CPU_CAPABILITY``."""
import torch.cpu

for _probe in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
               "_is_amx_tile_supported", "_is_amx_fp16_supported", "_init_amx"):
    if hasattr(torch.cpu, _probe):
        setattr(torch.cpu, _probe, lambda: False)
