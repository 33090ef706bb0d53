"""A vLLM mixture-of-experts layer with latq's method across the CUDA boundary: built by vLLM's
``FusedMoEFactory``, loaded from per-expert latq tensors through vLLM's expert mapping,
processed and applied (TP 2: half of each expert's rows a rank, partial outputs summed), against
``moe_models.moe_reference`` on latq's dequantized experts."""
from __future__ import annotations

import torch

from . import boundary_layers as bl
from .moe_models import moe_reference

GROUP = 64            # the MoE checkpoints' group: divides each rank's intermediate rows at TP 2
# layer name → hidden size: 256 is Marlin MoE's; 192 (not a multiple of 128) is vLLM's Triton WNA16 experts'
HIDDEN = {"moe": bl.HIDDEN, "moe-h192": 192}
PROJ = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))
_BUILT = [0]           # layers built in this process (vLLM keys each MoE layer by a unique name)


def _experts_module(runner):
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    return next(m for m in runner.modules() if isinstance(m, RoutedExperts))


def _routing(T: int, hidden: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, hidden, generator=g)
    w, ids = torch.randn(T, bl.E, generator=g).softmax(-1).topk(bl.TOPK, -1)
    return x, w / w.sum(-1, keepdim=True), ids.int()


def moe_case(case: bl.Case) -> dict:
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    dtype, hidden = bl.DTYPES[case.dtype], HIDDEN[case.layer]
    quant = bl.quant_config(case.bits, GROUP)
    _BUILT[0] += 1
    prefix = f"model.layers.{_BUILT[0]}.mlp.experts"
    runner = FusedMoEFactory(num_experts=bl.E, top_k=bl.TOPK, hidden_size=hidden, intermediate_size=bl.MOE_INTER,
                             params_dtype=dtype, quant_config=quant, prefix=prefix,
                             tp_size=get_tensor_model_parallel_world_size())
    layer = _experts_module(runner)
    experts = []
    for e in range(bl.E):
        mats = {}
        for i, (proj, shard) in enumerate(PROJ):
            rows, cin = (hidden, bl.MOE_INTER) if shard == "w2" else (bl.MOE_INTER, hidden)
            t = bl.checkpoint_tensors(rows, cin, case.bits, seed=10 * e + i, group=GROUP, outliers=case.outliers)
            mats[shard] = bl.dequantized(t, rows, cin, case.bits, GROUP)
            stem = "w2" if shard == "w2" else "w13"
            for suffix, v in t.items():
                p = getattr(layer, f"{stem}_{suffix}")
                p.weight_loader(p, v, f"{prefix}.{e}.{proj}.{suffix}", shard_id=shard, expert_id=e, return_success=True)
        experts.append((torch.cat([mats["w1"], mats["w3"]]), mats["w2"]))
    layer.quant_method.process_weights_after_loading(layer)
    x, w, ids = _routing(7, hidden)
    y = layer.quant_method.apply(layer, x.to(dtype), w, ids, None, None)
    if get_tensor_model_parallel_world_size() > 1:
        y = tensor_model_parallel_all_reduce(y)     # each rank's intermediate share: partial sums
    want = moe_reference(x.to(dtype).float(), w, ids, experts)
    rel = float((y.float() - want).norm() / want.norm())
    # weights, the intermediate activation and the output each rounded once to the activation type
    ok = rel <= 4 * (bl.ULP[dtype] + bl.MOE_INTER * bl.ULP[torch.float32]) and y.dtype == dtype
    report = quant.load_report
    return {"ok": ok, "rel_err": rel, "kernel": report.layers[-1].kernel, "table": report.reason_table(),
            "served_bits": report.served_bits(), "dtype": str(y.dtype)}
