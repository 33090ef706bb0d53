"""A Llama decoder written as gpt-fast writes one — fused qkv and gate_up projections, a static
KV cache, a decode step that reads the position from a device tensor and so runs unchanged in a
CUDA graph — whose linears are any kernel's: bf16 ``F.linear``, latq's (a ``LatqKernel``'s
prepared state) or torch's int4 kernel (:mod:`bench.kernel_peers`). Its weights come from a
transformers Llama (:meth:`Decoder.from_hf`: SmolLM2 in the tests, greedy-equal to transformers'
own forward) or are random at a transformers ``LlamaConfig``'s shapes (:func:`random_decoder`:
Llama-3-8B in ``bench/decode_gpu.py``).

A latq form is made from a dense weight quickly (:func:`quick_form`): absmax group scales, round
to nearest, and outliers at random positions holding the weight's own value in fp16, as SSQR
stores them. Its numerics are the kernels' tests' business; here it only has to have the served
form's shape and bytes.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from vllm_latq import format as fmt
from vllm_latq.kernels.weight import LatqWeight

# Llama-3-8B (transformers' LlamaConfig fields); rope scaling left out: it moves no bytes
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, vocab_size=128256, num_hidden_layers=32, rms_norm_eps=1e-5, rope_theta=500000.0,
                 tie_word_embeddings=False)
# latq forms: (inlier bits, group, outlier rate); "gptq-4b-g64" is latq-quantize's default form
FORMS = {"ssqr-1%-4b": (4, 128, 0.01), "ssqr-1%-3b": (3, 128, 0.01), "ssqr-1%-2b": (2, 128, 0.01),
         "gptq-4b-g64": (4, 64, 0.0)}
# codebook forms: (bits, group, scale-code bits); random codes, so their figures are speed only
CODEBOOK_FORMS = {"e8-3b-s4-g16": (3, 16, 4), "e8-2b-s4-g16": (2, 16, 4)}
PROJECTIONS = ("qkv", "o", "gate_up", "down")


@dataclasses.dataclass(frozen=True)
class Spec:
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    layers: int
    eps: float
    rope_theta: float
    tied: bool

    @classmethod
    def of(cls, config) -> "Spec":
        """From a transformers config (``rope_theta`` or, in transformers 5, ``rope_parameters``)."""
        get = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else \
            (lambda k, d=None: getattr(config, k, d))
        heads = get("num_attention_heads")
        theta = get("rope_theta") or (get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(get("hidden_size"), get("intermediate_size"), heads, get("num_key_value_heads") or heads,
                   get("head_dim") or get("hidden_size") // heads, get("vocab_size"), get("num_hidden_layers"),
                   get("rms_norm_eps", 1e-6), float(theta), bool(get("tie_word_embeddings", False)))

    def shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each projection of a block."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        return {"qkv": (qkv, self.hidden), "o": (self.hidden, self.heads * self.head_dim),
                "gate_up": (2 * self.inter, self.hidden), "down": (self.hidden, self.inter)}


# ----------------------------------------------------------------------------- linears

def quick_form(W: torch.Tensor, bits: int, group: int, rate: float, seed: int = 0) -> LatqWeight:
    """A latq runtime form of ``W`` [out, in] on W's device: absmax scales on the fp16 grid, round to
    nearest (``algorithms.solvers.rtn``), and at ``rate`` random positions an fp16 outlier holding
    W's own value (its integer 0)."""
    from vllm_latq.algorithms.scales import absmax_scales, to_fp16_grid
    from vllm_latq.algorithms.solvers import rtn
    res = rtn(W, bits=bits, group_size=group, scales=to_fp16_grid(absmax_scales(W, bits, group)))
    z = res.z
    n, k = W.shape
    crow = torch.zeros(n + 1, dtype=torch.int32, device=W.device)
    col = torch.zeros(0, dtype=torch.int32, device=W.device)
    val = torch.zeros(0, dtype=torch.float32, device=W.device)
    if rate > 0:
        g = torch.Generator(device=W.device).manual_seed(seed)
        mask = torch.rand(n, k, generator=g, device=W.device) < rate
        rows, col = mask.nonzero(as_tuple=True)
        val = W[rows, col].half().float()
        z = z.masked_fill(mask, 0)
        crow[1:] = torch.cumsum(mask.sum(1), 0)
        col = col.int()
    return LatqWeight(fmt.pack(z, bits), res.scales.half(), crow, col, val, bits, group, k)


class Linear:
    """One projection: ``y = lin(x)`` for x [rows, in], with its served bytes."""

    def __init__(self, apply, nbytes: int, kind: str):
        self.apply, self.nbytes, self.kind = apply, nbytes, kind

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply(x)


