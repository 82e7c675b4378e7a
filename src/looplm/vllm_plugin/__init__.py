"""Serve looplm models on vLLM (design §15): a model plugin with terminal KV sharing.

Installed with looplm, the `vllm.general_plugins` entry point calls `register()` in every vLLM
process, so a folder written by `looplm export` serves with no extra flag:

    vllm serve out/hf                       # or vllm.LLM(model="out/hf")
    vllm serve out/hf --hf-overrides '{"num_steps": 8}'

`register()` maps the architecture that `looplm export` writes in config.json
(`LoopedLMForCausalLM`) to `looplm.vllm_plugin.model.LoopedLMForVLLM`, makes transformers'
`AutoConfig` know model_type "looplm", and adds a config hook that refuses the settings the plugin
does not serve (speculative decoding among them) and turns chunked prefill and prefix caching off. vLLM is imported only inside this package.
"""

from __future__ import annotations

ARCHITECTURE = "LoopedLMForCausalLM"
"""The `architectures` entry of an exported config.json (the transformers class `looplm export` saves)."""


class LoopedConfigHook:
    """vLLM's per-architecture config hook (`verify_and_update_config`, run when the engine config is built).

    Chunked prefill is turned off (each prompt prefills as one chunk, the token budget raised to the
    context length where it is smaller): under the terminal cache a chunk's tokens read each other's
    current-recurrence K/V and earlier chunks' terminal K/V, so where vLLM cuts a prompt (wherever the
    step's budget runs out, which depends on the other requests) would change its K/V and outputs.
    Speculative decoding is refused: its verify chunk (the drafts run together) is not what one-token
    decoding computes under the terminal cache.
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
            raise Refused(
                "prompt embeddings (enable_prompt_embeds) are not served by the looplm vLLM plugin: its "
                "initial state and value embeddings are functions of the token ids; pass token ids or text"
            )
        if vllm_config.speculative_config is not None:
            raise Refused(
                "speculative decoding (speculative_config) is not served by the looplm vLLM plugin: its "
                "verify chunk runs the draft tokens together, which under the terminal cache is not what "
                "decoding them one at a time computes; serve without a speculative config"
            )
        from vllm.logger import init_logger

        log = init_logger("vllm.looplm_plugin")
        sched, max_len = vllm_config.scheduler_config, vllm_config.model_config.max_model_len
        short = sched.max_num_scheduled_tokens is not None and sched.max_num_scheduled_tokens < max_len
        if (
            sched.enable_chunked_prefill
            or sched.max_num_batched_tokens < max_len
            or sched.long_prefill_token_threshold
            or short  # with chunked prefill already off, a long prompt would never be scheduled
        ):
            budget = max(sched.max_num_batched_tokens, max_len)
            log.info(
                "looplm: chunked prefill is off, max_num_batched_tokens=%d (was %d): each prompt prefills as "
                "one chunk, since under the terminal cache where a prompt is cut changes its K/V and outputs, "
                "and vLLM cuts it where a step's token budget runs out, which depends on the other requests",
                budget,
                sched.max_num_batched_tokens,
            )
            sched.enable_chunked_prefill = False
            sched.long_prefill_token_threshold = 0  # it would cut a long prompt even without chunked prefill
            sched.max_num_batched_tokens = budget
            if short:
                sched.max_num_scheduled_tokens = budget
            sched.max_num_encoder_input_tokens = sched.encoder_cache_size = budget
            sched.verify_max_model_len(max_len)
        if not getattr(hf, "allow_prefix_caching", False) and vllm_config.cache_config.enable_prefix_caching:
            vllm_config.cache_config.enable_prefix_caching = False
            log.info(
                "looplm: prefix caching is off (a cached block holds the terminal K/V its tokens got when written, "
                "not what a fresh prefill computes); --hf-overrides '{\"allow_prefix_caching\": true}' turns it on"
            )


def register() -> None:
    """Register the looplm model, its config class and its config hook with vLLM (idempotent)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    import looplm.hf  # noqa: F401  (registers AutoConfig model_type "looplm")

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "looplm.vllm_plugin.model:LoopedLMForVLLM")
    MODELS_CONFIG_MAP[ARCHITECTURE] = LoopedConfigHook
