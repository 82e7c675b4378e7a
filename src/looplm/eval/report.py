"""The depth report: native perplexity and task accuracy against test-time depth, as one table."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from looplm.config import check_depth, shown_default
from looplm.data.record import DataRecord
from looplm.errors import UserError
from looplm.eval.cached import sharing_table
from looplm.eval.perplexity import native_perplexity
from looplm.eval.tasks import task_accuracy


@dataclass
class EvalConfig:
    """What `looplm eval` (and the end of `looplm train`) measures."""

    depths: tuple[int, ...] = (1, 2, 3, 5, 8, 16, 32)
    """Test-time recurrence counts R to evaluate."""
    max_sequences: int = 64
    """Held-out sequences for native perplexity."""
    task_examples: int = 600
    """Fresh generator examples for exact-match accuracy (0 skips; needs a task-trained model)."""
    task_seed: int = 1234
    """Seed of the evaluation examples (prompts seen in training are dropped)."""
    batch_size: int = 32
    """Sequences per forward pass."""
    sharing_sequences: int = 32
    """Held-out rows for terminal-KV vs full-KV perplexity and the sharing penalty (0 skips)."""
    cacheeval_span: tuple[int, int] | None = None
    """(P, C) for the sharing table: P prompt tokens from the start of a long enough document, then C scored
    targets, the first by the prefill's last logits (the paper's CacheEval, App. D.4: 1024 512); default: every
    supervised target in the second half of each row, each document read from its own start."""
    cache: Literal["terminal", "full"] = "terminal"
    """KV cache for the decoding-based protocols below (choice tasks, generation)."""
    prefill_depth: int | None = None
    """Prefill depth R_pre for the decoding-based protocols (default: the evaluated depth)."""
    generation_examples: int = 0
    """Generator-task examples drawn and scored by greedy generation with the cache (exact match; 0 skips);
    those whose prompt the training set holds are dropped, so the report's n may be smaller."""
    choice_tasks: Path | None = None
    """JSONL of {"context", "choices", "gold"}: acc and acc_norm by cached decoding at each depth."""
    gsm8k: Path | None = None
    """GSM8K-format JSONL ({"question", "answer" with '#### N'}): exact match of the final number."""
    gsm8k_max_new_tokens: int = 256
    """Longest GSM8K answer generated (cut to what the model's context leaves after the longest prompt)."""
    sample_depths: Annotated[tuple[int, ...], shown_default("none", if_empty=True)] = ()
    """Depths at which to continue `sample_prompt` (one sample each, same seed: what depth changes)."""
    sample_prompt: str | None = None
    """Prompt of the samples; default: one from the data: a held-out generator prompt (task generator), a
    speaker's line (the built-in Shakespeare), else the first line of the first held-out document."""
    sample_tokens: int = 200
    """Tokens per sample."""
    sample_temperature: float = 0.8
    """Sampling temperature of the samples (seeded, so a run prints the same text each time)."""
    output: Path | None = None
    """Write the report as JSON here (default: <run>/eval.json next to the checkpoint's run; with --data other
    than the run's own, <run>/eval-<data>.json)."""

    def check_span(self, row_len: int, prefix: str = "") -> None:
        """Refuse a CacheEval span that no data row of `row_len` tokens can hold (it failed only after
        every other measurement, with no report written)."""
        if self.cacheeval_span is not None and sum(self.cacheeval_span) > row_len:
            P, C = self.cacheeval_span
            name = f"{prefix}{'cacheeval-span' if prefix == '--' else 'cacheeval_span'}"
            raise UserError(f"{name}: P + C = {P + C} tokens do not fit the data's rows of {row_len}, got {P} {C}")

    def validate(
        self, max_depth: int, max_seq_len: int, *, prefix: str = "", allow_no_depths: bool = False, tokenizer=None
    ) -> None:
        """Raise a UserError naming the option (`prefix` + field: "eval." in `looplm train`, "--" in
        `looplm eval`) for what would fail only after the work has started: depths, sizes, input files, and
        with `tokenizer`, a sample prompt that does not fit the context."""

        def name(field: str) -> str:
            return f"{prefix}{field.replace('_', '-') if prefix == '--' else field}"

        def bad(field: str, rule: str, value) -> UserError:
            return UserError(f"{name(field)}: {rule}, got {value}")

        if not self.depths and not allow_no_depths:
            raise bad("depths", "give at least one depth", "none")
        for field in ("depths", "sample_depths"):
            given = getattr(self, field)
            if len(set(given)) < len(given):  # each would run again and its row be merged into one
                raise bad(field, "give each depth once", " ".join(map(str, given)))
        depths = [(field, r) for field in ("depths", "sample_depths") for r in getattr(self, field)]
        for field, r in depths + ([("prefill_depth", self.prefill_depth)] if self.prefill_depth is not None else []):
            check_depth(f"{name(field)}: depth", r, max_depth)
        for field, least in (
            ("batch_size", 1),
            ("max_sequences", 1),
            ("task_examples", 0),
            ("sharing_sequences", 0),
            ("generation_examples", 0),
            ("gsm8k_max_new_tokens", 1),
            ("sample_tokens", 1),
        ):
            if getattr(self, field) < least:
                raise bad(field, f"must be >= {least}", getattr(self, field))
        if not self.sample_temperature >= 0:
            raise bad("sample_temperature", "must be >= 0", self.sample_temperature)
        if self.output is not None and Path(self.output).is_dir():  # found only when the report was written
            raise bad("output", "is a folder; give the report's .json file path", self.output)
        if self.cacheeval_span is not None:
            P, C = self.cacheeval_span
            if P < 1 or C < 2 or P + C > max_seq_len:
                raise bad(
                    "cacheeval_span",
                    f"P >= 1 prompt and C >= 2 continuation tokens with P + C <= the context max_seq_len={max_seq_len}",
                    f"{P} {C}",
                )
        from looplm.eval.choice import load_choice_jsonl
        from looplm.eval.generation import GSM8K_PROMPT, load_gsm8k_jsonl

        for field, load in (("choice_tasks", load_choice_jsonl), ("gsm8k", load_gsm8k_jsonl)):
            path = getattr(self, field)
            if path is None:
                continue
            if not Path(path).is_file():
                raise bad(field, "no such file", path)
            try:  # read now: a bad line would otherwise surface after all the perplexity work
                items = load(path)
            except UserError as err:
                raise UserError(f"{name(field)}: {err}") from None
            if not items:
                raise bad(field, "no items in the file", path)
            if field == "gsm8k" and tokenizer is not None:
                longest = max(len(tokenizer.encode_prompt(GSM8K_PROMPT.format(question=it.question))) for it in items)
                if longest >= max_seq_len:
                    raise bad(
                        field,
                        f"a prompt of {longest} tokens leaves no room in the context max_seq_len={max_seq_len}",
                        path,
                    )
        if self.sample_depths:
            if self.sample_prompt == "":
                raise bad("sample_prompt", "the samples need a non-empty prompt", "''")
            n = len(tokenizer.encode_prompt(self.sample_prompt)) if tokenizer is not None and self.sample_prompt else 0
            if n > max_seq_len:
                raise bad("sample_prompt", f"does not fit the context max_seq_len={max_seq_len}", f"{n} tokens")


