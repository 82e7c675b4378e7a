"""Decode speed: today's eager step vs the compiled static step vs compiled + self-speculation,
against a plain compiled looped stack of the same shape, side by side in one process.

    python benchmarks/decode_speed.py [--quick] [--checkpoint runs/tiny] [--threads 1]
        [--out benchmarks/results/decode_speed.json] [--skip-speed] [--draft-depths 2 3 4] [--unroll U]

Speed arms (random weights; speed does not depend on them), for each shape (the tiny preset's
d 128, 4/2 heads, FFN 384, and d 512, 8/2 heads, FFN 1536; 1/2/1 blocks), batch (1, 16), depth
R (5, 32) and cache (terminal, full), after a prompt of 64 tokens:
  * `eager`: the model's cached forward one token at a time (`extend`, what `generate` ran before
    the static step);
  * `compiled`: `looplm.infer.step.DecodeStep(compile=True)`;
  * `plain`: `benchmarks/_plain_looped.py`, a looped decoder written from scratch with no looplm
    code (terminal banks, additive injection), compiled with the same three-piece split and
    options (inductor's C++ wrapper): the limit to approach.
Arms are interleaved over `--rounds` rounds after a warm-up; each figure is the median seconds
per step (tokens/s = batch / that). Compile (warm-up) time is recorded per shape and batch.

With `--checkpoint` (the main job's run, `looplm train tiny`), self-speculative decoding at
R = 32, batch 1, k = 4 and draft depth 2, 3, 4 against the compiled plain decode, for both caches,
through `looplm.infer.generate` on held-out Shakespeare prompts: tokens/s, acceptance rate,
tokens per verify, whether the greedy text equals plain decoding, and the quality cost as the mean
log-likelihood per generated token under the checkpoint's native forward at depth 32. Every arm
there decodes one prompt at a time (batch 1); tokens/s = generated tokens / decode seconds
(`generate`'s own timing, prefill excluded). The full cache also runs each draft depth with
`Speculation(reuse=False)` (`no reuse`): the verify chunk reruns recurrences 1..r_d instead of
resuming from the drafts' states (design §16); same text, same acceptance, the difference is the
reuse's gain. `--draft-depths 3` keeps one draft depth. `--unroll U` builds every compiled step
with U recurrences per graph; without it the speed arms use `DecodeStep`'s default (4) and the
speculative arms `generate`'s own step (`looplm.infer.generate.decode_step`: 8), so the plain arm is
the decode `looplm generate --compile` runs.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _command import command_line, machine_line  # noqa: E402
from _plain_looped import PlainLooped  # noqa: E402

from looplm.config import ModelConfig  # noqa: E402
from looplm.infer import extend, make_cache  # noqa: E402
from looplm.infer.generate import decode_step  # noqa: E402
from looplm.infer.step import DecodeStep, StepRows  # noqa: E402
from looplm.model import LoopedLM  # noqa: E402

PROMPT = 64
SHAPES = {
    "tiny": dict(d_model=128, n_heads=4, n_kv_heads=2, ffn_dim=384),
    "d512": dict(d_model=512, n_heads=8, n_kv_heads=2, ffn_dim=1536),
}


def median_time(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def speed_cell(
    shape: str, B: int, depths: list[int], caches: list[str], rounds: int, steps: int, unroll: dict
) -> list[dict]:
    """Every (depth, cache) cell of one shape and batch: the three arms, interleaved."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=258, max_seq_len=256, **SHAPES[shape])
    model = LoopedLM(cfg).eval()
    plain = PlainLooped(
        258, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim, cfg.n_prelude, cfg.n_core, cfg.n_coda
    ).decoding(B, 256)
    prompt = torch.randint(0, 258, (B, PROMPT))
    tok = torch.zeros(B, dtype=torch.long)
    at = torch.full((B,), PROMPT)
    caches_by = {}
    with torch.no_grad():  # a full cache as deep as the decode (as generate sizes it), prefilled at that depth
        for R in depths:
            for mode in caches:
                eager_c, static_c = (make_cache(mode, cfg, B, 256, R) for _ in range(2))
                extend(model, prompt, eager_c, R)
                extend(model, prompt, static_c, R)
                caches_by[R, mode] = (eager_c, static_c)
    step = DecodeStep(model, compile=True, **unroll)
    plain.compiled(step.unroll, step.whole)  # the same recurrences per graph as the step
    rows = StepRows(tok, at, torch.zeros(B, dtype=torch.long), torch.arange(B))
    # warm-up: compile the pieces of a deep step (prelude, windows, one recurrence, coda) and the plain
    # stack's; a shallow depth's one graph compiles in its cell's first call
    step.reset(caches_by[depths[0], caches[0]][1])
    deep = step.whole + step.unroll + 1
    t = time.perf_counter()
    step(rows, deep)
    compile_step = time.perf_counter() - t
    t = time.perf_counter()
    plain.step(tok, at, deep)
    compile_plain = time.perf_counter() - t
    out = []
    for R in depths:
        for mode in caches:
            eager_c, static_c = caches_by[R, mode]

            def eager():
                eager_c.length = PROMPT  # the same position every step: a step's cost, not a growing cache
                extend(model, tok[:, None], eager_c, R)

            def compiled():
                step(rows, R)

            def plain_step():
                plain.step(tok, at, R)

            step.reset(static_c)
            arms = {"eager": eager, "compiled": compiled, "plain": plain_step}
            first: dict[str, float] = {}  # the cell's first call: graphs its depth needs compile here
            for name, fn in arms.items():
                t = time.perf_counter()
                fn()
                first[name] = time.perf_counter() - t
            times: dict[str, list[float]] = {name: [] for name in arms}
            for r in range(rounds):
                names = list(arms)[r % 3 :] + list(arms)[: r % 3]  # rotate the order
                for name in names:
                    times[name].append(median_time(arms[name], steps))
            cell = {"shape": shape, "batch": B, "depth": R, "cache": mode}
            for name, v in times.items():
                s = statistics.median(v)
                cell[f"{name}_s_per_step"] = s
                cell[f"{name}_tokens_per_s"] = B / s
            cell["compiled_vs_eager"] = cell["eager_s_per_step"] / cell["compiled_s_per_step"]
            cell["compiled_vs_plain"] = cell["compiled_s_per_step"] / cell["plain_s_per_step"]
            cell["compile_s"] = {"step": compile_step, "plain": compile_plain}  # the shape's first graphs
            cell["first_call_s"] = {"step": first["compiled"], "plain": first["plain"]}  # and this cell's
            print(
                f"{shape} B={B} R={R} {mode:8s}: eager {cell['eager_tokens_per_s']:8.1f}  compiled "
                f"{cell['compiled_tokens_per_s']:8.1f}  plain {cell['plain_tokens_per_s']:8.1f} tok/s  "
                f"(compiled/eager {cell['compiled_vs_eager']:.2f}x, compiled time / plain {cell['compiled_vs_plain']:.2f})",
                flush=True,
            )
            out.append(cell)
    return out


