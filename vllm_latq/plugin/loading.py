"""Loading one latq layer: its checkpoint tensors stashed as they arrive, validated and cut to this
rank per logical matrix, assembled into the runtime form (docs/ARCHITECTURE.md, "Loading")."""
from __future__ import annotations

import torch
from vllm.logger import init_logger

from .. import format as fmt
from ..kernels.rotated import with_rotation
from ..kernels.transcode import transcode
from ..kernels.weight import RuntimeWeight
from .geometry import Geometry, Part
from .names import checkpoint_module
from .slicing import codes_refusal, merge, pad_rows, slice_codebook, slice_dense

logger = init_logger("vllm.latq")


def kernel_device(placed: torch.device) -> torch.device:
    """The device latq chooses a layer's kernels for: vLLM's platform's, whatever device the tensors are on."""
    from vllm.platforms import current_platform
    kind = current_platform.device_type
    return placed if not kind or torch.device(placed).type == kind else torch.device(kind)


def tensor_names(config) -> tuple[str, ...]:
    """The checkpoint tensors (suffixes) of each of ``config``'s layers."""
    return fmt.layer_tensors(config.kind, config.scale_bits is not None)


class LoadState:
    """Collects one layer's checkpoint tensors and builds its runtime form.
    Each logical matrix is validated, cut and dropped once in: one layer's full tensors at a time."""

    def __init__(self, layer, config, geo: Geometry, bits: int | None = None):
        # layer: the vLLM layer, or a name (one expert matrix of a MoE layer, moe_method.py)
        self.prefix = checkpoint_module(layer if isinstance(layer, str) else layer.prefix)
        self.config = config
        # a layer_bits override (e.g. an 8-bit lm_head)
        self.bits = config.bits_of(self.prefix) if bits is None else bits
        self.geo = geo
        self.names = tensor_names(config)
        self.keep_codes: bool | None = None   # coded scales: whether this rank's rows keep their codes
        self.fused: bool | None = None if geo.fused is not None else False
        self.stash: dict = {}
        self.parts: dict = {}     # shard id → the part cut: (z, row scales) for huffman, else its runtime form
        self.weight: RuntimeWeight | None = None
        self.family = None        # the kernel family whose served bytes choose HPTQ widths (the method sets it)
        self.stored_bytes = 0     # checkpoint bytes of this layer's tensors (the load report's stored bits)

    def expected(self) -> dict:
        return {None: self.geo.fused} if self.fused else self.geo.parts

    def add(self, name: str, tensor: torch.Tensor, shard_id) -> None:
        if isinstance(shard_id, (tuple, list)):
            raise NotImplementedError(f"latq: layer {self.prefix}: loading a span of fused parts {shard_id} "
                                      "is not supported")
        if self.fused is None:  # a fused layer: its first tensor says whether stored fused
            self.fused = shard_id is None
        exp = self.expected()
        if shard_id not in exp:
            raise ValueError(f"latq: layer {self.prefix}: unexpected part {shard_id!r} for tensor {name} "
                             f"(expected {list(exp)}); mixing fused and split tensors is not supported")
        if shard_id in self.parts or name in self.stash.get(shard_id, {}):
            raise ValueError(f"latq checkpoint: tensor {exp[shard_id].name}.{name} is loaded twice")
        self.stash.setdefault(shard_id, {})[name] = tensor
        if len(self.stash[shard_id]) == len(self.names):
            self.parts[shard_id] = self._part(exp[shard_id], self.stash.pop(shard_id))
            if len(self.parts) == len(exp):
                self.weight = with_rotation(pad_rows(self._finish([self.parts[k] for k in exp]), self.geo.pad_rows),
                                            self.config.rotation, self.geo.in_features, self.geo.col0, self.prefix)
                self.parts.clear()

    def _part(self, part: Part, t: dict):
        c = self.config
        shape = (part.rows, self.geo.in_features)
        # cut on the CPU: only this rank's runtime form goes to the layer's device (process_weights_after_loading)
        t = {k: v.detach().cpu() for k, v in t.items()}
        try:
            fmt.validate_layer(t, c.kind, shape, self.bits, c.group_size, layer=part.name, decode=False)
        except fmt.FormatError as e:
            raise fmt.FormatError(f"latq checkpoint does not match layer {self.prefix} of the model: {e}") from e
        g = self.geo
        if c.kind == "dense":
            return slice_dense(t, self.bits, c.group_size, g.in_features, part.blocks, g.col0, g.ncols,
                               coded=self._keeps_codes())
        if c.kind == "codebook":
            return slice_codebook(t, self.bits, c.group_size, part.blocks, g.col0, g.ncols, coded=self._keeps_codes())
        try:
            z = fmt.decode_integers(t, "huffman", shape, None)
        except ValueError as e:
            raise fmt.FormatError(f"latq checkpoint: Huffman stream does not decode: {e}",
                                  tensor=f"{part.name}.hstream") from e
        z = torch.cat([z[r0:r0 + n, g.col0:g.col0 + g.ncols] for r0, n in part.blocks])
        return z, t["hscale"].float().expand(z.shape[0])

    def _keeps_codes(self) -> bool:
        """Whether the runtime form keeps its scale codes (decided when its first part is cut)."""
        if self.keep_codes is None:
            why = None if self.config.scale_bits is None else codes_refusal(
                [(sh.name, r0, n) for sh in self.expected().values() for r0, n in sh.blocks], self.geo.pad_rows)
            if why is not None:
                logger.info("latq %s: fp16 scales served, not the stored scale codes: %s", self.prefix, why)
            self.keep_codes = self.config.scale_bits is not None and why is None
        return self.keep_codes

    def _finish(self, parts) -> RuntimeWeight:
        if self.config.kind in ("dense", "codebook"):
            return merge(parts)
        z = torch.cat([p[0] for p in parts])
        s = torch.cat([p[1] for p in parts])
        try:
            return transcode(z, s, family=self.family)   # per-row scales: a fused layer's parts keep their own
        except ValueError as e:
            raise fmt.FormatError(f"latq checkpoint: layer {self.prefix}: {e}") from e

    def missing(self) -> str:
        exp = self.expected() if self.fused is not None else self.geo.parts
        miss = []
        for k, part in exp.items():
            if k in self.parts:
                continue
            have = self.stash.get(k, {})
            miss += [f"{part.name}.{n}" for n in self.names if n not in have]
        return ", ".join(miss)



class WeightLoader:
    """The weight loader of one placeholder: stashes the whole tensor (see :class:`LoadState`)."""

    def __init__(self, layer, name):
        self.layer, self.name = layer, name

    def __call__(self, param, loaded_weight: torch.Tensor, shard_id=None) -> None:
        st: LoadState = self.layer._latq_load
        st.stored_bytes += loaded_weight.numel() * loaded_weight.element_size()
        st.add(self.name, loaded_weight, shard_id)

