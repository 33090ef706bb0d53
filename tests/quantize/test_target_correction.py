"""Target correction (after Qronos): each linear solved against ``W′ = (X̃ᵀX̃+λI)⁻¹X̃ᵀX·W``,
X its inputs with the full-precision prefix, X̃ with the quantized one (``--target-correction``)."""
from __future__ import annotations

import pytest
import torch

from vllm_latq.testing.tiny_models import TINY_OPTS, make_tiny_model
from vllm_latq import format as fmt
from vllm_latq import hf_model
from vllm_latq.format.checkpoint import Checkpoint
from vllm_latq.quantize import capture
from vllm_latq.quantize.activations import Activations
from vllm_latq.quantize.target_correction import target_corrected_stages
from vllm_latq.quantize.hessian import qronos_target
from vllm_latq.quantize.pipeline import QuantizeOptions, quantize_model


def _stream(run_dir, x: torch.Tensor) -> Activations:
    """The sequences ``x`` [n, seqlen, hidden] as an in-memory activations stream in ``run_dir``."""
    run_dir.mkdir(exist_ok=True)
    acts = Activations.create(run_dir, x.shape, x.dtype, "cpu", None)
    for j in range(len(x)):
        acts.write(j, x[j])
    acts.advance()
    return acts


def _block0(model_dir, nseq=3, seqlen=32):
    """Block 0 of the model at ``model_dir`` (fp32), its linears, its inputs ``[nseq, seqlen, hidden]``
    on random token ids and its keyword arguments."""
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prefix, layers = hf_model.decoder_layers(m)
    ids = torch.randint(0, 1000, (nseq, seqlen), generator=torch.Generator().manual_seed(0))
    x, kwargs = [], None
    for j in range(nseq):
        h, kw = capture.capture(m, layers, ids[j:j + 1], all_kwargs=True)
        x.append(h[0])
        kwargs = kwargs or kw
    return layers[0], hf_model.block_linears(layers[0], f"{prefix}.0"), torch.stack(x), kwargs[0]


def _stages(layer, linears, x_tilde, kw, targets):
    """Every stage of :func:`target_corrected_stages` with nothing quantized in between → ({linear:
    its stage's Hessians}, the group names in stage order)."""
    of, groups = {}, []
    for names, hs, _ in target_corrected_stages(layer, linears, _as_stream(x_tilde), targets, kw, "", False):
        groups.append(names)
        of.update({n: hs for n in names})
    return of, groups


def _as_stream(x):
    return x if isinstance(x, Activations) else _RowStream(x)


class _RowStream:
    """A tensor read one sequence at a time, as :class:`Activations` are."""
    def __init__(self, x):
        self.x, self.shape = x, x.shape

    def __len__(self):
        return len(self.x)

    def __getitem__(self, rows):
        return self.x[rows]


def test_same_streams_give_cross_equal_hessian_and_w_prime_near_w(tiny_llama, tmp_path):
    """At block 0 X̃ = X: C = H̃ (up to fp32 rounding of the products), so W′ = W; the groups come
    in forward order and the stream moves on to the block's outputs."""
    layer, linears, x, kw = _block0(tiny_llama)
    targets = _stream(tmp_path / "x", x)
    of, groups = _stages(layer, linears, x, kw, targets)
    assert [g[0].rsplit(".", 1)[-1] for g in groups] == ["q_proj", "o_proj", "gate_proj", "down_proj"]
    for j in range(len(x)):
        torch.testing.assert_close(targets[j:j + 1], capture.run_block(layer, x[j:j + 1], kw))
    for n, m in linears.items():
        H, C, W = of[n].of[n].H, of[n].cross_of[n].C, m.weight.detach().float()
        assert of[n].cross_of[n].n == of[n].of[n].n
        torch.testing.assert_close(C, H, rtol=1e-5, atol=1e-7 * H.abs().max().item())
        assert torch.equal(qronos_target(W, H, H, 0.01), W)
        torch.testing.assert_close(qronos_target(W, H, C, 0.01), W, rtol=1e-4, atol=1e-6)