def depth_report(
    model, tokenizer, data: DataRecord, cfg: EvalConfig, device="cpu", progress=None, prefill=None
) -> dict:
    """`progress(R)` is called after each batch (or table row) measured at depth R.

    {"perplexity": {R: ...}, "tasks": {R: ...} or None, ...} for a trained model on the held-out split
    of `data`, its checkpoint's data record (`looplm.checkpoint.load_data`); task accuracy when that data is
    the task generator.

    `prefill`, a list of `looplm.infer.prefill.Prefill` arms, adds "prefill": each arm's continuation
    perplexity (on `sharing_sequences` rows) and generator-task exact match (on `generation_examples`,
    or `task_examples` when that is 0) at each depth, the paper's Table 5 (`looplm.eval.prefill_arms`)."""
    val = data.validation(tokenizer)
    ppl = native_perplexity(
        model,
        val,
        cfg.depths,
        batch_size=cfg.batch_size,
        max_sequences=cfg.max_sequences,
        device=device,
        progress=progress,
        tokenizer=tokenizer,
    )
    acc = None
    if data.is_tasks and cfg.task_examples > 0:
        examples = data.held_out_examples(cfg.task_examples, cfg.task_seed)
        acc = task_accuracy(
            model, tokenizer, examples, cfg.depths, batch_size=cfg.batch_size, device=device, progress=progress
        )
    sharing = None
    if cfg.sharing_sequences > 0:
        sharing = sharing_table(
            model,
            val,
            cfg.depths,
            max_sequences=cfg.sharing_sequences,
            device=device,
            progress=progress,
            span=cfg.cacheeval_span,
        )
    report = {"perplexity": ppl, "tasks": acc, "sharing": sharing}
    report.update(decoding_report(model, tokenizer, cfg, data, device))
    if cfg.sample_depths:
        report["samples"] = depth_samples(
            model, tokenizer, cfg, device, prompt=sample_prompt_for(cfg, data, val, tokenizer)
        )
    if prefill:
        from looplm.eval.prefill_arms import prefill_table

        n_gen = cfg.generation_examples or cfg.task_examples
        examples = data.held_out_examples(n_gen, cfg.task_seed) if data.is_tasks and n_gen > 0 else []
        report["prefill"] = prefill_table(
            model,
            tokenizer,
            val,
            examples,
            prefill,
            cfg.depths,
            device=device,
            rows=cfg.sharing_sequences,
            batch_size=cfg.batch_size,
            progress=progress,
        )
    return report


