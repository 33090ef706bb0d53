"""The Triton kernels' cost model (``kernels/triton/cost_model.py``), pure functions, no GPU:

* the crossover thresholds (the numbers docs/KERNELS.md quotes), where the model crosses,
  monotone in layer size, never below 17;
* the tensor cores at an achievable efficiency (the published MAMF figures), not peak, and
  the switch to dequantise-once moving with the device and the kernel as it should;
* the tensor-core row tile per M;
* the device constants from ``torch.cuda.get_device_properties``: HBM bandwidth = 2 ×
  memory clock × bus width, issue rate from SMs × clock, family defaults where torch
  reports nothing;
* the predicted ratio vs bf16 ``F.linear`` on the 4096 × 14336 4-bit 1 % layer.
"""
import pytest
import torch

from vllm_latq.kernels.triton import cost_model as tm
from vllm_latq.kernels.triton.layout import WIDTHS

NEVER = tm.NEVER
SHAPES_8B = ((4096, 4096), (4096, 14336), (14336, 4096))


def test_mma_row_tiles():
    assert [tm.mma_bm(m) for m in (1, 16, 17, 32, 33, 64, 65, 4096)] == [16, 16, 32, 32, 64, 64, 64, 64]
    assert set(tm.MMA_IPW) == {(b, bm) for b in WIDTHS for bm in tm.MMA_BMS}     # every width the kernels take


def test_threshold_documented_numbers():
    """docs/KERNELS.md's table (bf16, g = 128, no outliers), the same for the three
    8B-class shapes: the 64-row MMA tiles beat dequantise-once up to M = 64..192."""
    table = {"a100": {2: 129, 3: 65, 4: 129, 5: 129}, "h100": {2: 193, 3: 129, 4: 193, 5: 129}}
    for dev, by_bits in table.items():
        for bits, m in by_bits.items():
            for n, k in SHAPES_8B:
                assert tm.large_m_threshold(n, k, bits, 0, torch.bfloat16, dev) == m, (dev, bits, n, k)
    assert tm.large_m_threshold(4096, 4096, 3, 0) == 65                    # A100 is the default


@pytest.mark.parametrize("dev", ["a100", "h100"])
def test_threshold_is_where_the_model_crosses(dev):
    m = tm.large_m_threshold(4096, 14336, 3, 0, torch.bfloat16, dev)
    t = tm.model_times(m - 1, 4096, 14336, 3, 0, torch.bfloat16, dev)
    assert t["deq"] >= t["mma"]
    for mm in (m, m + 7, m + 63, 2 * m, 8192):
        t = tm.model_times(mm, 4096, 14336, 3, 0, torch.bfloat16, dev)
        assert t["deq"] < t["mma"], (dev, mm)


@pytest.mark.parametrize("dev", ["a100", "h100"])
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_threshold_monotone_and_never_small(bits, dev):
    sizes = [(16, 16), (64, 64), (256, 256), (512, 1024), (1024, 1024), (2048, 2048), (4096, 4096),
             (4096, 14336), (8192, 8192), (8192, 28672), (16384, 32768), (32768, 65536)]
    ths = [tm.large_m_threshold(n, k, bits, 0, torch.bfloat16, dev) for n, k in sizes]
    assert all(t >= 17 for t in ths)
    assert all(a >= b for a, b in zip(ths, ths[1:])), ths                 # larger layer: no later
    # outliers cost the MMA kernel per M tile: never a later switch
    assert tm.large_m_threshold(4096, 4096, bits, 4096 * 41, torch.bfloat16, dev) <= ths[6]


class Props:                              # the fields of torch.cuda.get_device_properties we read
    def __init__(self, major=9, sms=114, clock=1755000, mem_clock=1593000, bus=5120):
        self.name, self.major, self.minor, self.multi_processor_count = "GPU", major, 0, sms
        self.L2_cache_size, self.clock_rate, self.memory_clock_rate, self.memory_bus_width = 50 << 20, clock, mem_clock, bus


def test_device_model_from_properties():
    d = tm.device_model(Props())                                       # an H100 PCIe-like part
    h = tm.DEVICES["h100"]
    assert d.sms == 114 and d.l2_bytes == 50 << 20
    assert d.hbm_bw == pytest.approx(2 * 1593e6 * 5120 / 8) == pytest.approx(2.04e12, rel=0.01)
    assert d.issue == pytest.approx(114 * 128 * 1.755e9) and d.tc_flops == pytest.approx(h.tc_flops * 114 / 132)
    # an H200 differs from an H100 SXM only in memory: its own bandwidth (4.8 TB/s)
    assert tm.device_model(Props(sms=132, mem_clock=3000000, bus=6400)).hbm_bw == pytest.approx(4.8e12)
    # torch without memory clock / SM clock: the family's constants
    bare = Props(major=8, sms=108, clock=0, mem_clock=0, bus=0)
    a = tm.device_model(bare)
    assert (a.hbm_bw, a.issue, a.tc_flops) == (tm.DEVICES["a100"].hbm_bw, tm.DEVICES["a100"].issue,
                                               tm.DEVICES["a100"].tc_flops)
    assert a.tc_eff == tm.DEVICES["a100"].tc_eff and d.tc_eff == h.tc_eff   # the family's η
    assert tm.large_m_threshold(4096, 4096, 3, 0, torch.bfloat16, bare) == 65
    # a GDDR part (A10-like: 6251 MHz × 384 bit) gets its own 600 GB/s
    slow = Props(major=8, sms=72, clock=1695000, mem_clock=6251000, bus=384)
    assert tm.device_model(slow).hbm_bw == pytest.approx(600e9, rel=0.01)