def test_cross_covariance_matches_hooked_inputs(tiny_llama, tmp_path):
    """With distinct streams, each linear's C equals X̃ᵀX/n of its inputs recorded by plain hooks,
    q/k/v and gate/up sharing one (like their Hessians)."""
    layer, linears, x, kw = _block0(tiny_llama)
    x_tilde = x + 0.1 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    rows = {n: {"tilde": [], "full": []} for n in linears}
    stream = ["full"]
    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: rows[n][stream[0]].append(a[0].reshape(-1, a[0].shape[-1])))
             for n, m in linears.items()]
    with torch.no_grad():
        for s, xs in (("full", x), ("tilde", x_tilde)):
            stream[0] = s
            for j in range(len(xs)):
                capture.run_block(layer, xs[j:j + 1], kw)
    for h in hooks:
        h.remove()
    of, _ = _stages(layer, linears, x_tilde, kw, _stream(tmp_path / "x", x))
    for n in linears:
        Xt, X = torch.cat(rows[n]["tilde"]).double(), torch.cat(rows[n]["full"]).double()
        torch.testing.assert_close(of[n].cross_of[n].C, Xt.T @ X / len(X), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(of[n].of[n].H, Xt.T @ Xt / len(X), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(of[n].cross_of[n].C, of[n].of[n].H)
    q, k = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"
    assert of[k].cross_of[k] is of[q].cross_of[q]


def test_later_groups_see_the_earlier_groups_quantized(tiny_llama, tmp_path):
    """True-sequential: a group's X̃ comes from the block with the earlier groups as quantized
    between the stages (here: o_proj's inputs once q/k/v are zeroed), its X from the unquantized copy."""
    layer, linears, x, kw = _block0(tiny_llama)
    o = "model.layers.0.self_attn.o_proj"
    for names, hs, _ in target_corrected_stages(layer, linears, _as_stream(x), _stream(tmp_path / "x", x), kw, "",
                                                False):
        if o in names:
            assert hs.of[o].H.abs().max() == 0              # v = 0: the attention output is 0
            assert hs.cross_of[o].C.abs().max() == 0
            assert hs.cross_of[o].n == hs.of[o].n > 0
            break
        for n in names:   # "quantize" the group
            linears[n].weight.data.zero_()


def _final_hidden_error(model_dir, ckpt, ids) -> float:
    """‖h − h_fp‖² / ‖h_fp‖² of the last hidden states, the checkpoint's dequantized weights vs the source's."""
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = m.model(input_ids=ids).last_hidden_state
        for name, w in Checkpoint(ckpt).dequantized_tensors(torch.float32):
            if name.endswith(".weight") and name.startswith("model.layers."):
                hf_model.set_tensor(m, name, w)
        got = m.model(input_ids=ids).last_hidden_state
    return ((got - ref).square().sum() / ref.square().sum()).item()


def _calibration_ids(src, opts: QuantizeOptions) -> torch.Tensor:
    from transformers import AutoTokenizer

    from vllm_latq import data
    return data.calibration_batches(AutoTokenizer.from_pretrained(src), nsamples=opts.nsamples, seqlen=opts.seqlen,
                                    seed=opts.seed)


def test_pipeline_with_target_correction(tiny_llama, tmp_path):
    """The option runs end to end, is recorded, and changes every layer's target except the first
    group's (q/k/v of block 0, where both streams agree; from o_proj on X̃ carries the block's
    already quantized groups)."""
    opts = dict(method="gptq", bits=3, **TINY_OPTS)
    res = {False: {}, True: {}}
    for tc in (False, True):
        d = quantize_model(tiny_llama, tmp_path / f"q{tc}", QuantizeOptions(target_correction=tc, **opts),
                           progress=False, on_layer=lambda n, W, H, r, tc=tc: res[tc].__setitem__(n, (W, r)))
        assert Checkpoint(d).spec.extra.get("target_correction") is (True if tc else None)
    for n, (W, r) in res[True].items():
        W0, r0 = res[False][n]
        if ".layers.0.self_attn." in n and not n.endswith("o_proj"):   # the first group: both streams agree
            torch.testing.assert_close(W, W0, rtol=1e-4, atol=1e-6)
        else:
            assert not torch.allclose(W, W0), n


@pytest.mark.slow
@pytest.mark.parametrize("bits", [2, 3])
def test_target_correction_lowers_the_models_output_error(tmp_path, bits):
    """A 4-block model quantized by GPTQ (16 × 64 calibration tokens: with 4 × 64 the corrected
    targets of the 144-wide down projections overfit at 3 bits): with target correction the last
    hidden states on the calibration text are closer to the full-precision model's
    (measured ×0.74 at 2 bits, ×0.84 at 3)."""
    src = make_tiny_model(tmp_path / "m", "llama", layers=4, dtype=torch.float32)
    err = {}
    for tc in (False, True):
        opts = QuantizeOptions(method="gptq", bits=bits, group_size=64, nsamples=16, seqlen=64, target_correction=tc)
        d = quantize_model(src, tmp_path / f"q{tc}", opts, progress=False)
        err[tc] = _final_hidden_error(src, d, _calibration_ids(src, opts))
    assert err[True] < 0.92 * err[False], err


def test_option_round_trips_and_is_checked():
    on = QuantizeOptions(method="ssqr", target_correction=True).quantization_config([])
    assert on["target_correction"] is True
    assert fmt.parse_quantization_config(on).extra["target_correction"] is True
    assert "target_correction" not in QuantizeOptions(method="ssqr").quantization_config([])
    with pytest.raises(fmt.FormatError, match="target_correction must be true or absent"):
        fmt.parse_quantization_config({**on, "target_correction": "yes"})
    rtn = QuantizeOptions(method="rtn").quantization_config([])
    with pytest.raises(fmt.FormatError, match="target_correction needs a calibrated method"):
        fmt.parse_quantization_config({**rtn, "target_correction": True})
    for method in ("rtn", "hrtn"):
        with pytest.raises(ValueError, match="target_correction needs a calibrated method"):
            QuantizeOptions(method=method, target_correction=True)


def test_resume_after_interruption(tiny_llama, tmp_path):
    """Interrupted after block 0, --resume continues both streams from what block 0 saved: the
    same bytes as an uninterrupted run, whether the streams were in memory or on disk (and
    moved between the two)."""
    from tests.quantize.test_pipeline import file_hashes
    from vllm_latq.quantize.activations import inputs_file
    from vllm_latq.quantize.target_correction import TARGET_STREAM_DIR
    from vllm_latq.quantize.pipeline import SimulatedInterruption
    opts = dict(method="gptq", bits=3, target_correction=True, **TINY_OPTS)
    ref = quantize_model(tiny_llama, tmp_path / "ref", QuantizeOptions(**opts), progress=False)
    for first, then in ((None, 0), (0, None)):
        out = tmp_path / f"ckpt-{first}"
        with pytest.raises(SimulatedInterruption):
            quantize_model(tiny_llama, out, QuantizeOptions(max_activation_memory=first, **opts), progress=False,
                           stop_after_block=0)
        stream_dir = out.with_name(out.name + ".tmp-latq") / TARGET_STREAM_DIR
        assert [p.name for p in stream_dir.glob("latq_activations.*")] == [inputs_file(stream_dir, 1).name]
        quantize_model(tiny_llama, out, QuantizeOptions(max_activation_memory=then, **opts), progress=False,
                       resume=True)
        assert file_hashes(out) == file_hashes(ref)


def test_with_experts(tmp_path):
    """Experts keep their own W and see only the quantized stream's tokens (the X pass is not
    recorded as routed inputs: each block routes its tokens × top-k slots, as without the option)."""
    import json
    src = make_tiny_model(tmp_path / "olmoe", "olmoe", layers=2, dtype=torch.float32)
    stats = {}
    for tc in (False, True):
        opts = QuantizeOptions(method="gptq", bits=3, target_correction=tc, **TINY_OPTS)
        d = quantize_model(src, tmp_path / f"q{tc}", opts, progress=False)
        stats[tc] = {s["name"]: s for s in json.loads((d / "latq_stats.json").read_text())["layers"]}
    assert stats[True].keys() == stats[False].keys()
    routed = {tc: {} for tc in stats}
    for tc, layers in stats.items():
        for n, s in layers.items():
            if n.endswith("gate_proj") and "expert" in s:
                block = n.split(".experts.")[0]
                routed[tc][block] = routed[tc].get(block, 0) + s["expert_tokens"]
            elif "expert" not in s:
                assert s["hessian_tokens"] == stats[False][n]["hessian_tokens"], n
    assert routed[True] == routed[False] and routed[True], routed


def test_column_scales_are_refused():
    with pytest.raises(ValueError, match="cannot be combined"):
        QuantizeOptions(method="gptq", column_scales="norm", target_correction=True)


def test_spilled_streams_give_the_same_checkpoint(tiny_llama, tmp_path):
    """Both streams on disk (a zero memory budget) write the in-memory run's checkpoint, and the
    second stream's directory is gone from it."""
    import hashlib
    hashes = {}
    for budget in (None, 0):
        opts = QuantizeOptions(method="gptq", bits=3, target_correction=True, max_activation_memory=budget, **TINY_OPTS)
        d = quantize_model(tiny_llama, tmp_path / f"q{budget}", opts, progress=False)
        hashes[budget] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}
    assert hashes[0] == hashes[None]
    assert not any("target_stream" in n or "activations" in n for n in hashes[0])


def test_stages_stop_their_forwards_without_changing_the_checkpoint(tiny_llama, tmp_path, monkeypatch):
    """Each stage's forwards end once its group has seen its input (the rest of the block cannot
    change its statistics): the checkpoint is byte-identical to forwards run to the end, and
    forwards did stop (both streams, every stage but the outputs' and the first sequence)."""
    import hashlib
    from vllm_latq.quantize.calibrate import InputsSeen, SharedHessians
    note_seen, stops = SharedHessians._note_seen, []

    def counting(self, name):
        try:
            note_seen(self, name)
        except InputsSeen:
            stops.append(name)
            raise

    hashes = {}
    for early in (True, False):
        monkeypatch.setattr(SharedHessians, "_note_seen", counting if early else lambda self, name: None)
        opts = QuantizeOptions(method="gptq", bits=3, target_correction=True, **TINY_OPTS)
        d = quantize_model(tiny_llama, tmp_path / f"q{early}", opts, progress=False)
        hashes[early] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}
    assert hashes[True] == hashes[False]
    import json
    blocks = json.loads((tiny_llama / "config.json").read_text())["num_hidden_layers"]
    n = TINY_OPTS["nsamples"]
    # per block: q/k/v on both streams but the first sequence's, o and gate/up on both, down on X̃
    assert len(stops) == blocks * (2 * (n - 1) + 2 * n + 2 * n + n)
    assert sum(s.endswith("down_proj") for s in stops) == blocks * n
