"""Issue 19: no CPU-only tensor on the way to a CUDA device. Every load, prepare, dequantize,
transcode and CSR path runs under :func:`tests.device_guard.factories_follow_inputs`, which
fails at the first tensor factory that names no device (the crash a CUDA load would hit)."""
from __future__ import annotations

import pytest
import torch

from tests.device_guard import DeviceUnspecified, factories_follow_inputs
from vllm_latq import format as fmt
from vllm_latq.kernels.reference import random_weight


def test_guard_catches_the_old_unpack():
    """The unpack of 9cfa0dd built its bit positions with torch.arange(32) on the CPU."""
    def old_unpack(qweight, bits, in_features):
        tiles = qweight.shape[1] // bits
        w = qweight.to(torch.int64).reshape(-1, tiles, bits, 1) & 0xFFFFFFFF
        bitplanes = ((w >> torch.arange(32)) & 1).reshape(-1, tiles, 32, bits)
        return ((bitplanes << torch.arange(bits)).sum(-1).reshape(-1, tiles * 32)[:, :in_features]
                - 2 ** (bits - 1)).to(torch.int32)

    q = fmt.pack(torch.zeros(4, 40, dtype=torch.int32), 3)
    with factories_follow_inputs(), pytest.raises(DeviceUnspecified, match="arange"):
        old_unpack(q, 3, 40)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_format_paths(bits):
    w = random_weight(48, 200, bits, 0.05, group=64, seed=bits)
    z = fmt.unpack(w.qweight, bits, 200)
    mask = z == 0
    with factories_follow_inputs():
        assert torch.equal(fmt.pack(z, bits), w.qweight)
        assert torch.equal(fmt.unpack(w.qweight, bits, 200), z)
        fmt.dequantize(w.qweight, w.scales, w.crow, w.col, w.val, bits, 64, 200)
        fmt.csr_rows(w.crow, w.nnz)
        fmt.csr_from_mask(mask, z)
        fmt.unpack_at(w.qweight, bits, fmt.csr_rows(w.crow, w.nnz), w.col)
