"""Typed configuration of the training depth sampler (design §3) and of the learned depth prior (design §4)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from looplm.errors import UserError

# Backprop window b of the sampled-depth priors (PLN, uniform, learned): paper App. B.3, b_max = 10.
SAMPLED_BPTT_WINDOW = 10


@dataclass
class LearnedPriorConfig:
    """Settings of the learned depth prior (design §4); used when `sampler` is 'learned'."""

    init: Literal["pln", "uniform", "restricted"] = "pln"
    """Initial logits: ln of the capped PLN pmf with mean `depth`; uniform over 1..cap; or uniform over
    low..high with every other depth inactive (probability 0 for the whole run: the restricted control)."""
    init_from: Path | None = None
    """Start from the learned logits of another run or checkpoint (overrides `init`); with `frozen`, this
    trains under a learned shape held fixed from step 0."""
    reward: Literal["inv_ppl", "ce", "neg_log_ce", "neg_exp_ce"] = "inv_ppl"
    """omega(CE): inverse perplexity exp(-CE), raw CE (cost = CE), -log CE, or -exp CE."""
    entropy_weight: float = 0.0
    """lambda_H: weight of the entropy bonus (the paper uses 0, 0.01, 0.05, 0.1)."""
    mean_weight: float = 1.0
    """lambda_m: weight of the squared penalty pulling the prior mean toward `depth`."""
    ema_decay: float = 0.95
    """nu: decay of the EMA baselines and variances of CE and cost."""
    lr: float = 1e-3
    """Learning rate of the prior's own Adam."""
    beta1: float = 0.9
    """Adam beta1 of the prior."""
    beta2: float = 0.999
    """Adam beta2 of the prior."""
    warmup_updates: int = 32
    """Updates with frozen logits while the baselines warm up."""
    frozen: bool = False
    """Never move the logits: sample a fixed shape through the same sampler (the frozen arm)."""


@dataclass
class DepthConfig:
    """How training chooses the recurrence count R of each microbatch (design §3)."""

    sampler: Literal["fixed", "pln", "uniform", "learned"] = "pln"
    """fixed: always `depth`; pln: capped Poisson-lognormal with mean `depth`; uniform: U(low..high);
    learned: a categorical prior trained from prediction feedback toward mean `depth` (design §4)."""
    depth: float = 5.0
    """Fixed R, or the target mean of the PLN prior and of the learned prior."""
    low: int = 1
    """Smallest depth of the uniform sampler."""
    high: int = 9
    """Largest depth of the uniform sampler."""
    sigma: float = 0.5
    """Standard deviation of ln(lambda) for PLN."""
    cap: int = 64
    """Largest depth any sampler may draw (the PLN cap bucket)."""
    bptt_window: int | None | Literal["auto"] = "auto"
    """Backprop window b: only the last min(R, b) recurrences get gradients. None = full BPTT;
    auto = full BPTT (b = R) for fixed, 10 for pln, uniform and learned (the paper's settings)."""
    seed: int = 0
    """Seed of the depth draws (independent of the model seed)."""
    learned: LearnedPriorConfig = field(default_factory=LearnedPriorConfig)
    """The learned prior's settings (sampler 'learned')."""

    def effective_bptt_window(self) -> int | None:
        """The backprop window this config trains with: `bptt_window` with 'auto' resolved by the
        sampler (design §3: full BPTT for the fixed-depth baseline, b = 10 for the sampled priors)."""
        b = self.bptt_window
        if b == "auto":
            return None if self.sampler == "fixed" else SAMPLED_BPTT_WINDOW
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise UserError(f"bptt_window must be >= 1, None (full BPTT) or 'auto', got {b!r}")
        return b

    @classmethod
    def from_dict(cls, data: dict) -> "DepthConfig":
        learned = dict(data.get("learned") or {})
        if learned.get("init_from"):
            learned["init_from"] = Path(learned["init_from"])
        return cls(**{**data, "learned": LearnedPriorConfig(**learned)})