def decoding_report(model, tokenizer, cfg: EvalConfig, data: DataRecord, device) -> dict:
    """Protocols scored by decoding with a KV cache, per depth: generation exact match, choice tasks, GSM8K."""
    from looplm.eval.choice import load_choice_jsonl, score_choices
    from looplm.eval.generation import GSM8K_PROMPT, exact_match_generator_tasks, exact_match_gsm8k, load_gsm8k_jsonl

    kw = dict(prefill_depth=cfg.prefill_depth, cache=cfg.cache)
    out: dict = {}
    if cfg.generation_examples > 0 and data.is_tasks:
        examples = data.held_out_examples(cfg.generation_examples, cfg.task_seed)
        out["generation"] = {
            r: {
                k: v
                for k, v in exact_match_generator_tasks(model, tokenizer, examples, depth=r, **kw).items()
                if k in ("acc", "n", "by_kind")
            }
            for r in cfg.depths
        }
    if cfg.choice_tasks is not None:
        items = load_choice_jsonl(cfg.choice_tasks)
        out["choice"] = {
            r: {
                k: v
                for k, v in score_choices(model, tokenizer, items, depth=r, device=device, **kw).items()
                if k != "items"
            }
            for r in cfg.depths
        }
    if cfg.gsm8k is not None:
        items = load_gsm8k_jsonl(cfg.gsm8k)
        longest = max(len(tokenizer.encode_prompt(GSM8K_PROMPT.format(question=it.question))) for it in items)
        room = min(cfg.gsm8k_max_new_tokens, model.cfg.max_seq_len - longest)
        if room < 1:
            raise UserError(
                f"{cfg.gsm8k}: a prompt of {longest} tokens leaves no room in the context "
                f"max_seq_len={model.cfg.max_seq_len}"
            )
        out["gsm8k"] = {
            r: {
                k: v
                for k, v in exact_match_gsm8k(model, tokenizer, items, depth=r, max_new_tokens=room, **kw).items()
                if k in ("acc", "n")
            }
            for r in cfg.depths
        }
    return out


TEXT_SAMPLE_PROMPT = "KING.\n"  # a speaker's name: the built-in Shakespeare text's lines start so


def sample_prompt_for(cfg: EvalConfig, data: DataRecord, val=None, tokenizer=None) -> str:
    """The samples' prompt: `cfg.sample_prompt`, else one of the data's own, so that a model continues what
    it was trained on (a task model given "KING." writes nothing): a held-out generator prompt, the built-in
    text's speaker line, or the first line (at most 32 tokens) of the first document of `val`, the held-out
    split (decoded with `tokenizer`)."""
    from looplm.data import generate_examples
    from looplm.data.record import BUILTIN_TEXT

    if cfg.sample_prompt is not None:
        return cfg.sample_prompt
    if data.is_tasks:
        examples = data.held_out_examples(1, cfg.task_seed) or generate_examples(data.tasks, 1, seed=cfg.task_seed)
        return examples[0].prompt
    if data.source == BUILTIN_TEXT or val is None or tokenizer is None or not len(val.doc_starts):
        return TEXT_SAMPLE_PROMPT
    start = int(val.doc_starts[0])
    end = int(val.doc_starts[1]) if len(val.doc_starts) > 1 else len(val.tokens)  # not into the next document
    text = tokenizer.decode([int(t) for t in val.tokens[start : min(start + 32, end)]])
    line = text.split("\n", 1)[0]
    return line + "\n" if line.strip() and "\n" in text else (text if text.strip() else TEXT_SAMPLE_PROMPT)


def depth_samples(model, tokenizer, cfg: EvalConfig, device, prompt: str | None = None) -> dict:
    """One seeded continuation of `prompt` (default: `cfg.sample_prompt`, else the built-in text's) per depth
    with the terminal cache, the same seed and initial state at every depth, so the texts differ only by depth.
    A sample is cut to what the model's context leaves after the prompt (`tokens` records the length used)."""
    from looplm.infer.generate import DepthRule, SamplingConfig, generate

    prompt = prompt or cfg.sample_prompt or TEXT_SAMPLE_PROMPT
    room = model.cfg.max_seq_len - len(tokenizer.encode_prompt(prompt)) + 1  # the last new token is never fed
    if room < 1:
        raise UserError(f"sample prompt {prompt!r:.60} does not fit the context max_seq_len={model.cfg.max_seq_len}")
    n = min(cfg.sample_tokens, room)
    sampling = SamplingConfig(max_new_tokens=n, temperature=cfg.sample_temperature, seed=cfg.task_seed)
    texts = {r: generate(model, tokenizer, [prompt], DepthRule(r), sampling=sampling)[0] for r in cfg.sample_depths}
    return {
        "prompt": prompt,
        "temperature": cfg.sample_temperature,
        "tokens": n,
        "seed": cfg.task_seed,
        "by_depth": texts,
    }


