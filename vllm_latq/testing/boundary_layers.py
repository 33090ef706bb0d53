"""vLLM's real layers with latq's quant method across the CUDA boundary (:mod:`.cuda_boundary`):
built by vLLM's constructors, loaded through their ``weight_loader``s, processed and applied on
CPU under a stubbed GPU, against the same layer unquantized holding latq's dequantized weights;
one process per rank (:mod:`.boundary_run`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import format as fmt
from ..algorithms.result import QuantResult

PREFIX = "model.layers.0"
HIDDEN, HEAD, HEADS, KV_HEADS, INTER, DOWN_K, COL_N, WIDE_K = 256, 64, 4, 2, 256, 576, 384, 512
VOCAB = 1000           # the output head's rows: vLLM pads the vocabulary to a multiple of 64, then splits it
E, TOPK, MOE_INTER = 4, 2, 128
GROUP = 128            # the checkpoints' group: 576 = 4.5 groups, so down_proj's rows are cut off them
CCS = (80, 86, 89, 90)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
ROTATION_SEED = 5
ULP = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}   # unit roundoff


@dataclass(frozen=True)
class Case:
    layer: str            # a key of LAYERS, or "moe"
    dtype: str            # a key of DTYPES
    cc: int               # 0: the host's own platform (no stub, no stand-ins)
    bias: bool = False
    bits: int = 4
    outliers: float = 0.0   # the checkpoint's outlier rate (SSQR's CSR form: no vLLM kernel takes it)
    scale_bits: int | None = None   # group scales stored as codes (format/scale_codes.py)
    group: int = GROUP      # the checkpoint's group (≥ K: one scale per row, channelwise for vLLM)
    env: tuple = ()       # (name, value) pairs set for the case (e.g. LATQ_KERNEL)
    compiled: bool = False  # the forward also compiled (Dynamo, full graph) and compared with eager
    export: str = ""      # "export" layers: the directory of the exports (not part of the id)
    rotation: int = 0     # a rotated checkpoint's max_block (0: not rotated; seed ROTATION_SEED)

    @property
    def id(self) -> str:
        env = "".join(f"-{k}={v}" for k, v in self.env)
        where = f"sm{self.cc}" if self.cc else "host"
        form = (f"{self.bits}bit" + (f"-{self.outliers:.0%}outliers" if self.outliers else "")
                + (f"-s{self.scale_bits}codes" if self.scale_bits else "") + f"-g{self.group}")
        return (f"{self.layer}-{form}-{self.dtype}-{where}-{'bias' if self.bias else 'nobias'}{env}"
                + ("-compiled" if self.compiled else "") + (f"-rot{self.rotation}" if self.rotation else ""))

    @property
    def rotated(self) -> fmt.Rotation | None:
        return fmt.Rotation(ROTATION_SEED, self.rotation) if self.rotation else None


def quant_config(bits: int, group: int = GROUP, scale_bits: int | None = None, rotation: fmt.Rotation | None = None,
                 lm_head: bool = False):
    from ..plugin.config import LatqConfig
    return LatqConfig.from_config(fmt.quantization_config("rtn", bits=bits, group_size=group, scale_bits=scale_bits,
                                                          rotation=rotation,
                                                          **({"lm_head_quantized": True} if lm_head else {})))


def checkpoint_tensors(rows: int, cin: int, bits: int, seed: int, group: int = GROUP,
                       outliers: float = 0.0, scale_bits: int | None = None) -> dict[str, torch.Tensor]:
    """One dense latq layer's checkpoint tensors as ``format.encode_layer`` writes them: uniform
    ``bits``-bit integers, fp16 (or coded) scales, a fraction ``outliers`` as fp16 CSR outliers."""
    from ..algorithms.result import CSR
    g = torch.Generator().manual_seed(seed)
    z = torch.randint(-2 ** (bits - 1), 2 ** (bits - 1), (rows, cin), generator=g, dtype=torch.int32)
    scales = (torch.rand(rows, -(-cin // group), generator=g) * 0.02 + 0.002).half().float()
    mask = torch.rand(rows, cin, generator=g) < outliers
    z[mask] = 0
    csr = CSR.from_mask(mask, torch.randn(rows, cin, generator=g) * 0.3) if outliers else None
    coded = fmt.scale_codes.code_scales(scales, scale_bits) if scale_bits else None
    if coded is not None:
        scales = coded.decode()
    return fmt.encode_layer(QuantResult("rtn", z, None, scales, group, bits, float(bits), outliers=csr,
                                        coded_scales=coded), "dense")


def dequantized(t: dict[str, torch.Tensor], rows: int, cin: int, bits: int, group: int = GROUP) -> torch.Tensor:
    return fmt.dequantize_layer(t, "dense", (rows, cin), bits, group)


# name → (constructor, its arguments, [(checkpoint module, shard id, rows)], input size)
def _layers():
    from vllm.model_executor.layers import linear as L
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    q, kv = HEADS * HEAD, KV_HEADS * HEAD
    return {
        # the output head (LogitsProcessor calls its quant_method.apply): vocabulary rows split over ranks
        "lm_head": (ParallelLMHead, dict(num_embeddings=VOCAB, embedding_dim=HIDDEN), [("lm_head", None, VOCAB)],
                    HIDDEN, "lm_head"),
        "qkv": (L.QKVParallelLinear, dict(hidden_size=HIDDEN, head_size=HEAD, total_num_heads=HEADS,
                                          total_num_kv_heads=KV_HEADS),
                [("self_attn.q_proj", "q", q), ("self_attn.k_proj", "k", kv), ("self_attn.v_proj", "v", kv)],
                HIDDEN, "self_attn.qkv_proj"),
        "gate_up": (L.MergedColumnParallelLinear, dict(input_size=HIDDEN, output_sizes=[INTER, INTER]),
                    [("mlp.gate_proj", 0, INTER), ("mlp.up_proj", 1, INTER)], HIDDEN, "mlp.gate_up_proj"),
        "down": (L.RowParallelLinear, dict(input_size=DOWN_K, output_size=HIDDEN, input_is_parallel=False),
                 [("mlp.down_proj", None, HIDDEN)], DOWN_K, "mlp.down_proj"),
        "column": (L.ColumnParallelLinear, dict(input_size=HIDDEN, output_size=COL_N), [("mlp.col", None, COL_N)],
                   HIDDEN, "mlp.col"),
        # K of two groups of 256 (a group Marlin does not take): Exllama (fp16) or Triton W4A16
        "wide": (L.ColumnParallelLinear, dict(input_size=WIDE_K, output_size=COL_N), [("mlp.wide", None, COL_N)],
                 WIDE_K, "mlp.wide"),
    }


def weight_tensors(w) -> dict[str, torch.Tensor]:
    """A runtime form's checkpoint tensors (dense kind, fp16 scales: its codes dropped)."""
    return {"qweight": w.qweight, "scales": w.scales, "outlier_crow": w.crow,
            "outlier_col": w.col.to(fmt.col_dtype(w.in_features)), "outlier_val": w.val.half()}


