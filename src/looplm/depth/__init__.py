"""Depth samplers (fixed, PLN, uniform, learned) behind one interface (design §3, 4), and
`build_sampler`, which picks one from a `DepthConfig`."""

import numpy as np

from looplm.depth.config import DepthConfig, LearnedPriorConfig
from looplm.depth.learned import LearnedDepthPrior, initial_logits, logits_from_run
from looplm.depth.pln import calibrate_mu, pln_pmf
from looplm.depth.samplers import DepthSampler, FixedDepth, PLNDepth, UniformDepth
from looplm.errors import UserError

__all__ = [
    "DepthConfig",
    "DepthSampler",
    "FixedDepth",
    "LearnedDepthPrior",
    "LearnedPriorConfig",
    "PLNDepth",
    "UniformDepth",
    "build_sampler",
    "calibrate_mu",
    "pln_pmf",
]


def build_sampler(cfg: DepthConfig, *, init_logits: np.ndarray | None = None) -> DepthSampler:
    """The sampler `cfg` names. A learned prior starts from `init_logits` when given (a resumed run's
    own, which its state then overwrites), else from the run `init_from` names, else from its
    `init` shape; its logits must cover depths 1..cap."""
    if cfg.cap < 1:
        raise UserError(f"depth cap must be >= 1, got {cfg.cap}")
    cfg.effective_bptt_window()  # validates an explicit window
    if cfg.sampler == "fixed":
        if cfg.depth != int(cfg.depth):
            raise UserError(f"fixed depth must be an integer, got {cfg.depth}")
        return FixedDepth(int(cfg.depth), cfg.cap, cfg.seed)
    if cfg.sampler == "pln":
        return PLNDepth(cfg.depth, cfg.sigma, cfg.cap, cfg.seed)
    if cfg.sampler == "uniform":
        return UniformDepth(cfg.low, cfg.high, cfg.cap, cfg.seed)
    if cfg.sampler == "learned":
        lc = cfg.learned
        if init_logits is not None:
            logits = np.asarray(init_logits, dtype=np.float64)
        elif lc.init_from is not None:
            logits = logits_from_run(lc.init_from)
        else:
            logits = initial_logits(lc.init, cfg.cap, cfg.depth, cfg.sigma, cfg.low, cfg.high)
        if len(logits) != cfg.cap:
            raise UserError(
                f"the learned prior's logits cover depths 1..{len(logits)} but depth.cap is {cfg.cap}"
                + (f" (the prior of {lc.init_from}): set --depth.cap {len(logits)}" if lc.init_from is not None else "")
            )
        return LearnedDepthPrior(logits, cfg.depth, lc, cfg.seed)
    raise UserError(f"unknown depth sampler {cfg.sampler!r}; choose fixed, pln, uniform or learned")
