"""Distillation of the prefill student against a frozen teacher (design §9).

Per step: a microbatch of the teacher's own training data; targets computed online by the frozen
teacher at depth R (seeded initial state, so a row's target is a pure function of the row); loss
    MSE(z_hat, z^R) / E + beta * KL(p_T || p_S),
E = mean((z^R)^2) measured once on training rows in fp64 and checkpointed (paper §3.2: a fixed
teacher-state energy calibrated on training data); p_T and p_S are the frozen coda and head applied
to z^R (no grad) and z_hat (the gradient flows through the frozen coda into the student). AdamW
(0.9, 0.95), no weight decay, clip 1.0, linear warmup to the peak, then cosine to 0.1x over the
remaining steps (`lr_multiplier`). Data order is a pure function of (seed, step) and the student
has no randomness, so a resumed run reproduces an uninterrupted one.

Data parallel under torchrun (gloo on CPU, nccl on CUDA; `looplm.train.distributed` owns the group
and every collective): `micro_batch` stays the global rows per step, rank r takes its contiguous
slice of them, and each rank's loss is scaled so that the all-reduced (averaged) gradient equals
the single-process gradient of the global token mean. No DDP: the student is called directly, so
gradients are all-reduced explicitly before clipping. The energy calibration and validation shard
their rows over ranks and sum in one collective, so every rank holds the same numbers. Rank 0
alone writes checkpoints and metrics; every rank loads on resume.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from looplm import checkpoint as ckpt
from looplm.config import check_depth
from looplm.data import Batch, batch_indices
from looplm.distill.checkpoint import load_student, teacher_hash, write_student
from looplm.distill.config import RESUMABLE, DistillConfig
from looplm.distill.student import EndpointStudent
from looplm.errors import UserError
from looplm.model.blocks import causal_document_mask, rope_tables
from looplm.train import distributed as D
from looplm.train.metrics import MetricsLogger
from looplm.train.optim import param_groups
from looplm.train.startup import format_params, model_line


@dataclass
class Targets:
    """What the frozen teacher gives one microbatch: the student's input and its targets."""

    prelude: torch.Tensor  # e [B, L, d]
    endpoint: torch.Tensor  # z^R [B, L, d]
    logits: torch.Tensor  # p_T as fp32 logits [B, L, V]
    rope: tuple[torch.Tensor, torch.Tensor]
    mask: torch.Tensor | None
    ctx: object  # the teacher's per-forward Context (for one more recurrence)


@torch.no_grad()
def teacher_targets(teacher, batch: Batch, depth: int) -> Targets:
    """Prelude output, depth-R endpoint and logits of the frozen teacher, from the seeded state (design §2)."""
    rope = rope_tables(batch.positions, teacher.cfg.head_dim, teacher.cfg.rope_base)
    mask = causal_document_mask(batch.doc_ids)
    e = teacher.run_prelude(batch.inputs, rope, mask)
    ctx = teacher.context(e, rope, mask, batch.inputs)
    s = teacher.initial_state(e, "seeded", example_ids=batch.example_ids, positions=batch.positions)
    for _ in range(depth):
        s = teacher.recurrence(s, ctx)
    return Targets(e, s, teacher.run_coda(s, rope, mask, ctx), rope, mask, ctx)


def distill_loss(teacher, z_hat: torch.Tensor, t: Targets, energy: float, kl_weight: float):
    """(loss, normalized MSE, KL) averaged over every token of the microbatch (design §9)."""
    mse = (z_hat.float() - t.endpoint.float()).pow(2).mean() / energy
    log_p_s = teacher.run_coda(z_hat, t.rope, t.mask, t.ctx).log_softmax(-1).flatten(0, 1)
    log_p_t = t.logits.log_softmax(-1).flatten(0, 1)
    kl = F.kl_div(log_p_s, log_p_t, log_target=True, reduction="batchmean")  # sum_v p_T (ln p_T - ln p_S), token mean
    return mse + kl_weight * kl, mse, kl


def lr_multiplier(step: int, steps: int, warmup: int, floor: float = 0.1) -> float:
    """Learning-rate multiplier of the update that follows `step` optimizer steps (design §9): with
    u = step + 1 updates done once it is applied, u / warmup while u <= warmup (linear, the peak 1
    exactly at the last warm-up step), then floor + (1 - floor)(1 + cos(pi (u - warmup) / (steps -
    warmup))) / 2 (a cosine from the peak down to `floor`, reached at the run's last step)."""
    u = step + 1
    if u <= warmup:
        return u / warmup
    frac = min(1.0, (u - warmup) / (steps - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))


