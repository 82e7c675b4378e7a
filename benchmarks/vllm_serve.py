"""`looplm serve` vs `vllm serve` (looplm's vLLM plugin) on CPU: the same checkpoint and workload.

    python benchmarks/vllm_serve.py [--checkpoint runs/tiny] [--clients 16] [--requests 64]
        [--max-tokens 32] [--depth 5] [--slots 16] [--rounds 1] [--out benchmarks/results/vllm_serve.json]

Run it in the vLLM environment (`bash .ci/install_vllm_cpu.sh .venv-vllm`; it has looplm's serving
dependencies too). Both servers load the same checkpoint (default: a random model of the tiny
preset's shape; vLLM reads its `looplm export --num-steps DEPTH` folder) in fp32 at depth `--depth`
with `--slots` concurrent sequences (looplm: `--max-batch`, terminal cache; vLLM: `--max-num-seqs`,
VLLM_CPU_KVCACHE_SPACE=1 GiB; two vLLM rows: eager mode and vLLM's default compiled mode, whose
start-up compile is not timed), one torch thread each. `--clients` threads send the same
`--requests` greedy streaming completions (Shakespeare lines, `--max-tokens` each, no early EOS
stop: `ignore_eos` for vLLM) through `serve_load.run_load`: tokens/s, latency p50/p95, time to
first token.

KV memory: vLLM reports the tokens its KV memory holds with terminal sharing (`/metrics`,
`vllm:cache_config_info`: num_gpu_blocks x block_size, one bank per physical layer). One KV bank per
layer visit would need (P + C R + D) / (P + C + D) times the bytes per token, so the same memory
would hold that many times fewer tokens; sequences that fit = tokens // max_seq_len.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _command import command_line  # noqa: E402
from serve_load import REPO, Server, prompts, run_load, write_random_run  # noqa: E402


def kv_tokens(url: str) -> int:
    """Tokens vLLM's KV memory holds (num_gpu_blocks x block_size, from its /metrics)."""
    text = httpx.get(f"{url}/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info"))
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    return int(labels["num_gpu_blocks"]) * int(labels["block_size"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=None, help="default: a random model of the tiny preset's shape")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--slots", type=int, default=16, help="concurrent sequences of both servers")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds of both arms; medians are reported")
    ap.add_argument("--time-limit", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "vllm_serve.json")
    args = ap.parse_args()

    from looplm.checkpoint import load_model
    from looplm.hf import export

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint or write_random_run(Path(tmp) / "random-tiny")
        folder = export(checkpoint, Path(tmp) / "hf", num_steps=args.depth)
        cfg = load_model(checkpoint)[0].cfg
        texts = prompts(args.requests)
        jobs = [{"prompt": p, "max_tokens": args.max_tokens, "temperature": 0} for p in texts]
        vllm_env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        arms = [  # (label, server command, folder, flags, extra request fields)
            (
                "looplm serve",
                None,
                checkpoint,
                ["--depth", str(args.depth), "--max-batch", str(args.slots), "--max-queue", str(args.requests)],
                {},
            ),
            # `vllm serve`'s server from its module: vllm-cpu 0.32's `vllm` command fails at start-up (README)
            *(
                (
                    label,
                    [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"],
                    folder,
                    [
                        "--host",
                        "127.0.0.1",
                        "--dtype",
                        "float32",
                        *eager,
                        "--max-model-len",
                        str(cfg.max_seq_len),
                        "--max-num-seqs",
                        str(args.slots),
                        "--served-model-name",
                        "looplm",
                    ],
                    {"ignore_eos": True},
                )
                # eager, and vLLM's default mode (on CPU: Dynamo traced once + Inductor, compiled at start-up)
                for label, eager in (("vllm serve", ["--enforce-eager"]), ("vllm compiled", []))
            ),
        ]
        rounds: list[list[dict]] = [[] for _ in arms]
        kv = None
        os.environ.update(vllm_env)
        for rnd in range(args.rounds):
            for k, (label, command, path, flags, extra) in enumerate(arms):
                server = Server(path, flags, 1, command=command)
                try:
                    body = [{**j, **extra} for j in jobs]
                    # a thread per client, as the runs in BENCHMARKS.md were measured (`run_load`)
                    run_load(server.url, body[:4], 4, args.time_limit, "threads")  # warm-up
                    result = run_load(server.url, body, args.clients, args.time_limit, "threads")
                    if command is not None:
                        kv = kv_tokens(server.url)
                finally:
                    server.close()
                rounds[k].append(result)
                print(
                    f"round {rnd + 1} {label:>13}: {result['completed']:3d} req in {result['wall_s']:7.2f} s, "
                    f"{result['tokens_per_s']:7.1f} tok/s, latency p50 {result['latency_p50_s']:.2f} s "
                    f"p95 {result['latency_p95_s']:.2f} s, ttft p50 {result['ttft_p50_s']:.2f} s",
                    flush=True,
                )
    rows = []
    for (label, command, _, flags, extra), runs in zip(arms, rounds):
        med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
        rows.append(
            {
                "arm": label,
                "flags": " ".join(flags),
                "extra_body": extra,
                "completed": runs[-1]["completed"],
                **{
                    f"median_{key}": med(key)
                    for key in ("tokens_per_s", "latency_p50_s", "latency_p95_s", "ttft_p50_s", "ttft_p95_s")
                },
                "texts": [r["text"] for r in runs[-1]["results"]],
            }
        )
    physical = cfg.n_prelude + cfg.n_core + cfg.n_coda
    visits = cfg.n_prelude + cfg.n_core * args.depth + cfg.n_coda
    same = {row["arm"]: sum(a == b for a, b in zip(rows[0]["texts"], row["texts"])) for row in rows[1:]}
    capacity = {
        "kv_gib": 1,
        "terminal_tokens": kv,
        "per_visit_tokens": kv * physical // visits,
        "terminal_sequences": kv // cfg.max_seq_len,
        "per_visit_sequences": kv * physical // visits // cfg.max_seq_len,
        "banks_terminal": physical,
        "banks_per_visit": visits,
    }
    print(
        f"\nKV memory 1 GiB: terminal sharing {kv} tokens = {capacity['terminal_sequences']} sequences of "
        f"{cfg.max_seq_len}; one KV per layer visit ({visits} vs {physical} banks) "
        f"{capacity['per_visit_tokens']} tokens = {capacity['per_visit_sequences']} sequences"
    )
    print(f"texts identical to looplm serve's (of {len(texts)}): {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": command_line(),
                "machine": {
                    "platform": platform.platform(),
                    "processor": platform.processor(),
                    "cpus": os.cpu_count(),
                    "load_average_at_end": os.getloadavg(),
                },
                "model": cfg.to_dict(),
                "depth": args.depth,
                "rows": rows,
                "kv_capacity": capacity,
                "identical_texts": same,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