def dense_linear(W: torch.Tensor) -> Linear:
    return Linear(lambda x: F.linear(x, W), W.numel() * W.element_size(), "dense")


def latq_linear(kernel, w: LatqWeight, act_dtype: torch.dtype) -> Linear:
    """``kernel`` (a ``LatqKernel`` class) serving ``w``: prepared, its scratch reserved at load."""
    st = kernel.prepare(w)
    kernel.reserve(st, act_dtype)
    return Linear(lambda x: kernel.apply(st, x), sum(kernel.served_bytes(st).values()), kernel.name)


def int4_linear(W: torch.Tensor, act_dtype: torch.dtype) -> Linear:
    """torch's int4 kernel at 4-bit groups of 128 (no outliers) from W's quick form."""
    from bench.kernel_peers import TorchInt4
    st = TorchInt4.prepare(quick_form(W, 4, 128, 0.0), W.device, act_dtype)
    return Linear(lambda x: TorchInt4.apply(st, x), TorchInt4.served_bytes(st), TorchInt4.name)


def make_linear(form: str, W: torch.Tensor, act_dtype: torch.dtype, kernel=None, seed: int = 0) -> Linear:
    """``form``: ``bf16`` (the dense weight in ``act_dtype``), ``int4`` (torch's kernel) or a key of
    :data:`FORMS` served by ``kernel``, or of :data:`CODEBOOK_FORMS` (by ``kernel`` where it serves
    codebook layers, else ``triton-e8``)."""
    if form == "bf16":
        return dense_linear(W.to(act_dtype))
    if form == "int4":
        return int4_linear(W, act_dtype)
    if form in CODEBOOK_FORMS:
        return codebook_linear(kernel, W.shape, *CODEBOOK_FORMS[form], act_dtype, W.device, seed)
    bits, group, rate = FORMS[form]
    return latq_linear(kernel, quick_form(W, bits, group, rate, seed), act_dtype)


def codebook_linear(kernel, shape, bits: int, group: int, scale_bits: int, act_dtype, device, seed: int) -> Linear:
    """A random codebook layer of ``shape`` (:func:`~vllm_latq.testing.weights.random_codebook_weight`)."""
    from vllm_latq.kernels.weight import CodebookWeight
    from vllm_latq.testing.weights import random_codebook_weight
    if CodebookWeight not in kernel.forms:
        from vllm_latq.kernels.triton.codebook import TritonCodebookKernel as kernel
    w = random_codebook_weight(*shape, bits, group=group, seed=seed, scale_bits=scale_bits)
    return latq_linear(kernel, w.to(device), act_dtype)


def form_maker(form: str, act_dtype: torch.dtype, kernel=None):
    """``make`` of :meth:`Decoder.from_hf`: every projection in ``form`` (:func:`make_linear`)."""
    return lambda proj, i, W: make_linear(form, W, act_dtype, kernel, seed=i)


