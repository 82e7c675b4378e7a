"""Configuration of `looplm rl` (design §10); standard library only, so the CLI reads it cheaply."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from looplm.config import check_depth, check_finite, shown_default
from looplm.data.tasks import TaskKind
from looplm.errors import UserError

GSM8K_TEMPLATE = "Question: {question}\nAnswer:"


@dataclass
class RLConfig:
    """GRPO post-training with rollout-state reuse (design §10)."""

    estimator: Literal["bptt", "recompute", "reuse"] = "reuse"
    """Update estimator: bptt (replay all R recurrences with grad), recompute (rebuild endpoints without grad, then
    the one-recurrence Neumann update) or reuse (the endpoints saved during the rollout, then the same update)."""
    neumann: int = 4
    """State products v <- g + J^T v in the recompute/reuse update (Neumann-(b-1); the paper's Neumann-4 is 4)."""
    depth: int = 6
    """Recurrences R for rollouts and updates (the paper's RL runs use 6)."""
    steps: int = 40
    """RL steps (one rollout batch and one optimizer step each)."""
    prompts_per_step: int = 16
    """Problems per step."""
    group_size: int = 8
    """Sampled completions per problem (G >= 2; advantages are normalised within each group)."""
    max_new_tokens: int = 8
    """Longest completion (tokens)."""
    temperature: float = 1.0
    """Sampling temperature; the policy scored in the update is softmax(logits / temperature)."""
    source: str = "tasks"
    """'tasks' (the generator's tasks, by default those the checkpoint was trained on) or a GSM8K-format JSONL."""
    task_kinds: tuple[TaskKind, ...] | None = None
    """Generator task kinds; None: the checkpoint's training tasks."""
    min_difficulty: int | None = None
    """Smallest task difficulty (default: the checkpoint's)."""
    max_difficulty: int | None = None
    """Largest task difficulty (default: the checkpoint's)."""
    prompt_template: Annotated[str, shown_default(repr(GSM8K_TEMPLATE))] = GSM8K_TEMPLATE
    """Prompt for GSM8K-format items ({question} is replaced)."""
    stop: tuple[str, ...] | None = None
    """Stop strings; None: a newline for tasks, a blank line and 'Question:' for GSM8K."""
    reward: str = "auto"
    """Reward function: auto (exact for tasks, final_number for GSM8K), exact, digits, final_number, or a registered name."""
    lr: float = 5e-5
    """AdamW learning rate (constant). Adam moves every weight by about lr per step, so the step's norm grows with
    the square root of the parameter count; on the tiny model 1e-3 collapsed the reward within two steps."""
    weight_decay: float = 0.0
    """AdamW weight decay on matrices."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.98
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    clip_eps: float = 0.2
    """PPO ratio clipping epsilon."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the starting model (0: no reference model is kept)."""
    eval_every: int = 10
    """Evaluate every this many steps and before the first (0 disables): mean reward of sampled completions and
    greedy pass@1 on fixed problems."""
    eval_examples: int = 128
    """Evaluation problems: fresh generator draws from the RL task distribution (a seed no RL step uses), or the
    first items of eval_jsonl."""
    eval_samples: int = 4
    """Sampled completions per evaluation problem (fixed sampling seed, so evaluations differ only by the model)."""
    eval_jsonl: Path | None = None
    """GSM8K-format JSONL to evaluate on when the source is a JSONL file."""
    checkpoint_every: int = 20
    """Write a checkpoint every this many steps (and at the end)."""
    keep_checkpoints: int = 2
    """How many recent checkpoints to keep."""
    seed: int = 0
    """Seed of prompt draws and sampling."""
    out_dir: Path = Path("runs/rl")
    """Run folder for checkpoints and metrics.jsonl (never the source checkpoint's run folder)."""
    resume: bool = False
    """Continue from the latest checkpoint in out_dir."""
    device: str = "auto"
    """Device: auto (CUDA when available), cpu, cuda, cuda:N; under torchrun each rank takes cuda:LOCAL_RANK."""
    progress: bool = True
    """Show a progress bar."""

    def validate(self, max_depth: int) -> None:
        check_depth("depth", self.depth, max_depth)
        if self.group_size < 2:
            raise UserError(
                f"group_size must be >= 2 (advantages are normalised within a group), got {self.group_size}"
            )
        for name in ("steps", "prompts_per_step", "max_new_tokens", "eval_samples", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        # NaN passes every comparison (a NaN kl_coef failed at step 1 as "lower --lr", a NaN grad_clip
        # turned clipping off), and an infinite temperature samples uniformly and learns nothing
        check_finite(self, ("temperature", "lr", "clip_eps", "kl_coef", "weight_decay", "grad_clip", "beta1", "beta2"))
        for name in ("kl_coef", "weight_decay", "grad_clip", "eval_every", "eval_examples"):  # 0: no evaluation
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.neumann < 0:
            raise UserError(f"neumann must be >= 0, got {self.neumann}")
        if self.temperature <= 0 or self.lr <= 0 or self.clip_eps <= 0:
            raise UserError("temperature, lr and clip_eps must be > 0")