def calibration_rows(n_train: int, count: int) -> list[int]:
    """`count` training rows (at most `n_train`), evenly spaced over the split: row i * n_train // count.
    A pure function of the split's size, so every rank and a resumed run pick the same rows, and the
    rows sample the whole split rather than its first (possibly corpus-ordered) stretch."""
    count = min(count, n_train)
    return [i * n_train // count for i in range(count)]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token |a - b| / |b|, [B, L]."""
    return (a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1).clamp_min(1e-12)


class DistillTrainer:
    def __init__(self, teacher_path: Path, cfg: DistillConfig, env: D.DistEnv | None = None):
        from looplm.train.config import flat_diff

        cfg.validate()
        self.cfg = cfg
        self.env = env or D.init_distributed(cfg.device)  # a process group whenever torchrun launched us
        self.local_batch = D.rank_share(cfg.micro_batch, self.env, "micro_batch")
        self.device = self.env.device
        self.teacher_path = ckpt.resolve(Path(teacher_path))
        self.teacher, self.tokenizer, _ = ckpt.load_model(self.teacher_path, self.device)
        self.data = ckpt.load_data(self.teacher_path)
        self.teacher.requires_grad_(False)
        tcfg = self.teacher.cfg
        check_depth("depth", cfg.depth, tcfg.max_depth)
        self.teacher_sha = teacher_hash(self.teacher)
        self.seq_len = cfg.seq_len or self.data.seq_len
        if self.seq_len > tcfg.max_seq_len:
            raise UserError(f"seq_len {self.seq_len} exceeds the teacher's context max_seq_len={tcfg.max_seq_len}")
        self.out_dir = Path(cfg.out_dir)
        ckpt.refuse_overlap(self.teacher_path, self.out_dir)
        ckpt.refuse_file_out_dir(self.out_dir, "--out-dir")
        self.ckpt_root = self.out_dir / "checkpoints"
        resume_from = None
        if (self.ckpt_root / "latest").exists():
            if not cfg.resume:
                raise UserError(
                    f"{self.out_dir} already holds checkpoints; pass --resume to continue or choose another --out-dir"
                )
            resume_from = ckpt.resolve(self.out_dir)
            saved = ckpt.read_json(resume_from, "student.json")["config"]
            diffs = [d for d in flat_diff(saved, cfg.to_dict()) if d.split(":")[0] not in RESUMABLE]
            if diffs:
                raise ckpt.CheckpointError(f"cannot resume into a different config ({'; '.join(diffs[:4])})")
        self.train_data, self.val_data = self.data.checked_datasets(self.tokenizer, self.seq_len)
        # E on training rows, as the paper calibrates it (§3.2); validation on held-out rows
        self.calib_rows = calibration_rows(len(self.train_data), cfg.calibration_rows)
        self.val_rows = list(range(min(len(self.val_data), cfg.val_rows)))
        if not self.val_rows:  # every figure the run reports is a held-out one
            raise UserError("the teacher's data has no held-out rows to validate the student on")
        torch.manual_seed(cfg.seed)
        self.student = EndpointStudent.from_teacher(self.teacher, cfg.student_blocks, cfg.init).train()
        self.optimizer = torch.optim.AdamW(
            param_groups(self.student, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8
        )
        self.step, self.elapsed = 0, 0.0
        self.logger = MetricsLogger(
            self.out_dir, enabled=self.env.is_main, tensorboard=False, wandb=False, config=cfg.to_dict()
        )
        if resume_from is not None:
            self._load(resume_from)
            if self.env.is_main:
                print(f"resuming {self.out_dir} from step {self.step} (of {cfg.steps})", flush=True)
        else:
            self.energy = self.calibrate()
        self.logger.truncate_after(None if resume_from is None else self.step)  # fresh: an earlier attempt's log goes
        self.start_step, self.start_elapsed = self.step, self.elapsed

    # -- pieces -------------------------------------------------------------------------------
    def _batch(self, data, rows) -> Batch:
        return data.get_batch(rows).to(self.device)

    def _my_rows(self, rows: list[int]) -> list[int]:
        """This rank's share of `rows` (every world_size-th, from its rank)."""
        return rows[self.env.rank :: self.env.world_size]

    @torch.no_grad()
    def calibrate(self) -> float:
        """E = mean((z^R)^2) over the calibration rows of the training split, accumulated in fp64
        (design §9; on training data as in the paper, §3.2). The rows are shared out over ranks and the
        fp64 sums reduced, so every rank gets the same E."""
        total, count = torch.zeros((), dtype=torch.float64), 0
        rows = self._my_rows(self.calib_rows)
        for start in range(0, len(rows), self.local_batch):
            t = teacher_targets(
                self.teacher, self._batch(self.train_data, rows[start : start + self.local_batch]), self.cfg.depth
            )
            total += t.endpoint.double().pow(2).sum().cpu()
            count += t.endpoint.numel()
        total, count = D.all_reduce_sums([float(total), float(count)], self.env)
        energy = total / count
        if not energy > 0:
            raise FloatingPointError(f"teacher endpoint energy E = {energy}; cannot normalize the state loss")
        return energy

    def lr_at(self, step: int) -> float:
        # the cosine starts where the warm-up ends, so the peak is reached whatever the run's length (design §9)
        return self.cfg.lr * lr_multiplier(step, self.cfg.steps, self.cfg.warmup)

    def train_step(self) -> dict:
        cfg = self.cfg
        lr = self.lr_at(self.step)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        env, b = self.env, self.local_batch
        rows = batch_indices(len(self.train_data), self.step, 0, cfg.micro_batch, 1, cfg.seed)
        mine = rows[env.rank * b : (env.rank + 1) * b]  # this rank's slice of the global batch
        t = teacher_targets(self.teacher, self._batch(self.train_data, mine), cfg.depth)
        z_hat = self.student(t.prelude, t.rope, t.mask, values=t.ctx.core_values)
        loss, mse, kl = distill_loss(self.teacher, z_hat, t, self.energy, cfg.kl_weight)
        # Every term is a mean over this rank's tokens (the MSE over tokens x d). Weighting each rank's
        # mean by its share of the global tokens, times world_size because the gradients are averaged
        # over ranks, makes the reduced gradient that of the global token mean (scale 1 on one rank).
        n_local = t.endpoint.shape[0] * t.endpoint.shape[1]
        n_global = D.all_reduce_int(n_local, env)
        (loss * (n_local * env.world_size / n_global)).backward()
        D.all_reduce_gradients(self.student.parameters(), env)
        clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.student.parameters(), clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        # global token means (on one process exactly the local values: x * n / n is exact in fp64)
        sums = D.all_reduce_sums([v.item() * n_local for v in (loss, mse, kl)], env)
        loss_g, mse_g, kl_g = (v / n_global for v in sums)
        return {"loss": loss_g, "mse_norm": mse_g, "kl": kl_g, "grad_norm": float(grad_norm), "lr": lr}

    @torch.no_grad()
    def validate(self) -> dict:
        """Token means over the validation rows: loss terms, relative state error |z_hat - z^R| / |z^R|,
        and the same error after the one teacher recurrence that distilled prefill runs next. Every rank
        must call it: each scores its share of the rows and the sums are reduced, so all ranks agree."""
        self.student.eval()
        sums = dict.fromkeys(("loss", "mse_norm", "kl", "rel_err", "rel_err_next"), 0.0)
        n_tok = 0
        rows = self._my_rows(self.val_rows)
        for start in range(0, len(rows), self.local_batch):
            t = teacher_targets(
                self.teacher, self._batch(self.val_data, rows[start : start + self.local_batch]), self.cfg.depth
            )
            z_hat = self.student(t.prelude, t.rope, t.mask, values=t.ctx.core_values)
            k = t.endpoint.shape[0] * t.endpoint.shape[1]
            for name, v in zip(
                ("loss", "mse_norm", "kl"), distill_loss(self.teacher, z_hat, t, self.energy, self.cfg.kl_weight)
            ):
                sums[name] += v.item() * k
            sums["rel_err"] += relative_error(z_hat, t.endpoint).sum().item()
            nxt = relative_error(self.teacher.recurrence(z_hat, t.ctx), self.teacher.recurrence(t.endpoint, t.ctx))
            sums["rel_err_next"] += nxt.sum().item()
            n_tok += k
        self.student.train()
        *totals, n_tok = D.all_reduce_sums([*sums.values(), n_tok], self.env)
        return {f"val_{k}": v / max(n_tok, 1) for k, v in zip(sums, totals)}

    # -- the loop -----------------------------------------------------------------------------
    def summary_line(self) -> str:
        """'teacher: 0.87 M params, vocab 258 (byte), context 256, student 0.40 M params (in_proj + 2 blocks)
        at R 5, device cpu, fp32'."""
        tcfg = self.teacher.cfg
        n_teacher = sum(p.numel() for p in self.teacher.parameters())
        n_student = sum(p.numel() for p in self.student.parameters())
        student = f"student {format_params(n_student)} params (in_proj + {self.student.n_blocks} blocks) at R {self.cfg.depth}"
        return model_line(
            n_teacher,
            tcfg.vocab_size,
            self.tokenizer,
            tcfg.max_seq_len,
            self.device,
            "fp32",
            rows=self.seq_len,
            world_size=self.env.world_size,
            extra=student,
            label="teacher",
        )

    def fit(self) -> dict:
        cfg = self.cfg
        if self.env.is_main:
            print(self.summary_line(), flush=True)
        bar = None
        if cfg.progress and self.env.is_main:
            from tqdm.auto import tqdm

            bar = tqdm(
                total=cfg.steps, initial=self.step, desc="distill", unit="step", dynamic_ncols=True, disable=None
            )  # None: off when stderr is not a terminal (metrics.jsonl has every step)
        last, val = None, {}
        while self.step < cfg.steps:
            t0 = time.perf_counter()
            rec = self.train_step()
            self.elapsed += time.perf_counter() - t0
            if not math.isfinite(rec["loss"]):
                raise FloatingPointError(f"non-finite distillation loss at step {self.step}; lower --lr")
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{rec['loss']:.4f}", mse=f"{rec['mse_norm']:.4f}", kl=f"{rec['kl']:.4f}")
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                self.logger.log({**rec, "energy": self.energy, "elapsed_s": self.elapsed}, self.step)
            if (cfg.val_every and self.step % cfg.val_every == 0) or self.step == cfg.steps:
                val = self.validate()
                self.logger.log(val, self.step)
                if bar is not None:
                    bar.write(
                        f"step {self.step}: val rel. state error {val['val_rel_err']:.4f}, "
                        f"after one recurrence {val['val_rel_err_next']:.4f}, KL {val['val_kl']:.4f}"
                    )
            if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                last = self.save()
        if bar is not None:
            bar.close()
        self.logger.close()
        if not val:
            val = self.validate()
        return {
            "step": self.step,
            "start_step": self.start_step,
            "checkpoint": str(last or ckpt.resolve(self.out_dir)),
            "energy": self.energy,
            "elapsed_s": self.elapsed,
            "session_s": self.elapsed - self.start_elapsed,
            **val,
        }

    # -- checkpoints --------------------------------------------------------------------------
    def save(self) -> Path:
        """Atomically write a checkpoint of the current step; every rank must call it (rank 0 writes:
        the student and optimizer are identical on every rank), and all wait until it is written."""
        target = self.ckpt_root / f"step_{self.step:07d}"
        if self.env.is_main:
            tensors, optim_meta = ckpt.flatten_optimizer_state(self.optimizer.state_dict())
            meta = {
                "teacher_sha256": self.teacher_sha,
                "teacher_path": str(self.teacher_path),
                "depth": self.cfg.depth,
                "init": self.cfg.init,
                "config": self.cfg.to_dict(),
            }
            state = {"step": self.step, "energy": self.energy, "elapsed_s": self.elapsed, "optimizer": optim_meta}

            def populate(tmp: Path) -> None:
                write_student(tmp, self.student, meta)
                ckpt.save_tensors(tmp, "optimizer.safetensors", tensors)
                ckpt.write_json(tmp, "distill_state.json", state)

            target = ckpt.save_step(self.ckpt_root, self.step, populate, self.cfg.keep_checkpoints)
        D.barrier(self.env)
        return target

    def _load(self, path: Path) -> None:
        student, _ = load_student(path, self.teacher)  # refuses a checkpoint of another teacher
        self.student.load_state_dict(student.state_dict())
        state = ckpt.read_json(path, "distill_state.json")
        optim = ckpt.unflatten_optimizer_state(ckpt.load_tensors(path, "optimizer.safetensors"), state["optimizer"])
        optim["state"] = {int(k): v for k, v in optim["state"].items()}
        self.optimizer.load_state_dict(optim)
        self.step, self.energy, self.elapsed = state["step"], state["energy"], state["elapsed_s"]