def held_out_prompts(checkpoint: Path, n: int) -> list[str]:
    """The first 60 characters of the first `n` held-out scenes of the run's data (the split of
    `looplm.data.packing.write_splits`: a seeded choice of documents)."""
    import numpy as np

    from looplm.data.sources import iter_documents

    path = checkpoint / "data.json"
    record = json.loads(path.read_text()) if path.exists() else {}
    holdout, seed = record.get("holdout", 0.05), record.get("seed", 0)
    docs = [d.text for d in iter_documents(record.get("source", "shakespeare"))]
    n_val = min(len(docs) - 1, max(1, round(len(docs) * holdout)))
    val = sorted(np.random.default_rng([seed, len(docs)]).choice(len(docs), n_val, replace=False))
    return [docs[i][:60] for i in val[:n]]


def speculative(
    checkpoint: Path,
    rounds: int,
    max_new: int,
    n_prompts: int,
    draft_depths: tuple[int, ...] = (2, 3, 4),
    unroll: dict | None = None,
    device: str = "cpu",
) -> list[dict]:
    from looplm.checkpoint import load_model, resolve
    from looplm.infer.decode import SamplingConfig
    from looplm.infer.generate import DepthRule, Speculation, generate

    checkpoint = resolve(checkpoint)  # a run folder: its latest checkpoint
    model, tokenizer, _ = load_model(checkpoint, torch.device(device))
    prompts = held_out_prompts(checkpoint, n_prompts)
    sampling = SamplingConfig(max_new_tokens=max_new)
    R = 32
    out = []
    for mode in ("full", "terminal"):
        # generate's own step (what `looplm generate --compile` decodes with), unless --unroll is given
        step = DecodeStep(model, compile=True, **unroll) if unroll else decode_step(model, compile=True)
        arms = {"compiled": None, **{f"speculate r_d={r}": Speculation(4, r) for r in draft_depths}}
        if mode == "full":  # the verify from recurrence 1 instead of r_d + 1: what reusing the drafts' states saves
            arms.update({f"speculate r_d={r}, no reuse": Speculation(4, r, reuse=False) for r in draft_depths})
        for spec in arms.values():  # warm-up (compiles)
            generate(
                model,
                tokenizer,
                prompts[:1],
                DepthRule(R),
                cache=mode,
                sampling=SamplingConfig(max_new_tokens=8),
                compile=True,
                speculate=spec,
                step=step,
            )
        results = {name: {"seconds": [], "texts": None, "stats": None} for name in arms}
        for r in range(rounds):
            names = list(arms)[r % len(arms) :] + list(arms)[: r % len(arms)]
            for name in names:  # batch 1 in every arm: one prompt at a time, as speculation decodes
                texts, seconds, tokens, spec = [], 0.0, 0, {"rounds": 0, "drafted": 0, "accepted": 0}
                for prompt in prompts:
                    stats: dict = {}
                    texts += generate(
                        model,
                        tokenizer,
                        [prompt],
                        DepthRule(R),
                        cache=mode,
                        sampling=sampling,
                        compile=True,
                        speculate=arms[name],
                        step=step,
                        stats=stats,
                    )
                    seconds += stats["decode_seconds"]
                    tokens += stats["decoded_tokens"]
                    for key in spec:
                        spec[key] += stats.get("speculation", {}).get(key, 0)
                results[name]["seconds"].append(seconds)
                results[name]["tokens"] = tokens
                results[name]["texts"] = texts
                results[name]["stats"] = {
                    "acceptance_rate": spec["accepted"] / max(spec["drafted"], 1),
                    "tokens_per_verify": (spec["accepted"] + spec["rounds"]) / max(spec["rounds"], 1),
                }
        base = results["compiled"]
        base_s = statistics.median(base["seconds"])
        for name, res in results.items():
            s = statistics.median(res["seconds"])
            row = {
                "cache": mode,
                "arm": name,
                "depth": R,
                "k": 4 if name != "compiled" else 0,
                "tokens": res["tokens"],
                "decode_s": s,
                "tokens_per_s": res["tokens"] / s,
                "vs_compiled": base_s / s * res["tokens"] / base["tokens"],
                "same_text_as_compiled": res["texts"] == base["texts"],
                "mean_loglik": mean_loglik(model, tokenizer, prompts, res["texts"], R),
            }
            if name != "compiled":
                row["reuse"] = mode == "full" and arms[name].reuse  # speculative_decode reuses on the full cache only
                row["acceptance_rate"] = res["stats"]["acceptance_rate"]
                row["tokens_per_verify"] = res["stats"]["tokens_per_verify"]
            print(
                f"speculative {mode:8s} {name:16s}: {row['tokens_per_s']:7.1f} tok/s ({row['vs_compiled']:.2f}x "
                f"compiled), same text {row['same_text_as_compiled']}, loglik {row['mean_loglik']:.4f}"
                + (
                    f", acceptance {row['acceptance_rate']:.1%}, {row['tokens_per_verify']:.2f} tokens/verify"
                    if name != "compiled"
                    else ""
                ),
                flush=True,
            )
            out.append(row)
    return out


