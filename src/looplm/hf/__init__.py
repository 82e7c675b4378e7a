"""Hugging Face Transformers integration (the hf extra: `pip install -c constraints.txt -e ".[hf]"`).

    from transformers import AutoModelForCausalLM, AutoTokenizer
    import looplm.hf  # registers model_type "looplm" with the Auto classes
    model = AutoModelForCausalLM.from_pretrained(folder)   # a folder written by `looplm export`
    out = model.generate(ids, attention_mask=mask, max_new_tokens=32, num_steps=5, cache_kind="terminal")

`LoopedLMForCausalLM` wraps the very same `LoopedLM`, and its cached forward is the model's own.
"""

from looplm.hf.configuration import LoopedLMConfig
from looplm.hf.export import byte_tokenizer, export, hf_tokenizer
from looplm.hf.modeling import LoopedCache, LoopedLMForCausalLM, LoopedLMPreTrainedModel


def register() -> None:
    """Register LoopedLMConfig / LoopedLMForCausalLM with AutoConfig / AutoModelForCausalLM (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "looplm" not in CONFIG_MAPPING:
        AutoConfig.register("looplm", LoopedLMConfig)
    try:
        AutoModelForCausalLM.register(LoopedLMConfig, LoopedLMForCausalLM)
    except ValueError:  # already registered
        pass


register()

__all__ = [
    "LoopedCache",
    "LoopedLMConfig",
    "LoopedLMForCausalLM",
    "LoopedLMPreTrainedModel",
    "byte_tokenizer",
    "export",
    "hf_tokenizer",
    "register",
]
