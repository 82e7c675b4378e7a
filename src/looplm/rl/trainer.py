"""The RL loop (`looplm rl`): GRPO on verifiable problems with a choice of update estimator (design §10).

One step: draw `prompts_per_step` problems; sample `group_size` completions of each with
terminal-KV decoding at depth R, saving endpoints; reward each completion; group-normalise the
advantages; score and backpropagate the clipped token-level loss with the estimator (`bptt`,
`recompute` or `reuse`), the optional KL penalty's reference log-probabilities scored along the
same path as the policy's (`reference_logits`); clip; AdamW. The saved endpoints are used before
that optimizer step and never after. Prompts, sampling seeds and example ids are functions of
(seed, step), so a resumed run continues exactly. Output: `<out_dir>/metrics.jsonl` (reward,
pass@1, lengths, the time split between rollout and update, greedy held-out accuracy) and
checkpoints that `looplm eval` and `looplm generate` read like training checkpoints.

Data parallel under torchrun (gloo on CPU, nccl on CUDA; `looplm.train.distributed` owns the group
and every collective): `prompts_per_step` stays the global prompt count, rank r rolls out and
scores its contiguous share of the prompts (whole GRPO groups, so the group-normalised advantages
are unchanged), and every prompt samples from its own generator seeded by (seed, step, prompt
index), so N ranks draw exactly the rollouts of one process. No DDP (the estimators call model
pieces directly): each rank's loss is scaled by its share of the global action tokens and the
gradients are all-reduced before clipping, which gives the single-process gradient of the global
token-mean loss. Metrics are reduced over ranks; rank 0 alone writes checkpoints and metrics.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from looplm import checkpoint as ckpt
from looplm.data import TaskConfig
from looplm.data import generate_examples
from looplm.errors import UserError
from looplm.eval.generation import greedy_generate, load_gsm8k_jsonl
from looplm.infer.decode import token_vocab
from looplm.rl.config import RLConfig
from looplm.rl.estimators import reference_logits, score_and_backward
from looplm.rl.grpo import action_logprobs, clipped_policy_loss, group_advantages
from looplm.rl.rewards import Problem, ProblemSource, get_reward
from looplm.rl.rollout import rollout
from looplm.train import distributed as D
from looplm.train.config import jsonable
from looplm.train.metrics import MetricsLogger
from looplm.train.startup import model_line
from looplm.train.config import flat_diff
from looplm.train.optim import param_groups

# Settings that may change when a run is resumed; everything else must match.
RESUMABLE = {"steps", "resume", "progress", "device", "eval_every", "checkpoint_every", "keep_checkpoints"}


def sampling_seed(seed: int, step: int, prompt: int) -> int:
    """Seed of the generator that samples the completions of prompt `prompt` (its index among the
    step's `prompts_per_step`, over all ranks) at RL step `step`: independent of the rank layout."""
    return ((seed * 1_000_003 + step) * 1_000_033 + prompt) % 2**63


class RLTrainer:
    def __init__(self, checkpoint: Path, cfg: RLConfig, env: D.DistEnv | None = None):
        self.cfg = cfg
        self.source_path = ckpt.resolve(Path(checkpoint))
        self.out_dir = Path(cfg.out_dir)
        self.ckpt_root = self.out_dir / "checkpoints"
        ckpt.refuse_overlap(self.source_path, self.out_dir)
        ckpt.refuse_file_out_dir(self.out_dir, "--out-dir")
        self.env = env or D.init_distributed(cfg.device)  # a process group whenever torchrun launched us
        self.local_prompts = D.rank_share(cfg.prompts_per_step, self.env, "prompts_per_step")
        self.device = self.env.device
        self.model, self.tokenizer, self.job = ckpt.load_model(self.source_path, self.device)
        self.vocab = token_vocab(self.model, self.tokenizer)  # the ids a rollout samples among
        self.data = ckpt.load_data(self.source_path)
        cfg.validate(self.model.cfg.max_depth)
        self.reference = None
        if cfg.kl_coef:
            self.reference = copy.deepcopy(self.model).requires_grad_(False)
        self.tasks = self._tasks()
        self.problems = ProblemSource(cfg.source, tasks=self.tasks, prompt_template=cfg.prompt_template, seed=cfg.seed)
        self.reward_fn = get_reward(cfg.reward, cfg.source)
        self.stop = cfg.stop if cfg.stop is not None else ("\n",) if cfg.source == "tasks" else ("\n\n", "Question:")
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, cfg.weight_decay),
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=1e-8,
            fused=False,  # a fused step writes without bumping version counters: the stale-state check needs them
        )
        self.step, self.elapsed = 0, 0.0
        resume_from = self._find_resume()
        self.logger = MetricsLogger(self.out_dir, enabled=self.env.is_main, tensorboard=False, wandb=False)
        if resume_from is not None:
            self._load(resume_from)
            if self.env.is_main:
                print(f"resuming {self.out_dir} from step {self.step} (of {cfg.steps})", flush=True)
        self.logger.truncate_after(None if resume_from is None else self.step)  # fresh: an earlier attempt's log goes
        self.start_step, self.start_elapsed = self.step, self.elapsed
        self._eval_set = None

    # -- setup ---------------------------------------------------------------------------------
    def _tasks(self) -> TaskConfig | None:
        if self.cfg.source != "tasks":
            return None
        trained = self.data.tasks
        tasks = TaskConfig(
            kinds=tuple(self.cfg.task_kinds or trained.kinds),
            min_difficulty=trained.min_difficulty if self.cfg.min_difficulty is None else self.cfg.min_difficulty,
            max_difficulty=trained.max_difficulty if self.cfg.max_difficulty is None else self.cfg.max_difficulty,
        )
        tasks.validate()
        if not self.data.is_tasks and self.env.is_main:  # legitimate, but easy to do by accident
            print(
                f"note: the checkpoint was trained on {self.data.source!r}, not the task generator; RL trains it "
                f"on generator tasks {', '.join(tasks.kinds)} (--task-kinds; or --source a GSM8K-format JSONL)",
                file=sys.stderr,
            )
        return tasks

    def config_dict(self) -> dict:
        return jsonable(dataclasses.asdict(self.cfg))

    def _find_resume(self) -> Path | None:
        latest = self.ckpt_root / "latest"
        if not latest.exists():
            return None
        if not self.cfg.resume:
            raise UserError(
                f"{self.out_dir} already holds RL checkpoints; pass --resume to continue or choose another --out-dir"
            )
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
        """One RL step; every rank must call it (it reduces over ranks)."""
        cfg, model, env = self.cfg, self.model, self.env
        G, n_rows = cfg.group_size, cfg.prompts_per_step * cfg.group_size
        t0 = time.perf_counter()
        first = env.rank * self.local_prompts  # this rank's prompts: first .. first + local_prompts - 1
        problems = self.problems.draw(self.step, cfg.prompts_per_step)[first : first + self.local_prompts]
        ro = rollout(
            model,
            self.tokenizer,
            [p.prompt for p in problems],
            group_size=G,
            depth=cfg.depth,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            stop=self.stop,
            seed=[sampling_seed(cfg.seed, self.step, first + i) for i in range(len(problems))],
            first_example_id=self.step * n_rows + first * G,
        )
        rewards = torch.tensor(
            [self.reward_fn(problems[i // G].reference, text) for i, text in enumerate(ro.texts)],
            dtype=torch.float32,
            device=self.device,
        )
        advantages = group_advantages(rewards, G)
        ref_logp = None
        if self.reference is not None:  # scored along the estimator's path: KL = 0 while policy == reference
            ref_logits = reference_logits(cfg.estimator, self.reference, model, ro, depth=cfg.depth)
            ref_logp = action_logprobs(ref_logits, ro.targets, cfg.temperature, self.vocab)
        t1 = time.perf_counter()
        stats: dict = {}
        # The loss is a mean over this rank's action tokens. Scaled by this rank's share of the global
        # action tokens, times world_size because the gradients are averaged over ranks, the reduced
        # gradient is that of the token mean over every rank's rollouts (the scale is 1 on one rank;
        # every estimator is linear in the loss, the Neumann update included).
        n_local = int(ro.mask.sum())
        n_global = D.all_reduce_int(n_local, env)
        scale = n_local * env.world_size / n_global

        def objective(logits: torch.Tensor) -> torch.Tensor:
            logp = action_logprobs(logits, ro.targets, cfg.temperature, self.vocab)
            loss, s = clipped_policy_loss(
                logp, advantages, ro.mask, clip_eps=cfg.clip_eps, kl_coef=cfg.kl_coef, ref_logp=ref_logp
            )
            stats.update(s)  # how far the scored policy is from the sampling one (terminal KV, one recurrence)
            stats["logp_gap"] = float(((logp.detach() - ro.logprobs).abs() * ro.mask).sum() / ro.mask.sum())
            stats["loss"] = float(loss.detach())
            return loss * scale

        out = score_and_backward(cfg.estimator, model, ro, objective, depth=cfg.depth, neumann_steps=cfg.neumann)
        D.all_reduce_gradients(model.parameters(), env)
        t2 = time.perf_counter()
        clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        self.step += 1
        correct = (rewards >= 1).float().view(-1, G)
        r = rewards.view(-1, G)
        lengths = ro.completion_lengths
        n_real = sum(ro.prompt_lengths) + sum(lengths) - len(lengths)  # non-pad tokens scored
        # Sums over this rank's rows, groups and action tokens, and each rank's longest completion (an
        # all-gather by a sum), reduced over ranks in one collective: the means are one process's.
        local = {
            "reward": (float(rewards.sum()), n_rows),
            "pass@1": (float(correct.sum()), n_rows),
            f"pass@{G}": (float(correct.amax(1).sum()), cfg.prompts_per_step),
            "completion_len": (float(sum(lengths)), n_rows),
            "stopped_frac": (float(sum(ro.stopped)), n_rows),
            "uniform_group_frac": (float((r.amax(1) == r.amin(1)).float().sum()), cfg.prompts_per_step),
            **{k: (v * n_local, n_global) for k, v in stats.items()},  # token means: loss, clip_frac, kl, logp_gap
        }
        if "residual" in out:  # a mean over the scored tokens (exact for reuse; recompute also counts padding)
            local["endpoint_residual"] = (out["residual"] * n_real, None)  # count: n_real over ranks, below
        longest = [0.0] * env.world_size
        longest[env.rank] = float(max(lengths))
        *reduced, n_real_global = D.all_reduce_sums([total for total, _ in local.values()] + longest + [n_real], env)
        mean = {k: total / (count or n_real_global) for (k, (_, count)), total in zip(local.items(), reduced)}
        record = {
            "reward": mean["reward"],
            "pass@1": mean["pass@1"],
            f"pass@{G}": mean[f"pass@{G}"],
            "completion_len": mean["completion_len"],
            "completion_len_max": int(max(reduced[len(local) :])),
            "stopped_frac": mean["stopped_frac"],
            "uniform_group_frac": mean["uniform_group_frac"],
            "loss": mean["loss"],
            "grad_norm": grad_norm,
            **{k: mean[k] for k in stats if k != "loss"},
            # this rank's timings
            "rollout_s": t1 - t0,
            "update_s": t2 - t1,
            "optim_s": t3 - t2,
            "rollout_frac": (t1 - t0) / (t3 - t0),
        }
        if "residual" in out:
            record["endpoint_residual"] = mean["endpoint_residual"]
        return record

    # -- evaluation -----------------------------------------------------------------------------
    def _eval_problems(self) -> list[Problem]:
        cfg = self.cfg
        if self._eval_set is None:
            if cfg.source == "tasks":  # fresh draws from the RL distribution, with a seed no RL step uses
                examples = generate_examples(self.tasks, cfg.eval_examples, seed=2_000_003 * (cfg.seed + 1) - 1)
                self._eval_set = [self.problems.problem(ex) for ex in examples]
            elif cfg.eval_jsonl is not None:
                self._eval_set = [
                    self.problems.problem(it) for it in load_gsm8k_jsonl(cfg.eval_jsonl)[: cfg.eval_examples]
                ]
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
        # Every rank must call this. Ranks share the work by whole chunks of 32 problems, chunk k on rank
        # k mod world_size: each chunk's sampling seed and example ids are functions of its position
        # alone, so a chunk scores the same wherever it runs and the reduced means equal one process's
        # exactly, while the ranks split the cost (rank 0 alone would leave the others idle at a barrier).
        sampled, greedy = [], []
        for k, start in enumerate(range(0, len(problems), 32)):
            if k % self.env.world_size != self.env.rank:
                continue
            chunk = problems[start : start + 32]
            ro = rollout(
                self.model,
                self.tokenizer,
                [p.prompt for p in chunk],
                group_size=cfg.eval_samples,
                depth=cfg.depth,
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                stop=self.stop,
                seed=start + 17,
                first_example_id=10**9 + start * cfg.eval_samples,
            )
            sampled += [self.reward_fn(chunk[i // cfg.eval_samples].reference, t) for i, t in enumerate(ro.texts)]
            texts = greedy_generate(
                self.model,
                self.tokenizer,
                [p.prompt for p in chunk],
                range(10**9 + start, 10**9 + start + len(chunk)),
                depth=cfg.depth,
                max_new_tokens=cfg.max_new_tokens,
                stop=self.stop,
            )
            greedy += [self.reward_fn(p.reference, t) >= 1 for p, t in zip(chunk, texts)]
        total_reward, n_sampled, n_solved, n_greedy = D.all_reduce_sums(
            [float(sum(sampled)), float(len(sampled)), float(sum(greedy)), float(len(greedy))], self.env
        )
        return {"eval_reward": total_reward / n_sampled, "eval_greedy_pass@1": n_solved / n_greedy}

    # -- the loop -------------------------------------------------------------------------------
    def summary_line(self) -> str:
        """'model: 0.87 M params, vocab 258 (byte), context 256, estimator reuse at depth 6, device cpu, fp32'."""
        m = self.model.cfg
        return model_line(
            sum(p.numel() for p in self.model.parameters()),
            m.vocab_size,
            self.tokenizer,
            m.max_seq_len,
            self.device,
            "fp32",
            world_size=self.env.world_size,
            extra=f"estimator {self.cfg.estimator} at depth {self.cfg.depth}",
        )

    def fit(self) -> dict:
        cfg = self.cfg
        if self.env.is_main:
            print(self.summary_line(), flush=True)
        bar = None
        if cfg.progress and self.env.is_main:
            from tqdm.auto import tqdm

            bar = tqdm(
                total=cfg.steps,
                initial=self.step,
                desc=f"rl {cfg.estimator}",
                unit="step",
                dynamic_ncols=True,
                disable=None,
            )  # None: off when stderr is not a terminal (metrics.jsonl has every step)
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
                bar.set_postfix(
                    reward=f"{record['reward']:.3f}",
                    roll=f"{record['rollout_s']:.2f}s",
                    upd=f"{record['update_s']:.2f}s",
                )
            if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                last = self.save()
        if bar is not None:
            bar.close()
        self.logger.close()
        return {
            "step": self.step,
            "start_step": self.start_step,
            "checkpoint": str(last or self.latest_checkpoint()),
            "out_dir": str(self.out_dir),
            "evals": evals,
            "elapsed_s": self.elapsed,
            "session_s": self.elapsed - self.start_elapsed,
        }

    # -- checkpoints ----------------------------------------------------------------------------
    def latest_checkpoint(self) -> Path | None:
        latest = self.ckpt_root / "latest"
        return self.ckpt_root / latest.read_text().strip() if latest.exists() else None

    def save(self) -> Path:
        """An atomic checkpoint `looplm eval`/`generate` can read: the source job config plus an "rl" entry.
        Every rank must call it: rank 0 writes (the model and optimizer are identical on every rank), and
        all wait until it is written."""
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=True))
        target = self.ckpt_root / f"step_{self.step:07d}"
        if self.env.is_main:
            tensors, optim_meta = ckpt.flatten_optimizer_state(optim_sd)
            config = dict(self.job, rl={"config": self.config_dict(), "source": str(self.source_path)})
            state = {"step": self.step, "elapsed_s": self.elapsed, "optimizer": optim_meta}

            def populate(tmp: Path) -> None:
                ckpt.save_tensors(tmp, "model.safetensors", self.model.state_dict())
                ckpt.save_tensors(tmp, "optimizer.safetensors", tensors)
                ckpt.write_json(tmp, "trainer_state.json", state)
                ckpt.write_json(tmp, "config.json", config)
                ckpt.write_data_record(tmp, self.data)
                self.tokenizer.save(tmp)

            target = ckpt.save_step(self.ckpt_root, self.step, populate, self.cfg.keep_checkpoints)
        D.barrier(self.env)
        return target

    def _load(self, path: Path) -> None:
        weights = ckpt.load_tensors(path, "model.safetensors")
        ckpt.check_model_shapes(self.model.state_dict(), weights, path)
        self.model.load_state_dict(weights)
        state = ckpt.read_json(path, "trainer_state.json")
        optim_sd = ckpt.unflatten_optimizer_state(ckpt.load_tensors(path, "optimizer.safetensors"), state["optimizer"])
        set_optimizer_state_dict(self.model, self.optimizer, optim_sd, options=StateDictOptions(full_state_dict=True))
        self.step, self.elapsed = state["step"], state["elapsed_s"]
