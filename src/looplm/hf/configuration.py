"""`LoopedLMConfig`: a looplm `ModelConfig` plus test-time generation fields, as a transformers config."""

from __future__ import annotations

import dataclasses
import numbers

from transformers import PretrainedConfig

from looplm.config import ModelConfig
from looplm.errors import UserError
from looplm.infer.depth_rule import DepthRule, check_exit_gate

MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))
CONFIG_KEYS = {
    "depth": "num_steps",
    "prefill_depth": "prefill_steps",
    "cache": "cache_kind",
    "exit_gate": "exit_gate_threshold",
}
"""looplm's name of each test-time setting -> its config.json key (and `generate`/forward keyword), kept as
exported by every looplm version and read by the vLLM plugin; `exit_tau` and `min_depth` are spelled alike."""


def check_tokenizer_vocab_size(n, vocab_size: int) -> None:
    """UserError (a ValueError) unless `n`, the tokenizer's ids in an embedding of `vocab_size` rows, is
    None or an integer in 1..vocab_size."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= vocab_size):
        raise UserError(f"tokenizer_vocab_size must be in 1..{vocab_size} (vocab_size), got {n!r}")


class LoopedLMConfig(PretrainedConfig):
    """Shape of the looped model (every `looplm.config.ModelConfig` field, same names and defaults)
    and how it runs at test time:

    - `num_steps`: recurrences per decoded token (and per token of a plain forward), R_dec;
    - `prefill_steps`: recurrences over the prompt during `generate` (R_pre; None = num_steps);
    - `cache_kind`: "terminal" (one KV bank per physical layer) or "full" (one per layer visit);
    - `exit_tau`, `min_depth`: adaptive decode depth (terminal cache; None = fixed depth; a call's
      `exit_tau=0` turns the config's off);
    - `exit_gate_threshold`: a model with a learned exit gate (`exit_gate=True`, Ouro) reads each
      token's logits at the first recurrence whose cumulative exit probability reaches it (every
      recurrence still runs; None = the last recurrence's logits);
    - `compile_decode`: `generate` runs its one-token decode steps through looplm's compiled
      `DecodeStep` (`torch.compile`; the first call of a batch size pays the compilation);
    - `tokenizer_vocab_size`: the ids the tokenizer has when the embedding is padded past them (a
      release's padded vocabulary; None: every row is a token): the logits of the other rows are
      -inf in the wrapper and the vLLM plugin, so no engine chooses or normalises over them.

    `depth_rule()` maps them to looplm's `DepthRule` (`CONFIG_KEYS`), the only place the two spellings meet.
    """

    model_type = "looplm"
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "n_heads",
        "num_key_value_heads": "n_kv_heads",
        "intermediate_size": "ffn_dim",
        "max_position_embeddings": "max_seq_len",
    }

    # -- ModelConfig (looplm.config): every field with its default, taken from the dataclass itself, so
    # the two cannot drift (looplm ties embeddings inside the model: tie_word_embeddings stays False) --
    __annotations__ = {f.name: f.type for f in dataclasses.fields(ModelConfig)}
    vars().update({f.name: f.default for f in dataclasses.fields(ModelConfig)})
    # -- test time --
    num_steps: int = 5
    prefill_steps: int | None = None
    cache_kind: str = "terminal"
    exit_tau: float | None = None
    min_depth: int = 1
    exit_gate_threshold: float | None = None
    compile_decode: bool = False
    tokenizer_vocab_size: int | None = None
    # -- tokens (looplm's ByteTokenizer by default) --
    eos_token_id: int | None = 256
    pad_token_id: int | None = 257
    bos_token_id: int | None = None
    use_cache: bool = True
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self.to_model_config()  # raises ValueError on an inconsistent shape
        self.check_generation_fields()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        found = config_dict.get("model_type", cls.model_type)
        if found != cls.model_type:
            raise ValueError(
                f"this is a config of model_type {found!r}, not {cls.model_type!r}: "
                "not a looplm model (export looplm checkpoints with `looplm export`)"
            )
        loaded = super().from_dict(config_dict, **kwargs)
        # transformers sets the caller's keyword overrides (from_pretrained(..., num_steps=...)) after
        # __post_init__ ran: check the result again, or a bad override would only fail on the next load
        config = loaded[0] if isinstance(loaded, tuple) else loaded
        config.to_model_config()
        config.check_generation_fields()
        return loaded

    @property
    def num_hidden_layers(self) -> int:
        """Physical blocks (prelude, core and coda), what transformers and peft read as the depth."""
        return self.n_prelude + self.n_core + self.n_coda

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def depth_rule(
        self,
        num_steps: int | None = None,
        prefill_steps: int | None = None,
        exit_tau: float | None = None,
        min_depth: int | None = None,
        exit_gate_threshold: float | None = None,
        *,
        cached: bool = True,
    ) -> DepthRule:
        """The config's test-time fields as a looplm `DepthRule`, each argument given (a forward's or
        `generate`'s keyword) in place of the config's own; `exit_tau=0` turns the config's adaptive exit
        off for the call. Not `cached` (a forward without a cache runs every token at num_steps), the
        config's `prefill_steps`, `exit_tau` and `min_depth`, which apply to cached decoding only, are
        not folded in: only the call's own (which the forward refuses)."""
        tau = exit_tau if exit_tau is not None else self.exit_tau if cached else None
        tau = None if tau == 0 else tau
        if prefill_steps is None and cached:
            prefill_steps = self.prefill_steps
        gate = self.exit_gate_threshold if exit_gate_threshold is None else exit_gate_threshold
        check_exit_gate(gate, tau, CONFIG_KEYS["exit_gate"])  # before DepthRule's own check: the config's name
        if min_depth is None:  # the config's bound on adaptive exit, where that exit runs
            min_depth = self.min_depth if cached and tau is not None else 1
        return DepthRule(
            self.num_steps if num_steps is None else num_steps,
            prefill_steps,
            tau,
            min_depth,
            gate,
        )

    def check_rule(self, rule: DepthRule, cache: str) -> DepthRule:
        """`rule` checked for a cache of kind `cache` against this config's max_depth, its settings named by
        their config keys (ValueError with a one-line reason); returns it."""
        return rule.check(
            self.max_depth, cache=cache, has_gate=self.exit_gate, what="the config's max_depth", spelling=CONFIG_KEYS
        )

    def check_generation_fields(self) -> None:
        """Raise ValueError with a one-line reason when a test-time field is out of range."""
        self.check_rule(self.depth_rule(), self.cache_kind)
        check_tokenizer_vocab_size(self.tokenizer_vocab_size, self.vocab_size)

    def to_model_config(self) -> ModelConfig:
        """The looplm `ModelConfig` of this config (validated)."""
        cfg = ModelConfig(**{name: getattr(self, name) for name in MODEL_FIELDS if hasattr(self, name)})
        cfg.validate()
        return cfg

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, **kwargs) -> "LoopedLMConfig":
        """A config for `cfg`; `kwargs` set test-time and token fields (num_steps=..., eos_token_id=...)."""
        return cls(**cfg.to_dict(), **kwargs)
