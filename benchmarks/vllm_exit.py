"""What adaptive exit (`exit_tau`) saves under `vllm serve` (looplm's vLLM plugin) on a trained checkpoint.

    python benchmarks/vllm_exit.py runs/tiny [--depth 16] [--taus 0.01 0.001] [--min-depth 2] [--fixed 6]
        [--prompts 16] [--max-tokens 64] [--runs 3] [--out benchmarks/results/vllm_exit.json]

Run it in the vLLM environment (`bash .ci/install_vllm_cpu.sh .venv-vllm`). The checkpoint is exported
(`looplm export --num-steps DEPTH`) and served offline (`vllm.LLM`, fp32, eager, one torch thread),
at the fixed depth DEPTH, at each `--fixed` depth (for scale: what a step costs at fewer recurrences), and
once per tau at DEPTH with `--hf-overrides '{"exit_tau": tau, "min_depth": m}'` (prompts at DEPTH, decoded
tokens adaptive). Each arm decodes the same `--prompts` Shakespeare lines (`--max-tokens` greedy tokens
each, submitted together, `ignore_eos`) once to warm up, then `--runs` times: the median time is reported.
Reported per arm: decode time and tokens/s; the recurrences vLLM's loop ran per forward (a step stops when
every token in it stopped: the plugin's eager counters); looplm's own recurrences per decoded token
(`looplm generate --exit-tau` on each prompt alone, its `mean_decode_depth`); how many prompts' tokens equal
the fixed-depth arm's and `looplm generate --exit-tau`'s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its counters readable
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _command import command_line  # noqa: E402
from serve_load import REPO, prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--taus", type=float, nargs="+", default=[0.01, 0.001])
    ap.add_argument("--min-depth", type=int, default=2)
    ap.add_argument("--fixed", type=int, nargs="*", default=[6], help="more fixed-depth arms (for scale)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "vllm_exit.json")
    args = ap.parse_args()

    import torch
    from vllm import LLM, SamplingParams

    from looplm.checkpoint import load_model
    from looplm.hf import export
    from looplm.infer.generate import SamplingConfig, generate

    torch.set_num_threads(1)
    model, tok, _ = load_model(args.checkpoint)
    model.eval()
    texts = prompts(args.prompts)
    encoded = [tok.encode_prompt(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = export(args.checkpoint, Path(tmp) / "hf", num_steps=args.depth)
        fixed_ids = None
        arms = [(args.depth, None), *((d, None) for d in args.fixed), *((args.depth, t) for t in args.taus)]
        for depth, tau in arms:
            overrides = {"num_steps": depth} if tau is None else {"exit_tau": tau, "min_depth": args.min_depth}
            llm = LLM(
                model=str(folder),
                dtype="float32",
                enforce_eager=True,
                max_num_seqs=args.prompts,
                seed=0,
                hf_overrides=overrides,
            )
            batch = [{"prompt_token_ids": ids} for ids in encoded]
            llm.generate(batch, params, use_tqdm=False)  # warm-up
            before = llm.apply_model(lambda m: dict(m.loop_stats))[0]
            times = []
            for _ in range(args.runs):
                start = time.perf_counter()
                outs = llm.generate(batch, params, use_tqdm=False)
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            after = llm.apply_model(lambda m: dict(m.loop_stats))[0]
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
            ids = [list(o.outputs[0].token_ids) for o in outs]
            fixed_ids = ids if fixed_ids is None else fixed_ids  # the first arm: fixed at DEPTH
            forwards = after["forwards"] - before["forwards"]
            row = {
                "arm": f"fixed R={depth}" if tau is None else f"exit_tau={tau}",
                "depth": depth,
                "exit_tau": tau,
                "min_depth": None if tau is None else args.min_depth,
                "decode_seconds": round(seconds, 3),
                "tokens_per_s": round(sum(map(len, ids)) / seconds, 1),
                "loop_recurrences_per_forward": (
                    depth if tau is None else round((after["recurrences"] - before["recurrences"]) / forwards, 2)
                ),
                "decode_seconds_all_runs": [round(t, 3) for t in times],
                f"same_tokens_as_fixed_R{args.depth}": sum(a == b for a, b in zip(ids, fixed_ids)),
            }
            if tau is not None:  # looplm's own decoding of each prompt alone
                depths, same = [], 0
                for text, got in zip(texts, ids):
                    stats: dict = {}
                    sampling = SamplingConfig(max_new_tokens=args.max_tokens, exit_tau=tau, min_depth=args.min_depth)
                    want = generate(model, tok, [text], depth=args.depth, sampling=sampling, stats=stats)[0]
                    depths.append(stats["mean_decode_depth"])
                    same += tok.decode(got) == want
                row["looplm_recurrences_per_decoded_token"] = round(sum(depths) / len(depths), 2)
                row["same_text_as_looplm_generate"] = same
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": command_line(),
                "checkpoint": str(args.checkpoint),
                "prompts": args.prompts,
                "max_tokens": args.max_tokens,
                "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "results": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
