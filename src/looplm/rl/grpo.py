"""The GRPO policy objective: group-normalised advantages and a token-level clipped loss (design §10).

- advantage of completion j of a prompt: A = (r_j - mean_g r) / (std_g r + 1e-4), over the G
  completions of that prompt; std is the sample (Bessel-corrected) standard deviation.
- per action token t: ratio = exp(logp_t - old_t); loss_t = -min(ratio A, clip(ratio, 1-eps, 1+eps) A)
  + beta * KL_t with the unbiased, non-negative estimator KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1
  of KL(pi || pi_ref); the loss is the mean of loss_t over every action token of the batch. `ref_t`
  must be scored along the same path as `logp_t` (the estimator's; `estimators.reference_logits`),
  or the gap between the two paths biases the KL away from 0 where pi == pi_ref.
With one inner iteration (design §10) `old` is the detached `logp` itself, so ratio = 1 carries the
gradient of logp and clipping is inactive; it matters when old log-probs come from elsewhere.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """[N] rewards of consecutive groups of `group_size` rows -> [N] normalised advantages."""
    if group_size < 2:
        raise ValueError(f"group-normalised advantages need group_size >= 2, got {group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.double().view(-1, group_size)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)
    return adv.flatten().to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def action_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, vocab: int | None = None
) -> torch.Tensor:
    """log pi(target) under softmax(logits / temperature): [N, L, V], [N, L] -> [N, L]; with `vocab`,
    over the first `vocab` logits only (the tokenizer's ids, where the model's head is padded past
    them: the rollout samples among those, `looplm.infer.decode.token_vocab`)."""
    logp = torch.log_softmax(logits[..., :vocab].float() / temperature, dim=-1)
    return logp.gather(-1, targets[..., None])[..., 0]


def clipped_policy_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_logp: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    kl_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Token-mean clipped policy-gradient loss over the action tokens `mask` [N, L].

    logp [N, L] carries the gradient; advantages [N] are per row; `old_logp` defaults to logp
    detached (one inner iteration). Returns (loss, {"clip_frac", "kl"}).
    """
    if kl_coef and ref_logp is None:
        raise ValueError("a KL penalty needs the reference log-probabilities")
    n = mask.sum()
    if n == 0:
        raise ValueError("no action tokens to score")
    old = logp.detach() if old_logp is None else old_logp
    # positions that are no actions enter as 0 (ratio 1, KL 0), so an inf there cannot make a NaN
    # in the loss or, through torch.where's 0 * inf, in the gradient
    ratio = torch.exp(torch.where(mask, logp - old, 0))
    adv = advantages[:, None].to(logp.dtype)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    per_token = -surrogate
    stats = {"clip_frac": float((((ratio - 1).abs() > clip_eps) & mask).sum() / n)}
    if ref_logp is not None:
        diff = torch.where(mask, ref_logp - logp, 0)
        kl = torch.exp(diff) - diff - 1
        stats["kl"] = float(kl.detach().sum() / n)
        if kl_coef:
            per_token = per_token + kl_coef * kl
    loss = torch.where(mask, per_token, 0).sum() / n
    return loss, stats
