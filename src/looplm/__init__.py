"""looplm: looped (recurrent-depth) language models shaped around fixed points."""

from looplm.config import MODEL_PRESETS, ModelConfig, model_preset

__version__ = "0.1.0"
__all__ = ["MODEL_PRESETS", "ModelConfig", "model_preset", "__version__"]


def _register_with_transformers() -> None:
    """Make `AutoConfig` / `AutoModelForCausalLM` know model_type "looplm" (looplm.hf) once
    transformers is imported, without importing it here: `import looplm` stays fast and works
    without transformers installed."""
    import importlib
    import importlib.util
    import sys
    import warnings

    def register() -> None:
        try:
            importlib.import_module("looplm.hf")  # registers itself (a no-op while it is being imported)
        except Exception as err:  # never break `import transformers`
            warnings.warn(f"looplm could not register with transformers: {err}", stacklevel=2)

    if "transformers" in sys.modules:
        register()
        return
    if importlib.util.find_spec("transformers") is None:
        return

    class _AfterTransformers:
        """One-shot meta path finder: lets the normal finders load transformers, then registers looplm."""

        def find_spec(self, name, path=None, target=None):
            if name != "transformers":
                return None
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            exec_module = spec.loader.exec_module

            def exec_then_register(module):
                exec_module(module)
                register()

            spec.loader.exec_module = exec_then_register
            return spec

    sys.meta_path.insert(0, _AfterTransformers())


_register_with_transformers()
