"""``LatqLinearMethod``: loads latq layers into vLLM linears and runs them through the
kernel selector.

Any linear (column-, row-parallel, replicated, merged ``gate_up``, ``qkv``), any TP size, both
checkpoint kinds: each checkpoint tensor is stashed whole as it arrives, each logical matrix
validated by the format's own validator and cut to this rank's rows and columns once all its
tensors are in (:class:`LoadState`), so at most one layer's full tensors are held at a time.
vLLM's Packed/GroupQuant parameter classes cannot do this: 3-bit tiles have no integer pack
factor (32 values in 3 int32 words), a row-parallel split need not fall on a tile or group
boundary (SmolLM2: 576 = 4.5 groups of 128), and CSR outliers and Huffman streams have a
variable length — one stash-and-slice path handles all of it, exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.nn import Parameter
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.utils import set_weight_attrs

from . import format as fmt
from . import loader_rows
from .kernels import ops, selector
from .kernels.weight import LatqWeight
from .kernels.transcode import transcode
from .slicing import codes_refusal, merge, pad_rows, slice_dense

logger = init_logger("vllm.latq")


# ----------------------------------------------------------------------------- geometry

@dataclass
class Shard:
    """One logical matrix as stored in the checkpoint and the rows this rank keeps."""
    name: str                              # checkpoint module name (for messages)
    rows: int                              # rows of the checkpoint matrix
    blocks: list[tuple[int, int]]          # (first source row, row count), in output order


@dataclass
class Geometry:
    shards: dict                           # shard id → Shard, in output order
    fused: Shard | None                    # the same matrix when stored fused (shard id None)
    in_features: int                       # checkpoint columns
    col0: int                              # this rank's first column
    ncols: int                             # this rank's column count
    pad_rows: int | None = None            # lm_head: rows of this rank's padded vocab shard


def geometry(layer, hf_names: list[str]) -> Geometry:
    """Which rows/columns of which checkpoint matrices this rank's layer holds."""
    cin = layer.input_size
    col0, ncols = 0, cin
    if isinstance(layer, RowParallelLinear):
        ncols = layer.input_size_per_partition
        col0 = layer.tp_rank * ncols
    name = hf_names[0] if len(hf_names) == 1 else layer.prefix
    if isinstance(layer, ParallelLMHead):
        # vocab rows sharded over ranks; the shard is padded (padding_size) past the real vocab
        if layer.num_added_embeddings:
            raise NotImplementedError(f"latq: {layer.prefix}: a quantized lm_head with added (LoRA) vocabulary "
                                      "is not supported")
        si = layer.shard_indices
        r0, r1 = si.org_vocab_start_index, si.org_vocab_end_index
        geo = _split([layer.org_vocab_size], [(r0, r1 - r0)], hf_names, name, cin, 0, cin)
        geo.pad_rows = layer.num_embeddings_per_partition
        return geo
    if isinstance(layer, ReplicatedLinear):
        sizes = getattr(layer, "output_sizes", None) or [layer.output_size]
        return _split(sizes, [(0, s) for s in sizes], hf_names, name, cin, col0, ncols)
    if isinstance(layer, QKVParallelLinear):
        r, kr = layer.tp_rank, layer.tp_rank // layer.num_kv_head_replicas
        full = [layer.total_num_heads * layer.head_size, layer.total_num_kv_heads * layer.head_size,
                layer.total_num_kv_heads * layer.v_head_size]
        part = [layer.num_heads * layer.head_size, layer.num_kv_heads * layer.head_size,
                layer.num_kv_heads * layer.v_head_size]
        blocks = [(r * part[0], part[0]), (kr * part[1], part[1]), (kr * part[2], part[2])]
        return _split(full, blocks, hf_names, name, cin, col0, ncols, ids=("q", "k", "v"))
    if isinstance(layer, MergedColumnParallelLinear):
        tp, r = layer.tp_size, layer.tp_rank
        sizes = list(layer.output_sizes)
        return _split(sizes, [(r * (s // tp), s // tp) for s in sizes], hf_names, name, cin, col0, ncols)
    if isinstance(layer, ColumnParallelLinear):
        n = layer.output_size_per_partition
        return _split([layer.output_size], [(layer.tp_rank * n, n)], hf_names, name, cin, col0, ncols)
    if isinstance(layer, RowParallelLinear):
        return _split([layer.output_size], [(0, layer.output_size)], hf_names, name, cin, col0, ncols)
    raise NotImplementedError(f"latq: unsupported linear layer type {type(layer).__name__} ({layer.prefix})")


def _split(full, blocks, hf_names, name, cin, col0, ncols, ids=None) -> Geometry:
    if len(full) == 1:
        return Geometry({None: Shard(name, full[0], [blocks[0]])}, None, cin, col0, ncols)
    ids = ids or tuple(range(len(full)))
    names = hf_names if len(hf_names) == len(full) else [f"{name}[{i}]" for i in ids]
    shards = {i: Shard(n, f, [b]) for i, n, f, b in zip(ids, names, full, blocks)}
    offs = [sum(full[:i]) for i in range(len(full))]
    fused = Shard(name, sum(full), [(o + s0, n) for o, (s0, n) in zip(offs, blocks)])
    return Geometry(shards, fused, cin, col0, ncols)


def in_loader_order(geo: Geometry, sources: torch.Tensor | None) -> Geometry:
    """``geo`` for a fused matrix whose rows the model's loader regroups (``sources[i]``: the
    checkpoint row of vLLM's row i, :mod:`~vllm_latq.loader_rows`): the fused shard's blocks
    become blocks of checkpoint rows, so every row-wise tensor is cut in vLLM's order."""
    if sources is None:
        return geo
    if sources.numel() != geo.fused.rows:
        raise ValueError(f"latq: {geo.fused.name}: a row regrouping of {sources.numel()} rows for "
                         f"{geo.fused.rows} rows")
    blocks = [b for r0, n in geo.fused.blocks for b in loader_rows.runs(sources[r0:r0 + n])]
    return replace(geo, fused=replace(geo.fused, blocks=blocks))


# ----------------------------------------------------------------------------- loading

def tensor_names(config) -> tuple[str, ...]:
    """The checkpoint tensors (suffixes) of each of ``config``'s layers."""
    if config.kind == "huffman":
        return fmt.HUFFMAN_TENSORS
    return fmt.dense_tensors(config.scale_bits is not None)


class LoadState:
    """Collects one layer's checkpoint tensors and builds its runtime form.

    Loading (any linear: column-, row-parallel, replicated, merged ``gate_up``, ``qkv``; any TP
    size; both checkpoint kinds). ``create_weights`` registers one empty placeholder parameter
    per checkpoint tensor (``P.qweight``, ``P.scales`` or the coded ``P.scale_codes/min/step``,
    ``P.outlier_*``, or ``P.h*``) with the checkpoint dtype and a weight loader that *stashes*
    the whole tensor it is given, per shard id (``'q'/'k'/'v'`` for QKV, ``0/1`` for gate_up,
    none otherwise). As soon as all tensors of one logical matrix (one shard) have arrived, the
    matrix is validated as a whole with the checkpoint format's own validator (shapes, dtypes,
    CSR structure, Huffman code), cut to this rank's rows/columns, and the full tensors are
    dropped — so at most one layer's full tensors are held at a time. When all shards are in,
    they are concatenated into the runtime form (:class:`~vllm_latq.kernels.weight.LatqWeight`).
    ``process_weights_after_loading`` then checks nothing is missing, deletes the
    placeholders, selects a kernel, and keeps its prepared state as buffers.

    Per rank (r = tp_rank; rows = output dim, cols = input dim):
    - column-parallel: rows ``[r·n, (r+1)·n)`` of each logical matrix (n = its partition size);
      QKV's k/v use source rank ``r // num_kv_head_replicas``; all columns.
    - row-parallel: all rows, columns ``[r·k, (r+1)·k)``: packed words sliced on 32-column
      tiles (unpacked and repacked only when the split is not on a tile), group scales sliced
      (off a group boundary the runtime group size becomes gcd(g, r·k) with scales repeated —
      exact), CSR outliers filtered to the column range and their columns re-based to 0
      (the cutting itself: :mod:`~vllm_latq.slicing`).
    - coded scales (``quantization_config.scale_bits``): the runtime form's ``scales`` are their
      fp16 decode, and its ``coded`` the codes cut alike where this rank's row blocks keep whole
      16-row grids; else (e.g. a rank's rows starting inside a grid) ``coded`` is None, with one
      log line naming the layer and why (``slicing.codes_refusal``).
    - HPTQ/HRTN: the Huffman stream is decoded once (whole matrix), cut like the dense case,
      and transcoded to dense+CSR with the inlier width, among those the device's kernel family
      takes (CUDA: Triton's 2–5 bits; CPU: 2–8), that minimises that family's served bytes for
      this rank's matrix (``selector.family_for``; one fp16 scale per row: q, k, v keep their
      own per-matrix scales).
    - a fused matrix whose rows the model's loader regroups (Falcon's ``query_key_value``):
      the same blocks, taken in the loader's row order (:mod:`~vllm_latq.loader_rows`)."""

    def __init__(self, layer, config, geo: Geometry, bits: int | None = None):
        # layer: the vLLM layer, or a name (one expert matrix of a MoE layer, moe_method.py)
        self.prefix = layer if isinstance(layer, str) else layer.prefix
        self.config = config
        # a layer_bits override (e.g. an 8-bit lm_head)
        self.bits = config.bits_of(self.prefix) if bits is None else bits
        self.geo = geo
        self.names = tensor_names(config)
        self.keep_codes: bool | None = None   # coded scales: whether this rank's rows keep their codes
        self.fused: bool | None = None if geo.fused is not None else False
        self.stash: dict = {}
        self.parts: dict = {}     # shard id → (z, row scales) for huffman, LatqWeight for dense
        self.weight: LatqWeight | None = None
        self.family = None        # the kernel family whose served bytes choose HPTQ widths (the method sets it)
        self.stored_bytes = 0     # checkpoint bytes of this layer's tensors (the load report's stored bits)

    def expected(self) -> dict:
        return {None: self.geo.fused} if self.fused else self.geo.shards

    def add(self, name: str, tensor: torch.Tensor, shard_id) -> None:
        if isinstance(shard_id, (tuple, list)):
            raise NotImplementedError(f"latq: layer {self.prefix}: loading a span of fused shards {shard_id} "
                                      "is not supported")
        if self.fused is None:  # a fused layer: its first tensor says whether stored fused
            self.fused = shard_id is None
        exp = self.expected()
        if shard_id not in exp:
            raise ValueError(f"latq: layer {self.prefix}: unexpected shard {shard_id!r} for tensor {name} "
                             f"(expected {list(exp)}); mixing fused and split tensors is not supported")
        if shard_id in self.parts or name in self.stash.get(shard_id, {}):
            raise ValueError(f"latq checkpoint: tensor {exp[shard_id].name}.{name} is loaded twice")
        self.stash.setdefault(shard_id, {})[name] = tensor
        if len(self.stash[shard_id]) == len(self.names):
            self.parts[shard_id] = self._part(exp[shard_id], self.stash.pop(shard_id))
            if len(self.parts) == len(exp):
                self.weight = pad_rows(self._finish([self.parts[k] for k in exp]), self.geo.pad_rows)
                self.parts.clear()

    def _part(self, shard: Shard, t: dict):
        c = self.config
        shape = (shard.rows, self.geo.in_features)
        # cut on the CPU: only this rank's runtime form goes to the layer's device (process_weights_after_loading)
        t = {k: v.detach().cpu() for k, v in t.items()}
        try:
            fmt.validate_layer(t, c.kind, shape, self.bits, c.group_size, layer=shard.name, decode=False)
        except fmt.FormatError as e:
            raise fmt.FormatError(f"latq checkpoint does not match layer {self.prefix} of the model: {e}") from e
        g = self.geo
        if c.kind == "dense":
            return slice_dense(t, self.bits, c.group_size, g.in_features, shard.blocks, g.col0, g.ncols,
                               coded=self._keeps_codes())
        try:
            z = fmt.decode_integers(t, "huffman", shape, None)
        except ValueError as e:
            raise fmt.FormatError(f"latq checkpoint: Huffman stream does not decode: {e}",
                                  tensor=f"{shard.name}.hstream") from e
        z = torch.cat([z[r0:r0 + n, g.col0:g.col0 + g.ncols] for r0, n in shard.blocks])
        return z, t["hscale"].float().expand(z.shape[0])

    def _keeps_codes(self) -> bool:
        """Whether the layer's runtime form keeps its scale codes (decided, and a refusal logged,
        when its first shard is cut: then the layer's shards are known)."""
        if self.keep_codes is None:
            why = None if self.config.scale_bits is None else codes_refusal(
                [(sh.name, r0, n) for sh in self.expected().values() for r0, n in sh.blocks], self.geo.pad_rows)
            if why is not None:
                logger.info("latq %s: fp16 scales served, not the stored scale codes: %s", self.prefix, why)
            self.keep_codes = self.config.scale_bits is not None and why is None
        return self.keep_codes

    def _finish(self, parts) -> LatqWeight:
        if self.config.kind == "dense":
            return merge(parts)
        z = torch.cat([p[0] for p in parts])
        s = torch.cat([p[1] for p in parts])
        try:
            return transcode(z, s, family=self.family)   # per-row scales: a fused layer's parts keep their own
        except ValueError as e:
            raise fmt.FormatError(f"latq checkpoint: layer {self.prefix}: {e}") from e

    def missing(self) -> str:
        exp = self.expected() if self.fused is not None else self.geo.shards
        miss = []
        for k, shard in exp.items():
            if k in self.parts:
                continue
            have = self.stash.get(k, {})
            miss += [f"{shard.name}.{n}" for n in self.names if n not in have]
        return ", ".join(miss)


# ----------------------------------------------------------------------------- the method

class LatqLinearMethod(LinearMethodBase):
    """A latq-quantized linear: loads the checkpoint tensors, runs the selected kernel."""

    def __init__(self, config, report: "LoadReport"):
        self.config = config
        self.report = report

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        arch, hf_config = loader_rows.loading_model()
        refusal = loader_rows.refusal(arch, layer.prefix)
        if refusal:
            raise NotImplementedError(refusal)
        geo = geometry(layer, self.config.hf_names(layer.prefix))
        if geo.fused is not None:
            geo = in_loader_order(geo, loader_rows.checkpoint_rows(arch, hf_config, layer.prefix, geo.fused.rows))
        st = layer._latq_load = LoadState(layer, self.config, geo)
        layer._latq_act_dtype = params_dtype
        for name in st.names:
            dtype = fmt.tensor_dtype(name, input_size)
            p = Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
            set_weight_attrs(p, {"weight_loader": _Loader(layer, name)})
            layer.register_parameter(name, p)
        # the placeholders are made on the device the model is built on: its kernel family's
        # widths and served bytes choose the inlier width of a transcoded (HPTQ) layer
        st.family = selector.family_for(p.device)
        self.report.expect()

    def process_weights_after_loading(self, layer) -> None:
        st: LoadState | None = getattr(layer, "_latq_load", None)
        if st is None:
            return  # already processed
        if st.weight is None:
            raise ValueError(f"latq checkpoint is missing tensors for layer {layer.prefix}: {st.missing()}")
        names = st.names
        device = getattr(layer, names[0]).device
        for name in names:
            delattr(layer, name)
        w = st.weight
        shards = [st.geo.fused] if st.fused else list(st.geo.shards.values())
        stored_bits = 8 * st.stored_bytes / (sum(sh.rows for sh in shards) * st.geo.in_features)
        del layer._latq_load
        w = w.to(device)
        kernel, refused = selector.select_with_reasons(w, device, layer._latq_act_dtype)
        state = kernel.prepare(w)
        kernel.reserve(state, layer._latq_act_dtype)
        tensors, ints = kernel.flatten(state)
        for i, t in enumerate(tensors):
            layer.register_buffer(f"latq_t{i}", t, persistent=False)
        layer.latq_kernel = kernel
        layer.latq_op = ops.op_for(kernel)
        layer.latq_state = state
        layer.latq_ntensors = len(tensors)
        layer.latq_ints = list(ints)
        layer.latq_out = w.out_features
        self.report.add(layer.prefix, w, kernel, state, stored_bits, refused)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():
            tensors = [getattr(layer, f"latq_t{i}") for i in range(layer.latq_ntensors)]
            return layer.latq_op(x, tensors, layer.latq_ints, bias, layer.latq_out)
        if torch.autograd.profiler._is_profiler_enabled:
            # eager calls are plain Python: name them for a running torch.profiler
            # (bench/decode.py --profile); compiled mode shows the custom op by itself
            with torch.profiler.record_function("latq::linear"):
                return layer.latq_kernel.apply(layer.latq_state, x, bias)
        return layer.latq_kernel.apply(layer.latq_state, x, bias)


class _Loader:
    """The weight loader of one placeholder: stashes the whole tensor (see :class:`LoadState`)."""

    def __init__(self, layer, name):
        self.layer, self.name = layer, name

    def __call__(self, param, loaded_weight: torch.Tensor, shard_id=None) -> None:
        st: LoadState = self.layer._latq_load
        st.stored_bytes += loaded_weight.numel() * loaded_weight.element_size()
        st.add(self.name, loaded_weight, shard_id)


class LoadReport:
    """What the latq layers of one model load were loaded as: a debug line per layer, and one
    info summary when the last layer that ``create_weights`` announced is processed — stored
    bits/weight (the checkpoint's tensors) and served bits/weight (what the kernel chosen per
    layer streams each decode step, ``LatqKernel.served_bytes``), and for a checkpoint with coded
    scales how many layers' runtime forms keep the codes. Owned by the
    :class:`~vllm_latq.config.LatqConfig` of that load and handed to each method."""

    def __init__(self, method: str, scale_bits: int | None = None):
        self.method, self.scale_bits = method, scale_bits
        self.expected = 0
        # (weights, stored bits/weight, served bits/weight, bits, nnz, kernel, scale codes kept)
        self.layers: list[tuple[int, float, float, int, int, str, bool]] = []
        self.reasons: dict[tuple[str, tuple[str, ...]], int] = {}   # (kernel, refusals before it) → layers

    def expect(self) -> None:
        self.expected += 1

    def add(self, prefix: str, w: LatqWeight, kernel, state, stored_bits: float,
            refused: list[str] = ()) -> None:
        n = w.out_features * w.in_features
        label = kernel.label(state)
        served = kernel.served_bytes(state)
        bpw = 8 * sum(served.values()) / n
        logger.debug("latq %s: %dx%d, %d-bit inliers, group %d, %.3f%% outliers, stored %.3f bits/weight, served "
                     "%.3f bits/weight (%s), kernel %s%s", prefix, w.out_features, w.in_features, w.bits,
                     w.group_size, 100 * w.nnz / n, stored_bits, bpw,
                     ", ".join(f"{k} {v} B" for k, v in served.items()), label,
                     "".join(f"; {r}" for r in refused))
        self.layers.append((n, stored_bits, bpw, w.bits, w.nnz, label, w.coded is not None))
        key = (label, tuple(refused))
        self.reasons[key] = self.reasons.get(key, 0) + 1
        if len(self.layers) == self.expected:
            logger.info("latq: %s", self.summary())
            logger.info("latq: kernel choices:\n%s", self.reason_table())

    def reason_table(self) -> str:
        """One line per (kernel chosen, why the kernels asked before it refused): layer count,
        served bits/weight of those layers."""
        served: dict = {}
        for s in self.layers:
            served.setdefault(s[5], []).append(s)
        lines = []
        for (label, refused), count in sorted(self.reasons.items(), key=lambda kv: -kv[1]):
            ls = served[label]
            bpw = sum(s[0] * s[2] for s in ls) / sum(s[0] for s in ls)
            lines.append(f"  {count:4d} layers → {label} ({bpw:.3f} bits/weight served)"
                         + ("".join(f"; refused by {r}" for r in refused) if refused else ""))
        return "\n".join(lines)

    def served_bits(self) -> float:
        """Served bits/weight of the model's latq layers, each with its chosen kernel."""
        total = sum(s[0] for s in self.layers)
        return sum(s[0] * s[2] for s in self.layers) / total

    def summary(self) -> str:
        total = sum(s[0] for s in self.layers)
        widths: dict = {}
        kernels: dict = {}
        for s in self.layers:
            widths[s[3]] = widths.get(s[3], 0) + 1
            kernels[s[5]] = kernels.get(s[5], 0) + 1
        codes = "" if self.scale_bits is None else (
            f", {self.scale_bits}-bit scale codes: kept in {sum(s[6] for s in self.layers)} of {len(self.layers)} "
            "layers' runtime forms")
        return (f"{len(self.layers)} linears loaded ({self.method} checkpoint{codes}): stored "
                f"{sum(s[0] * s[1] for s in self.layers) / total:.3f} bits/weight, served "
                f"{self.served_bits():.3f} bits/weight with the kernel chosen per layer, inlier widths "
                f"{dict(sorted(widths.items()))}, {100 * sum(s[4] for s in self.layers) / total:.3f}% outliers, "
                f"kernels {kernels}")
