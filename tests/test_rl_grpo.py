"""GRPO objective (design §10): group-normalised advantages and the clipped token-level loss against
hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from looplm.rl import action_logprobs, clipped_policy_loss, group_advantages


def test_group_advantages_hand_example():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 3.0, 1.0, 2.0, 2.0])
    adv = group_advantages(rewards, 4)
    s1 = math.sqrt((4 * 0.25) / 3)  # group 1: mean 0.5, sample std sqrt(1/3)
    s3 = math.sqrt((1 + 1 + 0 + 0) / 3)  # group 3: mean 2
    want = [
        0.5 / (s1 + 1e-4),
        -0.5 / (s1 + 1e-4),
        -0.5 / (s1 + 1e-4),
        0.5 / (s1 + 1e-4),
        0,
        0,
        0,
        0,  # a uniform group has no advantage
        1 / (s3 + 1e-4),
        -1 / (s3 + 1e-4),
        0,
        0,
    ]
    torch.testing.assert_close(adv, torch.tensor(want), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(rewards, 1)
    with pytest.raises(ValueError, match="do not split"):
        group_advantages(rewards, 5)


def test_clipped_loss_hand_example():
    old = torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.log(torch.tensor([[1.5, 1.1, 7.0], [0.5, 1.5, 1.0]], dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[True, True, False], [True, True, False]])  # the ratio-7 token is not an action
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    loss, stats = clipped_policy_loss(logp, adv, mask, old_logp=old, clip_eps=0.2)
    # per token -min(r A, clip(r) A): row 0: -min(3.0, 2.4) = -2.4, -min(2.2, 2.2) = -2.2;
    # row 1: -min(-0.5, -0.8) = 0.8, -min(-1.5, -1.2) = 1.5; mean over the 4 actions
    assert loss.item() == pytest.approx((-2.4 - 2.2 + 0.8 + 1.5) / 4)
    assert stats["clip_frac"] == pytest.approx(3 / 4)  # |r - 1| > 0.2 for ratios 1.5, 0.5, 1.5
    loss.backward()
    # clipped branches carry no gradient; unclipped ones d(-r A)/dlogp = -r A, divided by 4 tokens
    want = torch.tensor([[0.0, -1.1 * 2 / 4, 0.0], [0.0, 1.5 / 4, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, want)


def test_one_inner_iteration_gives_the_policy_gradient_and_kl_penalty():
    logp = torch.log(torch.tensor([[0.2, 0.5], [0.9, 0.3]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([1.5, -0.5], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    ref = torch.log(torch.tensor([[0.3, 0.5], [0.6, 0.3]], dtype=torch.float64))
    loss, stats = clipped_policy_loss(logp, adv, mask, kl_coef=0.1, ref_logp=ref)
    diff = ref - logp.detach()
    kl = diff.exp() - diff - 1  # k3: e^0.405 - 0.405 - 1 = 0.0945, 0, e^-0.405 - ... = 0.0721, 0
    assert stats["kl"] == pytest.approx(float(kl.mean()))
    assert loss.item() == pytest.approx(-float(adv.mean()) + 0.1 * float(kl.mean()))  # ratio = 1: -A mean + KL
    loss.backward()
    want = (-adv[:, None] + 0.1 * (1 - diff.exp())) / 4  # d/dlogp of -r A and of the k3 KL
    torch.testing.assert_close(logp.grad, want)
    with pytest.raises(ValueError, match="reference"):
        clipped_policy_loss(logp, adv, mask, kl_coef=0.1)


def test_action_logprobs_at_a_temperature():
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]]])
    got = action_logprobs(logits, torch.tensor([[0, 2]]), temperature=2.0)
    p0 = math.exp(1.0) / (math.exp(1.0) + 1 + math.exp(-0.5))
    p1 = math.exp(1.5) / (2 * math.exp(0.25) + math.exp(1.5))
    torch.testing.assert_close(got, torch.tensor([[math.log(p0), math.log(p1)]]))


def test_a_position_that_is_no_action_has_no_weight_even_at_inf():
    # a KL term that overflows at a padded position must not turn the loss into NaN (0 * inf)
    logp = torch.tensor([[-0.5, -200.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-0.5, 600.0]], dtype=torch.float64)  # exp(800) = inf at the padded position
    mask = torch.tensor([[True, False]])
    loss, stats = clipped_policy_loss(logp, torch.tensor([2.0], dtype=torch.float64), mask, kl_coef=0.1, ref_logp=ref)
    assert loss.item() == pytest.approx(-2.0) and stats["kl"] == 0.0
    loss.backward()
    assert logp.grad[0, 1] == 0 and torch.isfinite(logp.grad).all()


def test_action_logprobs_over_the_tokenizers_ids():
    logits = torch.tensor([[[1.0, 2.0, 9.0]]])  # the last row is padding past a 2-id tokenizer
    got = action_logprobs(logits, torch.tensor([[1]]), vocab=2)
    torch.testing.assert_close(got, torch.tensor([[2.0 - math.log(math.exp(1.0) + math.exp(2.0))]]))


def test_integer_rewards_give_float_advantages():
    """Rewards given as integers (0/1 correctness) are normalised in floating point, not truncated back
    to the reward's integer dtype."""
    adv = group_advantages(torch.tensor([1, 0, 0, 1, 2, 2]), 2)
    s = math.sqrt(0.5)  # sample std of {1, 0}
    want = [0.5 / (s + 1e-4), -0.5 / (s + 1e-4), -0.5 / (s + 1e-4), 0.5 / (s + 1e-4), 0.0, 0.0]
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor(want), rtol=1e-6, atol=1e-7)