def replicated_layer(w, dtype: torch.dtype, prefix: str = "bench.linear"):
    """vLLM's ``ReplicatedLinear`` with latq's method, loaded with ``w``'s tensors and processed
    (vLLM's distributed state initialized: ``boundary_run.init_ranks``)."""
    from vllm.model_executor.layers.linear import ReplicatedLinear
    layer = ReplicatedLinear(w.in_features, w.out_features, bias=False, quant_config=quant_config(w.bits, w.group_size),
                             params_dtype=dtype, prefix=prefix)
    load_parts(layer, {None: weight_tensors(w)})
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def load_parts(layer, parts: dict, suffixes=None) -> None:
    """Every tensor through its parameter's ``weight_loader``, with the shard id vLLM's model
    loader gives a fused layer's parts (none for a plain one)."""
    for shard, tensors in parts.items():
        for name, t in tensors.items():
            if suffixes is not None and name not in suffixes:
                continue
            p = getattr(layer, name)
            loader = getattr(p, "weight_loader")
            loader(p, t) if shard is None else loader(p, t, shard)


def _build(name: str, case: Case, quant, dtype: torch.dtype):
    cls, kw, parts, cin, leaf = _layers()[name]
    return cls(**kw, bias=case.bias, quant_config=quant, params_dtype=dtype, prefix=f"{PREFIX}.{leaf}")


