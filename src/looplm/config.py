"""Model configuration and named size presets.

Light on imports (only the standard library) so that the CLI, checkpoints and tests can read a
config without building a model. design §1 gives the paper's sizes; `tiny` is the CPU preset.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Literal

from looplm.errors import UserError


def check_finite(cfg, names: tuple[str, ...]) -> None:
    """A UserError naming the first of `cfg`'s float settings `names` that is NaN or infinite (NaN passes
    every range check written as a comparison, `lr <= 0` included)."""
    for name in names:
        if not math.isfinite(getattr(cfg, name)):
            raise UserError(f"{name} must be a finite number, got {getattr(cfg, name)}")


def check_depth(name: str, value, max_depth: int, what: str | None = None) -> int:
    """The one depth-range check of the library: every option, request field and config key that names a
    depth (`looplm.infer.DepthRule`, the model's forward, the CLI, the HTTP API, Transformers, vLLM, eval,
    RL, distillation, analysis, training) is checked by it, with one message.

    `value` if it is a depth in 1..max_depth, else a UserError naming the setting `name` (as the user
    wrote it: `depth`, `--max-depth`, `num_steps`) and, with `what`, what sets the bound."""
    by = f" ({what})" if what else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UserError(f"{name} must be an integer in 1..{max_depth}{by}, got {value!r}")
    if not 1 <= value <= max_depth:
        raise UserError(f"{name} must be in 1..{max_depth}{by}, got {value}")
    return int(value)


def shown_default(text: str, *, if_empty: bool = False):
    """`Annotated` metadata for a config field whose default tyro's --help would print empty (an empty
    tuple) or across lines (a newline): tyro's own `help_behavior_hint`, `(default: text)`; with
    `if_empty`, only where the default is empty (a preset that sets the field shows its own value).
    None where tyro is not installed (library use, the GPU benchmark's machine), where no help is printed."""
    try:
        import tyro
    except ImportError:
        return None
    if if_empty:
        return tyro.conf.arg(help_behavior_hint=lambda shown: f"(default: {shown or text})")
    return tyro.conf.arg(help_behavior_hint=f"(default: {text})")


InjectionName = Literal["parcae-decay", "parcae-nonorm", "ortho", "huginn-linear", "deq-qkv", "additive", "none"]
INJECTIONS: tuple[str, ...] = ("parcae-decay", "parcae-nonorm", "ortho", "huginn-linear", "deq-qkv", "additive")
"""The injection schemes a looplm model trains with (design §2)."""
ALL_INJECTIONS: tuple[str, ...] = (*INJECTIONS, "none")
"""Also "none" (design §14): no injection, the input enters through the initial state (Ouro)."""
# Architecture switches (design §14): each default is looplm's own architecture.
BlockNorm = Literal["pre", "sandwich", "branch"]
BLOCK_NORMS: tuple[str, ...] = ("pre", "sandwich", "branch")
ExitNorm = Literal["auto", "none", "rms", "rms-gain"]
EXIT_NORMS: tuple[str, ...] = ("auto", "none", "rms", "rms-gain")
StateKind = Literal["normal", "trunc-normal", "input"]
STATE_KINDS: tuple[str, ...] = ("normal", "trunc-normal", "input")
FfnAct = Literal["swiglu", "relu2"]
FFN_ACTS: tuple[str, ...] = ("swiglu", "relu2")
ValueEmbeds = Literal["none", "odd"]
VALUE_EMBEDS: tuple[str, ...] = ("none", "odd")
VALUE_GATE_CHANNELS = 32
"""The value-embedding gate reads the first 32 channels of the block's normed input (Parcae)."""


@dataclass
class ModelConfig:
    """Shape of a looped LM: prelude -> (injection -> core) x R -> coda (design §1-2)."""

    vocab_size: int = 258
    """Vocabulary size: embedding and head rows. In a training job 0 means the tokenizer's size (the
    presets' value); a larger value pads past the tokenizer (rows no token id reaches), a smaller one is refused."""
    d_model: int = 128
    """Width d of the residual stream and of the recurrent state."""
    n_heads: int = 4
    """Query heads per attention layer."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide n_heads."""
    ffn_dim: int = 384
    """Hidden width of the SwiGLU feed-forward."""
    n_prelude: int = 1
    """Non-shared blocks before the recurrence."""
    n_core: int = 2
    """Blocks of the shared recurrent core, iterated R times."""
    n_coda: int = 1
    """Non-shared blocks after the recurrence."""
    max_seq_len: int = 256
    """Longest sequence (context) the model accepts."""
    injection: InjectionName = "parcae-nonorm"
    """Input-injection scheme (design §2): parcae-decay, parcae-nonorm, ortho, huginn-linear, deq-qkv, additive;
    or none (design §14, with state_init="input")."""
    rope_base: float = 1e6
    """RoPE base frequency (design §1)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    ortho_eps: float = 1e-6
    """Stabilizer of the OrthoInj projection alpha = <r,u>/(|u|^2 + eps) (design §2)."""
    max_depth: int = 64
    """Largest recurrence count R the model accepts (the depth prior's cap)."""
    block_norm: BlockNorm = "pre"
    """Norm placement in every block (design §14): pre (x + f(n(x))), sandwich (n'(x + f(n(x))),
    Huginn) or branch (x + n'(f(n(x))), Ouro)."""
    qk_bias: bool = False
    """A learned bias added to the queries and keys before RoPE (Huginn)."""
    embed_scale: float = 1.0
    """The token embedding is multiplied by this (Huginn: sqrt(d))."""
    tie_embeddings: bool = False
    """The head reuses the token embedding matrix (Huginn); it has no weight of its own."""
    exit_norm: ExitNorm = "auto"
    """Norm of the state after every recurrence: auto (the injection's own: rms for huginn-linear,
    none otherwise), none, rms (gain-free) or rms-gain (learned gain, Ouro)."""
    post_loop_norm: bool = False
    """Apply the head's final norm to the endpoint once before the coda too (Huginn's ln_f)."""
    head_norm: bool = True
    """The head normalises its input (False: it reads the already normalised state, Ouro)."""
    state_init: StateKind = "normal"
    """Initial state kind: normal (the `init` argument: gaussian/seeded/zero), trunc-normal (the
    same noise truncated at +-3 std, Huginn) or input (s0 = the prelude output, Ouro)."""
    state_std: float = 0.0
    """Standard deviation of the noise initial state; 0 = 1/sqrt(d_model)."""
    exit_gate: bool = False
    """An exit gate Linear(d, 1) on each recurrence's state (Ouro's learned exit, design §14)."""
    ffn_act: FfnAct = "swiglu"
    """Feed-forward of every block: swiglu (w2(silu(w1 n) * w3 n)) or relu2 (w2(relu(w1 n)^2), Parcae)."""
    qk_norm: bool = False
    """Gain-free RMSNorm of every query and key head after RoPE (eps = fp32 machine eps, Parcae)."""
    value_embeds: ValueEmbeds = "none"
    """Value embeddings (Parcae): "odd" gives the odd-indexed blocks (1, 3, ...) of each of prelude, core and
    coda a token table E_v [V, n_kv_heads*head_dim] and a gate Linear(32, n_kv_heads); the block's values
    become v + 2 sigmoid(gate(n[..., :32])) * E_v[token] (core tables shared by every recurrence)."""
    coda_proj: bool = False
    """A bias-free d x d map C applied to the endpoint before the coda (after `post_loop_norm`; Parcae's C)."""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def has_value_embed(self, index: int) -> bool:
        """Whether block `index` of its stack (prelude, core or coda) has a value embedding."""
        return self.value_embeds == "odd" and index % 2 == 1

    def validate(self) -> None:
        """Raise ValueError with a one-line reason when the shape is inconsistent."""
        if self.injection not in ALL_INJECTIONS:
            raise UserError(f"unknown injection {self.injection!r}; choose one of {', '.join(ALL_INJECTIONS)}")
        for name in ("n_heads", "n_kv_heads"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name, ok, rule in (
            ("norm_eps", self.norm_eps > 0, "> 0"),
            ("rope_base", self.rope_base > 0, "> 0"),
            ("ortho_eps", self.ortho_eps >= 0, ">= 0"),
        ):
            if not ok:
                raise UserError(f"{name} must be {rule}, got {getattr(self, name):g}")
        if self.d_model % self.n_heads:
            raise UserError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise UserError(f"n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise UserError(f"head_dim {self.head_dim} must be even for RoPE")
        for name in ("vocab_size", "d_model", "ffn_dim", "n_core", "max_seq_len", "max_depth"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_prelude < 0 or self.n_coda < 0:
            raise UserError("n_prelude and n_coda must be >= 0")
        for name, allowed in (("block_norm", BLOCK_NORMS), ("exit_norm", EXIT_NORMS), ("state_init", STATE_KINDS)):
            if getattr(self, name) not in allowed:
                raise UserError(f"unknown {name} {getattr(self, name)!r}; choose one of {', '.join(allowed)}")
        if not self.embed_scale > 0:
            raise UserError(f"embed_scale must be > 0, got {self.embed_scale}")
        if self.state_std < 0:
            raise UserError(f"state_std must be >= 0 (0 = 1/sqrt(d_model)), got {self.state_std}")
        if self.injection == "none" and self.state_init != "input":
            raise UserError(
                "injection 'none' needs state_init='input' (otherwise the input never enters the recurrence)"
            )
        for name, allowed in (("ffn_act", FFN_ACTS), ("value_embeds", VALUE_EMBEDS)):
            if getattr(self, name) not in allowed:
                raise UserError(f"unknown {name} {getattr(self, name)!r}; choose one of {', '.join(allowed)}")
        if self.value_embeds != "none" and self.d_model < VALUE_GATE_CHANNELS:
            raise UserError(
                f"value_embeds needs d_model >= {VALUE_GATE_CHANNELS} (its gate reads 32 channels), got {self.d_model}"
            )
        if self.post_loop_norm and not self.head_norm:
            raise UserError("post_loop_norm reuses the head's final norm, so it needs head_norm=True")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise UserError(f"unknown model config fields: {sorted(unknown)}")
        return cls(**data)


# design §1: the paper's sizes (head_dim 64, 1/2/1 blocks). Vocabulary is set by the tokenizer.
MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(d_model=128, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=256),
    "S": ModelConfig(d_model=1536, n_heads=24, n_kv_heads=6, ffn_dim=4352, max_seq_len=8192),
    "M": ModelConfig(d_model=3072, n_heads=48, n_kv_heads=12, ffn_dim=8704, max_seq_len=8192),
    "L": ModelConfig(d_model=6144, n_heads=96, n_kv_heads=24, ffn_dim=17408, max_seq_len=8192),
}


def model_preset(name: str) -> ModelConfig:
    """A fresh copy of a named preset; ValueError names the known presets."""
    if name not in MODEL_PRESETS:
        raise UserError(f"unknown preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}")
    return dataclasses.replace(MODEL_PRESETS[name])
