#!/usr/bin/env python
"""Training-throughput benchmark for looplm on CPU (issue: foundation).

One run measures, side by side:

1. the matmul peak of this machine in fp32 and bf16 (best-of-N square `torch.matmul`);
2. training throughput through the real trainer (`Trainer.train_step`: packed task-generator
   data with document masks, fixed depth R=5, full BPTT, grad clip, AdamW) for the `tiny`
   preset and a d=512 model, in fp32 and under bf16 autocast: tokens/s and MFU;
3. an independent plain PyTorch looped-model baseline (`benchmarks/_plain_looped.py`) at the d=512
   shape, same batch, same dtypes: tokens/s, MFU and the looplm/baseline ratio;
4. truncated backprop at R=16: full BPTT vs `bptt_window=2`, step time and peak memory, each
   arm in a fresh subprocess.

Arms of one table are interleaved (round r starts at arm r mod n) so that drift in the machine's
speed hits every arm alike. MFU = flops_per_token(cfg, seq_len, R, window) x tokens/s divided by
the matmul peak measured in this run in the same dtype. (Run order: 4 first, while the parent
process is small, then 1, 2, 3.)

The machine may be shared: every timed sample records the cores other processes used meanwhile,
and `--wait-quiet S` spends up to S seconds waiting for them to go idle and rerunning contended
samples (see `measure`).

    python benchmarks/train_throughput.py [--quick] [--wait-quiet S] [--out benchmarks/results/train_throughput.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _command import command_line  # benchmarks/ is on sys.path when a script there runs
from _plain_looped import PlainLooped

THREADS = 2
SEQ_LEN = 256
DEPTH = 5
TBPTT_DEPTH = 16
TBPTT_WINDOW = 2
N_TASK_EXAMPLES = 3000  # enough packed sequences for every step of the run (the sampler wraps anyway)


# ------------------------------------------------------------------------------------------------
# machine


def machine_info() -> dict:
    info: dict = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        for key in (
            "Model name",
            "CPU(s)",
            "Core(s) per socket",
            "Socket(s)",
            "Thread(s) per core",
            "L2 cache",
            "L3 cache",
        ):
            if key in fields:
                info[key] = fields[key]
        flags = set(fields.get("Flags", "").split())
        info["isa"] = {f: f in flags for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")}
    except (OSError, subprocess.CalledProcessError):
        pass
    info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    info["mkldnn"] = torch.backends.mkldnn.is_available()
    return info


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def rss_bytes() -> int:
    """Current resident set size of this process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def hwm_bytes() -> int:
    """Peak resident set size of this process image (VmHWM; unlike getrusage's ru_maxrss it does
    not inherit the parent's peak across fork+exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def system_busy_s() -> tuple[float, float]:
    """(busy, steal) CPU-seconds of the whole machine so far, from /proc/stat."""
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0, 0.0
    busy = v[0] + v[1] + v[2] + v[5] + v[6]  # user nice system irq softirq
    return busy / _HZ, (v[7] if len(v) > 7 else 0) / _HZ


def timed(fn) -> dict:
    """Run fn once: wall seconds, this process's CPU seconds, and the CPU cores that *other*
    processes used meanwhile (machine busy time minus ours, per wall second) plus hypervisor steal."""
    b0, s0 = system_busy_s()
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    b1, s1 = system_busy_s()
    return {
        "wall": wall,
        "cpu": cpu,
        "foreign_cores": max(0.0, (b1 - b0 - cpu) / wall),
        "steal_cores": (s1 - s0) / wall,
    }


def wait_quiet(budget: dict, log, threshold: float = 0.2) -> None:
    """Wait (from the shared budget['left'] seconds) until other processes use < threshold cores."""
    while budget["left"] > 0:
        b0, _ = system_busy_s()
        c0 = time.process_time()
        time.sleep(0.5)
        foreign = ((system_busy_s()[0] - b0) - (time.process_time() - c0)) / 0.5
        budget["left"] -= 0.5
        if foreign < threshold:
            return
        budget["waited"] = budget.get("waited", 0.0) + 0.5
    if budget.get("waited") and not budget.get("warned"):
        log("  (quiet-wait budget spent; measuring under load)")
        budget["warned"] = True


MAX_FOREIGN_CORES = 0.25  # a timed sample during which other processes used more is "contended"


def measure(fn, quiet: dict, log, tries: int = 3) -> dict:
    """Time fn once on a quiet machine if the quiet-wait budget allows: wait for quiet, run, and
    re-run (up to `tries` times) when other processes used more than MAX_FOREIGN_CORES meanwhile.
    With 2 OpenMP threads on 2 vCPUs, a busy neighbour stalls every parallel region, so a
    contended sample can be several times slower; it is kept (flagged) only when retries or the
    budget run out."""
    rejected = []
    for attempt in range(tries):
        wait_quiet(quiet, log)
        x = timed(fn)
        if x["foreign_cores"] <= MAX_FOREIGN_CORES or quiet["left"] <= 0 or attempt == tries - 1:
            x["contended"] = x["foreign_cores"] > MAX_FOREIGN_CORES
            x["rejected_s"] = rejected
            return x
        rejected.append(x["wall"])
    raise AssertionError("unreachable")


def mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


# ------------------------------------------------------------------------------------------------
# 1. matmul peak


def matmul_peak(sizes: list[int], reps: int, quiet: dict, log) -> dict:
    """Best-of-`reps` GFLOP/s of an n x n x n matmul (2 n^3 flops) per dtype and size; the peak
    per dtype is the best over sizes. fp32 and bf16 are interleaved within each repetition."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    rows = []
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        mats = {
            k: (torch.randn(n, n, generator=g).to(dt), torch.randn(n, n, generator=g).to(dt))
            for k, dt in dtypes.items()
        }
        outs = {k: torch.empty(n, n, dtype=dt) for k, dt in dtypes.items()}
        for k in dtypes:  # warm-up (allocation, oneDNN/MKL kernel selection)
            torch.matmul(*mats[k], out=outs[k])
        samples: dict[str, list[dict]] = {k: [] for k in dtypes}
        order = list(dtypes)
        for r in range(reps):
            for k in order[r % 2 :] + order[: r % 2]:
                (a, b), out = mats[k], outs[k]
                samples[k].append(measure(lambda a=a, b=b, out=out: torch.matmul(a, b, out=out), quiet, log))
        for k in dtypes:
            flops = 2.0 * n**3
            walls = [x["wall"] for x in samples[k]]
            rows.append(
                {
                    "dtype": k,
                    "n": n,
                    "reps": reps,
                    "best_s": min(walls),
                    "best_gflops": flops / min(walls) / 1e9,
                    "mean_gflops": flops / statistics.fmean(walls) / 1e9,
                    "foreign_cores_mean": statistics.fmean(x["foreign_cores"] for x in samples[k]),
                    "contended": sum(x["contended"] for x in samples[k]),
                }
            )
        del mats, outs
    peak = {k: max(r["best_gflops"] for r in rows if r["dtype"] == k) for k in dtypes}
    return {"rows": rows, "peak_gflops": peak}


