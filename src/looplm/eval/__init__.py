"""Evaluation: native perplexity over depths and exact-match accuracy on the generator's tasks."""

from looplm.eval.cached import cached_perplexity, sharing_table
from looplm.eval.choice import load_choice_jsonl, score_choices
from looplm.eval.generation import exact_match_generator_tasks, exact_match_gsm8k, load_gsm8k_jsonl, pass_at_k
from looplm.eval.perplexity import native_perplexity
from looplm.eval.report import EvalConfig, depth_report, format_report
from looplm.eval.tasks import task_accuracy

__all__ = [
    "EvalConfig",
    "cached_perplexity",
    "depth_report",
    "exact_match_generator_tasks",
    "exact_match_gsm8k",
    "format_report",
    "load_choice_jsonl",
    "load_gsm8k_jsonl",
    "native_perplexity",
    "pass_at_k",
    "score_choices",
    "sharing_table",
    "task_accuracy",
]
