"""Converters from other projects' checkpoints into looplm checkpoints (`looplm convert`)."""

from looplm.convert.xllm_loop import convert_xllm_loop

CONVERTERS = {"xllm-loop": convert_xllm_loop}
"""`looplm convert --from NAME`: NAME -> converter(src, out, dtype=None) -> checkpoint path."""

__all__ = ["CONVERTERS", "convert_xllm_loop"]
