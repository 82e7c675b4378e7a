"""Depth samplers (fixed, PLN, uniform, learned) behind one interface (design §3, 4)."""

from looplm.depth.config import DepthConfig, LearnedPriorConfig
from looplm.depth.learned import LearnedDepthPrior
from looplm.depth.pln import calibrate_mu, pln_pmf
from looplm.depth.samplers import DepthSampler, FixedDepth, PLNDepth, UniformDepth, build_sampler

__all__ = ["DepthConfig", "DepthSampler", "FixedDepth", "LearnedDepthPrior", "LearnedPriorConfig", "PLNDepth",
           "UniformDepth", "build_sampler", "calibrate_mu", "pln_pmf"]