# ------------------------------------------------------------------------------------------------
# 2. arms: one training step each


@dataclasses.dataclass
class Arm:
    name: str
    model: str
    impl: str
    precision: str
    step: object  # () -> None
    tokens_per_step: int
    flops_per_token: float
    n_params: int
    samples: list = dataclasses.field(default_factory=list)


def make_trainer(model_cfg, micro_batch: int, precision: str, depth: int, bptt_window, workdir: Path, tag: str):
    """A real `Trainer` on the built-in task generator (byte tokenizer), fixed depth, no
    checkpoints, evals, TensorBoard or progress bar."""
    from looplm.depth.config import DepthConfig
    from looplm.train.config import job_preset
    from looplm.train.trainer import Trainer

    job = job_preset("tiny")
    job.model = dataclasses.replace(model_cfg)
    job.depth = DepthConfig(sampler="fixed", depth=float(depth), bptt_window=bptt_window)
    job.data.source = "tasks"  # as measured (the tiny preset trained on the task generator then)
    job.data.seq_len = SEQ_LEN
    job.data.cache_dir = workdir / "cache"
    job.data.n_task_examples = N_TASK_EXAMPLES
    t = job.train
    t.micro_batch, t.grad_accum, t.precision, t.device = micro_batch, 1, precision, "cpu"
    t.out_dir = workdir / f"run_{tag}"
    t.tensorboard = t.wandb = t.progress = False
    t.eval_every, t.checkpoint_every, t.steps = 0, 10**9, 10**6
    return Trainer(job)


