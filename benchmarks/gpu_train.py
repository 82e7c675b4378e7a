"""GPU training benchmark: throughput and MFU of looplm's training step at the paper's S width, side by
side with an independent compiled looped baseline, then one-rank process-group runs of the real
trainers. One prepared run on one GPU with one deadline for everything, compilation included:

    PYTHONPATH=src python benchmarks/gpu_train.py --out "$OUT"      # the GPU machine: nothing to install
    PYTHONPATH=src python benchmarks/gpu_train.py --tiny            # CPU dry run of every code path

It needs torch and looplm's own requirements only (no tyro: the torchrun jobs build their configs in
`benchmarks/gpu_jobs.py`). Every row is appended to `<out>/gpu_train.jsonl` and the log the moment it
is measured, and `<out>/gpu_train.json` (everything so far) is rewritten after each row, so a run cut
short keeps what it measured; each torchrun job's output goes to `<out>/gpu_train_torchrun_<job>.log`
(with --tiny the names start gpu_train_tiny). In order, most important first:

1. the CUDA FlexAttention gradient check (flex vs boolean-mask SDPA gradients of a small model, with
   training's kernel options; the CPU dry run compares logits: torch's flex has no CPU backward), then
   the chunked head + cross-entropy against full logits (loss and gradients, training's shapes);
2. the bf16 dense matmul peak (8192^3, CUDA events, windows of >= 0.25 s: best and median) and the
   datasheet peak;
3. training steps at fixed R = 5 (full BPTT, bf16 autocast, fused AdamW; the model built on the GPU),
   seq 2048 x batch 8: `compiled-flex` doc1 (the headline: compiled blocks and injection,
   FlexAttention masks, one document per row, the chunked head + cross-entropy), `plain-compiled`
   causal (a nanoGPT-style looped model, `benchmarks/_plain_looped.py`, compiled whole: same shapes,
   RMSNorm, RoPE, GQA, SwiGLU, 1/2/1 blocks, a linear injection; knows nothing of looplm), `eager-sdpa`
   doc1 (the old path), then compiled-flex causal / packed, compiled-flex doc1 with full fp32 logits
   (the loss lever), eager causal / packed; then, after `torch._dynamo.reset()`, seq 8192 x batch 2;
   masks: `causal` (no document ids), `doc1` (document ids, one document per row), `packed`
   (documents of 64..1024 tokens);
   then decoding at R = 32 (batch 1 and 16: eager, compiled with and without CUDA graphs, all of R in
   one graph, and self-speculation), which training rows leave `--decode-reserve-s` for;
4. `torchrun --nproc_per_node 1` runs (nccl on CUDA, gloo with --tiny) of the train (compiled, flex),
   distill and RL jobs, each with the time left as its timeout; timing rows stop `--torchrun-reserve-s`
   before the deadline to leave them that time.
Each timing row is the median of `--steps` steps after `--warmup` steps (more while graphs still
compile); MFU = flops.py FLOPs/token x tokens/s over the measured best peak (`mfu`), the median peak
and the datasheet; `mfu_pairs` counts the attention pairs the row's document mask runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _command import command_line, join  # benchmarks/ is on sys.path when a script runs
from _plain_looped import PlainLooped

from looplm.config import ModelConfig, model_preset
from looplm.data import Batch
from looplm.model import LoopedLM
from looplm.train.flops import flops_per_token, keys_per_query
from looplm.train.loss import microbatch_loss
from looplm.train.mfu import datasheet_peak, measure_matmul_peak
from looplm.train.parallelize import apply_compile, compiled_graphs
from looplm.train.trainer import param_groups

DEPTH = 5
HERE = Path(__file__).resolve().parent


# -- output: every row on disk as soon as it is measured ------------------------------------------
class Recorder:
    """Appends rows to <out>/<name>.jsonl and lines to <out>/<name>.log as they come, and rewrites
    <out>/<name>.json (the whole result so far) after each row."""

    def __init__(self, out: Path, name: str, result: dict):
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.name, self.result = out, name, result
        self.jsonl, self.json, self.log_path = out / f"{name}.jsonl", out / f"{name}.json", out / f"{name}.log"
        for p in (self.jsonl, self.log_path):
            p.write_text("")
        self.save()

    def log(self, msg: str) -> None:
        print(msg, flush=True)
        with self.log_path.open("a") as f:
            f.write(msg + "\n")

    def row(self, section: str, row: dict) -> None:
        self.result.setdefault(section, []).append(row)
        with self.jsonl.open("a") as f:
            f.write(json.dumps({"section": section, **row}) + "\n")
        self.log(f"{section}: {json.dumps(row)}")
        self.save()

    def save(self) -> None:
        tmp = self.json.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.result, indent=1) + "\n")
        tmp.replace(self.json)


class Deadline:
    def __init__(self, seconds: float):
        self.start, self.seconds = time.perf_counter(), seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()


# -- measurement --------------------------------------------------------------------------------
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(step, device, out: list | None = None) -> float:
    sync(device)
    t = time.perf_counter()
    value = step()
    sync(device)
    if out is not None:
        out.append(value)
    return time.perf_counter() - t


def time_steps(step, device, warmup: int, steps: int) -> tuple[float, float | None, float, int, list[float]]:
    """(median step seconds, peak GiB or None, first-step seconds incl. compile, graphs compiled
    during the timed steps: should be 0, the timed steps' losses). Warm-up goes on (up to 10 steps)
    while steps still compile graphs, so no compile lands in a timed step."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    first, n, before = None, 0, compiled_graphs()
    while n < warmup or (n < 10 and compiled_graphs() != before):
        before = compiled_graphs()
        dt = timed(step, device)
        first = dt if first is None else first
        n += 1
    before, losses = compiled_graphs(), []
    times = [timed(step, device, losses) for _ in range(steps)]  # each loss read after its step's timing
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return statistics.median(times), peak, first, compiled_graphs() - before, [float(v) for v in losses]


def doc_layout(mask: str, B: int, L: int, device, seed: int = 0) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(document ids or None, per-document positions) of rows: causal (no ids), doc1 (one document per
    row) or packed (documents of 64..1024 tokens, at most L/4..L/2 in the dry run)."""
    if mask == "causal":
        return None, torch.arange(L, device=device).expand(B, L)
    if mask == "doc1":
        return torch.zeros(B, L, dtype=torch.long, device=device), torch.arange(L, device=device).expand(B, L)
    lo, hi = min(64, L // 4), min(1024, L // 2)
    g = torch.Generator().manual_seed(seed)
    doc = torch.zeros(B, L, dtype=torch.long)
    pos = torch.zeros(B, L, dtype=torch.long)
    for b in range(B):
        start, k = 0, 0
        while start < L:
            n = int(torch.randint(lo, hi + 1, (1,), generator=g))
            doc[b, start : start + n], pos[b, start : start + n] = k, torch.arange(min(n, L - start))
            start, k = start + n, k + 1
    return doc.to(device), pos.to(device)


def looplm_arm(
    cfg,
    B,
    L,
    device,
    dtype,
    *,
    compiled: bool,
    attention: str,
    mask: str,
    loss: str,
    flex_options: dict | None,
    backend: str,
):
    """A step of the trainer's compute: microbatch_loss (what Trainer.train_step calls), backward, clip,
    fused AdamW; the model built on `device`."""
    torch.manual_seed(0)
    with torch.device(device):
        model = LoopedLM(cfg)
    if compiled:
        apply_compile(model, backend=backend)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    x = torch.randint(0, cfg.vocab_size, (B, L + 1), device=device)
    doc, pos = doc_layout(mask, B, L, device)
    batch = Batch(x[:, :-1], x[:, 1:], doc, pos, torch.arange(B, device=device))
    state0 = torch.randn(B, L, cfg.d_model, device=device) / math.sqrt(cfg.d_model)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    n = B * L

    def step():
        ce = microbatch_loss(
            model, batch, DEPTH, None, state0, autocast, attention, loss=loss, flex_options=flex_options
        )
        (ce / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return ce.detach() / n

    return step, (model, opt), doc


def plain_arm(cfg, B, L, device, dtype, backend: str):
    torch.manual_seed(0)
    # the plain baseline as this benchmark measures it: fused QKV and gate/up matmuls, RMSNorm and RoPE in fp32,
    # a linear injection (s = decay * s + W e), weights N(0, 0.02^2)
    with torch.device(device):
        model = PlainLooped(
            cfg.vocab_size,
            cfg.d_model,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.ffn_dim,
            cfg.n_prelude,
            cfg.n_core,
            cfg.n_coda,
            injection="linear",
            fused=True,
            norm="fp32",
            rope_fp32=True,
            rope_base=cfg.rope_base,
        ).init_weights()
    fwd = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    x = torch.randint(0, cfg.vocab_size, (B, L + 1), device=device)
    state0 = torch.randn(B, L, cfg.d_model, device=device) / math.sqrt(cfg.d_model)
    n = B * L

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits = fwd(x[:, :-1], state0, DEPTH)
        loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum") / n
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, (model, opt), None


# -- 1. the FlexAttention check ------------------------------------------------------------------
def flex_check(device, flex_options: dict) -> dict:
    """Flex (block mask, training's kernel options) against boolean-mask SDPA on packed rows, fp32: the
    largest gradient difference relative to the gradient's scale, per parameter (CUDA); the logits on a
    CPU, where torch's FlexAttention has no backward."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, d_model=128, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=512)
    with torch.device(device):
        model = LoopedLM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, 512), device=device)
    doc, pos = doc_layout("packed", 2, 512, device, seed=1)
    kw = dict(doc_ids=doc, positions=pos, init="seeded")
    if device.type != "cuda":
        with torch.no_grad():
            flex = model(tokens, 3, attention="flex", flex_options=flex_options, **kw).logits
            sdpa = model(tokens, 3, attention="sdpa", **kw).logits
        err = float((flex - sdpa).abs().max() / sdpa.abs().max())
        return {"check": "flex_vs_sdpa", "compared": "logits (no CPU backward)", "max_rel_err": err, "ok": err < 1e-4}
    grads = {}
    for kernel in ("sdpa", "flex"):
        model.zero_grad()
        extra = {"flex_options": flex_options} if kernel == "flex" else {}
        model(tokens, 3, attention=kernel, **extra, **kw).logits.logsumexp(-1).mean().backward()
        grads[kernel] = {n: p.grad.clone() for n, p in model.named_parameters()}
    errs = {
        n: float((grads["flex"][n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in grads["sdpa"].items()
    }
    worst = max(errs, key=errs.get)
    return {
        "check": "flex_vs_sdpa",
        "compared": "gradients, fp32",
        "max_rel_err": errs[worst],
        "worst": worst,
        "ok": errs[worst] < 1e-3,
        "kernel_options": flex_options,
    }


def ce_check(device, tiny: bool) -> dict:
    """The chunked head + cross-entropy (on CUDA its chunk math compiled) against full logits +
    F.cross_entropy: the loss and the gradients of the head input and weight, under bf16 autocast on a
    GPU (the training shapes: V = 64256, chunks of 4096 rows), fp32 in the dry run."""
    from looplm.model.cross_entropy import linear_cross_entropy

    V, d, N, chunk = (512, 64, 300, 128) if tiny else (64256, 256, 8192, 4096)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, d, generator=g).to(device).requires_grad_()
    w = (torch.randn(V, d, generator=g) / d**0.5).to(device).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    t[::7] = -100
    t = t.to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    with autocast:
        full = F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100, reduction="sum")
    want = torch.autograd.grad(full, (h, w))
    with autocast:
        chunked = linear_cross_entropy(h, w, t, chunk_rows=chunk)
    got = torch.autograd.grad(chunked, (h, w))
    errs = {"loss": float((chunked - full).abs() / full.abs())}
    for name, a, b in zip(("grad_h", "grad_w"), got, want):
        errs[name] = float((a - b).abs().max() / b.abs().max())
    bounds = (
        {"loss": 1e-5, "grad_h": 1e-5, "grad_w": 1e-5}
        if device.type != "cuda"
        else {"loss": 1e-4, "grad_h": 1e-2, "grad_w": 2e-2}
    )  # bf16 matmuls: per-chunk rounding of the weight gradient
    return {
        "check": "chunked_ce_vs_full",
        "rel_err": errs,
        "bounds": bounds,
        "ok": all(errs[k] < bounds[k] for k in errs),
    }


# -- 4. one-rank torchrun jobs -------------------------------------------------------------------
def run_logged(cmd: list[str], timeout: float, log: Path, env: dict) -> int | str:
    """Run `cmd` in its own process group with output to `log`; on timeout end the whole group (torchrun
    and its worker) and return 'timeout'."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            return proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=15)
                    break
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    continue
            return "timeout"


def torchrun_jobs(rec: Recorder, device: torch.device, tiny: bool, root: Path, deadline: Deadline) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for name in ("train", "distill", "rl"):
        left = deadline.left()
        row = {"job": name}
        if left < 20:
            rec.row("torchrun_one_rank", {**row, "skipped": f"deadline ({left:.0f} s left)"})
            continue
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "1",
            "--log-dir",  # torchrun's own logs with the results, not a torchelastic_* folder in /tmp
            str(rec.out / "torchrun-logs"),
            str(HERE / "gpu_jobs.py"),
            name,
            "--root",
            str(root),
            "--device",
            device.type,
            *(["--tiny"] if tiny else []),
        ]
        log = rec.out / f"{rec.name}_torchrun_{name}.log"
        t = time.perf_counter()
        rc = run_logged(cmd, left, log, env)
        out = log.read_text(errors="replace")
        group = [line for line in out.splitlines() if line.startswith("process group:")]
        rec.row(
            "torchrun_one_rank",
            {
                **row,
                "rc": rc,
                "wall_s": round(time.perf_counter() - t, 1),
                "timeout_s": round(left),
                "process_group": group[0] if group else None,
                "command": join(cmd[1:]),
                "log": log.name,
                "tail": out[-1500:] if rc != 0 else out[-300:],
            },
        )
        if name == "train" and rc != 0:
            break


# -- the run ------------------------------------------------------------------------------------
def timing_plan(tiny: bool) -> list[tuple[int, int, str, str, str]]:
    """(seq, batch, arm, mask, loss) rows, most important first."""
    shapes = [(128, 2), (256, 1)] if tiny else [(2048, 8), (8192, 2)]
    plan = []
    for L, B in shapes:
        plan += [
            (L, B, "compiled-flex", "doc1", "chunked"),
            (L, B, "plain-compiled", "causal", "full"),
            (L, B, "eager-sdpa", "doc1", "chunked"),
            (L, B, "compiled-flex", "causal", "chunked"),
            (L, B, "compiled-flex", "packed", "chunked"),
        ]
        if L == shapes[0][0]:
            plan += [
                (L, B, "compiled-flex", "doc1", "full"),
                (L, B, "eager-sdpa", "causal", "chunked"),
                (L, B, "eager-sdpa", "packed", "chunked"),
            ]
    return plan


def module_versions(names) -> dict:
    out = {}
    for name in names:
        try:
            if importlib.util.find_spec(name) is None:
                out[name] = None
                continue
            out[name] = getattr(__import__(name), "__version__", "present")
        except ImportError as err:  # hidden or broken
            out[name] = f"not importable: {err}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: a small model, few steps, gloo process groups")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default $OUT when set; else benchmarks/results with --tiny)",
    )
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="wall-clock budget of the whole run, compilation and torchrun jobs included (default 450; tiny 900)",
    )
    ap.add_argument(
        "--torchrun-reserve-s",
        type=float,
        default=None,
        help="stop timing rows this long before the deadline, for the torchrun jobs (default 180; tiny 0)",
    )
    ap.add_argument(
        "--decode-reserve-s",
        type=float,
        default=None,
        help="stop training rows this long before the torchrun reserve, for the decode rows (default 180; tiny 0)",
    )
    ap.add_argument("--steps", type=int, default=None, help="timed steps per row (default 8; tiny 2)")
    ap.add_argument(
        "--warmup", type=int, default=None, help="untimed steps per row, compile included (default 2; tiny 1)"
    )
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend (a dry run may use aot_eager)")
    ap.add_argument(
        "--flex-kernel-options",
        nargs="*",
        default=(),
        help="extra FlexAttention kernel options KEY=VALUE for the compiled rows (as --train.flex-kernel-options)",
    )
    ap.add_argument("--skip-torchrun", action="store_true", help="timing rows only")
    ap.add_argument(
        "--runs-dir",
        type=Path,
        default=None,
        help="folder of the torchrun jobs' runs (checkpoints, reports; default a temporary folder)",
    )
    args = ap.parse_args()
    deadline = Deadline(args.deadline_s or (900.0 if args.tiny else 450.0))
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        ap.error("no CUDA device: run with --tiny for the CPU dry run")
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    if out is None:
        if not args.tiny:
            ap.error("give --out (or set $OUT)")
        out = Path("benchmarks/results")
    steps = args.steps if args.steps is not None else (2 if args.tiny else 8)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    if steps < 1 or warmup < 0:  # --warmup 0 is no untimed step; it read as the default
        ap.error(f"--steps must be >= 1 and --warmup >= 0, got {steps} and {warmup}")
    reserve = (
        0.0
        if args.skip_torchrun
        else (args.torchrun_reserve_s if args.torchrun_reserve_s is not None else (0.0 if args.tiny else 180.0))
    )
    decode_reserve = args.decode_reserve_s if args.decode_reserve_s is not None else (0.0 if args.tiny else 180.0)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    from looplm.train.loss import parse_kernel_options

    flex_options = parse_kernel_options(tuple(args.flex_kernel_options))
    name = "gpu_train_tiny" if args.tiny else "gpu_train"
    res = {
        "command": command_line(python=Path(sys.executable).name),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({os.cpu_count()} cores, dry run)",
        "dtype": str(dtype),
        "depth": DEPTH,
        "steps": steps,
        "warmup": warmup,
        "deadline_s": deadline.seconds,
        "compile_backend": args.compile_backend,
        "flex_kernel_options": flex_options,
        "modules": module_versions(("numpy", "safetensors", "tokenizers", "tqdm", "matplotlib", "tyro")),
        "finished": False,
    }
    rec = Recorder(out, name, res)
    rec.log(
        f"{res['device']}, torch {res['torch']}, python {res['python']}; deadline {deadline.seconds:.0f} s; out {out}"
    )
    # 1. FlexAttention first: a wrong kernel makes every flex row meaningless
    try:
        rec.row("checks", {**flex_check(device, flex_options), "s": round(deadline.elapsed(), 1)})
    except Exception as err:  # recorded; the rest still runs
        rec.row("checks", {"check": "flex_vs_sdpa", "error": f"{type(err).__name__}: {str(err)[:500]}"})

    try:
        rec.row("checks", {**ce_check(device, args.tiny), "s": round(deadline.elapsed(), 1)})
    except Exception as err:
        rec.row("checks", {"check": "chunked_ce_vs_full", "error": f"{type(err).__name__}: {str(err)[:500]}"})

    # TF32 only after the checks, which compare fp32 kernels: in the first H200 runs it was on during them
    # and flex vs SDPA differed by 2.4e-3 (bound 1e-3; whether TF32 is all of it is not yet measured)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    # 2. peaks
    if args.tiny:
        peak = measure_matmul_peak(device, dtype, n=1024, window_s=0.1, windows=3)
    else:
        peak = measure_matmul_peak(device, dtype)
    sheet = datasheet_peak(res["device"], dtype) if device.type == "cuda" else None
    res["peak"] = {**peak, "datasheet": sheet}
    rec.log(
        f"{dtype} matmul peak: best {peak['best'] / 1e12:.1f}, median {peak['median'] / 1e12:.1f} TFLOP/s "
        f"({peak['timer']}, {peak['windows']} windows of {peak['window_s']:.2f} s); datasheet "
        f"{sheet / 1e12 if sheet else None} TFLOP/s"
    )
    rec.save()

    # 3. timing rows
    if args.tiny:
        cfg = ModelConfig(vocab_size=512, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=256)
    else:
        cfg = model_preset("S")
        cfg.vocab_size = 64256
    res["model"] = cfg.to_dict()
    # torch's FlexAttention has no CPU backward: the dry run takes the compiled arm through SDPA
    flex = "sdpa" if device.type == "cpu" else "flex"
    floor = 0.0 if args.tiny else 45.0  # a row is not started with less than this left before the reserve
    seq_done = None
    for L, B, arm, mask, loss in timing_plan(args.tiny):
        row = {"arm": arm, "mask": mask, "seq": L, "batch": B, "loss": loss}
        if seq_done is not None and L != seq_done:
            torch._dynamo.reset()  # the new length compiles static graphs afresh, not dynamic-shape ones
        seq_done = L
        left = deadline.left() - reserve - decode_reserve
        if left < floor or left <= 0:
            held = reserve + decode_reserve
            rec.row("rows", {**row, "skipped": f"deadline ({deadline.left():.0f} s left, {held:.0f} s reserved)"})
            continue
        cfg.max_seq_len = L
        graphs, step, keep = compiled_graphs(), None, None
        try:
            attention = flex if arm == "compiled-flex" else "sdpa"
            if arm == "plain-compiled":
                step, keep, doc = plain_arm(cfg, B, L, device, dtype, args.compile_backend)
            else:
                step, keep, doc = looplm_arm(
                    cfg,
                    B,
                    L,
                    device,
                    dtype,
                    compiled=arm == "compiled-flex",
                    attention=attention,
                    mask=mask,
                    loss=loss,
                    flex_options=flex_options if attention == "flex" else None,
                    backend=args.compile_backend,
                )
            dt, mem, first, late, losses = time_steps(step, device, warmup, steps)
            tps = B * L / dt
            fpt = flops_per_token(cfg, L, DEPTH, None)
            kpq = keys_per_query(doc) if doc is not None else (L + 1) / 2
            fpt_pairs = flops_per_token(cfg, L, DEPTH, None, keys_per_query=kpq)
            row.update(
                step_s=dt,
                tokens_per_s=tps,
                flops_per_token=fpt,
                mfu=tps * fpt / peak["best"],
                mfu_median_peak=tps * fpt / peak["median"],
                mfu_datasheet=tps * fpt / sheet if sheet else None,
                keys_per_query=kpq,
                mfu_pairs=tps * fpt_pairs / peak["best"],
                peak_gib=mem,
                first_step_s=first,
                graphs_compiled=compiled_graphs() - graphs,
                graphs_compiled_in_timed_steps=late,
                kernel=attention if mask != "causal" else "sdpa-causal",
                losses=losses,  # random data: about ln(vocab); a non-finite one makes the row's speed meaningless
                losses_finite=all(math.isfinite(v) for v in losses),
            )
        except torch.OutOfMemoryError as err:
            row["error"] = f"OOM: {str(err)[:200]}"
        except Exception as err:  # recorded; the other rows still run
            row["error"] = f"{type(err).__name__}: {str(err)[:500]}"
        row["s"] = round(deadline.elapsed(), 1)
        res["summary"] = summarize([*res.get("rows", []), row])  # kept current, in case the run is cut short
        rec.row("rows", row)
        del step, keep  # free this row's model and optimizer before the next one is built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rec.log("summary: " + json.dumps(res.get("summary")))

    # 3b. decoding: the eager step, the compiled static step (CUDA graphs on CUDA) and self-speculation
    torch._dynamo.reset()
    for B in (1, 16):
        left = deadline.left() - reserve
        if left < floor or left <= 0:
            rec.row("decode", {"batch": B, "skipped": f"deadline ({deadline.left():.0f} s left)"})
            continue
        for row in decode_rows(cfg, B, device, dtype, args.tiny, args.compile_backend):
            rec.row("decode", {**row, "s": round(deadline.elapsed(), 1)})
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # 4. the real trainers on a process group
    if not args.skip_torchrun:
        with tempfile.TemporaryDirectory(prefix="looplm-gpu-jobs-") as tmp:
            torchrun_jobs(rec, device, args.tiny, args.runs_dir or Path(tmp), deadline)
    res["wall_s"], res["finished"] = deadline.elapsed(), True
    rec.save()
    rec.log(f"wrote {rec.json} ({res['wall_s']:.0f} s)")


def decode_rows(cfg, B: int, device, dtype, tiny: bool, backend: str) -> list[dict]:
    """Decode tokens/s at R = 32 after a 512-token prompt (R = 8 after 64 with --tiny), batch B, terminal cache,
    random weights: `eager` (the cached forward one token at a time), `compiled` (`DecodeStep`,
    `mode="reduce-overhead"` on CUDA: CUDA graphs), `compiled-nographs` (CUDA only: inductor's kernels
    without graphs), `compiled-unroll-R` (batch 1: the R recurrences in one graph, where the default
    step replays 10 graphs; the host's share of a CUDA step) and `compiled+speculate` (k = 4 drafts at depth 4,
    verified at 32; with random weights the acceptance rate is a lower bound, not a trained model's).
    Each a median over timed steps after a warm-up that compiles."""
    from looplm.infer import extend, make_cache
    from looplm.infer.decode import SamplingConfig
    from looplm.infer.speculative import SpeculationStats, speculative_decode
    from looplm.infer.step import DecodeStep, StepRows
    from looplm.model import LoopedLM

    # the dry run checks the code paths: R = 8 still runs two 4-recurrence calls against one of all R
    R, prompt_len, steps = (8, 64, 3) if tiny else (32, 512, 16)
    dcfg = ModelConfig(**{**cfg.to_dict(), "max_seq_len": prompt_len + 64})
    torch.manual_seed(0)
    model = LoopedLM(dcfg).to(device=device, dtype=dtype).eval()
    prompt = torch.randint(0, dcfg.vocab_size, (B, prompt_len), device=device)
    tok = torch.zeros(B, dtype=torch.long, device=device)
    rows_in = StepRows(
        tok,
        torch.full((B,), prompt_len, device=device),
        torch.zeros(B, dtype=torch.long, device=device),
        torch.arange(B, device=device),
    )
    out = []
    for arm in ("eager", "compiled", "compiled-nographs", "compiled-unroll-R", "compiled+speculate"):
        row = {"arm": arm, "batch": B, "depth": R, "prompt": prompt_len, "cache": "terminal"}
        from torch._dynamo.utils import counters

        skips = counters["inductor"]["cudagraph_skips"]
        try:
            cache = make_cache("terminal", dcfg, B, dcfg.max_seq_len, R, device=device, dtype=dtype)
            with torch.no_grad():
                extend(model, prompt, cache, R)
            t0 = time.perf_counter()
            if arm == "eager":

                def run():
                    cache.length = prompt_len
                    extend(model, tok[:, None], cache, R)

                per_step = 1
            else:
                options = {} if backend == "inductor" else {"backend": backend}
                if arm == "compiled-nographs" and device.type == "cuda":
                    options["mode"] = "default"  # inductor's kernels, launched from Python one by one
                elif arm == "compiled-nographs":
                    continue  # a CPU has no graphs to leave out
                if arm == "compiled-unroll-R" and B != 1:
                    continue
                # compiled-unroll-R: all R recurrences in one graph, 3 replays a step instead of R / 4 + 2
                unroll = {"unroll": R} if arm == "compiled-unroll-R" else {}
                step = DecodeStep(model, cache, compile=True, compile_options=options, **unroll)
                if arm.startswith("compiled") and not arm.endswith("speculate"):

                    def run():
                        step(rows_in, R)

                    per_step = 1
                else:
                    if B != 1:  # speculation decodes one sequence at a time
                        continue
                    stats = SpeculationStats()
                    first = torch.zeros(1, dcfg.vocab_size, device=device)

                    def run():
                        n = [0]

                        def emit(_t):
                            n[0] += 1
                            return n[0] >= 16

                        speculative_decode(
                            step,
                            first,
                            length=prompt_len,
                            depth=R,
                            draft_depth=4,
                            k=4,
                            sampling=SamplingConfig(max_new_tokens=16),
                            generator=None,
                            pad=torch.zeros(1, dtype=torch.long, device=device),
                            example_ids=torch.zeros(1, dtype=torch.long, device=device),
                            emit=emit,
                            stats=stats,
                        )

                    # the first of the 16 tokens comes from `first` (the prompt's logits), no step: 15 decoded
                    per_step = 15
            run()
            sync(device)
            row["first_call_s"] = time.perf_counter() - t0
            times = []
            for _ in range(max(5, steps // per_step)):
                t = time.perf_counter()
                run()
                sync(device)
                times.append((time.perf_counter() - t) / per_step)
            dt = statistics.median(times)
            row.update(step_s=dt, tokens_per_s=B / dt)
            row["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips  # graphs run without
            if arm == "compiled+speculate":
                row.update(acceptance_rate=stats.acceptance_rate, tokens_per_verify=stats.tokens_per_verify)
        except Exception as err:  # recorded; the other arms still run
            row["error"] = f"{type(err).__name__}: {str(err)[:500]}"
        out.append(row)
    base = {r["arm"]: r.get("tokens_per_s") for r in out}
    for r in out:
        if r.get("tokens_per_s") and base.get("eager"):
            r["vs_eager"] = r["tokens_per_s"] / base["eager"]
    return out


def summarize(rows: list[dict]) -> dict:
    def get(arm, mask, L, loss="chunked", key="tokens_per_s"):
        hit = [
            r
            for r in rows
            if (r["arm"], r["mask"], r["seq"]) == (arm, mask, L)
            and key in r
            and (arm == "plain-compiled" or r["loss"] == loss)
        ]
        return hit[0][key] if hit else None

    def ratio(a, b):
        return a / b if a and b else None

    out = {}
    for L in sorted({r["seq"] for r in rows}):
        head = get("compiled-flex", "doc1", L)
        out[str(L)] = {
            "headline_mfu_compiled_doc1": get("compiled-flex", "doc1", L, key="mfu"),
            "headline_mfu_compiled_doc1_datasheet": get("compiled-flex", "doc1", L, key="mfu_datasheet"),
            "compiled_doc1_over_plain_causal": ratio(head, get("plain-compiled", "causal", L)),
            "compiled_causal_over_plain_causal": ratio(
                get("compiled-flex", "causal", L), get("plain-compiled", "causal", L)
            ),
            "compiled_doc1_over_eager_doc1": ratio(head, get("eager-sdpa", "doc1", L)),
            "chunked_over_full_loss_doc1": ratio(head, get("compiled-flex", "doc1", L, loss="full")),
            "mfu_pairs_compiled_packed": get("compiled-flex", "packed", L, key="mfu_pairs"),
        }
    out["targets"] = {"mfu_compiled_doc1_2048": 0.5, "compiled_over_plain": 0.95}
    return out


if __name__ == "__main__":
    main()
