"""Scratch per stream: two layers issued on two streams (vLLM runs MoE shared experts on a
second stream) never share the split-K partials or the large-M dequantisation buffer, while
layers on one stream keep sharing one buffer, sized at load for every stream."""
import pytest
import torch

triton = pytest.importorskip("triton")
from vllm_latq.kernels.triton import dequant as td  # noqa: E402
from vllm_latq.kernels.triton import kernel as tk  # noqa: E402
from vllm_latq.kernels.triton.kernel import TritonKernel  # noqa: E402
from vllm_latq.testing.weights import random_weight  # noqa: E402


class FakeStream:
    def __init__(self, sid):
        self.stream_id = sid


def on_stream(monkeypatch, sid):
    """Make ``sid`` the current stream of every device type the kernels may ask about."""
    for mod in (torch.cuda, torch.cpu):
        monkeypatch.setattr(mod, "current_stream", lambda *a, **k: FakeStream(sid))


def span(t):
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def disjoint(a, b):
    return span(a)[1] <= span(b)[0] or span(b)[1] <= span(a)[0]


@pytest.fixture
def layers():
    return [TritonKernel.prepare(random_weight(64, 512, 4, 0.0, seed=s)) for s in (1, 2)]


def test_split_k_scratch_per_stream(monkeypatch, layers):
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(args[11])        # the split-K scratch argument
    monkeypatch.setitem(tk._KERNELS, "gemv", Recorder())
    monkeypatch.setattr(TritonKernel, "splitk_workspace", td.Workspace())
    x = torch.zeros(1, 512, dtype=torch.float16)
    split = dict(BN=32, SPLIT=2, num_warps=2)
    for sid, st in ((1, layers[0]), (2, layers[1]), (1, layers[1])):
        on_stream(monkeypatch, sid)
        TritonKernel.apply(st, x, kernel="gemv", config=split)
    a, b, again = seen
    assert a.numel() >= tk.splitk_floats(64) and disjoint(a, b), "two streams share split-K scratch"
    assert a.data_ptr() == again.data_ptr(), "one stream's layers should share one buffer"


def test_large_m_workspace_per_stream(monkeypatch, layers):
    outs = []

    def record(st, out, row0=0):
        outs.append(out)
        return out.zero_()
    monkeypatch.setattr(td, "dequantize_into", record)
    monkeypatch.setattr(TritonKernel, "workspace", td.Workspace(max_bytes=td.DEFAULT_MAX_BYTES))
    x = torch.zeros(40, 512, dtype=torch.bfloat16)
    for sid, st in ((1, layers[0]), (2, layers[1])):
        on_stream(monkeypatch, sid)
        TritonKernel.apply(st, x, kernel="dequant")
    assert disjoint(*outs), "two streams share the large-M workspace"


def test_reserved_size_reaches_every_stream(monkeypatch):
    """A stream first seen after load (vLLM's capture stream, a shared-experts stream) gets the
    size reserved at load at once, so it never grows during a capture."""
    ws = td.Workspace()
    on_stream(monkeypatch, 1)
    ws.reserve(256, 512, torch.float16, torch.device("cpu"))
    on_stream(monkeypatch, 7)
    first = ws.flat(16, torch.float16, torch.device("cpu"))
    whole = ws.flat(256 * 512, torch.float16, torch.device("cpu"))
    assert first.data_ptr() == whole.data_ptr()
    assert ws.nbytes() == 2 * 256 * 512 * 2
