"""bench/decode_gpu.py and its decoder without a GPU: the gpt-fast-style step decodes real SmolLM2
greedy-equal to transformers, bare and with every projection in a latq form served through the
kernel interface (the dequantize-once fp32 kernel: the reference's numbers; transformers holding
the same dequantized weights); a tiny Llama through every form (torch's int4 kernel on its CPU
twin), and through latq's Triton kernel in the interpreter; the quick forms; the dry run. The
SmolLM2 and interpreter tests are slow."""
import json

import pytest
import torch

from bench import decode_gpu as dg, decode_model as dm
from vllm_latq.kernels.dequantized import DequantizedFp32Kernel as DequantKernel
from vllm_latq.kernels.weight import dequantize

N_NEW = 16


def our_greedy(dec: dm.Decoder, prompt: list[int], n: int) -> list[int]:
    """The decoder's step fed the prompt a token at a time, then greedy."""
    dec.allocate(1, len(prompt) + n + 1)
    out = []
    for t in prompt:
        logits = dec.step(torch.tensor([t]))
        dec.pos.add_(1)
    for _ in range(n):
        out.append(int(logits[0].argmax()))
        logits = dec.step(torch.tensor([out[-1]]))
        dec.pos.add_(1)
    return out


def _write_back(model, dense: dict) -> None:
    """Each fused projection's dequantized weight into transformers' separate ones."""
    for (i, proj), W in dense.items():
        layer = model.model.layers[i]
        at, mlp = layer.self_attn, layer.mlp
        mods = {"qkv": [at.q_proj, at.k_proj, at.v_proj], "o": [at.o_proj],
                "gate_up": [mlp.gate_proj, mlp.up_proj], "down": [mlp.down_proj]}[proj]
        for mod, part in zip(mods, W.split([m.weight.shape[0] for m in mods])):
            mod.weight.data.copy_(part)


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_latq.data import model_dir
    src = model_dir("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(src)("The capital of France is")["input_ids"]
    return model, ids


@pytest.mark.slow
@torch.no_grad()
def test_decoder_is_transformers_on_smollm2(smollm2):
    from tests.vllm_helpers import hf_greedy
    model, ids = smollm2
    want = hf_greedy(model, [ids], N_NEW)[0]
    got = our_greedy(dm.Decoder.from_hf(model, dm.form_maker("bf16", torch.float32)), ids, N_NEW)
    assert got == want


@pytest.mark.slow
@torch.no_grad()
def test_latq_wiring_decodes_greedy_equal_on_smollm2(smollm2):
    """SSQR-1 %-4b's form in every projection, served by a latq kernel through the decoder,
    against transformers on the same dequantized weights."""
    from tests.vllm_helpers import hf_greedy
    model, ids = smollm2
    dense = {}

    def make(proj, i, W):
        w = dm.quick_form(W, 4, 128, 0.01, seed=i)
        dense[i, proj] = dequantize(w)
        assert 0.005 < w.nnz / W.numel() < 0.015
        return dm.latq_linear(DequantKernel, w, torch.float32)
    dec = dm.Decoder.from_hf(model, make)
    got = our_greedy(dec, ids, N_NEW)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        _write_back(model, dense)
        want = hf_greedy(model, [ids], N_NEW)[0]
    finally:
        model.load_state_dict(saved)
    assert len(dense) == 4 * model.config.num_hidden_layers and got == want


def _tiny_hf():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**dg.TINY)).eval()


