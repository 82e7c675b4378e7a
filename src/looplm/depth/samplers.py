"""Training depth samplers: one interface, fixed / PLN / uniform implementations (design §3).

A sampler draws one recurrence count per microbatch. Draws are a pure function of (seed, draw
counter), so every rank draws the same depth without communication and a resumed run draws the
same depths as an uninterrupted one (the counter is checkpointed). The learned depth prior
(design §4, `looplm.depth.learned`) implements the same interface and uses `observe`/`update` for its
feedback.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import numpy as np

from looplm.config import check_depth
from looplm.depth.pln import pln_pmf, pmf_mean
from looplm.errors import UserError


class DepthSampler(ABC):
    """Draws one depth per microbatch, identically on every rank."""

    def __init__(self, cap: int, seed: int = 0):
        self.cap, self.seed, self.counter = cap, seed, 0

    @abstractmethod
    def pmf(self) -> np.ndarray:
        """Current distribution over depths 1..cap (index r-1)."""

    def draw(self) -> int:
        rng = np.random.default_rng([self.seed, self.counter])
        self.counter += 1
        return int(rng.choice(self.cap, p=self.pmf())) + 1

    def mean(self) -> float:
        return pmf_mean(self.pmf())

    def observe(self, depth: int, loss_sum: float, n_targets: int) -> None:
        """Feedback for one microbatch (globally reduced loss sum and target count). Default: ignored."""

    def update(self) -> dict[str, float]:
        """Called once per optimizer step after the model update; returns metrics to log."""
        return {}

    def state_dict(self) -> dict:
        return {"counter": self.counter, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.counter, self.seed = int(state["counter"]), int(state["seed"])


class FixedDepth(DepthSampler):
    def __init__(self, depth: int, cap: int = 64, seed: int = 0):
        check_depth("fixed depth", depth, cap)
        super().__init__(cap, seed)
        self.depth = depth

    def pmf(self):
        p = np.zeros(self.cap)
        p[self.depth - 1] = 1.0
        return p

    def draw(self) -> int:
        self.counter += 1
        return self.depth


class PLNDepth(DepthSampler):
    """Capped PLN-mu (Huginn's prior), mean calibrated by bisection (design §3)."""

    def __init__(self, target: float = 5.0, sigma: float = 0.5, cap: int = 64, seed: int = 0):
        super().__init__(cap, seed)
        self._pmf = pln_pmf(target, sigma, cap)

    def pmf(self):
        return self._pmf


class UniformDepth(DepthSampler):
    def __init__(self, low: int, high: int, cap: int = 64, seed: int = 0):
        if not 1 <= low <= high <= cap:
            raise UserError(f"uniform depths need 1 <= low <= high <= {cap}, got {low}..{high}")
        super().__init__(cap, seed)
        self._pmf = np.zeros(cap)
        self._pmf[low - 1 : high] = 1.0 / (high - low + 1)

    def pmf(self):
        return self._pmf