@torch.no_grad()
def mean_loglik(model, tokenizer, prompts, texts, depth: int) -> float:
    """Mean log-probability per generated token under the native forward at `depth`."""
    total, count = 0.0, 0
    for prompt, text in zip(prompts, texts):
        p, c = tokenizer.encode_prompt(prompt), tokenizer.encode(text)
        if not c:
            continue
        ids = torch.tensor([p + c], device=next(model.parameters()).device)
        lp = model(ids, depth, init="seeded").logits[0].log_softmax(-1)
        target = ids[0, len(p) :]
        total += float(lp[len(p) - 1 : -1].gather(-1, target[:, None]).sum())
        count += len(c)
    return total / max(count, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="the tiny shape at R = 32 only, each round the median of 3 steps (not 5)"
    )
    ap.add_argument("--checkpoint", type=Path, default=None, help="a trained run for the speculative arms")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-speed", action="store_true", help="only the speculative arms (needs --checkpoint)")
    ap.add_argument(
        "--unroll",
        type=int,
        default=None,
        help="recurrences per compiled graph of every compiled step (default: DecodeStep's)",
    )
    ap.add_argument("--draft-depths", type=int, nargs="+", default=[2, 3, 4], help="r_d of the speculative arms")
    ap.add_argument(
        "--device",
        default="cpu",
        help="device of the speculative arms (cuda: CUDA graphs; needs --skip-speed, the speed arms are CPU's)",
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_speed.json"))
    args = ap.parse_args()
    if args.device != "cpu" and not (args.skip_speed and args.checkpoint):
        ap.error("--device other than cpu runs the speculative arms only: give --skip-speed and --checkpoint")
    torch.set_num_threads(args.threads)
    started = time.time()
    shapes, depths = (["tiny"], [32]) if args.quick else (list(SHAPES), [5, 32])
    unroll = {} if args.unroll is None else {"unroll": args.unroll}
    steps = 3 if args.quick else 5
    speed = []
    for shape in [] if args.skip_speed else shapes:
        for B in (1, 16):
            speed += speed_cell(shape, B, depths, ["terminal", "full"], args.rounds, steps, unroll)
    spec = (
        speculative(args.checkpoint, args.rounds, 64, 4, tuple(args.draft_depths), unroll, args.device)
        if args.checkpoint
        else []
    )
    result = {
        "command": command_line(),
        "machine": machine_line(args.threads)
        + (f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""),
        "device": args.device,
        "elapsed_s": time.time() - started,
        "unroll": unroll.get("unroll", inspect.signature(DecodeStep).parameters["unroll"].default),
        "speculative_unroll": unroll.get("unroll", decode_step(LoopedLM(ModelConfig(**SHAPES["tiny"]))).unroll),
        "speed": speed,
        "speculative": spec,
    }
    if args.skip_speed and args.out.exists():  # an earlier run's speed arms stay, labelled as that run's
        earlier = json.loads(args.out.read_text())
        if earlier.get("speed"):
            result["earlier_speed"] = {k: earlier.get(k) for k in ("command", "machine", "unroll")}
            result["earlier_speed"]["speed"] = earlier["speed"]
        elif earlier.get("earlier_speed"):
            result["earlier_speed"] = earlier["earlier_speed"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
