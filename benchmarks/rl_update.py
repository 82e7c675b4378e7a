"""RL update estimators side by side (design §10): scoring + backward time, peak memory and
whole-model gradient cosines of `bptt`, `recompute` and `reuse` on one real rollout batch.

For each depth R: roll out G completions of P generator problems at R with the checkpoint (terminal
KV, endpoints saved), reward them (exact match), group-normalise, then
- gradients: one update per estimator from the same rollout; whole-model cosines between them,
  and reuse with 0..8 Neumann state products against bptt;
- time: `--warmup` untimed rounds, then `--rounds` rounds that run every arm once in a rotating
  order (so machine load hits the arms alike); per-round bptt/reuse and recompute/reuse ratios;
- memory: peak resident-memory increase during one update (VmHWM reset through
  /proc/self/clear_refs) and the bytes autograd saved for backward (activations; parameters excluded).

  python benchmarks/rl_update.py --checkpoint runs/tiny --depths 6 32 --rounds 12
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from looplm.checkpoint import load_data, load_model, resolve
from looplm.rl import ProblemSource, action_logprobs, clipped_policy_loss, get_reward, group_advantages, rollout
from looplm.rl.estimators import score_and_backward

from _command import command_line  # benchmarks/ is on sys.path when a script there runs

ARMS = ("bptt", "recompute", "reuse")


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_rss_increase(fn) -> int | None:
    """Bytes the resident set grew above its level before `fn` at its peak (Linux only)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so earlier arms' memory is not reused silently
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        before = _status("VmRSS")
    except OSError:
        return None
    fn()
    return _status("VmHWM") - before


def saved_activation_bytes(model, fn) -> int:
    """Bytes of distinct tensors autograd saves for backward during `fn`, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def flat_grad(model) -> torch.Tensor:
    out = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a.double() @ b.double() / (a.double().norm() * b.double().norm()))


def mean_std(xs: list[float]) -> dict:
    return {
        "mean": statistics.fmean(xs),
        "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
        "median": statistics.median(xs),
        "n": len(xs),
        "rounds": xs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default="runs/tiny")
    ap.add_argument("--depths", type=int, nargs="+", default=[6, 32])
    ap.add_argument("--neumann", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/rl_update.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve(Path(args.checkpoint))
    model, tok, _ = load_model(path)
    tasks = load_data(path).tasks
    problems = ProblemSource("tasks", tasks=tasks, seed=args.seed).draw(0, args.prompts)
    reward_fn = get_reward("exact", "tasks")
    results = {
        "command": command_line(),
        "checkpoint": str(path),
        "args": vars(args),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg(),
        "depths": {},
    }
    for R in args.depths:
        ro = rollout(
            model,
            tok,
            [p.prompt for p in problems],
            group_size=args.group,
            depth=R,
            max_new_tokens=args.max_new_tokens,
            stop=("\n",),
            seed=args.seed,
        )
        rewards = torch.tensor([reward_fn(problems[i // args.group].reference, x) for i, x in enumerate(ro.texts)])
        adv = group_advantages(rewards, args.group)

        def objective(logits):
            return clipped_policy_loss(action_logprobs(logits, ro.targets), adv, ro.mask)[0]

        def run(arm, steps=args.neumann):
            return score_and_backward(arm, model, ro, objective, depth=R, neumann_steps=steps)

        grads, residual = {}, None
        for arm in ARMS:
            out = run(arm)
            residual = out.get("residual", residual)
            grads[arm] = flat_grad(model)
        sweep = {}
        for steps in range(0, 9):
            run("reuse", steps)
            sweep[steps] = cosine(flat_grad(model), grads["bptt"])
        memory = {}
        for arm in ARMS:
            memory[arm] = {
                "peak_rss_increase_bytes": peak_rss_increase(lambda: run(arm)),
                "saved_activation_bytes": saved_activation_bytes(model, lambda: run(arm)),
            }
            model.zero_grad(set_to_none=True)
        times = {arm: [] for arm in ARMS}
        for rnd in range(args.warmup + args.rounds):
            order = ARMS[rnd % 3 :] + ARMS[: rnd % 3]
            for arm in order:
                model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                run(arm)
                dt = time.perf_counter() - t0
                if rnd >= args.warmup:
                    times[arm].append(dt)
        model.zero_grad(set_to_none=True)
        entry = {
            "rows": ro.tokens.shape[0],
            "seq_len": ro.tokens.shape[1],
            "action_tokens": int(ro.mask.sum()),
            "real_tokens": int(sum(p + len(c) - 1 for p, c in zip(ro.prompt_lengths, ro.completions))),
            "reward": float(rewards.mean()),
            "endpoint_residual": residual,
            "time_s": {arm: mean_std(ts) for arm, ts in times.items()},
            "speedup_vs_reuse": {
                arm: mean_std([a / b for a, b in zip(times[arm], times["reuse"])]) for arm in ("bptt", "recompute")
            },
            "memory": memory,
            "cosine": {
                "reuse_vs_recompute": cosine(grads["reuse"], grads["recompute"]),
                "reuse_vs_bptt": cosine(grads["reuse"], grads["bptt"]),
                "recompute_vs_bptt": cosine(grads["recompute"], grads["bptt"]),
            },
            "reuse_vs_bptt_by_neumann_steps": sweep,
        }
        results["depths"][R] = entry
        s = entry["speedup_vs_reuse"]
        print(
            f"R={R}: bptt {entry['time_s']['bptt']['mean'] * 1e3:.0f} ms, recompute "
            f"{entry['time_s']['recompute']['mean'] * 1e3:.0f} ms, reuse {entry['time_s']['reuse']['mean'] * 1e3:.0f} ms; "
            f"bptt/reuse {s['bptt']['mean']:.2f}x +- {s['bptt']['std']:.2f} (median {s['bptt']['median']:.2f}x), recompute/reuse "
            f"{s['recompute']['mean']:.2f}x +- {s['recompute']['std']:.2f}; cos(reuse, recompute) "
            f"{entry['cosine']['reuse_vs_recompute']:.4f}, cos(reuse, bptt) {entry['cosine']['reuse_vs_bptt']:.4f}",
            flush=True,
        )
    results["load_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
