"""glm5_next's MoE router as a megatron-core router (plugged in through ``MoESubmodules.router``).

megatron-core's sigmoid top-k router matches glm5_next only for one router group with
normalised top-k weights: its group-limited routing scores a group by the sum of its top
``topk // group_topk`` experts, glm5_next (DeepSeek-V3) by its top 2, and it always normalises
sigmoid weights. This router computes glm5_next's routing exactly:

    s = sigmoid(x W^T) (fp32);  choice = s + e_score_correction_bias
    group score = sum of the 2 best choices in the group; keep the best topk_group groups
    experts = top-k of choice within kept groups;  weight = s[experts] (/ sum if norm_topk_prob)
    weight *= routed_scaling_factor

and keeps megatron-core's bookkeeping (tokens per expert for the expert-bias update, the
auxiliary load-balancing losses) by reusing the parent class's helpers.

Auxiliary loss (``moe_router_load_balancing_type`` "seq_aux_loss" or "aux_loss" with
``moe_aux_loss_coeff`` > 0 in the megatron-core config): megatron-core computes it
(DeepSeek-V3's balance loss E * sum_i f_i P_i on sum-normalised sigmoid scores, per sequence for
"seq_aux_loss", per micro-batch for "aux_loss"; each tensor/context-parallel rank holds its
tokens' share) and hands it to ``attach_and_log_load_balancing_loss``, which this router
replaces: the loss joins backward as a gradient only (like megatron-core's
``MoEAuxLossAutoScaler``: ``coeff * aux_loss_grad_scale`` on each micro-batch's loss, the
trainer sets the scale to 1 / (micro-batches x data-parallel size)), and its value (without the
coefficient) is added to ``aux_loss_sum`` when that gradient is applied, in backward, so a
forward recomputed under activation checkpointing does not count twice. megatron-core's global
metrics tracker is not used. ``take_aux_loss`` reads and clears the sum. Positions padded for
context or sequence parallel (lengths that do not divide) are routed and count in it, as in the
expert-load statistics; with lengths that divide, CP 2, TP 2 (+ SP) and DP 2 gave the loss and
gradient norm of one process (checked by hand with torchrun, not a test).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter

from .config import ModelConfig


def glm_routing(logits: torch.Tensor, bias: torch.Tensor | None, *, topk: int, n_group: int, topk_group: int,
                norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, topk] fp32, expert ids [N, topk])."""
    scores = logits.float().sigmoid()
    choice = choice_scores(scores, bias)
    if n_group > 1:
        N, E = choice.shape
        group_scores = choice.view(N, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1).indices, 1.0)
        keep = keep.bool().repeat_interleave(E // n_group, dim=1)
        choice = choice.masked_fill(~keep, float("-inf"))
    experts = choice.topk(topk, dim=-1).indices
    return expert_weights(scores, experts, norm_topk_prob=norm_topk_prob, scaling=scaling), experts


def choice_scores(scores: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the top-k ranks experts by: the sigmoid scores [N, E] (fp32), plus the expert bias when
    there is one (the bias steers the choice only, never the weights)."""
    return scores if bias is None else scores + bias.float()


def expert_weights(scores: torch.Tensor, experts: torch.Tensor, *, norm_topk_prob: bool,
                   scaling: float) -> torch.Tensor:
    """The routing weights [N, k] fp32 of ``experts`` [N, k] from the sigmoid scores [N, E] (fp32,
    without the bias): theirs, normalised when ``norm_topk_prob``, x ``scaling``."""
    weights = scores.gather(1, experts)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the routing probabilities; in backward, the auxiliary loss's gradient
    (``coeff * router.aux_loss_grad_scale``, ``aux_loss`` already carries ``coeff``) and its
    value added to ``router.aux_loss_sum``."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, aux_loss: torch.Tensor, router, coeff: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.router, ctx.coeff = router, coeff
        return probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        router = ctx.router
        router.aux_loss_sum = router.aux_loss_sum.to(aux_loss.device) + aux_loss.detach().float() / ctx.coeff
        return grad, torch.full_like(aux_loss, router.aux_loss_grad_scale), None, None


class GLMRouterBase(TopKRouter):
    """megatron-core's top-k router with genome-lm's auxiliary-loss bookkeeping (see the module
    docstring); ``router_class`` binds glm5_next's routing to it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.aux_loss_grad_scale = 1.0  # plain attributes: not in the state dict or checkpoints
        self.aux_loss_sum = torch.zeros(())

    def attach_and_log_load_balancing_loss(self, activation, aux_loss_coeff, aux_loss, aux_loss_name,
                                           reduce_group=None, needs_dp_avg=True, valid_token_count=None):
        return _AttachAuxLoss.apply(activation, aux_loss, self, float(aux_loss_coeff))


def set_aux_loss_grad_scale(model: torch.nn.Module, scale: float) -> None:
    """The factor on each micro-batch's auxiliary-loss gradient, in every router of ``model``."""
    for module in model.modules():
        if isinstance(module, GLMRouterBase):
            module.aux_loss_grad_scale = scale


def take_aux_loss(model: torch.nn.Module) -> torch.Tensor:
    """Sum over the routers of ``model`` of the auxiliary losses recorded since the last call
    (without their coefficient; this rank's share under tensor/context parallel), and reset."""
    total = torch.zeros((), dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, GLMRouterBase):
            total = total + module.aux_loss_sum.detach().float().cpu()
            module.aux_loss_sum = torch.zeros(())
    return total


def router_class(cfg: ModelConfig):
    """A router subclass bound to ``cfg``'s glm5_next routing fields."""

    class GLMRouter(GLMRouterBase):
        glm_config = cfg  # the routing fields, for whoever weights given experts (compare.parity.ReplayRouting)

        def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
            seq_length, bsz = logits.shape[:2]  # [S, B, E] from the gate
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
                probs = self._apply_seq_aux_loss(probs, aux_scores, aux_map, seq_length, bsz,
                                                 with_padding_mask=False)
            self._apply_expert_bias(routing_map, padding_mask=padding_mask)
            return probs, routing_map

    return GLMRouter