def format_report(report: dict) -> str:
    """A plain-text table: one row per depth."""
    ppl, acc = report["perplexity"], report["tasks"]
    kinds = list(next(iter(acc.values()))["by_kind"]) if acc else []
    bpb = any(p.get("bits_per_byte") is not None for p in ppl.values())
    head = (
        f"{'R':>4} {'val ppl':>9}"
        + (f" {'bits/byte':>9}" if bpb else "")
        + f" {'dstate':>8}"
        + (f" {'acc':>7}" + "".join(f" {k:>7}" for k in kinds) if acc else "")
    )
    lines = [head, "-" * len(head)]
    for depth, p in ppl.items():
        dstate = f"{p['state_change']:>8.4f}" if p.get("state_change") is not None else f"{'-':>8}"
        row = f"{depth:>4} {p['ppl']:>9.4f}" + (f" {p['bits_per_byte']:>9.4f}" if bpb else "") + f" {dstate}"
        if acc:
            a = acc[depth]
            row += f" {100 * a['acc']:>6.1f}%" + "".join(f" {100 * a['by_kind'][k]:>6.1f}%" for k in kinds)
        lines.append(row)
    if report.get("sharing"):
        sh = report["sharing"]
        first = next(iter(sh.values()))
        n, span = first["tokens"], first.get("span")
        if span is None:
            caption = [
                f"terminal-KV sharing, {n} targets: every supervised target in the second half of each row, "
                "each document",
                "read from its own start (the part before the midpoint prefilled at R); chunk = each document's "
                "second-half",
                "tokens in one parallel pass, decode = the same targets by teacher-forced one-token decoding:",
            ]
        else:
            P, C = span
            caption = [
                f"terminal-KV sharing, {n} targets (CacheEval, App. D.4): per row, {P} prompt tokens from a "
                "document's start",
                f"prefilled at R, their last logits scoring the first of {C} continuation targets; chunk = the "
                f"other {C - 1}",
                f"in one parallel pass, decode = {C - 1} teacher-forced one-token decodes:",
            ]
        lines += ["", *caption, f"{'R':>4} {'full':>9} {'terminal':>9} {'penalty':>9} {'decode':>9} {'penalty':>9}"]
        lines += [
            f"{r:>4} {v['full_ppl']:>9.4f} {v['terminal_ppl']:>9.4f} {v['sharing_penalty']:>8.3f}% "
            f"{v['cacheeval_terminal_ppl']:>9.4f} {v['cacheeval_penalty']:>8.3f}%"
            for r, v in sh.items()
        ]
    for key, title in (
        ("generation", "generator tasks, greedy generation with the cache"),
        ("choice", "choice tasks (acc / acc_norm)"),
        ("gsm8k", "GSM8K-format exact match"),
    ):
        if report.get(key):
            lines += ["", f"{title}:"]
            for r, v in report[key].items():
                extra = f" / {100 * v['acc_norm']:.1f}%" if "acc_norm" in v else ""
                lines.append(f"{r:>4} {100 * v['acc']:>6.1f}%{extra}  (n={v['n']})")
    if report.get("samples"):
        sm = report["samples"]
        lines += [
            "",
            f"samples of {sm['tokens']} tokens from the same prompt and seed (temperature "
            f"{sm['temperature']:g}), by depth:",
        ]
        for r, text in sm["by_depth"].items():
            lines += [f"--- R = {r} ---", sm["prompt"] + text]
    if report.get("prefill"):
        from looplm.eval.prefill_arms import format_prefill_table

        lines += [
            "",
            "prefill arms (decoding at R with the terminal cache; blocks = block passes per prompt token):",
            format_prefill_table(report["prefill"]),
        ]
    return "\n".join(lines)


def report_name(source: str | None) -> str:
    """The file name of an eval report in a run folder: eval.json for the run's own data (source None),
    eval-<source>.json for other data (`--data`), so that scoring other text never replaces the run's report.
    <source> is the data's name made safe for any file system: a path's last part, hf:org/set:split as
    hf-org-set-split."""
    return "eval.json" if source is None else f"eval-{data_name(source)}.json"


def data_name(source: str) -> str:
    """A data source's name made safe for any file system: a path's last part, hf:org/set:split as
    hf-org-set-split (what reports on other data than a run's own are named after)."""
    import re

    name = source if source.startswith("hf:") else (Path(source.rstrip("/\\")).name or source)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")[:80] or "data"


def write_report(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
