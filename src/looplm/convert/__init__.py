"""Converters from other projects' checkpoints into looplm checkpoints (`looplm convert`)."""

from looplm.convert.huginn import convert_huginn
from looplm.convert.ouro import convert_ouro
from looplm.convert.parcae import convert_parcae
from looplm.convert.xllm_loop import convert_xllm_loop
from looplm.convert.xllm_student import convert_xllm_student

CONVERTERS = {"xllm-loop": convert_xllm_loop, "huginn": convert_huginn, "ouro": convert_ouro, "parcae": convert_parcae}
"""`looplm convert --from NAME`: NAME -> converter(src, out, dtype=None, *, data=None) -> checkpoint path."""

__all__ = [
    "CONVERTERS",
    "convert_huginn",
    "convert_ouro",
    "convert_parcae",
    "convert_xllm_loop",
    "convert_xllm_student",
]
