"""`LoopedLMConfig`: a looplm `ModelConfig` plus test-time generation fields, as a transformers config."""

from __future__ import annotations

import dataclasses

from transformers import PretrainedConfig

from looplm.config import ModelConfig

CACHE_KINDS = ("terminal", "full")
MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))


class LoopedLMConfig(PretrainedConfig):
    """Shape of the looped model (every `looplm.config.ModelConfig` field, same names and defaults)
    and how it runs at test time:

    - `num_steps`: recurrences per decoded token (and per token of a plain forward), R_dec;
    - `prefill_steps`: recurrences over the prompt during `generate` (R_pre; None = num_steps);
    - `cache_kind`: "terminal" (one KV bank per physical layer) or "full" (one per layer visit);
    - `exit_tau`, `min_depth`: adaptive decode depth (terminal cache; None = fixed depth).
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
            raise ValueError(f"this is a config of model_type {found!r}, not {cls.model_type!r}: "
                             "not a looplm model (export looplm checkpoints with `looplm export`)")
        return super().from_dict(config_dict, **kwargs)

    def check_generation_fields(self) -> None:
        """Raise ValueError with a one-line reason when a test-time field is out of range."""
        for name in ("num_steps", "prefill_steps"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= self.max_depth:
                raise ValueError(f"{name} must be in 1..max_depth={self.max_depth}, got {value}")
        if self.cache_kind not in CACHE_KINDS:
            raise ValueError(f"unknown cache_kind {self.cache_kind!r}; choose terminal or full")
        if self.exit_tau is not None and not self.exit_tau > 0:
            raise ValueError(f"exit_tau must be > 0 (adaptive depth) or None, got {self.exit_tau}")
        if self.min_depth < 1:
            raise ValueError(f"min_depth must be >= 1, got {self.min_depth}")

    def to_model_config(self) -> ModelConfig:
        """The looplm `ModelConfig` of this config (validated)."""
        cfg = ModelConfig(**{name: getattr(self, name) for name in MODEL_FIELDS if hasattr(self, name)})
        cfg.validate()
        return cfg

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, **kwargs) -> "LoopedLMConfig":
        """A config for `cfg`; `kwargs` set test-time and token fields (num_steps=..., eos_token_id=...)."""
        return cls(**cfg.to_dict(), **kwargs)
