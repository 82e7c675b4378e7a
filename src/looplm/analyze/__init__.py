"""Fixed-point diagnostics (design §11): convergence profile, KV settling, carryover alignment,
joint vs frozen-prefix fixed-point solves and the sharing penalty against depth."""

from .carryover import carryover_alignment
from .convergence import NEVER, convergence_depths, convergence_profile, spearman
from .kv_settling import KVSums, kv_settling
from .report import AnalyzeConfig, Analysis, analyze, format_summary, write_outputs
from .solves import SolveRule, solve, span_solves
from .trajectory import Trajectory, relative_change, run_trajectory, start

__all__ = [
    "NEVER",
    "AnalyzeConfig",
    "Analysis",
    "KVSums",
    "SolveRule",
    "Trajectory",
    "analyze",
    "carryover_alignment",
    "convergence_depths",
    "convergence_profile",
    "format_summary",
    "kv_settling",
    "relative_change",
    "run_trajectory",
    "solve",
    "span_solves",
    "spearman",
    "start",
    "write_outputs",
]
