"""glm5_next's MoE router as a megatron-core router (plugged in through ``MoESubmodules.router``).

megatron-core's sigmoid top-k router matches glm5_next only for one router group with
normalised top-k weights: its group-limited routing scores a group by the sum of its top
``topk // group_topk`` experts, glm5_next (DeepSeek-V3) by its top 2, and it always normalises
sigmoid weights. This router computes glm5_next's routing exactly:

    s = sigmoid(x W^T) (fp32);  choice = s + e_score_correction_bias
    group score = sum of the 2 best choices in the group; keep the best topk_group groups
    experts = top-k of choice within kept groups;  weight = s[experts] (/ sum if norm_topk_prob)
    weight *= routed_scaling_factor

and keeps megatron-core's bookkeeping (tokens per expert for the expert-bias update, optional
auxiliary losses) by reusing the parent class's helpers.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter

from .config import ModelConfig


def glm_routing(logits: torch.Tensor, bias: torch.Tensor | None, *, topk: int, n_group: int, topk_group: int,
                norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, topk] fp32, expert ids [N, topk])."""
    scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1:
        N, E = choice.shape
        group_scores = choice.view(N, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1).indices, 1.0)
        keep = keep.bool().repeat_interleave(E // n_group, dim=1)
        choice = choice.masked_fill(~keep, float("-inf"))
    experts = choice.topk(topk, dim=-1).indices
    weights = scores.gather(1, experts)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, experts


def router_class(cfg: ModelConfig):
    """A TopKRouter subclass bound to ``cfg``'s glm5_next routing fields."""

    class GLMRouter(TopKRouter):
        def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
            logits = logits.view(-1, self.config.num_moe_experts)
            weights, experts = glm_routing(
                logits, self.expert_bias, topk=self.topk, n_group=cfg.n_group, topk_group=cfg.topk_group,
                norm_topk_prob=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor)
            probs = torch.zeros_like(logits).scatter(1, experts, weights.type_as(logits))
            routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, experts, True)
            if self.training and torch.is_grad_enabled() and self.is_aux_loss_enabled():
                from megatron.core.transformer.moe.moe_utils import compute_routing_scores_for_aux_loss

                aux_map, aux_scores = compute_routing_scores_for_aux_loss(
                    logits, self.topk, self.score_function, fused=False, padding_mask=None)
                probs = self._apply_aux_loss(probs, aux_scores, aux_map, with_padding_mask=False)
            self._apply_expert_bias(routing_map, padding_mask=padding_mask)
            return probs, routing_map

    return GLMRouter
