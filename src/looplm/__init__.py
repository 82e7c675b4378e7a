"""looplm: looped (recurrent-depth) language models shaped around fixed points.

`import looplm` imports only the configuration. The Transformers integration registers the model
type "looplm" with `AutoConfig` / `AutoModelForCausalLM` when it is imported: `import looplm.hf`
before `AutoModelForCausalLM.from_pretrained(folder)`. vLLM finds the plugin through its
`vllm.general_plugins` entry point (`looplm.vllm_plugin`).
"""

from looplm.config import MODEL_PRESETS, ModelConfig, model_preset

__version__ = "0.1.0"
__all__ = ["MODEL_PRESETS", "ModelConfig", "model_preset", "__version__"]