def test_predicted_ratio_vs_bf16():
    """4096 × 14336 at 4 bits, 1 % outliers: the best latq path over bf16 ``F.linear`` (the
    issue's target: ≥ 1 at every M ≤ 256). Predicted ≥ 1.07 up to M = 64 on both models,
    below 1 from M = 65 (two 64-row tiles) to 256 (docs/KERNELS.md)."""
    nnz = int(0.01 * 4096 * 14336)

    def ratio(m, dev):
        t = tm.model_times(m, 4096, 14336, 4, nnz, torch.bfloat16, dev)
        return t["unquantized"] / min(t["mma"], t["deq"])
    for dev in ("a100", "h100"):
        assert min(ratio(m, dev) for m in range(17, 65)) > 1.07
        assert max(ratio(m, dev) for m in range(65, 257)) < 1
    assert [round(ratio(m, "a100"), 2) for m in (16, 64, 65, 129, 256)] == [2.58, 1.09, 0.54, 0.45, 0.6]
    assert [round(ratio(m, "h100"), 2) for m in (16, 64, 65, 129, 256)] == [3.02, 1.4, 0.7, 0.48, 0.46]


def test_tensor_cores_at_achievable_efficiency():
    """η = the maximum achievable matmul FLOPS over the datasheet peak (bf16, the published
    MAMF table docs/KERNELS.md cites): every tensor-core term runs at η · peak."""
    a, h = tm.DEVICES["a100"], tm.DEVICES["h100"]
    assert a.tc_achievable == pytest.approx(271.2e12) and h.tc_achievable == pytest.approx(794.5e12 * 990 / 989)
    assert 0.8 < h.tc_eff < a.tc_eff < 0.9
    m, n, k = 8192, 4096, 14336                                  # compute-bound: the GEMM term binds
    assert tm.model_times(m, n, k, 4, 0, torch.bfloat16, "a100")["unquantized"] == pytest.approx(2 * m * n * k / 271.2e12)


def replace(dev: str, **kw) -> tm.DeviceModel:
    import dataclasses
    return dataclasses.replace(tm.DEVICES[dev], **kw)


@pytest.mark.parametrize("dev", ["a100", "h100"])
def test_switch_moves_as_it_should(dev):
    """Dequantise-once + cuBLAS takes over where a bf16 GEMM wins: for 8B shapes by 256 rows
    (vLLM's own AWQ switch), not thousands (full peak and dequantisation overlapped put the
    A100's 4-bit switch at 3265). Slower HBM (the dequantised copy is written and re-read)
    moves it later, faster HBM and weaker tensor cores (the MMA kernel pays for its MMAs after
    its decode, the GEMM hides them under memory) no later, more decode work no later."""
    for n, k in SHAPES_8B:
        for bits in WIDTHS:
            th = tm.large_m_threshold(n, k, bits, 0, torch.bfloat16, dev)
            assert th <= 256, (n, k, bits)
            assert tm.large_m_threshold(n, k, bits, 0, torch.bfloat16, replace(dev, hbm_bw=0.6e12)) > th
            assert tm.large_m_threshold(n, k, bits, 0, torch.bfloat16, replace(dev, hbm_bw=4.8e12)) <= th
            assert tm.large_m_threshold(n, k, bits, 0, torch.bfloat16, replace(dev, tc_eff=0.5)) <= th
        assert (tm.large_m_threshold(n, k, 3, 0, torch.bfloat16, dev)        # 3 bits: the longest K loop
                <= min(tm.large_m_threshold(n, k, b, 0, torch.bfloat16, dev) for b in (2, 4)))


def test_coded_scales_in_the_model():
    """Coded group scales (``--scale-bits 4``): 12 bytes per 16 scales streamed (g64: 0.094 b/w
    of scales, fp16 g128: 0.125), a costlier K loop (the decode), so the MMA kernel's issue
    term grows and the switch to dequantise-once comes no later; the layer's own form is used."""
    n = k = 4096
    bpw = {(g, c): 8 * tm.packed_bytes(n, k, 4, 0, g, c) / (n * k) - 4 for g in (64, 128) for c in (False, True)}
    assert bpw == {(64, False): 0.25, (128, False): 0.125, (64, True): 0.09375, (128, True): 0.046875}
    assert set(tm.MMA_IPW_CODED) == set(tm.MMA_IPW)
    assert all(tm.MMA_IPW_CODED[key] >= tm.MMA_IPW[key] for key in tm.MMA_IPW)
    for dev in ("a100", "h100"):
        for bits in WIDTHS:
            assert (tm.large_m_threshold(n, 14336, bits, 0, torch.bfloat16, dev, 64, coded=True)
                    <= tm.large_m_threshold(n, 14336, bits, 0, torch.bfloat16, dev, 64))
        t16, tc = (tm.model_times(1, n, 14336, 4, 0, torch.bfloat16, dev, 64, coded=c) for c in (False, True))
        assert tc["deq"] < t16["deq"]                       # fewer bytes where the issue term does not bind

