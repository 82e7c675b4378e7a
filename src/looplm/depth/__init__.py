"""Depth samplers (fixed, PLN, uniform) behind one interface (SPEC 3)."""

from looplm.depth.pln import calibrate_mu, pln_pmf
from looplm.depth.samplers import DepthConfig, DepthSampler, FixedDepth, PLNDepth, UniformDepth, build_sampler

__all__ = ["DepthConfig", "DepthSampler", "FixedDepth", "PLNDepth", "UniformDepth", "build_sampler", "calibrate_mu", "pln_pmf"]
