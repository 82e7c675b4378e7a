"""The learned depth prior (design §4): a categorical over 1..cap trained by REINFORCE on prediction feedback.

The prior is a vector of float64 logits phi outside the model optimizer. Each microbatch draws its
depth R_i from softmax(phi) (a pure function of (seed, counter), so every rank draws the same
depth). The trainer reports each microbatch's globally reduced (CE sum, target count); once per
optimizer step the prior turns the microbatch CEs l_i into costs c_i = -omega(l_i) and minimises

    J(phi) = sum_i w_i * sg[s * (c_i - b_c)] * ln p(R_i) + lambda_m * (E_p[R] - R_target)^2 - lambda_H * H(p)

with token weights w_i = N_i / sum N, an EMA cost baseline b_c (taken before this step; the first
update's observation initialises it, paper App. B.3) and a PopArt-like scale s = std(l) / std(c)
that puts cost advantages in CE units. Its own Adam steps on J
only after `warmup_updates` updates; until then only the baselines move.

The gradient is computed in closed form here (`objective_gradient`); the tests check it against
autograd of J.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from looplm.depth.config import LearnedPriorConfig
from looplm.depth.samplers import DepthSampler
from looplm.errors import UserError

STD_FLOOR = 1e-12

# omega: reward from a microbatch's mean CE; the prior works with costs c = -omega(l).
REWARDS = {
    "inv_ppl": lambda ce: math.exp(-ce),
    "ce": lambda ce: -ce,
    "neg_log_ce": lambda ce: -math.log(max(ce, 1e-12)),
    "neg_exp_ce": lambda ce: -math.exp(ce),
}


def reward_fn(name: str):
    if name not in REWARDS:
        raise UserError(f"unknown depth-prior reward {name!r}; choose one of {', '.join(REWARDS)}")
    return REWARDS[name]


def masked_softmax(logits: np.ndarray, active: np.ndarray) -> np.ndarray:
    z = np.where(active, logits, -np.inf)
    z = z - z[active].max()
    p = np.where(active, np.exp(z), 0.0)
    return p / p.sum()


def entropy(p: np.ndarray) -> float:
    nz = p > 0
    return float(-(p[nz] * np.log(p[nz])).sum())


def objective_gradient(
    logits: np.ndarray,
    active: np.ndarray,
    depths,
    advantages,
    weights,
    *,
    target: float,
    mean_weight: float,
    entropy_weight: float,
) -> np.ndarray:
    """dJ/dphi in closed form. `advantages` are the stop-gradient factors s * (c_i - b_c).

    Policy term: sum_i w_i a_i (onehot(R_i) - p); mean term: 2 lambda_m (m - target) p (k - m);
    entropy term: -lambda_H dH/dphi with dH/dphi(r) = -p(r) [ln p(r) + H]. Inactive depths get 0.
    """
    p = masked_softmax(logits, active)
    k = np.arange(1, len(p) + 1, dtype=np.float64)
    m = float((k * p).sum())
    grad = np.zeros_like(p)
    for r, a, w in zip(depths, advantages, weights):
        grad[r - 1] += w * a
    grad -= float(np.dot(weights, advantages)) * p
    grad += 2.0 * mean_weight * (m - target) * p * (k - m)
    logp = np.where(p > 0, np.log(np.where(p > 0, p, 1.0)), 0.0)
    grad += entropy_weight * p * (logp + entropy(p))
    return np.where(active, grad, 0.0)


def _weighted_moments(x: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    mean = float(np.dot(w, x))
    return mean, float(np.dot(w, (x - mean) ** 2))


class LearnedDepthPrior(DepthSampler):
    """Categorical depth prior over 1..cap with float64 logits, REINFORCE + entropy + mean penalty."""

    def __init__(self, logits: np.ndarray, target: float, cfg: LearnedPriorConfig, seed: int = 0):
        logits = np.asarray(logits, dtype=np.float64)
        active = np.isfinite(logits)
        if not active.any():
            raise UserError("the depth prior needs at least one active depth")
        super().__init__(len(logits), seed)
        if not 1 <= target <= len(logits):
            raise UserError(f"depth-prior target mean must lie in [1, {len(logits)}], got {target}")
        depths = np.flatnonzero(active) + 1
        if not depths[0] <= target <= depths[-1]:  # the mean penalty could never be met
            raise UserError(
                f"depth-prior target mean {target} lies outside its active depths {depths[0]}..{depths[-1]}"
            )
        for name in ("ema_decay", "beta1", "beta2"):
            if not 0 <= getattr(cfg, name) < 1:
                raise UserError(f"depth-prior {name} must be in [0, 1), got {getattr(cfg, name)}")
        if not (cfg.lr > 0 and cfg.entropy_weight >= 0 and cfg.mean_weight >= 0) or cfg.warmup_updates < 0:  # NaN too
            raise UserError("depth-prior lr must be > 0 and warmup_updates, entropy_weight, mean_weight >= 0")
        reward_fn(cfg.reward)
        self.cfg, self.target, self.active = cfg, float(target), active
        self.logits = torch.tensor(np.where(active, logits, 0.0), dtype=torch.float64, requires_grad=True)
        self.optimizer = torch.optim.Adam(
            [self.logits], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8, weight_decay=0.0, foreach=False
        )
        self.n = 0
        self.base_ce = self.var_ce = self.base_cost = self.var_cost = 0.0
        self.allocation = np.zeros(len(logits), dtype=np.int64)  # microbatches drawn at each depth
        self._pending: list[tuple[int, float, int]] = []
        self._pmf = masked_softmax(self._phi(), active)

    def _phi(self) -> np.ndarray:
        return self.logits.detach().numpy().copy()

    def pmf(self) -> np.ndarray:
        return self._pmf

    def draw(self) -> int:
        r = super().draw()
        self.allocation[r - 1] += 1
        return r

    def observe(self, depth: int, loss_sum: float, n_targets: int) -> None:
        if n_targets > 0:
            self._pending.append((int(depth), float(loss_sum) / n_targets, int(n_targets)))

    def update(self) -> dict:
        """One prior update from the microbatches observed since the last call (design §4 steps 1-6)."""
        if self._pending:
            self._step(self._pending)
        self._pending = []
        return self.metrics()

    def _step(self, observed) -> None:
        cfg = self.cfg
        depths = [r for r, _, _ in observed]
        ce = np.array([loss for _, loss, _ in observed], dtype=np.float64)
        n_tok = np.array([n for _, _, n in observed], dtype=np.float64)
        w = n_tok / n_tok.sum()
        omega = reward_fn(cfg.reward)
        cost = np.array([-omega(loss) for loss in ce], dtype=np.float64)
        moments = {name: _weighted_moments(x, w) for name, x in (("ce", ce), ("cost", cost))}
        if self.n == 0:
            # The first token-weighted observation initialises the baselines and their variances
            # (design §4 step 5; paper App. B.3: "the first weighted CE initializes the baseline"), so the
            # first update's advantages are centred on it rather than on 0.
            for name, (mean, var) in moments.items():
                setattr(self, f"base_{name}", mean)
                setattr(self, f"var_{name}", var)
        # s starts at one (design §4 step 2; paper App. B.3) and is a ratio of EMA stds afterwards.
        scale = (
            1.0 if self.n == 0 else (max(math.sqrt(self.var_ce), STD_FLOOR) / max(math.sqrt(self.var_cost), STD_FLOOR))
        )
        advantages = scale * (cost - self.base_cost)
        self.last = {
            "scale": scale,
            "advantage_abs": float(np.dot(w, np.abs(advantages))),
            "cost": float(np.dot(w, cost)),
        }
        if self.n >= cfg.warmup_updates and not cfg.frozen:
            grad = objective_gradient(
                self._phi(),
                self.active,
                depths,
                advantages,
                w,
                target=self.target,
                mean_weight=cfg.mean_weight,
                entropy_weight=cfg.entropy_weight,
            )
            self.logits.grad = torch.from_numpy(grad)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.n > 0:  # EMA of the baselines and variances (at n = 0 they were initialised above)
            nu = cfg.ema_decay
            for name, (mean, var) in moments.items():
                base, v = getattr(self, f"base_{name}"), getattr(self, f"var_{name}")
                v = nu * v + (1 - nu) * var + nu * (1 - nu) * (mean - base) ** 2
                base = nu * base + (1 - nu) * mean
                setattr(self, f"base_{name}", base)
                setattr(self, f"var_{name}", v)
        self.n += 1
        p = masked_softmax(self._phi(), self.active)
        if not np.isfinite(p).all() or (p[self.active] <= 0).any():
            raise FloatingPointError(
                f"depth prior collapsed at update {self.n}: zero or non-finite probabilities "
                "(lower --depth.learned.lr or raise --depth.learned.entropy-weight)"
            )
        self._pmf = p

    def metrics(self) -> dict:
        p = self._pmf
        t = int(round(self.target))
        out = {
            "mean": self.mean(),
            "entropy": entropy(p),
            f"p{t}": float(p[t - 1]),
            "updates": self.n,
            "baseline_ce": self.base_ce,
            "baseline_cost": self.base_cost,
            "pmf": p.tolist(),
            "allocation": self.allocation.tolist(),
        }
        out.update(getattr(self, "last", {}))
        return out

    def state_dict(self) -> dict:
        opt = self.optimizer.state_dict()
        adam = {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in opt["state"].get(0, {}).items()}
        return {
            **super().state_dict(),
            "kind": "learned",
            "logits": self._phi().tolist(),
            "active": self.active.tolist(),
            "n": self.n,
            "base_ce": self.base_ce,
            "var_ce": self.var_ce,
            "base_cost": self.base_cost,
            "var_cost": self.var_cost,
            "allocation": self.allocation.tolist(),
            "adam": adam,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "learned":
            raise UserError("checkpoint's depth sampler is not a learned prior; the depth config must match to resume")
        super().load_state_dict(state)
        if len(state["logits"]) != self.cap:
            raise UserError(f"checkpoint's depth prior has {len(state['logits'])} depths, this run {self.cap}")
        with torch.no_grad():
            self.logits.copy_(torch.tensor(state["logits"], dtype=torch.float64))
        self.active = np.array(state["active"], dtype=bool)
        self.n = int(state["n"])
        for k in ("base_ce", "var_ce", "base_cost", "var_cost"):
            setattr(self, k, float(state[k]))
        self.allocation = np.array(state["allocation"], dtype=np.int64)
        if state["adam"]:
            opt = self.optimizer.state_dict()
            opt["state"] = {
                0: {
                    k: torch.tensor(v, dtype=torch.float64 if k != "step" else torch.float32)
                    for k, v in state["adam"].items()
                }
            }
            self.optimizer.load_state_dict(opt)
        self._pmf = masked_softmax(self._phi(), self.active)


def initial_logits(init: str, cap: int, target: float, sigma: float, low: int, high: int) -> np.ndarray:
    from looplm.depth.pln import pln_log_pmf

    if init == "pln":
        return pln_log_pmf(target, sigma, cap)
    if init == "uniform":
        return np.zeros(cap)
    if init == "restricted":
        if not 1 <= low <= high <= cap:
            raise UserError(f"restricted prior needs 1 <= low <= high <= {cap}, got {low}..{high}")
        logits = np.full(cap, -np.inf)
        logits[low - 1 : high] = 0.0
        return logits
    raise UserError(f"unknown depth-prior init {init!r}; choose pln, uniform or restricted")


def logits_from_run(path: Path) -> np.ndarray:
    """The learned logits stored in a run folder's latest checkpoint (or in a checkpoint folder)."""
    from looplm.checkpoint import read_json, resolve

    state = read_json(resolve(Path(path)), "trainer_state.json")["sampler"]
    if state.get("kind") != "learned":
        raise UserError(f"{path} was not trained with a learned depth prior")
    return np.where(np.array(state["active"], dtype=bool), np.array(state["logits"], dtype=np.float64), -np.inf)
