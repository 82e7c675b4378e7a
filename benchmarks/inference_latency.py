"""Prefill/decode speed and cache memory: terminal vs full KV cache vs no-cache decoding.

    python benchmarks/inference_latency.py [--quick] [--out benchmarks/results/inference_latency.json]

Model: d 256, 4/2 heads (head_dim 64), FFN 768, 1/2/1 blocks, random weights (speed does not
depend on training), fp32, 2 threads. At R = 5 and R = 16:
  * prefill of 1,024 tokens into each cache;
  * decode of new tokens one at a time after that prefill: terminal cache, full cache, and a
    no-cache decoder that reruns the native forward over the whole sequence for every token;
  * cache bytes per sequence;
  * serving throughput at a fixed cache-memory budget (the full cache's bytes at batch 4): the
    terminal cache fits a batch (budget / its bytes per sequence) that is 3x larger at R = 5.
Arms run interleaved over several rounds after a warm-up; mean and std of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from looplm.config import ModelConfig
from looplm.infer import extend, make_cache
from looplm.model import LoopedLM

CTX = 1024


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def greedy_decode(model, cache, tok: torch.Tensor, depth: int, n: int) -> float:
    """Seconds for n one-token greedy decode steps against `cache`, starting from `tok` [B, 1]."""
    t = time.perf_counter()
    for _ in range(n):
        tok = extend(model, tok, cache, depth).logits[:, -1:].argmax(-1)
    return time.perf_counter() - t


def mean_std(v: list[float]) -> tuple[float, float]:
    return statistics.mean(v), statistics.stdev(v) if len(v) > 1 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/inference_latency.json"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=258, d_model=256, n_heads=4, n_kv_heads=2, ffn_dim=768, max_seq_len=2048)
    model = LoopedLM(cfg).eval()
    rounds, n_dec, n_nocache = (2, 8, 2) if args.quick else (4, 32, 4)
    prompt = torch.randint(0, 258, (1, CTX))
    result: dict = {"config": cfg.to_dict(), "context": CTX, "rounds": rounds, "decode_tokens": n_dec, "arms": {}}
    torch.set_grad_enabled(False)

    for R in (5, 16):
        arms = {"terminal": [], "full": [], "nocache": []}
        prefill = {"terminal": [], "full": []}
        for rnd in range(rounds + 1):  # round 0 is the warm-up
            order = ["terminal", "full", "nocache"]
            order = order[rnd % 3 :] + order[: rnd % 3]
            for arm in order:
                if arm == "nocache":
                    seq = prompt.clone()

                    def nocache_decode():
                        nonlocal seq
                        for _ in range(n_nocache):
                            logits = model(seq, R, init="seeded").logits
                            seq = torch.cat([seq, logits[:, -1:].argmax(-1)], dim=1)

                    dt = timed(nocache_decode)
                    if rnd:
                        arms[arm].append(n_nocache / dt)
                    continue
                cache = make_cache(arm, cfg, 1, CTX + n_dec, R)
                pt = timed(lambda: extend(model, prompt, cache, R).logits)
                dt = greedy_decode(model, cache, prompt[:, -1:], R, n_dec)
                if rnd:
                    prefill[arm].append(CTX / pt)
                    arms[arm].append(n_dec / dt)
        bytes_per_seq = {m: make_cache(m, cfg, 1, CTX + n_dec, R).nbytes for m in ("terminal", "full")}
        row = {
            "prefill_tok_s": {k: mean_std(v) for k, v in prefill.items()},
            "decode_tok_s": {k: mean_std(v) for k, v in arms.items()},
            "cache_bytes_per_sequence": bytes_per_seq,
            "bytes_ratio_terminal_over_full": bytes_per_seq["terminal"] / bytes_per_seq["full"],
        }
        result["arms"][f"R={R}"] = row
        print(f"R={R}: {json.dumps(row)}", flush=True)

    # serving throughput at a fixed cache-memory budget, R = 5
    R, b_full = 5, 4
    budget = make_cache("full", cfg, b_full, CTX + n_dec, R).nbytes
    b_term = budget // make_cache("terminal", cfg, 1, CTX + n_dec, R).nbytes
    serving = {"full": [], "terminal": []}
    for rnd in range(rounds + 1):
        for arm in ["full", "terminal"] if rnd % 2 == 0 else ["terminal", "full"]:
            B = b_full if arm == "full" else b_term
            cache = make_cache(arm, cfg, B, CTX + n_dec, R)
            assert cache.nbytes <= budget
            x = torch.randint(0, 258, (B, CTX))
            extend(model, x, cache, R).logits
            dt = greedy_decode(model, cache, x[:, -1:], R, n_dec)
            if rnd:
                serving[arm].append(B * n_dec / dt)
    result["serving_R5"] = {
        "cache_budget_bytes": budget,
        "batch": {"full": b_full, "terminal": int(b_term)},
        "decode_tok_s": {k: mean_std(v) for k, v in serving.items()},
    }
    print(f"serving: {json.dumps(result['serving_R5'])}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
