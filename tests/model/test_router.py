"""glm5_next's routing (group-limited, optional normalisation) against transformers' router."""

import pytest
import torch

from genome_lm.model.router import glm_routing


@pytest.mark.parametrize("n_group,topk_group,norm", [(1, 1, True), (4, 2, True), (4, 2, False), (8, 3, True)])
def test_routing_matches_transformers(n_group, topk_group, norm):
    from transformers import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextTopkRouter

    cfg = Glm5NextTextConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                             topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = Glm5NextTextTopkRouter(cfg)
    g = torch.Generator().manual_seed(n_group * 10 + topk_group)
    with torch.no_grad():
        router.weight.normal_(generator=g)
        router.e_score_correction_bias.normal_(generator=g).mul_(0.1)
    x = torch.randn(300, 32, generator=g)
    logits, hf_w, hf_idx = router(x)
    w, idx = glm_routing(logits, router.e_score_correction_bias, topk=4, n_group=n_group, topk_group=topk_group,
                         norm_topk_prob=norm, scaling=2.5)
    # same experts (as sets per token) with the same weights
    order_hf, order = hf_idx.argsort(-1), idx.argsort(-1)
    assert torch.equal(hf_idx.gather(1, order_hf), idx.gather(1, order))
    torch.testing.assert_close(hf_w.gather(1, order_hf), w.gather(1, order), rtol=1e-6, atol=1e-7)
    if n_group > 1:  # the group limit matters: plain top-k would pick other experts for some tokens
        plain = (logits.sigmoid() + router.e_score_correction_bias).topk(4, dim=-1).indices.sort(-1).values
        assert not torch.equal(plain, idx.sort(-1).values)