def test_a_batch_without_action_tokens_is_refused():
    """No action token: the token mean would be 0 / 0 (a NaN loss), so it is an error."""
    logp = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match="no action tokens"):
        clipped_policy_loss(logp, torch.ones(2), torch.zeros(2, 3, dtype=torch.bool))


def test_a_non_action_position_at_minus_inf_keeps_the_gradient_finite():
    """A log-prob of -inf off the mask (e.g. a padded target an fp16 softmax underflowed) gives
    logp - old = -inf - -inf = NaN there; masked before the exp, it leaves no NaN in the gradient."""
    logp = torch.tensor([[-0.7, -float("inf")]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, False]])
    loss, stats = clipped_policy_loss(logp, torch.tensor([1.5], dtype=torch.float64), mask)
    assert loss.item() == pytest.approx(-1.5) and stats["clip_frac"] == 0.0
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.5, 0.0]], dtype=torch.float64))


def test_clip_frac_counts_ratios_strictly_beyond_the_clip_range():
    """A ratio on the edge of [1 - eps, 1 + eps] is not clipped (its clip is itself): clip_frac counts
    |ratio - 1| > eps only."""
    logp = torch.log(torch.tensor([[2.0, 2.5, 1.0]], dtype=torch.float64))
    assert torch.exp(logp[0, 0]).item() == 2.0  # exactly on the edge for eps = 1
    mask = torch.ones(1, 3, dtype=torch.bool)
    old = torch.zeros(1, 3, dtype=torch.float64)
    _, stats = clipped_policy_loss(logp, torch.ones(1, dtype=torch.float64), mask, old_logp=old, clip_eps=1.0)
    assert stats["clip_frac"] == pytest.approx(1 / 3)  # only the ratio 2.5


def test_kl_statistic_is_the_mean_over_action_tokens_only():
    """The logged KL is a mean over the action tokens (the masked positions count neither in the sum
    nor in the denominator)."""
    logp = torch.log(torch.tensor([[0.2, 0.5, 0.1], [0.9, 0.3, 0.4]], dtype=torch.float64))
    ref = torch.log(torch.tensor([[0.3, 0.5, 0.9], [0.6, 0.1, 0.4]], dtype=torch.float64))
    mask = torch.tensor([[True, True, False], [True, False, False]])
    _, stats = clipped_policy_loss(logp, torch.zeros(2, dtype=torch.float64), mask, ref_logp=ref)
    k3 = lambda p, q: q / p - math.log(q / p) - 1  # noqa: E731  exp(ref - logp) - (ref - logp) - 1
    assert stats["kl"] == pytest.approx((k3(0.2, 0.3) + k3(0.5, 0.5) + k3(0.9, 0.6)) / 3)
