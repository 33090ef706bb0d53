"""``LatqMoEMethod``: the latq experts of a vLLM mixture-of-experts layer (docs/ARCHITECTURE.md, "Experts")."""
from __future__ import annotations

import logging

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.utils import set_weight_attrs

from .. import format as fmt
from ..kernels import graphs, moe, ops, selector, vllm_moe
from ..kernels.weight import LatqWeight
from .geometry import Geometry, Part
from . import vllm_scheme
from .loading import LoadState, kernel_device, tensor_names

STEMS = ("w13", "w2")
log = logging.getLogger("vllm.latq")


def graph_tokens() -> int:
    """The largest batch the engine captures in a CUDA graph (0: graphs off), from its config."""
    from vllm.config import get_current_vllm_config_or_none
    cfg = get_current_vllm_config_or_none()
    if cfg is None:
        return graphs.GRAPH_TOKENS
    if getattr(cfg.model_config, "enforce_eager", False):
        return 0
    mode = getattr(cfg.compilation_config, "cudagraph_mode", None)
    if mode is not None and getattr(mode, "name", "") == "NONE":
        return 0
    return getattr(cfg.compilation_config, "max_cudagraph_capture_size", None) or graphs.GRAPH_TOKENS


class LatqMoEMethod(FusedMoEMethodBase):
    """latq experts of one ``RoutedExperts`` layer: one latq layer per expert and projection.
    Each is loaded by the linear loader's :class:`~vllm_latq.plugin.loading.LoadState`; then served
    by vLLM's WNA16 MoE method where it takes them, else by latq's kernels."""

    def __init__(self, config, moe_config, report, prefix: str):
        super().__init__(moe_config)
        self.config, self.report, self.prefix = config, report, prefix
        self.vllm_method = None     # vLLM's WNA16 MoE method, where it serves this layer (vllm_scheme.py)
        activation = moe_config.activation.value
        if activation not in moe.ACTIVATIONS:
            raise NotImplementedError(f"latq: mixture-of-experts layer {prefix}: activation {activation!r} is not "
                                      f"supported by the latq experts (supported: {list(moe.ACTIVATIONS)})")
        if moe_config.has_bias:
            raise NotImplementedError(f"latq: mixture-of-experts layer {prefix}: expert biases are not supported")

    def maybe_roundup_sizes(self, hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config):
        return hidden_size, intermediate_size_per_partition   # latq layers keep their exact shapes

    def get_fused_moe_quant_config(self, layer) -> FusedMoEQuantConfig | None:
        if self.vllm_method is not None:
            return self.vllm_method.get_fused_moe_quant_config(layer)
        return FusedMoEQuantConfig.make()   # weights and scales live in the latq kernels' states

    def apply_monolithic(self, layer, x, router_logits, input_ids=None) -> torch.Tensor:
        """vLLM's monolithic experts (they route themselves), where its backend is one."""
        return self.vllm_method.apply_monolithic(layer, x, router_logits, input_ids)

    # ------------------------------------------------------------------ loading

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        m = self.moe
        if m.intermediate_size % m.tp_size:
            raise ValueError(f"latq: {self.prefix}: intermediate size {m.intermediate_size} does not split over "
                             f"{m.tp_size} ranks")
        names = tensor_names(self.config)
        layer._latq_moe_load = {}    # (local expert, stem) → LoadState, made when its first tensor arrives
        layer._latq_moe_names = names
        layer._latq_act_dtype = params_dtype
        in_features = {"w13": m.hidden_dim, "w2": m.intermediate_size}
        for stem in STEMS:
            for name in names:
                p = Parameter(torch.empty(0, dtype=fmt.tensor_dtype(name, in_features[stem])), requires_grad=False)
                set_weight_attrs(p, {"weight_loader": _ExpertLoader(self, layer, stem, name)})
                layer.register_parameter(f"{stem}_{name}", p)
        # the device the model is built on: the kernels' (and an HPTQ transcode's width family's)
        layer._latq_device = p.device
        layer._latq_kernel_device = kernel_device(p.device)     # what the kernels are chosen for
        layer._latq_family = selector.family_for(layer._latq_kernel_device)
        for _ in range(num_experts * len(STEMS)):
            self.report.expect()

    def checkpoint_names(self, layer, expert: int) -> dict[str, str]:
        """shard id → checkpoint module of ``expert`` (w3 absent for a non-gated layer)."""
        base = f"{self.prefix}.{expert}"
        names = {"w1": layer.ckpt_gate_proj_name, "w3": layer.ckpt_up_proj_name, "w2": layer.ckpt_down_proj_name}
        return {sid: f"{base}.{n}" for sid, n in names.items() if n is not None}

    def load_state(self, layer, stem: str, local: int, expert: int) -> LoadState:
        key = (local, stem)
        if key not in layer._latq_moe_load:
            m = self.moe
            n_full, n = m.intermediate_size, m.intermediate_size_per_partition
            rows = (m.tp_rank * n, n)                          # this rank's intermediate range
            ckpt = self.checkpoint_names(layer, expert)
            if stem == "w13":
                parts = {sid: Part(ckpt[sid], n_full, [rows]) for sid in ("w1", "w3") if sid in ckpt}
                geo = Geometry(parts, None, m.hidden_dim, 0, m.hidden_dim)
            else:
                geo = Geometry({"w2": Part(ckpt["w2"], m.hidden_dim, [(0, m.hidden_dim)])}, None, n_full,
                               rows[0], n)
            bits = {self.config.spec.bits_of(s.name) for s in geo.parts.values()}
            if len(bits) > 1:
                raise ValueError(f"latq checkpoint: {[s.name for s in geo.parts.values()]} have different bits "
                                 f"{bits} (quantization_config.layer_bits); vLLM runs them as one matrix")
            st = LoadState(f"{self.prefix}.{expert}.{stem}", self.config, geo, bits=bits.pop())
            st.family = layer._latq_family
            layer._latq_moe_load[key] = st
        return layer._latq_moe_load[key]

    def process_weights_after_loading(self, layer) -> None:
        loads = getattr(layer, "_latq_moe_load", None)
        if loads is None:
            return  # already processed
        weights = self.loaded_weights(layer, loads)
        for stem in STEMS:
            for name in layer._latq_moe_names:
                delattr(layer, f"{stem}_{name}")
        del layer._latq_moe_load
        self.vllm_method, why = vllm_scheme.choose_experts(weights, self.moe, layer._latq_kernel_device, self.prefix)
        if self.vllm_method is None and selector.forced_kernel() == vllm_moe.NAME:
            raise ValueError(f"latq: {self.prefix}: {selector.ENV_FORCE}={vllm_moe.NAME}, but vLLM's MoE kernels "
                             f"cannot serve its experts: {why}")
        if self.vllm_method is not None:
            self.serve_with_vllm(layer, weights, loads)
        else:
            self.serve_with_latq(layer, weights, loads, f"{vllm_moe.NAME}: {why}")

    def loaded_weights(self, layer, loads) -> dict[tuple[int, str], LatqWeight]:
        """(local expert, stem) → its runtime form on the layer's device; every one present."""
        weights = {}
        for local in range(layer.local_num_experts):
            for stem in STEMS:
                st = loads.get((local, stem))
                if st is None or st.weight is None:
                    what = st.missing() if st is not None else "all tensors"
                    raise ValueError(f"latq checkpoint is missing tensors for {self.prefix}, local expert {local} "
                                     f"{stem}: {what}")
                weights[local, stem] = st.weight.to(layer._latq_device)
        return weights

    def serve_with_vllm(self, layer, weights, loads) -> None:
        """vLLM's WNA16 MoE method, its parameters registered on this layer, repacks and runs the experts."""
        per_expert = vllm_scheme.install_experts(self.vllm_method, layer, weights, layer._latq_act_dtype)
        self.moe_kernel, self.moe_quant_config = self.vllm_method.moe_kernel, self.vllm_method.moe_quant_config
        experts_cls = self.vllm_method.experts_cls.__name__
        for (local, stem), w in weights.items():
            self.report.add(loads[local, stem].prefix, w, vllm_scheme.ServedExpert, (experts_cls, per_expert[stem]),
                            _stored_bits(loads[local, stem]))
        log.info("latq: %s: %d experts → %s:%s (%s backend, %.3f bits/weight served)", self.prefix, len(weights) // 2,
                 vllm_moe.NAME, experts_cls, self.vllm_method.wna16_backend.value,
                 8 * sum(per_expert.values()) / sum(w.out_features * w.in_features
                                                    for (e, _), w in weights.items() if e == 0))

    def serve_with_latq(self, layer, weights, loads, vllm_refusal: str) -> None:
        """latq's kernels per expert (stacked for the grouped kernel where they are Triton's)."""
        graphs.GRAPH_TOKENS = graph_tokens()
        device = layer._latq_kernel_device
        experts = []
        for local in range(layer.local_num_experts):
            pair = []
            for stem in STEMS:
                w, st = weights[local, stem], loads[local, stem]
                # an expert runs in latq's per-expert/grouped paths: vLLM's linear kernels serve no experts
                kernel, refused = selector.select_with_reasons(w, device, layer._latq_act_dtype,
                                                               skip=(vllm_moe.NAME,))
                state = kernel.prepare(w)
                kernel.place(state)
                kernel.reserve(state, layer._latq_act_dtype)
                self.report.add(st.prefix, w, kernel, state, _stored_bits(st), [vllm_refusal] + refused)
                pair.append((kernel, state))
            experts.append(moe.Expert(*pair))
        log.info("latq: %s: %d experts → latq's %s kernel; refused by %s", self.prefix, len(experts),
                 experts[0].w13[0].name, vllm_refusal)
        # stacked for the grouped kernel (captured decode), the experts' states becoming views
        stacked, why = moe.stack_experts(experts)
        if stacked is None and device.type == "cuda":
            log.info("latq: %s: experts run per expert, and all of them under CUDA graphs (%s)", self.prefix, why)
        elif stacked is not None and device.type == "cuda":
            moe.compile_stacked(stacked, layer._latq_act_dtype)
        tensors, ints = moe.flatten(experts, stacked)
        for i, t in enumerate(tensors):
            layer.register_buffer(f"latq_t{i}", t, persistent=False)
        layer.latq_experts, layer.latq_stacked = experts, stacked
        layer.latq_ntensors, layer.latq_ints = len(tensors), ints
        layer.latq_moe_op = ops.moe_op()

    # ------------------------------------------------------------------ forward

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input) -> torch.Tensor:
        if self.vllm_method is not None:
            return self.vllm_method.apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        expert_map = layer.expert_map
        ids = topk_ids if expert_map is None else expert_map[topk_ids.long()]   # global → local (−1: elsewhere)
        activation = layer.activation.value
        on_input = bool(layer.apply_router_weight_on_input)
        if torch.compiler.is_compiling():
            tensors = [getattr(layer, f"latq_t{i}") for i in range(layer.latq_ntensors)]
            return layer.latq_moe_op(x, topk_weights, ids, tensors, layer.latq_ints, activation, on_input)
        return moe.experts_forward(x, topk_weights, ids, layer.latq_experts, activation, weights_on_input=on_input,
                                   stacked=layer.latq_stacked)