@pytest.mark.parametrize("form", ["bf16", "int4", "ssqr-1%-3b", "gptq-4b-g64"])
@torch.no_grad()
def test_every_form_through_the_decoder_on_a_tiny_llama(form):
    """The decoder's logits with each form's projections against transformers' forward on the
    weights each form computes with (torch's int4 kernel: its own bf16 scales)."""
    from bench.kernel_peers import exact_weight
    model = _tiny_hf()
    dense = {}

    def make(proj, i, W):
        if form in ("bf16", "int4"):
            lin = dm.make_linear(form, W, torch.float32)
            dense[i, proj] = W if form == "bf16" else exact_weight(dm.quick_form(W, 4, 128, 0.0), torch.float32)
            return lin
        w = dm.quick_form(W, *dm.FORMS[form], seed=i)
        dense[i, proj] = dequantize(w)
        return dm.latq_linear(DequantKernel, w, torch.float32)
    dec = dm.Decoder.from_hf(model, make)
    ids = torch.randint(0, dg.TINY["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(3))
    dec.allocate(1, 8)
    for t in ids[0]:
        logits = dec.step(t[None])
        dec.pos.add_(1)
    _write_back(model, dense)
    ref = model(ids).logits[0, -1]
    assert torch.allclose(logits[0], ref, atol=1e-4, rtol=1e-4), float((logits[0] - ref).abs().max())


def test_quick_forms_have_the_served_shape():
    W = torch.randn(64, 384) * 0.02
    for form, (bits, group, rate) in dm.FORMS.items():
        w = dm.quick_form(W, bits, group, rate)
        assert (w.bits, w.group_size, w.out_features, w.in_features) == (bits, group, 64, 384)
        assert w.scales.shape == (64, 384 // group) and w.scales.dtype == torch.float16
        assert (w.nnz == 0) == (rate == 0) and torch.equal(w.val, w.val.half().float())
        err = (dequantize(w) - W).abs().max() / W.abs().max()
        assert err < 2.0 ** (1 - bits), form                     # round to nearest on absmax scales
    spec = dm.Spec.of(dm.LLAMA3_8B)
    assert spec.shapes() == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def test_dry_run_rows_and_headline(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    assert dg.main(["--dry-run", "--tokens", "3", "--prompt", "2", "--batches", "1,2", "--forms", "ssqr-1%-4b",
                    "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["e2e"]
    assert [(r["form"], r["batch"]) for r in rows] == [("ssqr-1%-4b", 1), ("ssqr-1%-4b", 2)]
    assert all(list(r) == ["model", "form", "batch", "tokens", "latq_tok_s", "bf16_tok_s", "int4_tok_s"] and
               r["tokens"] == 3 and r["latq_tok_s"] > 0 and r["int4_tok_s"] > 0 and "dry run" in r["model"]
               for r in rows)
    text = capsys.readouterr().out
    assert "graph vs eager max |Δlogit| 0.0e+00" in text and "FAILED" not in text
    head = dict(kv.split("=") for kv in text.strip().splitlines()[-1].split()[1:])
    assert set(head) == {"e2e_ssqr-1%-4b_vs_bf16_b1", "e2e_ssqr-1%-4b_vs_int4_b1", "e2e_ssqr-1%-4b_vs_bf16_b2",
                         "e2e_ssqr-1%-4b_vs_int4_b2", "layers", "device"}
    with pytest.raises(SystemExit):
        dg.parse_args(["--forms", "awq-4b"])
    assert dg.project({"head": 1.0, "step_s": 3.0}, 8, 32) == 9.0


@pytest.mark.slow
@torch.no_grad()
def test_triton_kernel_through_the_decoder_in_the_interpreter(monkeypatch):
    """The GPU run's kernel class in the decoder (prepared, scratch reserved, applied on [B, K]
    rows), in Triton's interpreter: the same logits as the reference's numbers on the same form."""
    from vllm_latq.kernels.triton import kernel as tk
    monkeypatch.setenv(tk.ENV_INTERPRET_OK, "1")
    spec = dm.Spec.of(dict(dg.TINY, num_hidden_layers=1))
    weights = [{k: v.float() for k, v in w.items()} for w in dm.random_weights(spec, torch.device("cpu"))]
    logits = []
    for kernel in (DequantKernel, tk.TritonKernel):
        dec = dm.random_decoder(spec, weights, "ssqr-1%-4b", torch.float32, kernel)
        dec.allocate(2, 4)
        steps = []
        for _ in range(2):
            steps.append(dec.step(torch.tensor([3, 5])))
            dec.pos.add_(1)
        logits.append(torch.stack(steps))
    assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=1e-5)
