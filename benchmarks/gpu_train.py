"""GPU training benchmark: throughput and MFU of looplm's training step at the paper's S width,
side by side with an independent compiled looped baseline, plus one-rank NCCL runs of the real
trainers. One prepared run on one GPU (budgeted to finish in under 8 minutes on an H200):

    PYTHONPATH=src python benchmarks/gpu_train.py --out benchmarks/results/gpu_train_h200.json
    PYTHONPATH=src python benchmarks/gpu_train.py --tiny      # CPU dry run of every code path (minutes)

What it measures, in one process, in this order:
1. the bf16 dense matmul peak of this GPU (8192^3, the MFU denominator);
2. training steps at fixed R = 5 (the PLN-5 draws replaced by their mean, so every step costs the
   same) with full BPTT, bf16 autocast, fused AdamW, for seq 2048 (batch 8) and 8192 (batch 2):
   - `eager-sdpa`: looplm as it trained before (eager, boolean document masks through SDPA);
   - `compiled-flex`: `--train.compile on --train.attention flex` (compiled blocks and injection,
     FlexAttention block masks);
   - `plain-compiled`: a nanoGPT-style looped model written in this file (same shapes: RMSNorm,
     RoPE, GQA, SwiGLU, 1/2/1 blocks, a linear injection), `torch.compile` of the whole model,
     causal SDPA; it knows nothing of looplm.
   Masks: `causal` (no document ids), `doc1` (document ids with one document per row: the
   same attention pattern as causal, so it isolates the mask kernel's cost) and `packed`
   (documents of 64..1024 tokens packed into rows). MFU = flops.py FLOPs/token (full-length
   attention, the paper's convention, also for masked rows) x tokens/s / measured peak;
3. `torchrun --nproc_per_node 1` runs (nccl on CUDA, gloo with --tiny) of `looplm train`,
   `looplm distill` and `looplm rl`: the collectives the multi-GPU crash came from, on a real
   process group.
Each timing row is the median of `--steps` steps after `--warmup` steps; peak memory is
torch.cuda.max_memory_allocated over the row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from looplm.config import ModelConfig, model_preset
from looplm.data import Batch
from looplm.model import LoopedLM
from looplm.train.flops import flops_per_token
from looplm.train.parallelize import apply_compile, compiled_graphs
from looplm.train.trainer import microbatch_loss, param_groups

DEPTH = 5


# -- the independent baseline -------------------------------------------------------------------
class PlainNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.rms_norm(x.float(), (x.shape[-1],), eps=1e-6).type_as(x) * self.g


def rotate(x, cos, sin):
    a, b = x.float().chunk(2, -1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), -1).type_as(x)


class PlainBlock(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.h, self.kv, self.hd = heads, kv_heads, d // heads
        self.n1, self.n2 = PlainNorm(d), PlainNorm(d)
        self.qkv = nn.Linear(d, (heads + 2 * kv_heads) * self.hd, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x, cos, sin):
        B, L, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).split([self.h * self.hd, self.kv * self.hd, self.kv * self.hd], -1)
        q = rotate(q.view(B, L, self.h, self.hd).transpose(1, 2), cos, sin)
        k = rotate(k.view(B, L, self.kv, self.hd).transpose(1, 2), cos, sin)
        v = v.view(B, L, self.kv, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.out(y.transpose(1, 2).reshape(B, L, -1))
        gate, up = self.up(self.n2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class PlainLooped(nn.Module):
    """prelude -> (s = decay * s + W e; core) x R -> coda, compiled whole."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        mk = lambda: PlainBlock(d, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim)  # noqa: E731
        self.emb = nn.Embedding(cfg.vocab_size, d)
        self.pre = nn.ModuleList(mk() for _ in range(cfg.n_prelude))
        self.core = nn.ModuleList(mk() for _ in range(cfg.n_core))
        self.post = nn.ModuleList(mk() for _ in range(cfg.n_coda))
        self.inject = nn.Linear(d, d, bias=False)
        self.decay = nn.Parameter(torch.full((d,), 0.5))
        self.norm = PlainNorm(d)
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        inv = 1.0 / (cfg.rope_base ** (torch.arange(0, d // cfg.n_heads, 2).double() / (d // cfg.n_heads)))
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        for p in self.parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens, state0, depth: int):
        L = tokens.shape[1]
        ang = torch.arange(L, device=tokens.device).float()[:, None] * self.inv_freq
        cos, sin = ang.cos(), ang.sin()
        e = self.emb(tokens)
        for blk in self.pre:
            e = blk(e, cos, sin)
        u, s = self.inject(e), state0.type_as(e)
        for _ in range(depth):
            s = self.decay * s + u
            for blk in self.core:
                s = blk(s, cos, sin)
        for blk in self.post:
            s = blk(s, cos, sin)
        return self.head(self.norm(s)).float()


# -- measurement --------------------------------------------------------------------------------
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device, dtype, n: int, reps: int = 20) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - t)


