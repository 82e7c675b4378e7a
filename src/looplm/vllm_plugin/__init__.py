"""Serve looplm models on vLLM (design §15): a model plugin with terminal KV sharing.

Installed with looplm, the `vllm.general_plugins` entry point calls `register()` in every vLLM
process, so a folder written by `looplm export` serves with no extra flag:

    vllm serve out/hf                       # or vllm.LLM(model="out/hf")
    vllm serve out/hf --hf-overrides '{"num_steps": 8}'

`register()` maps the architecture that `looplm export` writes in config.json
(`LoopedLMForCausalLM`) to `looplm.vllm_plugin.model.LoopedLMForVLLM`, makes transformers'
`AutoConfig` know model_type "looplm", and adds a config hook that refuses the settings the plugin
does not serve and turns prefix caching off. vLLM is imported only inside this package.
"""

from __future__ import annotations

ARCHITECTURE = "LoopedLMForCausalLM"
"""The `architectures` entry of an exported config.json (the transformers class `looplm export` saves)."""


class LoopedConfigHook:
    """vLLM's per-architecture config hook (`verify_and_update_config`, run when the engine config is built).

    Prefix caching is turned off unless the config sets `allow_prefix_caching`: a cached block holds the
    terminal K/V its tokens got when they were written (by a prompt chunk, or one by one while decoding),
    which a fresh prefill of the same tokens does not compute (design §15)."""

    @staticmethod
    def verify_and_update_model_config(model_config) -> None:
        return

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        from looplm.vllm_plugin.model import Refused, check_servable

        hf = vllm_config.model_config.hf_config
        par = vllm_config.parallel_config
        check_servable(hf, tensor_parallel=par.tensor_parallel_size, pipeline_parallel=par.pipeline_parallel_size)
        if getattr(vllm_config.model_config, "enable_prompt_embeds", False):
            raise Refused("prompt embeddings (enable_prompt_embeds) are not served by the looplm vLLM plugin: its "
                          "initial state and value embeddings are functions of the token ids; pass token ids or text")
        if not getattr(hf, "allow_prefix_caching", False) and vllm_config.cache_config.enable_prefix_caching:
            vllm_config.cache_config.enable_prefix_caching = False
            from vllm.logger import init_logger

            init_logger("vllm.looplm_plugin").info(
                "looplm: prefix caching is off (a cached block holds the terminal K/V its tokens got when written, "
                "not what a fresh prefill computes); --hf-overrides '{\"allow_prefix_caching\": true}' turns it on")


def register() -> None:
    """Register the looplm model, its config class and its config hook with vLLM (idempotent)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    import looplm.hf  # noqa: F401  (registers AutoConfig model_type "looplm")

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "looplm.vllm_plugin.model:LoopedLMForVLLM")
    MODELS_CONFIG_MAP[ARCHITECTURE] = LoopedConfigHook