def trainer_arm(name, model_name, model_cfg, micro_batch, precision, workdir) -> Arm:
    from looplm.train.flops import flops_per_token

    tr = make_trainer(model_cfg, micro_batch, precision, DEPTH, None, workdir, name)
    return Arm(
        name,
        model_name,
        "looplm Trainer.train_step",
        precision,
        tr.train_step,
        micro_batch * SEQ_LEN,
        flops_per_token(tr.job.model, SEQ_LEN, DEPTH, None),
        tr.model.num_parameters(),
    )


def baseline_arm(name, model_cfg, micro_batch, precision) -> Arm:
    """Forward + CE + backward + grad clip + AdamW on the plain model, random tokens (no documents)."""
    from looplm.train.flops import flops_per_token

    c = model_cfg
    torch.manual_seed(0)
    # the plain baseline as this benchmark measures it: RMSNorm written out in the working dtype, GQA by
    # repeat_interleave, RoPE tables precomputed, additive injection, weights N(0, 0.02^2) (embedding N(0, 1/d))
    model = PlainLooped(
        c.vocab_size,
        c.d_model,
        c.n_heads,
        c.n_kv_heads,
        c.ffn_dim,
        c.n_prelude,
        c.n_core,
        c.n_coda,
        norm="written",
        repeat_kv=True,
        max_len=c.max_seq_len,
    ).init_weights(embed_std=c.d_model**-0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, c.vocab_size, (micro_batch, SEQ_LEN + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    bf16 = precision == "bf16"

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(x, torch.randn(micro_batch, SEQ_LEN, c.d_model) / math.sqrt(c.d_model), DEPTH)  # fp32 logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    flops_cfg = dataclasses.replace(c, injection="additive")
    return Arm(
        name,
        "d512",
        "plain PyTorch baseline",
        precision,
        step,
        micro_batch * SEQ_LEN,
        flops_per_token(flops_cfg, SEQ_LEN, DEPTH, None),
        sum(p.numel() for p in model.parameters()),
    )


def run_interleaved(arms: list[Arm], warmup: int, rounds: int, log, quiet: dict) -> None:
    for arm in arms:
        for _ in range(warmup):
            arm.step()
        log(f"  warmed up {arm.name}")
    n = len(arms)
    for r in range(rounds):
        for arm in arms[r % n :] + arms[: r % n]:
            gc.collect()
            arm.samples.append(measure(arm.step, quiet, log))
        log(
            f"  round {r + 1}/{rounds}: "
            + ", ".join(
                f"{a.name} {a.samples[-1]['wall']:.2f}s (others {a.samples[-1]['foreign_cores']:.1f} cores)"
                for a in arms
            )
        )


def arm_result(arm: Arm, peak: dict) -> dict:
    walls = [x["wall"] for x in arm.samples]
    mean, std = mean_std(walls)
    best = min(walls)
    tps, tps_best = arm.tokens_per_step / mean, arm.tokens_per_step / best
    gflops = arm.flops_per_token * tps / 1e9
    return {
        "name": arm.name,
        "model": arm.model,
        "impl": arm.impl,
        "precision": arm.precision,
        "params": arm.n_params,
        "tokens_per_step": arm.tokens_per_step,
        "flops_per_token": arm.flops_per_token,
        "step_s": walls,
        "cpu_s": [x["cpu"] for x in arm.samples],
        "foreign_cores": [x["foreign_cores"] for x in arm.samples],
        "steal_cores": [x["steal_cores"] for x in arm.samples],
        "step_mean_s": mean,
        "step_std_s": std,
        "step_best_s": best,
        "tokens_per_s": tps,
        "tokens_per_s_std": tps * std / mean,
        "tokens_per_s_best": tps_best,
        "model_gflops": gflops,
        "mfu": gflops / peak[arm.precision],
        "mfu_best": arm.flops_per_token * tps_best / 1e9 / peak[arm.precision],
        "cpu_util": statistics.fmean(x["cpu"] for x in arm.samples) / mean,
        "foreign_cores_mean": statistics.fmean(x["foreign_cores"] for x in arm.samples),
        "contended_steps": sum(x["contended"] for x in arm.samples),
        "rejected_contended_s": [t for x in arm.samples for t in x["rejected_s"]],
    }


# ------------------------------------------------------------------------------------------------
# 4. truncated backprop: one arm per fresh process


def saved_tensor_bytes(fn) -> int:
    """Bytes of distinct storages autograd saves for backward while `fn` runs (its forward)."""
    seen: dict[int, int] = {}

    def pack(t):
        try:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def tbptt_child(spec: dict) -> dict:
    torch.set_num_threads(THREADS)
    from looplm.config import ModelConfig
    from looplm.train.flops import flops_per_token

    cfg = ModelConfig.from_dict(spec["cfg"])
    tr = make_trainer(
        cfg,
        spec["micro_batch"],
        spec["precision"],
        spec["depth"],
        spec["bptt_window"],
        Path(spec["workdir"]),
        spec["tag"],
    )
    gc.collect()
    hwm_reset = reset_hwm()
    rss0, hwm0 = rss_bytes(), hwm_bytes()
    # The first warm-up step also counts autograd's saved tensors (the activation memory).
    saved = saved_tensor_bytes(tr.train_step)
    for _ in range(spec["warmup"] - 1):
        tr.train_step()
    quiet = {"left": spec["wait_quiet_s"]}
    samples = [measure(tr.train_step, quiet, lambda m: print(m, file=sys.stderr)) for _ in range(spec["steps"])]
    times = [x["wall"] for x in samples]
    hwm1 = hwm_bytes()
    n_params = tr.model.num_parameters()
    return {
        "bptt_window": spec["bptt_window"],
        "depth": spec["depth"],
        "step_s": times,
        "foreign_cores": [x["foreign_cores"] for x in samples],
        "contended": [x["contended"] for x in samples],
        "rejected_contended_s": [t for x in samples for t in x["rejected_s"]],
        "quiet_wait_used_s": spec["wait_quiet_s"] - quiet["left"],
        "quiet_waited_s": quiet.get("waited", 0.0),
        "rss_before_first_step": rss0,
        "hwm_reset": hwm_reset,
        "hwm_before_first_step": hwm0,
        "hwm_after": hwm1,
        "peak_rss_delta": max(0, hwm1 - rss0),
        "saved_for_backward_bytes": saved,
        "params": n_params,
        "grad_and_adam_state_bytes": 12 * n_params,
        "flops_per_token": flops_per_token(tr.job.model, SEQ_LEN, spec["depth"], spec["bptt_window"]),
    }


def run_child(spec: dict) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"TBPTT child failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------
# report


def fmt_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def report(res: dict) -> str:
    out = []
    m = res["machine"]
    isa = m.get("isa", {})
    out.append(
        f"Machine: {m.get('Model name', '?')}, {m.get('CPU(s)', '?')} CPUs "
        f"({m.get('Core(s) per socket', '?')} cores/socket x {m.get('Socket(s)', '?')}), torch {m['torch']} "
        f"({m['torch_cpu_capability']}), {res['config']['threads']} threads; avx512_bf16={isa.get('avx512_bf16')}, "
        f"amx_bf16={isa.get('amx_bf16')}. Load average before/after: {res['loadavg_start']} / {res['loadavg_end']}; "
        f"quiet-wait spent {res['quiet_wait_s']:.0f} s."
    )
    out.append("")
    out.append("Matmul peak (n x n @ n x n, 2n^3 flops, warm-up then best of N):")
    out.append(
        fmt_table(
            ["dtype", "n", "best GFLOP/s", "mean GFLOP/s", "others (cores)", "contended"],
            [
                [
                    r["dtype"],
                    str(r["n"]),
                    f"{r['best_gflops']:.1f}",
                    f"{r['mean_gflops']:.1f}",
                    f"{r['foreign_cores_mean']:.2f}",
                    f"{r['contended']}/{r['reps']}",
                ]
                for r in res["matmul"]["rows"]
            ],
        )
    )
    pk = res["matmul"]["peak_gflops"]
    out.append(
        f"\nPeak used for MFU: fp32 {pk['fp32']:.1f} GFLOP/s, bf16 {pk['bf16']:.1f} GFLOP/s "
        f"(bf16/fp32 = {pk['bf16'] / pk['fp32']:.2f})\n"
    )
    out.append(
        f"Training step throughput (R={DEPTH}, full BPTT, seq {SEQ_LEN}, grad clip + AdamW included). "
        "step s = mean +- std over the timed steps (best in brackets); MFU from the mean (best in brackets); "
        "CPU util = our CPU-seconds per wall second; others = cores used by other processes meanwhile; "
        f"contended = timed steps kept although others used > {MAX_FOREIGN_CORES} cores:"
    )
    rows = []
    for a in res["throughput"]:
        rows.append(
            [
                a["model"],
                a["impl"],
                a["precision"],
                str(a["tokens_per_step"] // SEQ_LEN),
                f"{a['step_mean_s']:.2f} +- {a['step_std_s']:.2f} ({a['step_best_s']:.2f})",
                f"{a['tokens_per_s']:.0f} +- {a['tokens_per_s_std']:.0f}",
                f"{a['flops_per_token'] / 1e6:.1f}",
                f"{a['model_gflops']:.1f}",
                f"{100 * a['mfu']:.1f}% ({100 * a['mfu_best']:.1f}%)",
                f"{a['cpu_util']:.2f}",
                f"{a['foreign_cores_mean']:.2f}",
                f"{a['contended_steps']}/{len(a['step_s'])}",
            ]
        )
    out.append(
        fmt_table(
            [
                "model",
                "implementation",
                "precision",
                "batch",
                "step s",
                "tokens/s",
                "MFLOP/token",
                "model GFLOP/s",
                "MFU",
                "CPU util",
                "others",
                "contended",
            ],
            rows,
        )
    )
    out.append("")
    out.append(
        fmt_table(
            ["ratio (tokens/s)", "from means", "from best steps"],
            [[k, f"{v['mean']:.3f}", f"{v['best']:.3f}"] for k, v in res["ratios"].items()],
        )
    )
    out.append("")
    tb = res.get("tbptt")
    if tb:
        out.append(
            f"Truncated backprop ({tb['model']}, R={tb['depth']}, batch {tb['micro_batch']}, {tb['precision']}, "
            f"Trainer.train_step; processes in order {tb['order']}):"
        )
        rows = []
        for a in tb["arms"]:
            mean, std = mean_std(a["step_s"])
            rows.append(
                [
                    str(a["bptt_window"] or "full"),
                    str(len(a["step_s"])),
                    f"{mean:.2f} +- {std:.2f}",
                    f"{a['flops_per_token'] / 1e6:.0f}",
                    f"{a['peak_rss_delta'] / 2**20:.0f}",
                    f"{a['saved_for_backward_bytes'] / 2**20:.0f}",
                    f"{statistics.fmean(a['foreign_cores']):.2f}",
                    f"{sum(a['contended'])}/{len(a['step_s'])}",
                ]
            )
        out.append(
            fmt_table(
                [
                    "window",
                    "timed steps",
                    "step s",
                    "MFLOP/token (flops.py)",
                    "peak RSS delta MiB",
                    "saved-for-backward MiB",
                    "others",
                    "contended",
                ],
                rows,
            )
        )
        out.append("")
        out.append(
            fmt_table([f"window {TBPTT_WINDOW} / full", "ratio"], [[k, f"{v:.3f}"] for k, v in tb["ratios"].items()])
        )
        out.append("\n" + tb["memory_method"])
    return "\n".join(out)


def merge_child_runs(runs: list[dict]) -> dict:
    """One arm's fresh-process runs: steps pooled, memory = the largest of the runs."""
    out = dict(runs[0])
    out["step_s"] = [t for r in runs for t in r["step_s"]]
    for key in ("foreign_cores", "contended", "rejected_contended_s"):
        out[key] = [f for r in runs for f in r[key]]
    for key in ("peak_rss_delta", "saved_for_backward_bytes", "hwm_after", "rss_before_first_step"):
        out[key] = max(r[key] for r in runs)
    out["runs"] = runs
    return out


# ------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="few repetitions, smaller matmuls, TBPTT on tiny: a smoke run")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/train_throughput.json"))
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="up to S seconds in all to wait for other processes to go idle before timed samples, and to rerun contended ones",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(tbptt_child(json.loads(args.child))))
        return

    torch.set_num_threads(THREADS)
    from looplm.config import ModelConfig, model_preset

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    q = args.quick
    plan = {
        "matmul_sizes": [1024, 2048] if q else [2048, 4096],
        "matmul_reps": 2 if q else 5,
        "tiny_warmup": 1 if q else 2,
        "tiny_rounds": 1 if q else 6,
        "d512_warmup": 1,
        "d512_rounds": 1 if q else 5,
        "tbptt_model": "tiny" if q else "d512",
        "tbptt_order": [None, TBPTT_WINDOW] if q else [None, TBPTT_WINDOW, TBPTT_WINDOW, None],
        "tbptt_warmup": 1,
        "tbptt_steps": 1 if q else 2,
    }
    tiny = model_preset("tiny")
    tiny.vocab_size = 258
    d512 = ModelConfig(
        vocab_size=258,
        d_model=512,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=1536,
        n_prelude=1,
        n_core=2,
        n_coda=1,
        max_seq_len=SEQ_LEN,
        injection="additive",
    )
    res: dict = {
        "command": command_line(),
        "quick": q,
        "config": {
            "threads": THREADS,
            "seq_len": SEQ_LEN,
            "depth": DEPTH,
            "plan": plan,
            "tiny": dataclasses.asdict(tiny),
            "d512": dataclasses.asdict(d512),
        },
        "machine": machine_info(),
        "loadavg_start": loadavg(),
    }
    quiet = {"left": args.wait_quiet}
    t_start = time.perf_counter()

    with tempfile.TemporaryDirectory(prefix="looplm-bench-") as tmp:
        workdir = Path(tmp)
        # Truncated backprop first, while this parent process is still small.
        log(f"[1/4] truncated backprop at R={TBPTT_DEPTH}, {plan['tbptt_model']}: a fresh process per run")
        cfg, mb = (tiny, 16) if plan["tbptt_model"] == "tiny" else (d512, 8)
        runs: dict = {None: [], TBPTT_WINDOW: []}
        for window in plan["tbptt_order"]:
            spec = {
                "cfg": dataclasses.asdict(cfg),
                "micro_batch": mb,
                "precision": "fp32",
                "depth": TBPTT_DEPTH,
                "bptt_window": window,
                "workdir": str(workdir),
                "tag": f"tbptt-{window}-{len(runs[window])}",
                "warmup": plan["tbptt_warmup"],
                "steps": plan["tbptt_steps"],
                "wait_quiet_s": max(0.0, quiet["left"]),
            }
            r = run_child(spec)
            quiet["left"] -= r["quiet_wait_used_s"]
            quiet["waited"] = quiet.get("waited", 0.0) + r["quiet_waited_s"]
            runs[window].append(r)
            log(
                f"  window {window or 'full'}: steps {['%.2f' % x for x in r['step_s']]}, peak RSS delta "
                f"{r['peak_rss_delta'] / 2**20:.0f} MiB, saved for backward {r['saved_for_backward_bytes'] / 2**20:.0f} MiB"
            )
        full, win = merge_child_runs(runs[None]), merge_child_runs(runs[TBPTT_WINDOW])
        res["tbptt"] = {
            "model": plan["tbptt_model"],
            "depth": TBPTT_DEPTH,
            "micro_batch": mb,
            "precision": "fp32",
            "order": ", ".join(str(w or "full") for w in plan["tbptt_order"]),
            "arms": [full, win],
            "ratios": {
                "step time (mean)": statistics.fmean(win["step_s"]) / statistics.fmean(full["step_s"]),
                "step time (best)": min(win["step_s"]) / min(full["step_s"]),
                "model FLOPs/token (flops.py)": win["flops_per_token"] / full["flops_per_token"],
                "peak RSS delta": win["peak_rss_delta"] / max(full["peak_rss_delta"], 1),
                "saved-for-backward bytes": win["saved_for_backward_bytes"] / max(full["saved_for_backward_bytes"], 1),
            },
            "memory_method": (
                "Memory method: each run is a fresh Python process (Trainer built, then "
                f"{plan['tbptt_warmup']} warm-up + {plan['tbptt_steps']} timed train_step calls). 'peak RSS delta' = "
                "the process's peak RSS (VmHWM in /proc/self/status, reset to the current RSS through "
                "/proc/self/clear_refs just before the first step; getrusage's ru_maxrss is not used because it "
                "inherits the parent's peak across fork+exec) minus VmRSS at that moment. It includes gradients and "
                "the AdamW state created by the first step (12 bytes/parameter, the same in both arms) and allocator "
                "slack. 'saved-for-backward' = bytes of distinct storages that autograd saved during the first step's "
                "forward (torch.autograd.graph.saved_tensors_hooks): the activation memory held at the start of "
                "backward. Each arm reports the largest value over its runs."
            ),
        }

        log("[2/4] matmul peak")
        res["matmul"] = matmul_peak(plan["matmul_sizes"], plan["matmul_reps"], quiet, log)
        peak = res["matmul"]["peak_gflops"]
        log(f"  peak GFLOP/s: {peak}")

        log("[3/4] tiny preset through Trainer.train_step")
        arms = [trainer_arm(f"tiny-{p}", "tiny", tiny, 16, p, workdir) for p in ("fp32", "bf16")]
        run_interleaved(arms, plan["tiny_warmup"], plan["tiny_rounds"], log, quiet)
        results = [arm_result(a, peak) for a in arms]
        del arms
        gc.collect()

        log("[4/4] d512: Trainer.train_step vs the plain baseline")
        arms = []
        for p in ("fp32", "bf16"):
            arms.append(trainer_arm(f"d512-looplm-{p}", "d512", d512, 8, p, workdir))
            arms.append(baseline_arm(f"d512-plain-{p}", d512, 8, p))
        run_interleaved(arms, plan["d512_warmup"], plan["d512_rounds"], log, quiet)
        results += [arm_result(a, peak) for a in arms]
        del arms
        gc.collect()

    res["throughput"] = results
    by = {a["name"]: a for a in results}

    def ratio(a, b):
        return {
            "mean": by[a]["tokens_per_s"] / by[b]["tokens_per_s"],
            "best": by[a]["tokens_per_s_best"] / by[b]["tokens_per_s_best"],
        }

    res["ratios"] = {
        "d512 looplm / plain, fp32": ratio("d512-looplm-fp32", "d512-plain-fp32"),
        "d512 looplm / plain, bf16": ratio("d512-looplm-bf16", "d512-plain-bf16"),
        "tiny looplm bf16 / fp32": ratio("tiny-bf16", "tiny-fp32"),
        "d512 looplm bf16 / fp32": ratio("d512-looplm-bf16", "d512-looplm-fp32"),
        "d512 plain bf16 / fp32": ratio("d512-plain-bf16", "d512-plain-fp32"),
    }
    res["loadavg_end"] = loadavg()
    res["quiet_wait_s"] = quiet.get("waited", 0.0)
    res["wall_s"] = time.perf_counter() - t_start
    text = report(res)
    res["report_markdown"] = text
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(text)
    print(f"\n(total {res['wall_s']:.0f} s; JSON: {args.out})")


if __name__ == "__main__":
    main()
