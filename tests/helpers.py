"""Test helpers no bench needs: the kernel tests' outlier pattern, the block replay check; the fake GPU
timer is ``vllm_latq.testing.timers``' (what tests and benches share lives in ``vllm_latq.testing``)."""
from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from vllm_latq.testing.timers import FakeTimer  # noqa: F401  (the benches' tests time with it)

# kernel tests' outlier pattern (random_weight rows=): row 1 has half its columns as outliers
# (a crowded row), rows 3..5 none
CROWDED = ((1, 0.5), (3, 0.0), (4, 0.0), (5, 0.0))


def replay_blocks(model_dir, ntokens: int):
    """Load the HF model at ``model_dir`` (fp32), capture block 0's inputs and every block's
    keyword arguments, and replay the blocks one by one, asserting that each reproduces the
    model's own hidden states exactly. → (blocks, per-block kwargs, the model's hidden states)."""
    from transformers import AutoModelForCausalLM

    from vllm_latq import hf_model
    from vllm_latq.quantize import capture
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 1000, (1, ntokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(input_ids=ids, output_hidden_states=True).hidden_states
        _, layers = hf_model.decoder_layers(m)
        x, kwargs = capture.capture(m, layers, ids, all_kwargs=True)
        assert torch.equal(x, ref[0])
        for i in range(len(layers) - 1):
            x = capture.run_block(layers[i], x, kwargs[i])
            assert torch.equal(x, ref[i + 1]), f"block {i}"
    return layers, kwargs, ref


@contextlib.contextmanager
def op_setting(name: str, value):
    """The C++ ops' process-wide setting ``name`` (read by ``torch.ops.latq_cpu.<name>()``, set by
    ``set_<name>``) at ``value`` within the block, then back to what it was."""
    ops = torch.ops.latq_cpu
    saved = getattr(ops, name)()
    getattr(ops, f"set_{name}")(value)
    try:
        yield
    finally:
        getattr(ops, f"set_{name}")(saved)


@contextlib.contextmanager
def gemv_isa_set(name: str):
    """The C++ GEMV on instruction set ``name`` within the block (AVX2 runs on an AVX-512 CPU
    too); skips the test where this CPU or build lacks it; nothing to set without the op."""
    from vllm_latq import native
    if not native.available():
        yield None
        return
    saved = torch.ops.latq_cpu.gemv_isa()
    try:
        torch.ops.latq_cpu.set_gemv_isa(name)
    except RuntimeError as e:
        pytest.skip(str(e))
    try:
        yield name
    finally:
        torch.ops.latq_cpu.set_gemv_isa(saved)


def random_layer_problem(r: int = 24, c: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random correlated layer problem (W, H = XᵀX/n) in fp64."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(c, dtype=torch.float64) + 0.3 * torch.randn(c, c, generator=g, dtype=torch.float64)
    X = torch.randn(512, c, generator=g, dtype=torch.float64) @ mix
    return torch.randn(r, c, generator=g, dtype=torch.float64) * 0.05, X.T @ X / 512


def _param_id(v) -> str:
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    if isinstance(v, dict):
        return "_".join(f"{k}{x}" for k, x in v.items())
    return str(v)


def pairwise(**values) -> list:
    """The whole grid over ``values`` (name → its values; a name "a,b" takes tuples, one value of
    each) as pytest params for ``parametrize`` of the names joined by commas: a covering subset in
    which every pair of values of any two names meets at least once runs in the default suite, the
    rest of the grid is marked slow and runs in the slow suite. A fault in one value or in one
    interaction of two shows in the default suite."""
    return _covering(2, values)


def each_value(**values) -> list:
    """As :func:`pairwise`, the default subset only holding every value of every name once at least
    (for two-name grids, where all pairs would be the whole grid)."""
    return _covering(1, values)


def pairs_sampled(**values) -> list:
    """As :func:`pairwise` for a grid too large to run whole: a covering subset holding every value of
    every name once at least runs in the default suite, the cases that complete a covering of every
    pair of values of any two names run in the slow suite, and the grid's other cases not at all."""
    lists = list(values.values())
    grid = list(itertools.product(*(range(len(v)) for v in lists)))
    once = _greedy(grid, 1)
    both = _greedy(grid, 2, once)
    return [_param(values, c, slow=c not in once) for c in grid if c in both]


def _covering(strength: int, values: dict) -> list:
    lists = list(values.values())
    grid = list(itertools.product(*(range(len(v)) for v in lists)))   # indices: values need not hash
    keep = _greedy(grid, strength) if len(lists) >= strength else set(grid)
    return [_param(values, c, slow=c not in keep) for c in grid]


def _greedy(grid: list, strength: int, keep: set = frozenset()) -> set:
    """``keep`` and the cases added to it, greedily, until every ``strength`` values of ``strength``
    names meet in one of them: the case meeting the most not yet met, the first in grid order on ties."""
    def pairs(case):
        return frozenset(tuple((i, case[i]) for i in ii) for ii in itertools.combinations(range(len(case)), strength))

    met = {c: pairs(c) for c in grid}   # once: large grids are searched again for each case kept
    keep = set(keep)
    todo = set().union(*met.values()) - set().union(set(), *(met[c] for c in keep))
    while todo:
        best = max(grid, key=lambda c: len(met[c] & todo))
        keep.add(best)
        todo -= met[best]
    return keep


def _param(values: dict, case: tuple, slow: bool):
    """Grid case ``case`` (an index into each name's values) as a pytest param, marked slow if ``slow``."""
    flat = [x for name, vs, i in zip(values, values.values(), case) for x in (vs[i] if "," in name else (vs[i],))]
    return pytest.param(*flat, id="-".join(_param_id(v) for v in flat), marks=pytest.mark.slow if slow else ())
