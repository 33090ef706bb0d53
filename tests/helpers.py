"""Shared test helpers: the readable reference GPTQ loop the fast solver is tied to, and
real SmolLM2 layers with real-data Hessians (cached under the cache dir).

The study (``bench/accuracy.py``) imports :func:`reference_gptq` from here as its peer GPTQ.
"""
from __future__ import annotations

import torch

# kernel tests' outlier pattern (reference.random_weight rows=): row 1 has half its columns as outliers
# (a crowded row), rows 3..5 none
CROWDED = ((1, 0.5), (3, 0.0), (4, 0.0), (5, 0.0))

REAL_NSEQ, REAL_SEQLEN = 8, 512
REAL_LAYERS = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj",
               "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.up_proj")


def reference_gptq(W: torch.Tensor, H: torch.Tensor, S: torch.Tensor, perm: torch.Tensor, bits: int,
                   damp: float) -> torch.Tensor:
    """GPTQ as IST-DASLab's ``fasterquant`` without lazy batches, written independently of the
    package: H damped by ``damp·mean(diag H)``, ``Hinv = cholesky(H⁻¹, upper)`` in ``perm``
    order, columns processed in ``perm``, each rounded to the clipped signed ``bits`` grid on its
    fixed scale (``S`` ``[out, in]``) and its error spread over the later columns. Computed in
    W's dtype (the factor in fp64 first). → int32 integers ``[out, in]``."""
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    Hd = H.double().clone()
    Hd.diagonal().add_(damp * Hd.diagonal().mean())
    Hd = Hd[perm][:, perm]
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(Hd)), upper=True).to(W.dtype)
    Wp = W[:, perm].clone()
    Sp = S[:, perm].to(W.dtype)
    Z = torch.empty_like(Wp, dtype=torch.int32)
    for j in range(Wp.shape[1]):
        w = Wp[:, j]
        z = torch.clamp(torch.round(w / Sp[:, j]), lo, hi)
        Z[:, j] = z.int()
        e = (w - z * Sp[:, j]) / Hinv[j, j]
        Wp[:, j:].sub_(e[:, None] * Hinv[j, j:][None, :])
    out = torch.empty_like(Z)
    out[:, perm] = Z
    return out


def real_layer_hessians() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name → (W [out, in] fp32, H [in, in] fp64) for ``REAL_LAYERS`` of SmolLM2-135M on
    ``REAL_NSEQ`` × ``REAL_SEQLEN`` tokens of Wikipedia calibration text (cached on disk)."""
    from safetensors.torch import load_file, save_file

    from vllm_latq import data
    from vllm_latq.quantize.hessian import linear_hessians

    path = data.cache_dir() / f"test_hessians_smollm2_{REAL_NSEQ}x{REAL_SEQLEN}.safetensors"
    if not path.exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer
        mdir = data.model_dir("smollm2-135m")
        tok = AutoTokenizer.from_pretrained(mdir)
        model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32).eval()
        mods = {n: m for n, m in model.named_modules() if n in REAL_LAYERS}
        layers = linear_hessians(model, mods, data.calibration_batches(tok, nsamples=REAL_NSEQ, seqlen=REAL_SEQLEN))
        tensors = {}
        for n in REAL_LAYERS:
            W, H = layers[n]
            tensors[n + ".W"], tensors[n + ".H"] = W.contiguous(), H.contiguous()
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(path)
    t = load_file(str(path))
    return {n: (t[n + ".W"], t[n + ".H"]) for n in REAL_LAYERS}


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
