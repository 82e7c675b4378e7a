"""The RL loop (`looplm rl`): GRPO on verifiable problems with a choice of update estimator (SPEC 10).

One step: draw `prompts_per_step` problems; sample `group_size` completions of each with
terminal-KV decoding at depth R, saving endpoints; reward each completion; group-normalise the
advantages; score and backpropagate the clipped token-level loss with the estimator (`bptt`,
`recompute` or `reuse`); clip; AdamW. The saved endpoints are used before that optimizer step and
never after. Prompts, sampling seeds and example ids are functions of (seed, step), so a resumed
run continues exactly. Output: `<out_dir>/metrics.jsonl` (reward, pass@1, lengths, the time split
between rollout and update, greedy held-out accuracy) and checkpoints that `looplm eval` and
`looplm generate` read like training checkpoints.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from looplm import checkpoint as ckpt
from looplm.data import TaskConfig
from looplm.data import generate_examples
from looplm.eval.generation import greedy_generate, load_gsm8k_jsonl
from looplm.rl.config import RLConfig
from looplm.rl.estimators import score_and_backward
from looplm.rl.grpo import action_logprobs, clipped_policy_loss, group_advantages
from looplm.rl.rewards import Problem, ProblemSource, get_reward
from looplm.rl.rollout import rollout
from looplm.train.config import jsonable
from looplm.train.metrics import MetricsLogger
from looplm.train.trainer import flat_diff, param_groups

# Settings that may change when a run is resumed; everything else must match.
RESUMABLE = {"steps", "resume", "progress", "device", "eval_every", "checkpoint_every", "keep_checkpoints"}


def _inside(path: Path, folder: Path) -> bool:
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


class RLTrainer:
    def __init__(self, checkpoint: Path, cfg: RLConfig):
        self.cfg = cfg
        self.source_path = ckpt.resolve(Path(checkpoint))
        self.out_dir = Path(cfg.out_dir)
        self.ckpt_root = self.out_dir / "checkpoints"
        src = self.source_path
        source_run = src.parent.parent if src.parent.name == "checkpoints" else src
        if _inside(src, self.out_dir) or _inside(self.out_dir, source_run):
            raise ValueError(f"out_dir {self.out_dir} overlaps the source run {source_run}; choose another --out-dir "
                             "(RL never writes into the source run)")
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        self.model, self.tokenizer, self.job = ckpt.load_model(self.source_path, self.device)
        cfg.validate(self.model.cfg.max_depth)
        self.reference = None
        if cfg.kl_coef:
            self.reference = copy.deepcopy(self.model).requires_grad_(False)
        self.tasks = self._tasks()
        self.problems = ProblemSource(cfg.source, tasks=self.tasks, prompt_template=cfg.prompt_template, seed=cfg.seed)
        self.reward_fn = get_reward(cfg.reward, cfg.source)
        self.stop = cfg.stop or (("\n",) if cfg.source == "tasks" else ("\n\n", "Question:"))
        self.optimizer = torch.optim.AdamW(param_groups(self.model, cfg.weight_decay), lr=cfg.lr,
                                           betas=(cfg.beta1, cfg.beta2), eps=1e-8)
        self.step, self.elapsed = 0, 0.0
        resume_from = self._find_resume()
        self.logger = MetricsLogger(self.out_dir, enabled=True, tensorboard=False, wandb=False)
        if resume_from is not None:
            self._load(resume_from)
            self.logger.truncate_after(self.step)
        self._eval_set = None

    # -- setup ---------------------------------------------------------------------------------
    def _tasks(self) -> TaskConfig | None:
        if self.cfg.source != "tasks":
            return None
        trained = self.job["data"]["tasks"]
        tasks = TaskConfig(kinds=tuple(self.cfg.task_kinds or trained["kinds"]),
                           min_difficulty=self.cfg.min_difficulty or trained["min_difficulty"],
                           max_difficulty=self.cfg.max_difficulty or trained["max_difficulty"])
        tasks.validate()
        return tasks

    def config_dict(self) -> dict:
        return jsonable(dataclasses.asdict(self.cfg))

    def _find_resume(self) -> Path | None:
        latest = self.ckpt_root / "latest"
        if not latest.exists():
            return None
        if not self.cfg.resume:
            raise ValueError(f"{self.out_dir} already holds RL checkpoints; pass --resume to continue or choose "
                             "another --out-dir")
        path = self.ckpt_root / latest.read_text().strip()
        ckpt.verify(path)
        saved = ckpt.read_json(path, "config.json")["rl"]
        diffs = [d for d in flat_diff(saved["config"], self.config_dict()) if d.split(":")[0] not in RESUMABLE]
        if saved["source"] != str(self.source_path):
            diffs.append(f"source: {saved['source']} -> {self.source_path}")
        if diffs:
            raise ckpt.CheckpointError(f"cannot resume into a different RL config ({'; '.join(diffs[:4])})")
        return path

    # -- one RL step ----------------------------------------------------------------------------
    def train_step(self) -> dict:
        cfg, model = self.cfg, self.model
        G, n_rows = cfg.group_size, cfg.prompts_per_step * cfg.group_size
        t0 = time.perf_counter()
        problems = self.problems.draw(self.step, cfg.prompts_per_step)
        ro = rollout(model, self.tokenizer, [p.prompt for p in problems], group_size=G, depth=cfg.depth,
                     max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, stop=self.stop,
                     seed=cfg.seed * 1_000_003 + self.step, first_example_id=self.step * n_rows)
        rewards = torch.tensor([self.reward_fn(problems[i // G].reference, text) for i, text in enumerate(ro.texts)],
                               dtype=torch.float32, device=self.device)
        advantages = group_advantages(rewards, G)
        ref_logp = None
        if self.reference is not None:
            with torch.no_grad():
                ref_logits = self.reference(ro.tokens, cfg.depth, init="seeded", example_ids=ro.example_ids).logits
                ref_logp = action_logprobs(ref_logits, ro.targets, cfg.temperature)
        t1 = time.perf_counter()
        stats: dict = {}

        def objective(logits: torch.Tensor) -> torch.Tensor:
            logp = action_logprobs(logits, ro.targets, cfg.temperature)
            loss, s = clipped_policy_loss(logp, advantages, ro.mask, clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef,
                                          ref_logp=ref_logp)
            stats.update(s)  # how far the scored policy is from the sampling one (terminal KV, one recurrence)
            stats["logp_gap"] = float(((logp.detach() - ro.logprobs).abs() * ro.mask).sum() / ro.mask.sum())
            return loss

        out = score_and_backward(cfg.estimator, model, ro, objective, depth=cfg.depth, neumann_steps=cfg.neumann)
        t2 = time.perf_counter()
        clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        self.step += 1
        correct = (rewards >= 1).float().view(-1, G)
        lengths = torch.tensor(ro.completion_lengths, dtype=torch.float32)
        r = rewards.view(-1, G)
        record = {
            "reward": float(rewards.mean()), "pass@1": float(correct.mean()), f"pass@{G}": float(correct.amax(1).mean()),
            "completion_len": float(lengths.mean()), "completion_len_max": int(lengths.max()),
            "stopped_frac": sum(ro.stopped) / len(ro.stopped),
            "uniform_group_frac": float((r.amax(1) == r.amin(1)).float().mean()),
            "loss": out["loss"], "grad_norm": grad_norm, **stats,
            "rollout_s": t1 - t0, "update_s": t2 - t1, "optim_s": t3 - t2, "rollout_frac": (t1 - t0) / (t3 - t0),
        }
        if "residual" in out:
            record["endpoint_residual"] = out["residual"]
        return record

    # -- evaluation -----------------------------------------------------------------------------
    def _eval_problems(self) -> list[Problem]:
        cfg = self.cfg
        if self._eval_set is None:
            if cfg.source == "tasks":  # fresh draws from the RL distribution, with a seed no RL step uses
                examples = generate_examples(self.tasks, cfg.eval_examples, seed=2_000_003 * (cfg.seed + 1) - 1)
                self._eval_set = [self.problems.problem(ex) for ex in examples]
            elif cfg.eval_jsonl is not None:
                self._eval_set = [self.problems.problem(it) for it in load_gsm8k_jsonl(cfg.eval_jsonl)[:cfg.eval_examples]]
            else:
                self._eval_set = []
        return self._eval_set

    @torch.no_grad()
    def evaluate(self) -> dict:
        """On fixed evaluation problems at the RL depth: the mean reward of `eval_samples` sampled
        completions each (fixed sampling seed, the rollout temperature) and greedy pass@1."""
        cfg, problems = self.cfg, self._eval_problems()
        if not problems:
            return {}
        sampled, greedy = [], []
        for start in range(0, len(problems), 32):
            chunk = problems[start:start + 32]
            ro = rollout(self.model, self.tokenizer, [p.prompt for p in chunk], group_size=cfg.eval_samples,
                         depth=cfg.depth, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                         stop=self.stop, seed=start + 17, first_example_id=10**9 + start * cfg.eval_samples)
            sampled += [self.reward_fn(chunk[i // cfg.eval_samples].reference, t) for i, t in enumerate(ro.texts)]
            texts = greedy_generate(self.model, self.tokenizer, [p.prompt for p in chunk],
                                    range(10**9 + start, 10**9 + start + len(chunk)), depth=cfg.depth,
                                    max_new_tokens=cfg.max_new_tokens, stop=self.stop)
            greedy += [self.reward_fn(p.reference, t) >= 1 for p, t in zip(chunk, texts)]
        return {"eval_reward": sum(sampled) / len(sampled), "eval_greedy_pass@1": sum(greedy) / len(greedy)}

    # -- the loop -------------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg = self.cfg
        bar = None
        if cfg.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.steps, initial=self.step, desc=f"rl {cfg.estimator}", unit="step", dynamic_ncols=True)
        evals = {}
        last = None
        if cfg.eval_every and self.step == 0:
            evals[0] = self.evaluate()
            if evals[0]:
                self.logger.log(evals[0], 0)
        while self.step < cfg.steps:
            t0 = time.perf_counter()
            record = self.train_step()
            self.elapsed += time.perf_counter() - t0
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(f"non-finite loss at RL step {self.step}; lower --lr")
            record["elapsed_s"] = self.elapsed
            if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps):
                evals[self.step] = self.evaluate()
                record.update(evals[self.step])
            self.logger.log(record, self.step)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{record['reward']:.3f}", roll=f"{record['rollout_s']:.2f}s",
                                upd=f"{record['update_s']:.2f}s")
            if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                last = self.save()
        if bar is not None:
            bar.close()
        self.logger.close()
        return {"step": self.step, "checkpoint": str(last or self.latest_checkpoint()), "out_dir": str(self.out_dir),
                "evals": evals, "elapsed_s": self.elapsed}

    # -- checkpoints ----------------------------------------------------------------------------
    def latest_checkpoint(self) -> Path | None:
        latest = self.ckpt_root / "latest"
        return self.ckpt_root / latest.read_text().strip() if latest.exists() else None

    def save(self) -> Path:
        """An atomic checkpoint `looplm eval`/`generate` can read: the source job config plus an "rl" entry."""
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=True))
        tensors, optim_meta = ckpt.flatten_optimizer_state(optim_sd)
        config = dict(self.job, rl={"config": self.config_dict(), "source": str(self.source_path)})
        state = {"step": self.step, "elapsed_s": self.elapsed, "optimizer": optim_meta}

        def populate(tmp: Path) -> None:
            ckpt.save_tensors(tmp, "model.safetensors", self.model.state_dict())
            ckpt.save_tensors(tmp, "optimizer.safetensors", tensors)
            ckpt.write_json(tmp, "trainer_state.json", state)
            ckpt.write_json(tmp, "config.json", config)
            self.tokenizer.save(tmp)

        return ckpt.save_step(self.ckpt_root, self.step, populate, self.cfg.keep_checkpoints)

    def _load(self, path: Path) -> None:
        weights = ckpt.load_tensors(path, "model.safetensors")
        ckpt.check_model_shapes(self.model.state_dict(), weights, path)
        self.model.load_state_dict(weights)
        state = ckpt.read_json(path, "trainer_state.json")
        optim_sd = ckpt.unflatten_optimizer_state(ckpt.load_tensors(path, "optimizer.safetensors"), state["optimizer"])
        set_optimizer_state_dict(self.model, self.optimizer, optim_sd, options=StateDictOptions(full_state_dict=True))
        self.step, self.elapsed = state["step"], state["elapsed_s"]
