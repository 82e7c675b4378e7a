"""Load test of `looplm serve`: continuous batching vs one request at a time, terminal vs full
cache at the same cache memory, and adaptive exit vs fixed depth, side by side in one run.

    python benchmarks/serve_load.py [--checkpoint runs/tiny] [--clients 16] [--requests 64]
        [--max-tokens 32] [--depth 5] [--full-slots 4] [--time-limit 120] [--rounds 3]
        [--out benchmarks/results/serve_load.json]
    python benchmarks/serve_load.py --workload mixed-depth [--slots 64] [--deep 12] [--max-tokens 48]
    python benchmarks/serve_load.py --compiled ...   # also `continuous terminal, --compile`
    python benchmarks/serve_load.py --key-range ...  # also `continuous terminal, --compile --key-range`
    python benchmarks/serve_load.py --speculate 4 --draft-depth 2 [--compiled] ...   # also a speculating arm
    python benchmarks/serve_load.py --minimal --compiled --baseline-src /tmp/looplm-baseline/src   # vs another checkout

Every arm starts its own `looplm serve` process on 127.0.0.1 (same checkpoint, same flags apart
from the arm's), waits for /health, and then `--clients` concurrent clients (this process: asyncio
tasks on one thread, or with `--client threads` a thread each) send the same `--requests` streaming
completion requests (prompts: lines of the built-in Shakespeare
corpus, greedy, `--max-tokens` each, depth `--depth`); a client stops taking new requests after
`--time-limit` seconds. Per request: latency (send -> last byte) and time to first token.
Throughput = completion tokens / wall time of the arm. Each arm is then repeated without HTTP:
the same requests submitted at once to `looplm.serve.Engine` in this process (`engine alone`),
which separates what the engine sustains from the cost of HTTP, SSE and the clients sharing the
machine's cores. Both report where the engine's time went: its prompts' prefills (with their
first token) and its decode steps (the server's `looplm_prefill_seconds_total` and
`looplm_decode_seconds_total` over the load; the engine's stats alone).

Arms (the first three are the acceptance's comparison):
- `continuous terminal`: terminal cache with the slots that fit the memory of `--full-slots`
  full-cache slots (at 1/2/1 blocks and R = 5: 4 banks per slot vs 12, so 3x the slots);
- `one at a time terminal`: 1 slot (each request waits for the previous one);
- `continuous full`: the full cache with `--full-slots` slots (the same bytes);
- `continuous terminal, same slots as full`: separates the cost per step from the capacity.
With `--checkpoint` (a trained, depth-using model), two more arms run at `--adaptive-depth`:
fixed depth vs adaptive exit (`exit_tau`), and their outputs are scored by the checkpoint itself
(mean log-likelihood per token of the generated text under a native forward at the fixed depth) and
compared token for token (exact-match rate of the texts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
from _command import command_line  # benchmarks/ is on sys.path when a script there runs

REPO = Path(__file__).resolve().parents[1]


def write_random_run(folder: Path) -> Path:
    """A run folder with a random model of the tiny preset's shape (speed does not depend on training)."""
    from looplm.checkpoint import save_model
    from looplm.data import ByteTokenizer
    from looplm.model import LoopedLM
    from looplm.train.config import job_preset

    job = job_preset("tiny")
    job.model.vocab_size = ByteTokenizer().vocab_size
    torch.manual_seed(0)
    save_model(folder, LoopedLM(job.model), job.to_dict(), ByteTokenizer())
    return folder


def prompts(n: int, seed: int = 0) -> list[str]:
    """`n` prompts: consecutive non-empty lines of the built-in Shakespeare corpus (8-120 characters)."""
    import random

    from looplm.data.corpus import iter_corpus

    lines = [ln.strip() for doc in iter_corpus("shakespeare") for ln in doc.splitlines()]
    lines = [ln for ln in lines if 8 <= len(ln) <= 120]
    rng = random.Random(seed)
    return [ln + "\n" for ln in rng.sample(lines, n)]