def _stored_bits(st: LoadState) -> float:
    """The checkpoint's bits/weight of one expert projection as this rank loaded it."""
    rows = sum(s.rows for s in st.geo.parts.values())
    return 8 * st.stored_bytes / (rows * st.geo.in_features)


class _ExpertLoader:
    """The weight loader of one placeholder (``w13_qweight`` …), called per expert id and shard id."""

    def __init__(self, method: LatqMoEMethod, layer, stem: str, name: str):
        self.method, self.layer, self.stem, self.name = method, layer, stem, name

    def __call__(self, param, loaded_weight: torch.Tensor, weight_name: str = "", shard_id: str | None = None,
                 expert_id: int | None = None, return_success: bool = False):
        if expert_id is None or shard_id not in ("w1", "w3", "w2"):
            raise ValueError(f"latq: {self.method.prefix}: tensor {weight_name} is not a per-expert tensor "
                             f"(shard {shard_id!r}, expert {expert_id!r}); latq checkpoints store each expert's "
                             "projections separately (docs/FORMAT.md)")
        local = self.layer._map_global_expert_id_to_local_expert_id(expert_id)
        if local == -1:
            return False if return_success else None       # another rank's expert
        st = self.method.load_state(self.layer, self.stem, local, expert_id)
        st.stored_bytes += loaded_weight.numel() * loaded_weight.element_size()
        st.add(self.name, loaded_weight, shard_id)
        return True if return_success else None
