"""The pipelined Triton kernels (``kernels/triton/pipelined.py``: DEPTH K steps of weights in
flight, the outliers' loads a step ahead) in Triton's interpreter against the fp32 reference,
as tightly as the unpipelined ones (``test_triton.check``): 2, 4 and 5 bits × the GEMV's and the
tensor-core kernel's row tiles (the tensor-core kernel below 8 rows too, the launch table's other
route) × no / ELL / CSR outliers × one or several K splits, on layers whose K is a whole number of
steps or not (the last step's activations masked), fp16 and coded scales, groups that split a
step, fp32 activations; and the launch plumbing that picks them."""
import pytest
import torch

from tests.kernels.test_triton import activations, check, make_weight

triton = pytest.importorskip("triton")
from vllm_latq.kernels.triton import configs as cfg  # noqa: E402
from vllm_latq.kernels.triton import kernel as tk  # noqa: E402
from vllm_latq.kernels.triton.kernel import TritonKernel, launch_config  # noqa: E402

pytestmark = pytest.mark.skipif(not tk.INTERPRET, reason="kernel tests run in Triton's interpreter")

N = 40
_STATES = {}


def state(bits, rate, mode=None, k=300, group=128, scale_bits=None):
    key = (bits, rate, mode, k, group, scale_bits)
    if key not in _STATES:
        w = make_weight(bits=bits, k=k, rate=rate, group=group, seed=bits, scale_bits=scale_bits)
        _STATES[key] = (w, TritonKernel.prepare(w, outlier_mode=mode))
    return _STATES[key]


def cases(fast, *axes):
    """Every combination of ``axes``, those not in ``fast`` in the slow suite."""
    import itertools
    return [pytest.param(*c, marks=() if c in fast else pytest.mark.slow) for c in itertools.product(*axes)]


def run(st, x, kernel, split=1, depth=None, bias=None):
    """One launch of the pipelined ``kernel`` at ``split`` K splits (``depth``: the configured one, else
    2 where the tile has none: the kernel takes every tile, the launch table offers the spill-free ones)."""
    c = dict(launch_config(st, x.shape[0], kernel, x.device), SPLIT=split)
    c["DEPTH"] = depth or (cfg.pipelined(c, kernel, st.bits) or {"DEPTH": 2})["DEPTH"]
    return TritonKernel.apply(st, x, bias, kernel=kernel, config=c)


@pytest.mark.parametrize("bits,outliers,launch", cases(
    {(4, (0.05, "ell"), ("gemv", 1)), (4, (0.05, "csr"), ("gemv", 3)), (4, (0.05, "ell"), ("mma", 2)),
     (4, (0.05, "csr"), ("mma", 20)), (2, (0.05, "csr"), ("gemv", 1)), (2, (0.05, "ell"), ("mma", 16))},
    [2, 4, 5], [(0.0, None), (0.05, "ell"), (0.05, "csr")],
    [("gemv", 1), ("gemv", 3), ("gemv", 7), ("mma", 2), ("mma", 16), ("mma", 20), ("mma", 40)]))
def test_pipelined_kernels_match_the_reference(bits, outliers, launch):
    """K = 300: three steps at 4/5 bits, two at 2, the last reaching past K; a crowded row of
    outliers (more than the loop's slots) and rows without; bias on odd M."""
    (rate, mode), (kernel, m) = outliers, launch
    w, st = state(bits, rate, mode)
    x = activations(m, torch.bfloat16, seed=m)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16) if m % 2 else None
    check(run(st, x, kernel, bias=bias), x, w, bias)


@pytest.mark.parametrize("bits,launch,depth", cases({(4, ("gemv", 1), 4), (4, ("mma", 8), 4)},
                                                   [4, 5], [("gemv", 1), ("gemv", 4), ("mma", 8)], [2, 3, 4]))
def test_every_depth_and_split_over_whole_steps(bits, launch, depth):
    """K = 1280 (ten 128-column steps): split 4 gives splits of 3, 3, 3 and 1 steps, shorter than
    the queue; ELL outliers at 2 % ride the loop, the crowded row's rest after it."""
    kernel, m = launch
    w, st = state(bits, 0.02, "ell", k=1280)
    x = activations(m, torch.float16, k=1280, seed=m)
    for split in (1, 4):
        check(run(st, x, kernel, split=split, depth=depth), x, w)


@pytest.mark.parametrize("bits", [2, 4])
def test_splits_past_the_last_step_add_nothing(bits):
    """K = 300 in 8 splits: two or three steps, so most splits start past the last one; with
    groups narrower than a 2-bit step the scales are read in the step, so an empty split that ran
    the last step again would add it twice (a GPU run caught this)."""
    w, st = state(bits, 0.05, "csr")
    x = activations(1, torch.float16, seed=1)
    check(run(st, x, "gemv", split=8, depth=2), x, w)


@pytest.mark.parametrize("bits,launch,scales", cases({(4, ("gemv", 1), (4, 64)), (4, ("mma", 16), (None, None))},
                                                    [2, 4], [("gemv", 1), ("gemv", 2), ("mma", 16)],
                                                    [(4, 64), (None, 32), (None, None)]))
def test_scale_forms(bits, launch, scales):
    """Coded scales and groups smaller than a step (scales loaded in the step), one group per
    row (prefetched with the words)."""
    (kernel, m), (scale_bits, group) = launch, scales
    w, st = state(bits, 0.02, "ell", k=640, group=group or 640, scale_bits=scale_bits)
    x = activations(m, torch.bfloat16, k=640, seed=m)
    check(run(st, x, kernel, split=2 if m <= 16 else 1), x, w)


def test_fp32_activations():
    w, st = state(4, 0.05, "ell")
    x = activations(3, torch.float32)
    check(run(st, x, "gemv", split=2), x, w)
    check(run(st, x, "mma"), x, w)


def test_three_and_five_bit_layers_are_served_unpipelined():
    """The launch table offers no pipelined kernel for them (3 bits: the queue's three word tiles a
    step halve the resident programs; 5 bits: not compiled into the record), though the kernels
    take 5-bit layers (the tests above)."""
    assert {b for _, b, _ in cfg.PIPE_DEPTH} == {2, 4}
    assert cfg.pipelined({"BM": 1, "BN": 64}, "gemv", 3) is None and not cfg.pipelined_configs("mma", 16, 5)


def test_depth_selects_the_pipelined_kernel(monkeypatch):
    """A config with DEPTH ≥ 2 launches the pipelined kernel of its name with DEPTH, one without
    (or DEPTH 1) the unpipelined one, which takes no DEPTH."""
    seen = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((self.name, kw.get("DEPTH")))
    for kind in ("gemv", "mma"):
        monkeypatch.setitem(tk._KERNELS, kind, Recorder(kind))
        monkeypatch.setitem(tk._PIPELINED, kind, Recorder(kind + "+"))
    w, st = state(4, 0.0)
    x = activations(1, torch.float16)
    for depth, want in ((None, ("gemv", None)), (1, ("gemv", None)), (4, ("gemv+", 4))):
        c = dict(launch_config(st, 1, "gemv", x.device), **({} if depth is None else {"DEPTH": depth}))
        TritonKernel.apply(st, x, kernel="gemv", config=c)
        assert seen.pop() == want
    TritonKernel.apply(st, activations(8, torch.float16), kernel="mma",
                       config=cfg.pipelined(launch_config(st, 8, "mma", x.device), "mma", 4))
    assert seen.pop() == ("mma+", cfg.PIPE_DEPTH["mma", 4, 16])
