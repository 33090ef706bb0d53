"""``LatqLinearMethod``: a latq layer in a vLLM linear: placeholders whose loaders hand the
checkpoint tensors to a :class:`~.loading.LoadState`, then the kernel the selector picks — latq's
own, or vLLM's compressed-tensors scheme installed on the layer (:mod:`.vllm_scheme`)."""
from __future__ import annotations

import torch
from torch.nn import Parameter
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.utils import set_weight_attrs

from .. import format as fmt
from ..kernels import ops, selector
from . import loader_rows, vllm_scheme
from .geometry import geometry, in_loader_order
from .load_report import LoadReport
from .loading import LoadState, WeightLoader, kernel_device
from .names import checkpoint_module


class LatqLinearMethod(LinearMethodBase):
    """A latq-quantized linear: loads the checkpoint tensors, runs the selected kernel."""

    def __init__(self, config, report: "LoadReport"):
        self.config = config
        self.report = report

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                       output_size, params_dtype, **extra_weight_attrs):
        arch, hf_config = loader_rows.loading_model()
        module = checkpoint_module(layer.prefix)
        head = self.config.lm_head_quantized and loader_rows.head_refusal(arch)
        refusal = loader_rows.refusal(arch, module) or head
        if refusal:   # the head's: at the model's first latq layer, before any tensor is read
            raise NotImplementedError(refusal)
        geo = geometry(layer, self.config.hf_names(module))
        if geo.fused is not None:
            geo = in_loader_order(geo, loader_rows.checkpoint_rows(arch, hf_config, module, geo.fused.rows))
        st = layer._latq_load = LoadState(layer, self.config, geo)
        layer._latq_act_dtype = params_dtype
        for name in st.names:
            dtype = fmt.tensor_dtype(name, input_size)
            p = Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
            set_weight_attrs(p, {"weight_loader": WeightLoader(layer, name)})
            layer.register_parameter(name, p)
        # the placeholders are made on the device the model is built on: its kernel family's
        # widths and served bytes choose the inlier width of a transcoded (HPTQ) layer
        st.family = selector.family_for(kernel_device(p.device))
        self.report.expect()

    def process_weights_after_loading(self, layer) -> None:
        st: LoadState | None = getattr(layer, "_latq_load", None)
        if st is None:
            return  # already processed
        unserved = self.config.head_refusal(loader_rows.loading_model()[0])
        if unserved:
            raise ValueError(unserved)
        if st.weight is None:
            raise ValueError(f"latq checkpoint is missing tensors for layer {st.prefix}: {st.missing()}")
        names = st.names
        device = getattr(layer, names[0]).device
        for name in names:
            delattr(layer, name)
        w = st.weight
        parts = [st.geo.fused] if st.fused else list(st.geo.parts.values())
        stored_bits = 8 * st.stored_bytes / (sum(p.rows for p in parts) * st.geo.in_features)
        prefix, head = st.prefix, isinstance(layer, ParallelLMHead)
        del layer._latq_load
        w = w.to(device)
        act = layer._latq_act_dtype
        kernel, refused = selector.select_with_reasons(w, kernel_device(device), act)
        if kernel.delegated:     # vLLM's own layer code: its scheme's parameters on this layer
            vllm_scheme.install(layer, w, act, st.geo.in_features)
            if w.rotation is not None:   # x·R in front of it: vLLM's transform, or latq's op where it refuses
                why = vllm_scheme.install_transform(layer, w, act, getattr(layer, "tp_size", 1))
                refused = refused + [f"vllm's transform: {why}"] if why else refused
            self.report.add(prefix, w, vllm_scheme.ServedScheme, layer, stored_bits, refused, head)
            return
        state = kernel.prepare(w)
        kernel.place(state)
        kernel.reserve(state, act)
        install_kernel(layer, kernel, state, w.out_features)
        self.report.add(prefix, w, kernel, state, stored_bits, refused, head)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        scheme = layer.latq_scheme
        if scheme is not None:   # vLLM's kernel class, on the layer's own (possibly permuted) bias
            transform = getattr(layer, "latq_transform", None)
            return scheme.apply_weights(layer, x if transform is None else transform(x), bias)
        if torch.compiler.is_compiling():
            if bias is None and layer.latq_plain is not None:   # two tensors (and the signs), not ten to parse
                rest = [getattr(layer, f"latq_t{i}") for i in layer.latq_plain_rest]
                return layer.latq_plain(x, layer.latq_t0, layer.latq_t1, layer.latq_ints, layer.latq_out, *rest)
            tensors = [getattr(layer, f"latq_t{i}") for i in range(layer.latq_ntensors)]
            return layer.latq_op(x, tensors, layer.latq_ints, bias, layer.latq_out)
        if torch.autograd.profiler._is_profiler_enabled:
            # eager calls are plain Python: name them for a running torch.profiler
            # (bench/decode.py --profile); compiled mode shows the custom op by itself
            with torch.profiler.record_function("latq::linear"):
                return _eager(layer, x, bias)
        return _eager(layer, x, bias)


def _eager(layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """An eager call: a kernel with a C++ op runs it on the tensors flattened at load, as compiled
    mode does (the kernel's Python around it cost as much as a small layer's op); else its apply."""
    if layer.latq_native is not None:
        return layer.latq_op(x, layer.latq_native, layer.latq_ints, bias, layer.latq_out)
    return layer.latq_kernel.apply(layer.latq_state, x, bias)


def install_kernel(layer, kernel, state, out_features: int) -> None:
    """``kernel``'s prepared ``state`` on ``layer`` as :meth:`LatqLinearMethod.apply` calls it."""
    tensors, ints = kernel.flatten(state)
    for i, t in enumerate(tensors):
        layer.register_buffer(f"latq_t{i}", t, persistent=False)
    layer.latq_kernel = kernel
    layer.latq_scheme = None   # set: a missing attribute costs nn.Module a raised AttributeError a call
    layer.latq_op = ops.op_for(kernel)
    layer.latq_native = tensors if kernel.native_op() is not None else None
    layer.latq_plain, layer.latq_plain_rest = ops.plain_call(kernel, state, tensors) or (None, ())
    layer.latq_state = state
    layer.latq_ntensors = len(tensors)
    layer.latq_ints = list(ints)
    layer.latq_out = out_features
