"""Scratch per lane: every stream vLLM orders with the forward (the default stream, a CUDA-graph
capture stream, the memory profiler's) shares one buffer, sized at load, so a new capture
stream allocates nothing after vLLM sized the KV cache; a stream vLLM runs concurrently with
the forward (MoE shared experts: ``graphs.concurrent_streams``) gets its own, also at load,
and never shares the split-K partials or the large-M dequantisation buffer."""
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
from vllm_latq.kernels import graphs  # noqa: E402
from vllm_latq.kernels.triton import dequant as td  # noqa: E402
from vllm_latq.kernels.triton import kernel as tk  # noqa: E402
from vllm_latq.kernels.triton.kernel import TritonKernel  # noqa: E402
from vllm_latq.testing.weights import random_weight  # noqa: E402

DEFAULT, CAPTURE, PROFILER, AUX = 1, 2, 3, 9


class FakeStream:
    def __init__(self, sid):
        self.stream_id = sid


def on_stream(monkeypatch, sid):
    """Make ``sid`` the current stream of every device type the kernels may ask about."""
    for mod in (torch.cuda, torch.cpu):
        monkeypatch.setattr(mod, "current_stream", lambda *a, **k: FakeStream(sid))


def concurrent(monkeypatch, *sids):
    monkeypatch.setattr(graphs, "concurrent_streams", lambda: [FakeStream(s) for s in sids])


def span(t):
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def disjoint(a, b):
    return span(a)[1] <= span(b)[0] or span(b)[1] <= span(a)[0]


@pytest.fixture
def layers():
    return [TritonKernel.prepare(random_weight(64, 512, 4, 0.0, seed=s)) for s in (1, 2)]


def split_k_scratch(monkeypatch, calls):
    """The split-K scratch each (stream, layer) gemv launch gets, with the layers reserved at load."""
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(args[11])        # the split-K scratch argument
    monkeypatch.setitem(tk._KERNELS, "gemv", Recorder())
    ws = td.Workspace()
    monkeypatch.setattr(TritonKernel, "splitk_workspace", ws)
    on_stream(monkeypatch, DEFAULT)
    for st in {id(st): st for _, st in calls}.values():
        TritonKernel.reserve(st, torch.float16)
    loaded = ws.nbytes()
    x = torch.zeros(1, 512, dtype=torch.float16)
    for sid, st in calls:
        on_stream(monkeypatch, sid)
        TritonKernel.apply(st, x, kernel="gemv", config=dict(BN=32, SPLIT=2, num_warps=2))
    assert ws.nbytes() == loaded, "scratch allocated after load"
    return seen, loaded


def test_streams_ordered_with_the_forward_share_the_split_k_scratch(monkeypatch, layers):
    seen, loaded = split_k_scratch(monkeypatch, [(DEFAULT, layers[0]), (PROFILER, layers[1]), (CAPTURE, layers[0])])
    assert loaded == tk.splitk_floats(64) * 4
    assert len({t.data_ptr() for t in seen}) == 1, "the capture streams should reuse the forward's buffer"


def test_a_concurrent_stream_has_its_own_split_k_scratch_reserved_at_load(monkeypatch, layers):
    concurrent(monkeypatch, AUX)
    seen, loaded = split_k_scratch(monkeypatch, [(DEFAULT, layers[0]), (AUX, layers[1]), (CAPTURE, layers[1])])
    main, aux, capture = seen
    assert loaded == 2 * tk.splitk_floats(64) * 4
    assert disjoint(main, aux), "the shared-experts stream shares split-K scratch with the forward"
    assert main.data_ptr() == capture.data_ptr()


def test_large_m_workspace_per_lane(monkeypatch, layers):
    outs = []

    def record(st, out, row0=0):
        outs.append(out)
        return out.zero_()
    monkeypatch.setattr(td, "dequantize_into", record)
    ws = td.Workspace(max_bytes=td.DEFAULT_MAX_BYTES)
    monkeypatch.setattr(TritonKernel, "workspace", ws)
    concurrent(monkeypatch, AUX)
    on_stream(monkeypatch, DEFAULT)
    TritonKernel.reserve(layers[0], torch.bfloat16)
    loaded = ws.nbytes()
    x = torch.zeros(40, 512, dtype=torch.bfloat16)
    for sid, st in ((DEFAULT, layers[0]), (AUX, layers[1]), (CAPTURE, layers[1])):
        on_stream(monkeypatch, sid)
        TritonKernel.apply(st, x, kernel="dequant")
    main, aux, capture = outs
    assert loaded == 2 * 64 * 512 * 2 and ws.nbytes() == loaded
    assert disjoint(main, aux) and main.data_ptr() == capture.data_ptr()


def test_a_stream_first_seen_after_load_allocates_nothing(monkeypatch):
    """vLLM's capture stream (and its memory profiler's) is created after the KV cache is sized:
    it finds the main lane's buffer, sized at load."""
    ws = td.Workspace()
    on_stream(monkeypatch, DEFAULT)
    ws.reserve(256, 512, torch.float16, torch.device("cpu"))
    on_stream(monkeypatch, CAPTURE)
    first = ws.flat(16, torch.float16, torch.device("cpu"))
    whole = ws.flat(256 * 512, torch.float16, torch.device("cpu"))
    assert first.data_ptr() == whole.data_ptr() and ws.nbytes() == 256 * 512 * 2


def test_concurrent_streams_are_vllms_aux_stream(monkeypatch):
    """The one stream vLLM runs layers on beside the forward's is ``aux_stream()``'s, kept in
    ``vllm.utils.torch_utils._aux_stream``; read without creating it (or importing vLLM)."""
    monkeypatch.delitem(sys.modules, "vllm.utils.torch_utils", raising=False)
    assert graphs.concurrent_streams() == []
    monkeypatch.undo()
    tu = pytest.importorskip("vllm.utils.torch_utils")
    assert "_aux_stream" in vars(tu) and "aux_stream" in vars(tu), "vLLM moved its aux stream: update graphs"
    monkeypatch.setattr(tu, "_aux_stream", None)
    assert graphs.concurrent_streams() == []
    aux = FakeStream(AUX)
    monkeypatch.setattr(tu, "_aux_stream", aux)
    assert graphs.concurrent_streams() == [aux]


def test_cuda_and_its_current_index_are_one_device(monkeypatch):
    """A layer reserves under its tensors' ``cuda:N`` and a caller may ask under ``cuda``: one key,
    so the reserved buffer is found (a bare H100 run found the split-K scratch empty without it)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert td._device("cuda") == td._device("cuda:3") == torch.device("cuda", 3)
    assert td._device("cuda:1") == torch.device("cuda", 1) and td._device("cpu") == torch.device("cpu")
