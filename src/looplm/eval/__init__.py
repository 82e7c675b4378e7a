"""Evaluation: native perplexity over depths and exact-match accuracy on the generator's tasks."""

from looplm.eval.perplexity import native_perplexity
from looplm.eval.report import EvalConfig, depth_report, format_report
from looplm.eval.tasks import task_accuracy

__all__ = ["EvalConfig", "depth_report", "format_report", "native_perplexity", "task_accuracy"]
