"""looplm: looped (recurrent-depth) language models shaped around fixed points."""

from looplm.config import MODEL_PRESETS, ModelConfig, model_preset

__version__ = "0.1.0"
__all__ = ["MODEL_PRESETS", "ModelConfig", "model_preset", "__version__"]
