"""Depth samplers (fixed, PLN, uniform, learned) behind one interface (design §3, 4), and
`build_sampler`, which picks one from a `DepthConfig`."""

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


def build_sampler(cfg: DepthConfig) -> DepthSampler:
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
        logits = (
            logits_from_run(lc.init_from)
            if lc.init_from is not None
            else initial_logits(lc.init, cfg.cap, cfg.depth, cfg.sigma, cfg.low, cfg.high)
        )
        return LearnedDepthPrior(logits, cfg.depth, lc, cfg.seed)
    raise UserError(f"unknown depth sampler {cfg.sampler!r}; choose fixed, pln, uniform or learned")
