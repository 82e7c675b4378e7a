#!/usr/bin/env python
"""Where a looplm training step spends its time, next to the plain baseline (issue: foundation).

Three arms at one shape and precision, interleaved, then one `torch.profiler` step of each:

(All three use the additive injection, so they compute the same model.)

* `looplm`        -- `Trainer.train_step` on the packed task data (boolean document masks);
* `looplm-causal` -- the same trainer, the same batches with `doc_ids`/`positions` dropped, so
  attention takes the `is_causal=True` path (isolates the cost of the document mask);
* `plain`         -- the independent baseline of `train_throughput.py` (no masks).

    python benchmarks/profile_train_step.py [--model tiny|d512] [--precision fp32|bf16] [--rounds 3] [--top 15]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_throughput as tt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("tiny", "d512"), default="tiny")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(tt.THREADS)
    from looplm.config import ModelConfig, model_preset
    from looplm.data import Batch

    if args.model == "tiny":
        cfg, mb = dataclasses.replace(model_preset("tiny"), vocab_size=258, injection="additive"), 16
    else:
        cfg = ModelConfig(
            vocab_size=258,
            d_model=512,
            n_heads=8,
            n_kv_heads=4,
            ffn_dim=1536,
            max_seq_len=tt.SEQ_LEN,
            injection="additive",
        )
        mb = 8
    p = args.precision
    with tempfile.TemporaryDirectory(prefix="looplm-prof-") as tmp:
        wd = Path(tmp)
        masked = tt.trainer_arm("looplm", args.model, cfg, mb, p, wd)
        causal = tt.trainer_arm("looplm-causal", args.model, cfg, mb, p, wd)
        trainer = causal.step.__self__
        get_batch = trainer._batch

        def batch_without_documents(*a, **k):
            b = get_batch(*a, **k)
            return Batch(b.inputs, b.targets, None, None, b.example_ids)

        trainer._batch = batch_without_documents
        plain = tt.baseline_arm("plain", cfg, mb, p)
        arms = [masked, causal, plain]
        tt.run_interleaved(arms, 1, args.rounds, lambda m: print(m, file=sys.stderr), {"left": 0})
        print(f"\n{args.model} {p}, batch {mb} x {tt.SEQ_LEN}, R={tt.DEPTH}, {tt.THREADS} threads")
        print(
            tt.fmt_table(
                ["arm", "step s mean +- std", "best", "others (cores)"],
                [
                    [
                        a.name,
                        "%.3f +- %.3f" % tt.mean_std([x["wall"] for x in a.samples]),
                        "%.3f" % min(x["wall"] for x in a.samples),
                        "%.2f" % (sum(x["foreign_cores"] for x in a.samples) / len(a.samples)),
                    ]
                    for a in arms
                ],
            )
        )
        for a in arms:
            gc.collect()
            with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
                a.step()
            total = sum(e.self_cpu_time_total for e in prof.key_averages())
            print(f"\n### {a.name}: self CPU {total / 1e6:.2f} s in one profiled step (top {args.top} ops)")
            rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: args.top]
            print(
                tt.fmt_table(
                    ["op", "calls", "self CPU ms", "share"],
                    [
                        [
                            e.key,
                            str(e.count),
                            f"{e.self_cpu_time_total / 1e3:.1f}",
                            f"{100 * e.self_cpu_time_total / total:.1f}%",
                        ]
                        for e in rows
                    ],
                )
            )


if __name__ == "__main__":
    main()