class Server:
    """`looplm serve CHECKPOINT ARGS` on a free port, until `close()`."""

    def __init__(
        self,
        checkpoint: Path,
        args: list[str],
        threads: int,
        command: list[str] | None = None,
        src: Path | None = None,
        start_timeout: float = 600.0,
    ):
        """`command` replaces `python -m looplm.cli serve` (e.g. `vllm serve`); it gets CHECKPOINT, --port, ARGS.
        `src`: import looplm from this source folder (another checkout's `src`)."""
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        if src is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src), env.get("PYTHONPATH", "")) if p)
        cmd = [
            *(command or [sys.executable, "-m", "looplm.cli", "serve"]),
            str(checkpoint),
            "--port",
            str(self.port),
            *args,
        ]
        self.cmd = cmd
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited: {self.log.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics").text
        return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class _Reply:
    """One streamed completion as a client reads it: its text, when its first text arrived, its usage."""

    def __init__(self):
        self.start, self.first, self.text, self.usage = time.perf_counter(), None, "", None

    def line(self, line: str) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for c in chunk.get("choices", []):
            if c["text"] and self.first is None:
                self.first = time.perf_counter()
            self.text += c["text"]

    def result(self, index: int) -> dict:
        end = time.perf_counter()
        return {
            "index": index,
            "latency_s": end - self.start,
            "ttft_s": (self.first or end) - self.start,
            "text": self.text,
            "completion_tokens": self.usage["completion_tokens"],
            "mean_decode_depth": self.usage.get("mean_decode_depth", math.nan),  # looplm's
        }


def run_load(url: str, jobs: list[dict], clients: int, time_limit: float, kind: str = "async") -> dict:
    """Send `jobs` (request bodies) from `clients` concurrent clients, streaming; per-request timings.
    `kind` "async": the clients are asyncio tasks on one thread of this process (one `httpx.AsyncClient`,
    as serving benchmarks' load generators are written); "threads": one thread and `httpx.Client` each,
    which costs this process about as much CPU as the server it loads (measured: 1.2-1.8 CPU-seconds
    per round against the compiled server's 1.5), taken from the 2 cores the server runs on."""
    results: list[dict] = []
    lock = threading.Lock()
    queue = list(enumerate(jobs))
    t0 = time.perf_counter()
    payload = {"stream": True, "stream_options": {"include_usage": True}}

    def client():
        with httpx.Client(timeout=600) as http:
            while True:
                with lock:
                    if not queue or time.perf_counter() - t0 > time_limit:
                        return
                    i, body = queue.pop(0)
                reply = _Reply()
                with http.stream("POST", f"{url}/v1/completions", json={**body, **payload}) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {r.read()}")
                    for line in r.iter_lines():
                        reply.line(line)
                with lock:
                    results.append(reply.result(i))

    async def tasks():
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:

            async def one_client():
                while queue and time.perf_counter() - t0 <= time_limit:
                    i, body = queue.pop(0)
                    reply = _Reply()
                    async with http.stream("POST", f"{url}/v1/completions", json={**body, **payload}) as r:
                        if r.status_code != 200:
                            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())!r}")
                        async for line in r.aiter_lines():
                            reply.line(line)
                    results.append(reply.result(i))

            await asyncio.gather(*(one_client() for _ in range(clients)))

    if kind == "async":
        asyncio.run(tasks())
    elif kind == "threads":
        threads = [threading.Thread(target=client) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        raise ValueError(f"kind must be 'async' or 'threads', got {kind!r}")
    wall = time.perf_counter() - t0
    lat = sorted(r["latency_s"] for r in results)
    ttft = sorted(r["ttft_s"] for r in results)
    tokens = sum(r["completion_tokens"] for r in results)

    def pct(xs, q):
        return xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)]

    return {
        "completed": len(results),
        "wall_s": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "requests_per_s": len(results) / wall,
        "latency_p50_s": pct(lat, 0.5),
        "latency_p95_s": pct(lat, 0.95),
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p95_s": pct(ttft, 0.95),
        "mean_decode_depth": sum(r["mean_decode_depth"] * r["completion_tokens"] for r in results) / max(tokens, 1),
        "results": sorted(results, key=lambda r: r["index"]),
    }


