"""The looped LM: blocks, input-injection schemes, initial states and the model itself."""

from looplm.model.injection import Injection, build_injection
from looplm.model.looped import LoopedLM, LoopOutput
from looplm.model.state import StateInit, StateStart, initial_state, seeded_normal

__all__ = [
    "Injection",
    "LoopOutput",
    "LoopedLM",
    "StateInit",
    "StateStart",
    "build_injection",
    "initial_state",
    "seeded_normal",
]