def timed(step, device) -> float:
    sync(device)
    t = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - t


def time_steps(step, device, warmup: int, steps: int) -> tuple[float, float | None, float, int]:
    """(median step seconds, peak GiB or None, first-step seconds incl. compile, graphs compiled
    during the timed steps: should be 0). Warm-up goes on
    (up to 10 steps) while steps still compile graphs, so no compile lands in a timed step."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    first, n = None, 0
    while n < warmup or (n < 10 and compiled_graphs() != before):
        before = compiled_graphs()
        dt = timed(step, device)
        first = dt if first is None else first
        n += 1
    before = compiled_graphs()
    times = [timed(step, device) for _ in range(steps)]
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return statistics.median(times), peak, first, compiled_graphs() - before


def packed_doc_ids(B: int, L: int, device, *, lo: int, hi: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Document ids and per-document positions of rows packed with documents of lo..hi tokens."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.zeros(B, L, dtype=torch.long)
    pos = torch.zeros(B, L, dtype=torch.long)
    for b in range(B):
        start, k = 0, 0
        while start < L:
            n = int(torch.randint(lo, hi + 1, (1,), generator=g))
            doc[b, start:start + n], pos[b, start:start + n] = k, torch.arange(min(n, L - start))
            start, k = start + n, k + 1
    return doc.to(device), pos.to(device)


def looplm_arm(cfg, B, L, device, dtype, *, compiled: bool, attention: str, mask: str):
    """A step of the trainer's compute: microbatch_loss (the function Trainer.train_step calls),
    backward, clip, fused AdamW."""
    torch.manual_seed(0)
    model = LoopedLM(cfg).to(device)
    if compiled:
        apply_compile(model)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
    x = torch.randint(0, cfg.vocab_size, (B, L + 1), device=device)
    if mask == "causal":
        doc, pos = None, torch.arange(L, device=device).expand(B, L)
    elif mask == "doc1":
        doc, pos = torch.zeros(B, L, dtype=torch.long, device=device), torch.arange(L, device=device).expand(B, L)
    else:
        doc, pos = packed_doc_ids(B, L, device, lo=min(64, L // 4), hi=min(1024, L // 2))
    batch = Batch(x[:, :-1], x[:, 1:], doc, pos, torch.arange(B, device=device))
    state0 = torch.randn(B, L, cfg.d_model, device=device) / math.sqrt(cfg.d_model)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    n = B * L

    def step():
        loss = microbatch_loss(model, batch, DEPTH, None, state0, autocast, attention) / n
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, lambda: (model, opt)


def plain_arm(cfg, B, L, device, dtype):
    torch.manual_seed(0)
    model = PlainLooped(cfg).to(device)
    fwd = torch.compile(model)
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

    return step, lambda: (model, opt)


# -- one-rank process-group runs of the real trainers --------------------------------------------
def torchrun_runs(device: torch.device, tiny: bool, root: Path, timeout: int) -> list[dict]:
    dev = device.type
    train_flags = ["--train.steps", "12", "--train.log-every", "4", "--train.eval-every", "6", "--train.no-progress",
                   "--train.device", dev, "--train.no-tensorboard", "--data.n-task-examples", "4000",
                   "--data.cache-dir", str(root / "cache"), "--train.out-dir", str(root / "train"),
                   "--eval.depths", "1", "5", "--eval.task-examples", "16", "--eval.max-sequences", "8"]
    if tiny:
        train_flags += ["--model.d-model", "32", "--model.n-heads", "2", "--model.n-kv-heads", "1", "--model.ffn-dim", "64",
                        "--model.max-seq-len", "64", "--data.seq-len", "64", "--train.micro-batch", "4"]
    else:
        train_flags += ["--train.compile", "on", "--train.attention", "flex"]
    ckpt = root / "train"
    jobs = [
        ("train", ["train", "tiny", *train_flags]),
        ("distill", ["distill", str(ckpt), "--steps", "4", "--micro-batch", "4", "--calibration-rows", "8",
                     "--val-rows", "8", "--val-every", "2", "--report-rows", "8", "--report-examples", "8",
                     "--out-dir", str(root / "distill"), "--device", dev, "--no-progress"]),
        ("rl", ["rl", str(ckpt), "--steps", "2", "--prompts-per-step", "4", "--group-size", "2", "--eval-every", "2",
                "--eval-examples", "8", "--eval-samples", "1", "--out-dir", str(root / "rl"), "--device", dev,
                "--no-progress"]),
    ]
    rows = []
    for name, args in jobs:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               "-m", "looplm.cli", *args]
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            rc, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as err:
            rc, out = "timeout", f"{err.stdout or ''}{err.stderr or ''}"
        group = [line for line in out.splitlines() if line.startswith("process group:")]
        rows.append({"job": name, "rc": rc, "wall_s": round(time.perf_counter() - t, 1),
                     "process_group": group[0] if group else None, "command": shlex.join(cmd[2:]),
                     "tail": out[-1500:] if rc != 0 else out[-400:]})
        print(f"torchrun {name}: rc {rc} in {rows[-1]['wall_s']} s; {rows[-1]['process_group']}", flush=True)
        if name == "train" and rc != 0:
            break
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU dry run: a small model, few steps, gloo process groups")
    ap.add_argument("--out", type=Path, default=None, help="JSON output (default benchmarks/results/gpu_train[_tiny].json)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per row (default 8; tiny 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per row, compile included (default 3; tiny 1)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip the remaining timing rows past this many seconds")
    ap.add_argument("--skip-torchrun", action="store_true", help="timing rows only")
    args = ap.parse_args()
    start = time.perf_counter()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        ap.error("no CUDA device: run with --tiny for the CPU dry run")
    steps, warmup = args.steps or (2 if args.tiny else 8), args.warmup or (1 if args.tiny else 3)
    out = args.out or Path("benchmarks/results") / ("gpu_train_tiny.json" if args.tiny else "gpu_train.json")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    res = {"command": shlex.join([sys.executable, *sys.argv]), "torch": torch.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
           "dtype": str(dtype), "depth": DEPTH, "steps": steps, "warmup": warmup}
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    peak = matmul_peak(device, dtype, 1024 if args.tiny else 8192)
    res["matmul_peak_tflops"] = peak / 1e12
    print(f"{dtype} matmul peak: {peak / 1e12:.3f} TFLOP/s", flush=True)

    if args.tiny:
        cfg = ModelConfig(vocab_size=512, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=256)
        shapes = [(128, 2), (256, 1)]
    else:
        cfg = model_preset("S")
        cfg.vocab_size = 64256
        shapes = [(2048, 8), (8192, 2)]
    res["model"] = cfg.to_dict()
    # FlexAttention has no CPU backward in torch: the dry run takes the compiled arm through SDPA
    flex = "sdpa" if device.type == "cpu" else "flex"
    rows = []
    for L, B in shapes:
        cfg.max_seq_len = L
        fpt = flops_per_token(cfg, L, DEPTH, None)
        plan = [("eager-sdpa", m) for m in ("causal", "doc1", "packed")] + \
               [("compiled-flex", m) for m in ("causal", "doc1", "packed")] + [("plain-compiled", "causal")]
        for arm, mask in plan:
            row = {"arm": arm, "mask": mask, "seq": L, "batch": B}
            if time.perf_counter() - start > args.budget_s:
                rows.append({**row, "skipped": "time budget"})
                continue
            graphs = compiled_graphs()
            step = _keep = None
            try:
                if arm == "plain-compiled":
                    step, _keep = plain_arm(cfg, B, L, device, dtype)
                else:
                    step, _keep = looplm_arm(cfg, B, L, device, dtype, compiled=arm == "compiled-flex",
                                             attention=flex if arm == "compiled-flex" else "sdpa", mask=mask)
                dt, mem, first, late = time_steps(step, device, warmup, steps)
                tps = B * L / dt
                row.update(step_s=dt, tokens_per_s=tps, mfu=tps * fpt / peak, peak_gib=mem, first_step_s=first,
                           graphs_compiled=compiled_graphs() - graphs, graphs_compiled_in_timed_steps=late,
                           kernel=(flex if arm == "compiled-flex" else "sdpa") if mask != "causal" else "sdpa-causal")
            except torch.OutOfMemoryError as err:
                row["error"] = f"OOM: {str(err)[:200]}"
            except Exception as err:  # report it in the JSON; the other rows still run
                row["error"] = f"{type(err).__name__}: {str(err)[:500]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            del step, _keep
            if device.type == "cuda":
                torch.cuda.empty_cache()
    res["rows"] = rows

    def tps(arm, mask, L):
        r = [x for x in rows if x["arm"] == arm and x["mask"] == mask and x["seq"] == L and "tokens_per_s" in x]
        return r[0]["tokens_per_s"] if r else None

    res["summary"] = {}
    for L, _ in shapes:
        new, base, old = tps("compiled-flex", "causal", L), tps("plain-compiled", "causal", L), tps("eager-sdpa", "causal", L)
        masked = [x for x in rows if x["arm"] == "compiled-flex" and x["mask"] == "doc1" and x["seq"] == L and "mfu" in x]
        res["summary"][str(L)] = {
            "compiled_over_plain_baseline": new / base if new and base else None,
            "compiled_over_eager": new / old if new and old else None,
            "mfu_compiled_doc1": masked[0]["mfu"] if masked else None,
        }
    print(json.dumps(res["summary"], indent=1), flush=True)

    if not args.skip_torchrun:
        with tempfile.TemporaryDirectory(prefix="looplm-gpu-train-") as tmp:
            res["torchrun_one_rank"] = torchrun_runs(device, args.tiny, Path(tmp), timeout=240 if args.tiny else 150)
    res["wall_s"] = time.perf_counter() - start
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out} ({res['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
