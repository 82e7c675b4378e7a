#!/usr/bin/env python
"""Peak memory of one training step against depth R, with and without activation checkpointing.

For each depth R and each activation-checkpointing mode (`none`, `block`: every prelude, core and
coda block wrapped by `looplm.train.parallelize.apply_activation_checkpointing`, as the trainer
does), one row builds a fresh model and AdamW from the same seed and runs training steps of
full BPTT (`model(tokens, R, bptt_window=None)`), next-token cross-entropy, backward, grad-norm
clip and AdamW:

1. one warm-up step at R=1 (creates the AdamW state, so the measured steps are steady-state
   ones; at R=1 to keep CPU runs short);
2. `--steps` timed steps (step time: their mean and best);
3. memory of one more step:
   - CUDA: `torch.cuda.reset_peak_memory_stats` before it, `max_memory_allocated` after it (all
     tensors: parameters, gradients, AdamW state, activations, temporaries), plus
     `max_memory_reserved` (what the caching allocator held);
   - CPU: torch's `MemTracker` (a dispatch mode that counts every tensor until it is freed; the
     same tool as `tests/test_train_parallelize.py`). Its peak snapshot is the breakdown at the moment
     of the highest total: the `Activation` category and the total (parameters, gradients,
     optimizer state, activations, temporaries). These are tensor bytes, not allocator memory.
     The highest Activation count at any moment is recorded too (`max act`).

A CUDA out-of-memory error is caught and the row is recorded as `oom` (larger R of the same mode are
then skipped unless `--no-skip-after-oom`). `--memory-budget-gib G` marks rows whose peak total
exceeds G GiB as `would not fit` (meant for CPU runs, where nothing runs out of memory).

    python benchmarks/activation_memory.py                                   # CPU defaults (~d 256, seq 256, batch 4)
    python benchmarks/activation_memory.py --preset S --seq 2048 --batch 1 --depths 1 2 4 8 16 32 64 \
        --out benchmarks/results/activation_memory_cuda.json     # on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from looplm.config import ModelConfig, model_preset
from looplm.model import LoopedLM
from looplm.train.parallelize import apply_activation_checkpointing
from looplm.train.trainer import param_groups, resolve_dtype
from _command import command_line  # benchmarks/ is on sys.path when a script there runs
from prefill_latency import cpu_name

GIB = 2**30
MIB = 2**20
MODES = ("none", "block")


# ------------------------------------------------------------------------------------------------
# machine


def machine_info(device: torch.device) -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "nproc": os.cpu_count(),
        "cpu_model": cpu_name(),
        "threads": torch.get_num_threads(),
        "loadavg_start": list(os.getloadavg()),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, gpu_memory_gib=p.total_memory / GIB, cuda=torch.version.cuda)
    return info


# ------------------------------------------------------------------------------------------------
# one row


def build_config(args) -> ModelConfig:
    if args.preset:
        cfg = model_preset(args.preset)
    else:
        cfg = ModelConfig(d_model=args.d_model, n_heads=args.heads, n_kv_heads=args.kv_heads, ffn_dim=args.ffn)
    for name, value in (
        ("d_model", args.d_model if not args.preset else None),
        ("n_prelude", args.blocks[0]),
        ("n_core", args.blocks[1]),
        ("n_coda", args.blocks[2]),
    ):
        if value is not None:
            setattr(cfg, name, value)
    cfg.vocab_size = args.vocab
    cfg.max_seq_len = max(cfg.max_seq_len, args.seq)
    cfg.max_depth = max(cfg.max_depth, max(args.depths))
    if args.injection:
        cfg.injection = args.injection
    cfg.validate()
    return cfg


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Row:
    """A fresh model + AdamW (same seed in every row) and a fixed batch of random tokens."""

    def __init__(self, cfg: ModelConfig, mode: str, args, device: torch.device, dtype: torch.dtype):
        torch.manual_seed(args.seed)
        self.model = LoopedLM(cfg).to(device)
        apply_activation_checkpointing(self.model, mode)
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, 0.1), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda"
        )
        g = torch.Generator().manual_seed(args.seed + 1)
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device)
        self.inputs, self.targets = tokens[:, :-1], tokens[:, 1:]
        self.device, self.dtype = device, dtype

    def step(self, depth: int) -> float:
        """One optimizer step at `depth` with full BPTT; returns the loss."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16):
            logits = self.model(self.inputs, depth, bptt_window=None).logits
        loss = F.cross_entropy(logits.flatten(0, 1), self.targets.flatten())
        loss.backward()
        del logits
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def memtracker_step(row: Row, depth: int) -> dict:
    """MemTracker's peak snapshot of one step (CPU): bytes per category at the moment of the highest total."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(row.model, row.optimizer)
    # The peak snapshot is taken at the highest *total*; also follow the highest Activation count on
    # its own (MemTracker updates its stats after every op; a private hook, skipped if it is gone).
    max_act = {"bytes": None}
    update = getattr(mt, "_update_peak_stats", None)
    if update is not None and hasattr(mt, "_curr_mem_snap"):
        max_act["bytes"] = 0

        def follow(state):
            update(state)
            for snap in mt._curr_mem_snap.values():
                act = sum(v for k, v in snap.items() if str(getattr(k, "value", k)) == "Activation")
                max_act["bytes"] = max(max_act["bytes"], int(act))

        mt._update_peak_stats = follow
    with mt:
        row.step(depth)
    peak = mt.get_tracker_snapshot("peak")[row.device]
    by_kind = {str(getattr(k, "value", k)): int(v) for k, v in peak.items()}
    return {
        "peak_total_bytes": by_kind.pop("Total"),
        "peak_activation_bytes": by_kind.get("Activation", 0),
        "peak_breakdown_bytes": by_kind,
        "max_activation_bytes": max_act["bytes"],
    }


def cuda_step(row: Row, depth: int) -> dict:
    dev = row.device
    sync(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    row.step(depth)
    sync(dev)
    return {
        "peak_total_bytes": torch.cuda.max_memory_allocated(dev),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(dev),
        "allocated_before_step_bytes": before,
        "peak_activation_bytes": torch.cuda.max_memory_allocated(dev) - before,
    }


def run_row(cfg: ModelConfig, mode: str, depth: int, args, device: torch.device, dtype: torch.dtype) -> dict:
    out: dict = {"depth": depth, "ac": mode, "status": "ok"}
    row = None
    try:
        row = Row(cfg, mode, args, device, dtype)
        out["loss_warmup"] = row.step(1)  # creates the AdamW state (cheaply: at R=1)
        times = []
        for _ in range(args.steps):
            sync(device)
            t0 = time.perf_counter()
            row.step(depth)
            sync(device)
            times.append(time.perf_counter() - t0)
        out.update(step_s=times, step_mean_s=statistics.fmean(times), step_best_s=min(times))
        out.update(cuda_step(row, depth) if device.type == "cuda" else memtracker_step(row, depth))
    except torch.OutOfMemoryError as e:
        out.update(status="oom", error=str(e).split("\n")[0][:300])
    finally:
        del row
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if (
        out["status"] == "ok"
        and args.memory_budget_gib is not None
        and out["peak_total_bytes"] > args.memory_budget_gib * GIB
    ):
        out["status"] = "would not fit"
    return out


# ------------------------------------------------------------------------------------------------
# report


def fmt_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def mib(b) -> str:
    return f"{b / MIB:,.1f}"


def cell(r: dict | None, key: str) -> str:
    if r is None:
        return "-"
    if r["status"] in ("oom", "skipped after oom"):
        return r["status"].upper() if r["status"] == "oom" else "skipped"
    text = mib(r[key])
    return text + (" (would not fit)" if r["status"] == "would not fit" and key == "peak_total_bytes" else "")


def ratio(a: dict | None, b: dict | None, key: str) -> str:
    if not a or not b or key not in a or key not in b or not b[key]:
        return "-"
    return f"{a[key] / b[key]:.3f}"


def report(res: dict) -> str:
    cuda = res["device"] == "cuda"
    by = {(r["depth"], r["ac"]): r for r in res["rows"]}
    c, m = res["config"], res["machine"]
    where = (
        f"{m.get('gpu')} ({m.get('gpu_memory_gib', 0):.0f} GiB), CUDA {m.get('cuda')}"
        if cuda
        else f"{m['cpu_model']}, nproc {m['nproc']}, {m['threads']} threads"
    )
    out = [
        f"command: {res['command']}",
        f"machine: {where}; torch {m['torch']}, Python {m['python']}; load average at start {m['loadavg_start']}",
        f"model: d {c['model']['d_model']}, {c['model']['n_heads']}/{c['model']['n_kv_heads']} heads, FFN {c['model']['ffn_dim']}, "
        f"{c['model']['n_prelude']}/{c['model']['n_core']}/{c['model']['n_coda']} blocks, vocab {c['model']['vocab_size']}, "
        f"injection {c['model']['injection']}, {res['parameters'] / 1e6:.2f} M params; batch {c['batch']} x seq {c['seq']}; "
        f"{c['precision']}; full BPTT; steps per row: 1 warm-up at R=1 + {c['steps']} timed + 1 measured at R",
        "",
    ]
    if cuda:
        out.append(
            "peak = torch.cuda.max_memory_allocated over one steady-state step (MiB; parameters, grads, AdamW state, "
            "activations, temporaries); 'step peak - before' = that minus what was allocated before the step"
        )
        header = [
            "R",
            "peak, no AC",
            "peak, AC block",
            "block/none",
            "step peak - before, no AC",
            "same, AC block",
            "step s, no AC",
            "step s, AC block",
            "time block/none",
        ]
        keys = ("peak_total_bytes", "peak_activation_bytes")
    else:
        out.append(
            "MemTracker peak snapshot of one steady-state step (MiB): 'act' = the Activation category, "
            "'total' = all tracked tensors (parameters, grads, AdamW state, activations, temporaries), both at "
            "the moment of the highest total; 'max act' = the highest Activation count at any moment"
        )
        header = [
            "R",
            "act, no AC",
            "act, AC block",
            "act block/none",
            "max act, no AC",
            "max act, AC block",
            "total, no AC",
            "total, AC block",
            "total block/none",
            "step s, no AC",
            "step s, AC block",
            "time block/none",
        ]
        keys = ("peak_activation_bytes", "peak_total_bytes")
    rows = []
    for R in c["depths"]:
        a, b = by.get((R, "none")), by.get((R, "block"))
        if cuda:
            cells = [
                str(R),
                cell(a, keys[0]),
                cell(b, keys[0]),
                ratio(b, a, keys[0]),
                cell(a, keys[1]),
                cell(b, keys[1]),
            ]
        else:
            mx = [
                mib(r["max_activation_bytes"]) if r and r.get("max_activation_bytes") is not None else "-"
                for r in (a, b)
            ]
            cells = [
                str(R),
                cell(a, keys[0]),
                cell(b, keys[0]),
                ratio(b, a, keys[0]),
                *mx,
                cell(a, keys[1]),
                cell(b, keys[1]),
                ratio(b, a, keys[1]),
            ]
        t = [f"{r['step_mean_s']:.3f}" if r and "step_mean_s" in r else "-" for r in (a, b)]
        rows.append(cells + t + [ratio(b, a, "step_mean_s")])
    out.append(fmt_table(header, rows))
    if c["memory_budget_gib"] is not None:
        out.append(f"\n'would not fit': peak total above the --memory-budget-gib {c['memory_budget_gib']} GiB budget")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--preset", choices=["tiny", "S", "M", "L"], help="model preset (replaces --d-model/--heads/--kv-heads/--ffn)"
    )
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--blocks", type=int, nargs=3, default=[1, 2, 1], metavar=("PRELUDE", "CORE", "CODA"))
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--injection", help="injection scheme (default: the config's)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="depths R")
    ap.add_argument("--ac", nargs="+", choices=MODES, default=list(MODES), help="activation checkpointing modes")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per row (after one warm-up step)")
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    ap.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="auto: bf16 autocast on CUDA and on CPUs with native bf16, fp32 elsewhere (the trainer's rule)",
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--memory-budget-gib", type=float, help="mark rows whose peak total exceeds this as 'would not fit'"
    )
    ap.add_argument(
        "--no-skip-after-oom", action="store_true", help="also run larger R of a mode that already ran out of memory"
    )
    ap.add_argument(
        "--out", type=Path, help="JSON result (default benchmarks/results/activation_memory_<cpu|cuda>.json)"
    )
    args = ap.parse_args()
    if args.preset:  # the preset gives the shape; --d-model etc. keep their defaults unused
        args.d_model = None

    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.precision, device)
    cfg = build_config(args)
    out_path = args.out or Path(f"benchmarks/results/activation_memory_{device.type}.json")
    with torch.device("meta"):
        n_params = sum(p.numel() for p in LoopedLM(cfg).parameters())

    res: dict = {
        "command": command_line(),
        "device": device.type,
        "machine": machine_info(device),
        "config": {
            "model": dataclasses.asdict(cfg),
            "seq": args.seq,
            "batch": args.batch,
            "depths": args.depths,
            "ac": args.ac,
            "steps": args.steps,
            "precision": str(dtype).replace("torch.", ""),
            "seed": args.seed,
            "memory_budget_gib": args.memory_budget_gib,
            "bptt_window": None,
            "loss": "next-token CE (mean) + grad-norm clip 1.0 + AdamW",
        },
        "parameters": n_params,
        "memory_method": (
            "cuda: torch.cuda.max_memory_allocated over one steady-state step (after reset_peak_memory_stats); "
            "peak_activation_bytes = that minus memory_allocated before the step"
            if device.type == "cuda"
            else "cpu: torch.distributed._tools.mem_tracker.MemTracker tracking the model and optimizer over one "
            "steady-state step; its peak snapshot (per-category tensor bytes at the moment of the highest "
            "total), not the allocator's resident memory; max_activation_bytes = the highest Activation "
            "count at any op, which need not fall at the moment of the highest total"
        ),
        "rows": [],
    }
    print(
        f"activation memory: {device.type}, {res['config']['precision']}, R in {args.depths}, AC in {args.ac}, "
        f"batch {args.batch} x seq {args.seq}, {n_params / 1e6:.2f} M params",
        file=sys.stderr,
        flush=True,
    )
    t_start = time.perf_counter()
    oom_at: dict[str, int] = {}
    for R in args.depths:
        for mode in args.ac:
            if mode in oom_at and not args.no_skip_after_oom:
                res["rows"].append(
                    {"depth": R, "ac": mode, "status": "skipped after oom", "oom_at_depth": oom_at[mode]}
                )
                continue
            t0 = time.perf_counter()
            r = run_row(cfg, mode, R, args, device, dtype)
            r["row_wall_s"] = time.perf_counter() - t0
            if r["status"] == "oom":
                oom_at[mode] = R
            res["rows"].append(r)
            mem = (
                (
                    f"act {mib(r['peak_activation_bytes'])} MiB, total {mib(r['peak_total_bytes'])} MiB, "
                    + (
                        f"max act {mib(r['max_activation_bytes'])} MiB, "
                        if r.get("max_activation_bytes") is not None
                        else ""
                    )
                    + f"step {r['step_mean_s']:.3f} s"
                )
                if "peak_total_bytes" in r
                else ""
            )
            print(
                f"  R={R:>3} ac={mode:<5} {r['status']:<13} {mem} ({r['row_wall_s']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    res["machine"]["loadavg_end"] = list(os.getloadavg())
    res["wall_s"] = time.perf_counter() - t_start
    text = report(res)
    res["report_markdown"] = text
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=1) + "\n")
    print(text)
    print(f"\n(total {res['wall_s']:.0f} s; JSON: {out_path})")


if __name__ == "__main__":
    main()
