"""A vLLM mixture-of-experts layer's configuration and the attributes vLLM's WNA16 MoE methods
read of it, without vLLM's engine (tests and benches of ``plugin/vllm_scheme``'s experts)."""
from __future__ import annotations

import torch


def fused_moe_config(experts: int, topk: int, hidden: int, inter: int, device: str = "cpu",
                     dtype: torch.dtype = torch.bfloat16):
    """vLLM's ``FusedMoEConfig`` of one rank holding every expert, SiLU-gated, renormalized top-``topk``."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                             RoutingMethodType)
    par = FusedMoEParallelConfig(tp_size=1, tp_rank=0, pcp_size=1, pcp_rank=0, dp_size=1, dp_rank=0, ep_size=1,
                                 ep_rank=0, sp_size=1, use_ep=False, all2all_backend="allgather_reducescatter",
                                 enable_eplb=False)
    return FusedMoEConfig(num_experts=experts, experts_per_token=topk, hidden_dim=hidden, intermediate_size=inter,
                          num_local_experts=experts, num_logical_experts=experts, activation=MoEActivation.SILU,
                          device=device, routing_method=RoutingMethodType.Renormalize, moe_parallel_config=par,
                          in_dtype=dtype)


class BareExperts(torch.nn.Module):
    """What vLLM's WNA16 MoE method reads of its ``RoutedExperts`` layer, and nothing more."""

    def __init__(self, moe_config):
        super().__init__()
        self.moe_config = moe_config
        self.local_num_experts = self.global_num_experts = moe_config.num_experts
        self.intermediate_size_per_partition = moe_config.intermediate_size_per_partition
        self.activation = moe_config.activation
        self.apply_router_weight_on_input = False
        self.expert_map = None

    def _expert_routing_tables(self):
        return None