def forward(layer, x: torch.Tensor) -> torch.Tensor:
    """A layer's output on this rank: the head's logits slice as ``LogitsProcessor`` computes it."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    return layer.quant_method.apply(layer, x) if isinstance(layer, ParallelLMHead) else layer(x)[0]


def _reference(case: Case, deq: dict, bias: dict):
    """The same vLLM layer unquantized, fp32, holding ``deq`` (and ``bias`` where given)."""
    ref = _build(case.layer, Case(case.layer, case.dtype, case.cc, bool(bias)), None, torch.float32)
    load_parts(ref, deq)
    if bias:
        load_parts(ref, {s: {"bias": b.float()} for s, b in bias.items()})
    ref.quant_method.process_weights_after_loading(ref)
    return ref


def dense_case(case: Case) -> dict:
    """One linear: latq's layer and vLLM's unquantized one (the reference), same inputs."""
    cls, kw, parts, cin, leaf = _layers()[case.layer]
    dtype, rot = DTYPES[case.dtype], case.rotated
    ckpt, q, deq, bias = {}, {}, {}, {}
    for i, (module, shard, rows) in enumerate(parts):
        ckpt[shard] = checkpoint_tensors(rows, cin, case.bits, seed=10 * i + case.bits, group=case.group,
                                         outliers=case.outliers, scale_bits=case.scale_bits)
        q[shard] = dequantized(ckpt[shard], rows, cin, case.bits, case.group)
        deq[shard] = {"weight": q[shard] if rot is None else fmt.rotation.unrotate(q[shard], rot.signs(cin))}  # QRᵀ
        g = torch.Generator().manual_seed(100 + i)
        if case.bias:
            bias[shard] = (torch.randn(rows, generator=g) * 4).to(dtype)
    quant = quant_config(case.bits, case.group, scale_bits=case.scale_bits, rotation=rot,
                         lm_head=case.layer == "lm_head")
    layer = _build(case.layer, case, quant, dtype)
    load_parts(layer, ckpt)
    if case.bias:
        load_parts(layer, {s: {"bias": b} for s, b in bias.items()})
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(5, cin, generator=torch.Generator().manual_seed(7)).to(dtype)
    y = forward(layer, x)
    compiled = compiled_forward(layer, x, y) if case.compiled else {}
    ref = _reference(case, deq, bias)
    absolute = _reference(case, {s: {"weight": w.abs()} for s, w in q.items()}, {})
    # the bias as this rank's output has it
    want, bias_out = forward(ref, x.float()), forward(ref, torch.zeros(1, cin))
    xr = x.float().abs() if rot is None else x.float().abs() @ fmt.rotation.matrix(rot.signs(cin), cin).abs().float()
    scale = forward(absolute, xr) + bias_out.abs()           # |x|·|R|·|Q|ᵀ + |b| (R = I unrotated)
    row = quant.load_report.layers[-1]
    return {**compare(y, want, dtype, scale, cin, row.kernel, 3 if rot is None else 5), "served_bits": row.served_bits,
            "table": quant.load_report.reason_table(), **compiled}


def compiled_forward(layer, x: torch.Tensor, eager: torch.Tensor) -> dict:
    """``layer``'s forward compiled as vLLM compiles a model's: whether it equals the eager output bit
    for bit, and the ops the graph calls (the kernel's GEMM traced over by its fake)."""
    import torch._dynamo
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=False):        # the workers run with TORCH_COMPILE_DISABLE=1
        y = torch.compile(lambda t: layer(t)[0], backend=keep, fullgraph=True)(x)
    ops = sorted({str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"})
    return {"compiled_equal": bool(torch.equal(y, eager)), "graphs": len(graphs), "graph_ops": ops}


def placement_case(case: Case) -> dict:
    """Whether vLLM's scheme parameters are made on the device of latq's tensors, not the default
    device: registered from meta tensors, dense and experts."""
    from ..plugin import vllm_scheme
    from .vllm_experts import BareExperts, fused_moe_config
    from .weights import random_weight
    dtype = DTYPES[case.dtype]
    layer = torch.nn.Module()
    layer.prefix = "placement.linear"
    vllm_scheme.register(layer, random_weight(256, 256, 4, 0.0, group=64).to("meta"), dtype, 256)
    config = fused_moe_config(E, TOPK, HIDDEN, MOE_INTER, "cuda", dtype)
    weights = {(e, s): random_weight(*shape, 4, 0.0, group=64, seed=e).to("meta") for e in range(E)
               for s, shape in (("w13", (2 * MOE_INTER, HIDDEN)), ("w2", (HIDDEN, MOE_INTER)))}
    method, why = vllm_scheme.choose_experts(weights, config, torch.device("cuda"), "placement.experts")
    experts = BareExperts(config)
    vllm_scheme.register_experts(method, experts, weights, dtype)
    devices = {n: p.device.type for m in (layer, experts) for n, p in m.named_parameters()}
    return {"ok": bool(devices) and set(devices.values()) == {"meta"}, "devices": devices, "kernel": why}


def compare(y: torch.Tensor, want: torch.Tensor, dtype, scale: torch.Tensor, k: int, kernel: str,
            roundings: int = 3) -> dict:
    """Within the kernel's rounding: weights rounded once to the activation type (≤ u·|x|·|W|ᵀ),
    the output once more (≤ u·|y|), sums of ``k`` fp32 products (≤ k·u₃₂·|x|·|W|ᵀ);
    ``scale`` = |x|·|W|ᵀ + |b| bounds all three. A rotated layer's x·R adds two (the transform's
    matrix and its output rounded to the activation type: ``roundings`` 5, ``scale`` on |x|·|R|)."""
    err = (y.float() - want).abs()
    bound = roundings * (ULP[dtype] + k * ULP[torch.float32]) * scale + 1e-6
    worst = float((err / bound).max())
    return {"kernel": kernel, "ok": worst <= 1.0 and y.dtype == dtype and y.shape == want.shape,
            "worst": worst, "max_err": float(err.max()), "dtype": str(y.dtype)}