# ----------------------------------------------------------------------------- the decoder

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: in fp32, the weight applied after casting back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Decoder:
    """Embedding, blocks of {norms, qkv, o, gate_up, down}, final norm and head, and a static KV
    cache of ``max_len`` positions for ``batch`` sequences; :meth:`step` decodes one token a
    sequence at the position held by the device tensor ``pos``."""

    def __init__(self, spec: Spec, embed, blocks: list[dict], norm, head: Linear, inv_freq, rope_scale=1.0):
        self.spec, self.embed, self.blocks, self.norm, self.head = spec, embed, blocks, norm, head
        self.inv_freq, self.rope_scale = inv_freq.float(), rope_scale
        self.cache = None

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def linears(self) -> list[Linear]:
        return [b[p] for b in self.blocks for p in PROJECTIONS]

    def allocate(self, batch: int, max_len: int) -> None:
        """The KV cache, rope tables and the step's position tensor (zeroed)."""
        s, dev, dt = self.spec, self.device, self.embed.dtype
        shape = (len(self.blocks), batch, s.kv_heads, max_len, s.head_dim)
        self.cache = (torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev))
        freqs = torch.arange(max_len, device=dev, dtype=torch.float32)[:, None] * self.inv_freq.to(dev)[None, :]
        emb = torch.cat((freqs, freqs), -1)
        self.cos, self.sin = (emb.cos() * self.rope_scale).to(dt), (emb.sin() * self.rope_scale).to(dt)
        self.positions = torch.arange(max_len, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)

    def reset(self) -> None:
        for c in self.cache:
            c.zero_()
        self.pos.zero_()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] of ``tokens`` [B] at position ``self.pos`` (their K and V cached
        there); no host synchronisation, so a CUDA graph may capture it."""
        s = self.spec
        h = F.embedding(tokens, self.embed)
        cos, sin = self.cos.index_select(0, self.pos), self.sin.index_select(0, self.pos)
        masked = (self.positions > self.pos)[None, None, None, :]
        for i, blk in enumerate(self.blocks):
            h = h + self._attention(i, blk, rms_norm(h, blk["norm1"], s.eps), cos, sin, masked)
            gate, up = blk["gate_up"](rms_norm(h, blk["norm2"], s.eps)).chunk(2, dim=-1)
            h = h + blk["down"](F.silu(gate) * up)
        return self.head(rms_norm(h, self.norm, s.eps))

    def _attention(self, i, blk, a, cos, sin, masked):
        s, B = self.spec, a.shape[0]
        q, k, v = blk["qkv"](a).split([s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1)
        q = q.view(B, s.heads, s.head_dim)
        k = k.view(B, s.kv_heads, s.head_dim)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        kc, vc = self.cache[0][i], self.cache[1][i]
        kc.index_copy_(2, self.pos, k[:, :, None])
        vc.index_copy_(2, self.pos, v.view(B, s.kv_heads, 1, s.head_dim))
        rep = s.heads // s.kv_heads
        qg = q.view(B, s.kv_heads, rep, s.head_dim)
        scores = (qg @ kc.transpose(-1, -2)).float() / math.sqrt(s.head_dim)
        probs = scores.masked_fill(masked, float("-inf")).softmax(-1).to(vc.dtype)
        return blk["o"]((probs @ vc).reshape(B, s.heads * s.head_dim))

    @classmethod
    def from_hf(cls, model, make, act_dtype: torch.dtype = torch.float32) -> "Decoder":
        """A transformers Llama's weights, its q/k/v and gate/up fused as vLLM fuses them, each
        projection served by ``make(projection, block index, fp32 weight) → Linear`` (e.g.
        :func:`form_maker`); embedding, norms and the (tied or own) dense head in ``act_dtype``."""
        spec = Spec.of(model.config)
        inner = model.model
        blocks = []
        for i, layer in enumerate(inner.layers):
            at, mlp = layer.self_attn, layer.mlp
            ws = {"qkv": torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight]), "o": at.o_proj.weight,
                  "gate_up": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), "down": mlp.down_proj.weight}
            blk = {p: make(p, i, ws[p].detach().float()) for p in PROJECTIONS}
            blk.update(norm1=layer.input_layernorm.weight.detach().to(act_dtype),
                       norm2=layer.post_attention_layernorm.weight.detach().to(act_dtype))
            blocks.append(blk)
        embed = inner.embed_tokens.weight.detach().to(act_dtype)
        rot = inner.rotary_emb
        return cls(spec, embed, blocks, inner.norm.weight.detach().to(act_dtype),
                   dense_linear(model.lm_head.weight.detach().to(act_dtype)), rot.inv_freq,
                   float(getattr(rot, "attention_scaling", 1.0)))


def random_weights(spec: Spec, device, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """bf16 weights of every block, N(0, 0.02²) as transformers initialises a Llama, made on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(spec.layers):
        blk = {p: (torch.randn(*shape, generator=g, device=device) * 0.02).to(torch.bfloat16)
               for p, shape in spec.shapes().items()}
        blk.update(norm1=torch.ones(spec.hidden, device=device), norm2=torch.ones(spec.hidden, device=device))
        out.append(blk)
    return out


def random_decoder(spec: Spec, weights: list[dict], form: str, act_dtype=torch.bfloat16, kernel=None,
                   like: Decoder | None = None) -> Decoder:
    """A :class:`Decoder` over ``weights`` (:func:`random_weights`) with its projections in ``form``;
    the embedding and the dense head are ``like``'s (shared between forms), else random."""
    dev = weights[0]["qkv"].device
    if like is None:
        g = torch.Generator(device=dev).manual_seed(1)
        embed = (torch.randn(spec.vocab, spec.hidden, generator=g, device=dev) * 0.02).to(act_dtype)
        head = dense_linear(embed if spec.tied else
                            (torch.randn(spec.vocab, spec.hidden, generator=g, device=dev) * 0.02).to(act_dtype))
    else:
        embed, head = like.embed, like.head
    blocks = [{**{p: make_linear(form, w[p], act_dtype, kernel, seed=i) for p in PROJECTIONS},
               "norm1": w["norm1"].to(act_dtype), "norm2": w["norm2"].to(act_dtype)} for i, w in enumerate(weights)]
    inv_freq = 1.0 / spec.rope_theta ** (torch.arange(0, spec.head_dim, 2, device=dev).float() / spec.head_dim)
    return Decoder(spec, embed, blocks, torch.ones(spec.hidden, device=dev, dtype=act_dtype), head, inv_freq)