def server_flags(opts: dict) -> list[str]:
    """`looplm serve` flags of an arm's engine options (compile, key_range, speculate, draft_depth)."""
    flags = ["--compile"] if opts.get("compile") else []  # (opts["src"]: another checkout, no flags)
    if opts.get("key_range"):
        flags.append("--key-range")
    if opts.get("speculate"):
        flags += ["--speculate", str(opts["speculate"]), "--draft-depth", str(opts["draft_depth"])]
    return flags


def busy_seconds(before: dict, after: dict, prefix: str = "") -> dict[str, float]:
    """The engine's busy time between two readings of its counters (`Engine.stats()`, or /metrics
    with prefix `looplm_`): its prompts' prefills (with their first token) and its decode steps; NaN
    where a reading lacks them (another checkout's server)."""
    names = {k: f"{prefix}{k}_seconds_total" for k in ("prefill", "decode")}
    return {k: after.get(n, math.nan) - before.get(n, math.nan) for k, n in names.items()}


def engine_only(
    checkpoint: Path, texts: list[str], args, cache: str, slots: int, extra: dict, opts: dict | None = None
) -> dict:
    """The same requests through `looplm.serve.Engine` in this process (no HTTP, no clients),
    all submitted at once, on `--server-threads` torch threads: what the engine itself sustains."""
    from looplm.checkpoint import load_model
    from looplm.infer import DepthRule
    from looplm.infer.decode import SamplingConfig
    from looplm.serve import Engine, EngineConfig, Request

    threads = torch.get_num_threads()
    torch.set_num_threads(args.server_threads)
    try:
        model, tok, _ = load_model(checkpoint)
        engine = Engine(
            model,
            tok,
            EngineConfig(
                max_batch=slots,
                depth=args.depth,
                cache=cache,
                max_depth=max(args.depth, extra.get("depth", 0)) if cache == "full" else None,
                max_queue=len(texts),
                **(opts or {}),
            ),
        )
        rule = DepthRule(extra.get("depth", args.depth), exit_tau=extra.get("exit_tau"))  # `extra`: HTTP body fields
        reqs = [Request(tok.encode(t), SamplingConfig(args.max_tokens), rule) for t in texts]
        engine.warm_up()  # compiled: every batch bucket, as `looplm serve --compile` does before it listens
        engine.generate(reqs[:4])  # warm-up
        before = engine.stats()
        t0 = time.perf_counter()
        finishes = engine.generate(reqs)
        wall = time.perf_counter() - t0
        after = engine.stats()
    finally:
        torch.set_num_threads(threads)
    tokens = sum(f.completion_tokens for f in finishes)
    split = {f"{k}_s": v for k, v in busy_seconds(before, after).items()}
    return {"wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall, **split}


def score(checkpoint: Path, texts: list[tuple[str, str]], depth: int) -> float:
    """Mean log-likelihood per token of each completion given its prompt, native forward at `depth`."""
    from looplm.checkpoint import load_model

    model, tok, _ = load_model(checkpoint)
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt, completion in texts:
            p, c = tok.encode(prompt), tok.encode(completion)
            if not c:
                continue
            ids = torch.tensor([p + c])
            lp = model(ids, depth, init="seeded").logits[0, :-1].log_softmax(-1)
            total += float(lp[torch.arange(len(p) - 1, len(p) + len(c) - 1), ids[0, len(p) :]].sum())
            count += len(c)
    return total / max(count, 1)


def mixed_depth(args) -> None:
    """`--workload mixed-depth`: does a batch whose rows decode at different depths cost the sum of
    their depths? `--slots` slots of a random d512 model (the tiny preset's blocks, d 512, 8 heads,
    4 kv heads, ffn 1536); every request prefilled at `--deep` recurrences and decoding
    `--max-tokens` greedy tokens; all requests submitted at once to `looplm.serve.Engine` (no HTTP).
    Arms, alternating over `--rounds`: every row decoding at `--deep`, and half the rows at 1 and
    half at `--deep`. Block visits per decode step: slots * deep vs slots/2 * (1 + deep)."""
    from looplm.data import ByteTokenizer
    from looplm.infer import DepthRule
    from looplm.infer.decode import SamplingConfig
    from looplm.model import LoopedLM
    from looplm.serve import Engine, EngineConfig, Request
    from looplm.train.config import job_preset

    torch.set_num_threads(args.server_threads)
    job = job_preset("tiny")
    for name, value in (("d_model", 512), ("n_heads", 8), ("n_kv_heads", 4), ("ffn_dim", 1536)):
        setattr(job.model, name, value)
    tok = ByteTokenizer()
    job.model.vocab_size = tok.vocab_size
    torch.manual_seed(0)
    model = LoopedLM(job.model).eval()
    texts = prompts(args.slots)
    deep = args.deep

    def requests(shallow_half: bool) -> list:
        return [
            Request(
                tok.encode(t), SamplingConfig(args.max_tokens), DepthRule(1 if shallow_half and i % 2 else deep, deep)
            )
            for i, t in enumerate(texts)
        ]

    engine = Engine(model, tok, EngineConfig(max_batch=args.slots, depth=deep, max_queue=args.slots))
    decode_s = [0.0]  # time inside decode steps (prefills excluded): what per-row depth can save
    decode = engine._decode

    def timed_decode():
        t = time.perf_counter()
        decode()
        decode_s[0] += time.perf_counter() - t

    engine._decode = timed_decode
    arms = {f"all {args.slots} rows at depth {deep}": False, f"half at depth 1, half at {deep}": True}
    arms = {k: v for k, v in arms.items() if args.arms in ("both", "deep" if not v else "mixed")}
    engine.generate(requests(False)[:4])  # warm-up
    runs: dict[str, list[dict]] = {k: [] for k in arms}
    for rnd in range(args.rounds):
        for label, shallow in arms.items():
            reqs = requests(shallow)
            decode_s[0] = 0.0
            t0 = time.perf_counter()
            finishes = engine.generate(reqs)
            wall = time.perf_counter() - t0
            tokens = sum(f.completion_tokens for f in finishes)
            decoded = tokens - len(finishes)  # each request's first token comes from its prefill
            runs[label].append(
                {
                    "wall_s": wall,
                    "completion_tokens": tokens,
                    "tokens_per_s": tokens / wall,
                    "decode_s": decode_s[0],
                    "decode_tokens_per_s": decoded / decode_s[0],
                    "mean_decode_depth": statistics.fmean(f.mean_decode_depth for f in finishes),
                }
            )
            print(
                f"round {rnd + 1} {label:>32}: {tokens} tokens in {wall:6.2f} s = {tokens / wall:7.1f} tok/s; "
                f"decode steps {decode_s[0]:6.2f} s = {decoded / decode_s[0]:7.1f} tok/s",
                flush=True,
            )
    rows = [
        {
            "arm": k,
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in v),
            "median_decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in v),
            "rounds": v,
        }
        for k, v in runs.items()
    ]
    for r in rows:
        print(
            f"{r['arm']:>32}: median {r['median_tokens_per_s']:.1f} tok/s end to end, "
            f"{r['median_decode_tokens_per_s']:.1f} tok/s in decode steps"
        )
    ratio = decode_ratio = None
    if len(rows) == 2:
        ratio = rows[1]["median_tokens_per_s"] / rows[0]["median_tokens_per_s"]
        decode_ratio = rows[1]["median_decode_tokens_per_s"] / rows[0]["median_decode_tokens_per_s"]
        visits = lambda r: job.model.n_prelude + job.model.n_core * r + job.model.n_coda  # noqa: E731
        print(
            f"mixed / all deep: {ratio:.2f}x end to end, {decode_ratio:.2f}x in decode steps (block visits "
            f"per decode step: {(visits(1) + visits(deep)) / 2 / visits(deep):.2f}x)"
        )
    record = {
        "command": command_line(),
        "machine": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads": args.server_threads,
        "model": {"d_model": 512, "blocks": [job.model.n_prelude, job.model.n_core, job.model.n_coda]},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "arms": rows,
        "mixed_over_deep": ratio,
        "mixed_over_deep_decode_steps": decode_ratio,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workload",
        choices=["load", "mixed-depth"],
        default="load",
        help="load: the HTTP load test below; mixed-depth: see `mixed_depth`",
    )
    ap.add_argument("--slots", type=int, default=64, help="mixed-depth: engine slots (= requests)")
    ap.add_argument("--deep", type=int, default=12, help="mixed-depth: prefill and deep decode depth")
    ap.add_argument("--arms", choices=["both", "deep", "mixed"], default="both", help="mixed-depth: arms to run")
    ap.add_argument("--checkpoint", type=Path, default=None, help="default: a random model of the tiny preset's shape")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument(
        "--client",
        choices=["async", "threads"],
        default="async",
        help="how the clients run in this process: asyncio tasks on one thread, or a thread each (what "
        "runs before 2026-12-05 used; it takes about as much CPU as the server: see `run_load`)",
    )
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--full-slots", type=int, default=4)
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of all arms; medians are reported")
    ap.add_argument("--server-threads", type=int, default=1, help="torch threads of the server process")
    ap.add_argument("--adaptive-depth", type=int, default=8)
    ap.add_argument("--exit-tau", type=float, default=0.05)
    ap.add_argument("--compiled", action="store_true", help="add the arm `continuous terminal, --compile`")
    ap.add_argument(
        "--speculate",
        type=int,
        default=0,
        help="add an arm with self-speculative decoding: k drafts per round (with --compiled, compiled)",
    )
    ap.add_argument("--draft-depth", type=int, default=2, help="draft depth of the --speculate arm")
    ap.add_argument(
        "--key-range",
        action="store_true",
        help="add the arm `continuous terminal, --compile --key-range` (steps attend over what the rows filled)",
    )
    ap.add_argument(
        "--start-timeout",
        type=float,
        default=600.0,
        help="seconds a server may take to listen (a compiled one compiles first; --key-range's graphs longer)",
    )
    ap.add_argument(
        "--baseline-src",
        type=Path,
        default=None,
        help="add the arm `baseline`: `looplm serve` of another checkout (its src folder; e.g. the code the "
        "fast-decoding issue measured, `git worktree add /tmp/looplm-baseline f6932e3`), eager, over HTTP only",
    )
    ap.add_argument(
        "--minimal",
        action="store_true",
        help="only `continuous terminal` and the arms asked for (--compiled, --key-range, --speculate, --baseline-src)",
    )
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "serve_load.json")
    args = ap.parse_args()
    if args.workload == "mixed-depth":
        if args.out == REPO / "benchmarks" / "results" / "serve_load.json":
            args.out = REPO / "benchmarks" / "results" / "serve_mixed_depth.json"
        mixed_depth(args)
        return

    from looplm.checkpoint import load_model

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint or write_random_run(Path(tmp) / "random-tiny")
        model, _, _ = load_model(checkpoint)
        cfg = model.cfg
        del model
        banks_terminal = cfg.n_prelude + cfg.n_core + cfg.n_coda
        banks_full = cfg.n_prelude + cfg.n_core * args.depth + cfg.n_coda
        terminal_slots = args.full_slots * banks_full // banks_terminal
        texts = prompts(args.requests)
        jobs = [{"prompt": p, "max_tokens": args.max_tokens, "temperature": 0} for p in texts]
        common = ["--depth", str(args.depth), "--max-queue", str(args.requests)]
        arms = [  # (label, cache, slots, extra request fields, engine options)
            ("continuous terminal", "terminal", terminal_slots, {}, {}),
            ("one at a time terminal", "terminal", 1, {}, {}),
            ("continuous full", "full", args.full_slots, {}, {}),
            (f"continuous terminal, {args.full_slots} slots", "terminal", args.full_slots, {}, {}),
        ]
        compared = [(0, 1), (0, 3)]  # greedy: batching must not change a request's text
        if args.minimal:
            arms, compared = arms[:1], []
        if args.baseline_src is not None:
            arms.append(("baseline", "terminal", terminal_slots, {}, {"src": args.baseline_src}))
            compared.append((0, len(arms) - 1))
        if args.compiled:
            arms.append(("continuous terminal, --compile", "terminal", terminal_slots, {}, {"compile": True}))
            compared.append((0, len(arms) - 1))
        if args.key_range:
            keyed = {"compile": True, "key_range": True}
            arms.append(("continuous terminal, --compile --key-range", "terminal", terminal_slots, {}, keyed))
            compared.append((0, len(arms) - 1))
        if args.speculate:
            spec = {"compile": args.compiled, "speculate": args.speculate, "draft_depth": args.draft_depth}
            arms.append((f"continuous terminal, {' '.join(server_flags(spec))}", "terminal", terminal_slots, {}, spec))
            compared.append((0, len(arms) - 1))  # terminal cache: texts may differ (design §16's window rule)
        if args.checkpoint is not None and not args.minimal:
            R = args.adaptive_depth
            arms += [
                (f"fixed depth {R}", "terminal", terminal_slots, {"depth": R}, {}),
                (
                    f"adaptive exit tau {args.exit_tau} (max {R})",
                    "terminal",
                    terminal_slots,
                    {"depth": R, "exit_tau": args.exit_tau},
                    {},
                ),
            ]
        rounds: list[list[dict]] = [[] for _ in arms]
        for rnd in range(args.rounds):  # arms alternate, so drifting machine load hits all of them alike
            for k, (label, cache, slots, extra, opts) in enumerate(arms):
                flags = ["--cache", cache, "--max-batch", str(slots), *server_flags(opts)]
                server = Server(
                    checkpoint,
                    common + flags,
                    args.server_threads,
                    src=opts.get("src"),
                    start_timeout=args.start_timeout,
                )
                try:
                    # warm-up (a compiled server compiled its batch buckets before it listened)
                    run_load(server.url, jobs[: min(4, len(jobs))], 4, args.time_limit, args.client)
                    before = server.metrics()
                    result = run_load(
                        server.url, [{**j, **extra} for j in jobs], args.clients, args.time_limit, args.client
                    )
                    after = server.metrics()
                    result["cache_bytes"] = after["looplm_cache_bytes_capacity"]
                    # the server's engine busy time under the load (NaN for the baseline's server)
                    result.update({f"server_{k}_s": v for k, v in busy_seconds(before, after, "looplm_").items()})
                finally:
                    server.close()
                result["engine_only"] = (  # the baseline's engine is another checkout's: HTTP only
                    {"tokens_per_s": math.nan, "prefill_s": math.nan, "decode_s": math.nan}
                    if "src" in opts
                    else engine_only(checkpoint, texts, args, cache, slots, extra, opts)
                )
                rounds[k].append(result)
                print(
                    f"round {rnd + 1} {label:>40}: {result['completed']:3d} req in {result['wall_s']:6.2f} s, "
                    f"{result['tokens_per_s']:8.1f} tok/s, latency p50 {result['latency_p50_s']:.3f} s "
                    f"p95 {result['latency_p95_s']:.3f} s, cache {result['cache_bytes'] / 2**20:.1f} MiB, "
                    f"depth {result['mean_decode_depth']:.2f}, its engine busy "
                    f"{result['server_prefill_s']:.2f} s prefill + {result['server_decode_s']:.2f} s decode; engine alone "
                    f"{result['engine_only']['tokens_per_s']:.1f} tok/s (prefill "
                    f"{result['engine_only']['prefill_s']:.2f} s, decode {result['engine_only']['decode_s']:.2f} s)",
                    flush=True,
                )
        rows = []
        for (label, cache, slots, extra, opts), runs in zip(arms, rounds):
            med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
            rows.append(
                {
                    "arm": label,
                    "server_flags": " ".join(
                        common + ["--cache", cache, "--max-batch", str(slots)] + server_flags(opts)
                    ),
                    "extra_body": extra,
                    "slots": slots,
                    "cache_bytes": runs[0]["cache_bytes"],
                    **{
                        f"median_{key}": med(key)
                        for key in (
                            "tokens_per_s",
                            "requests_per_s",
                            "latency_p50_s",
                            "latency_p95_s",
                            "ttft_p50_s",
                            "ttft_p95_s",
                            "server_prefill_s",
                            "server_decode_s",
                        )
                    },
                    **{
                        f"median_engine_only_{key}": statistics.median(r["engine_only"][key] for r in runs)
                        for key in ("tokens_per_s", "prefill_s", "decode_s")
                    },
                    "completed": runs[-1]["completed"],
                    "mean_decode_depth": runs[-1]["mean_decode_depth"],
                    "results": runs[-1]["results"],
                    "rounds": [{k: v for k, v in r.items() if k != "results"} for r in runs],
                }
            )
        print("\nmedians over rounds:")
        for r in rows:
            print(
                f"{r['arm']:>40}: {r['median_tokens_per_s']:8.1f} tok/s, latency p50 {r['median_latency_p50_s']:.3f} s "
                f"p95 {r['median_latency_p95_s']:.3f} s, ttft p50 {r['median_ttft_p50_s']:.3f} s; engine alone "
                f"{r['median_engine_only_tokens_per_s']:.1f} tok/s; depth {r['mean_decode_depth']:.2f}"
            )
        same_outputs = {  # greedy: batching must not change a request's text (an arm cut short is no pair)
            rows[i]["arm"] + " vs " + rows[j]["arm"]: (
                sum(a["text"] == b["text"] for a, b in zip(rows[i]["results"], rows[j]["results"]))
                if rows[i]["completed"] == rows[j]["completed"] == len(jobs)
                else f"not compared (completed {rows[i]['completed']} and {rows[j]['completed']})"
            )
            for i, j in compared
        }
        print(f"identical texts (of {len(jobs)}): {same_outputs}")
        over_baseline = None
        if args.baseline_src is not None:  # tokens/s over HTTP of each arm against the baseline's, same rounds
            base = next(r for r in rows if r["arm"] == "baseline")["median_tokens_per_s"]
            over_baseline = {r["arm"]: r["median_tokens_per_s"] / base for r in rows}
            print("over the baseline: " + ", ".join(f"{a} {x:.2f}x" for a, x in over_baseline.items()))
        quality = None
        if args.checkpoint is not None and not args.minimal:  # the two arms added for it, found by name
            fixed = next(r for r in rows if r["arm"] == f"fixed depth {args.adaptive_depth}")
            adaptive = next(r for r in rows if r["arm"].startswith("adaptive exit tau"))
            pairs = lambda row: [(texts[r["index"]], r["text"]) for r in row["results"]]  # noqa: E731
            same = [
                a["text"] == f["text"]
                for a, f in zip(adaptive["results"], fixed["results"])
                if a["index"] == f["index"]
            ]
            quality = {
                "scored_at_depth": args.adaptive_depth,
                "fixed_mean_loglik_per_token": score(checkpoint, pairs(fixed), args.adaptive_depth),
                "adaptive_mean_loglik_per_token": score(checkpoint, pairs(adaptive), args.adaptive_depth),
                "identical_texts": sum(same),
                "compared": len(same),
            }
            print(f"quality: {quality}")
    for r in rows:
        for res in r["results"]:
            res.pop("text")
    record = {
        "command": command_line(),
        "machine": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "checkpoint": str(args.checkpoint or "random tiny"),
        "model": {
            "d_model": cfg.d_model,
            "blocks": [cfg.n_prelude, cfg.n_core, cfg.n_coda],
            "context": cfg.max_seq_len,
        },
        "settings": vars(args) | {"out": str(args.out), "checkpoint": str(args.checkpoint)},
        "arms": rows,
        "identical_texts": same_outputs,
        "over_baseline": over_baseline,
        "adaptive_quality": quality,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
