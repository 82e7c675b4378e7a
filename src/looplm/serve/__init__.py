"""Serving: continuous batching on the terminal KV cache (`Engine`) behind an OpenAI-compatible
HTTP API (`looplm serve`, `looplm.serve.api`; needs the `serve` extra). design §15."""

from looplm.serve.engine import (
    ContextOverflow,
    Engine,
    EngineConfig,
    EngineFull,
    EngineStopped,
    Finish,
    PromptLogprobs,
    Request,
    RequestHandle,
    Token,
)
from looplm.serve.slots import SlotPool

__all__ = [
    "ContextOverflow",
    "Engine",
    "EngineConfig",
    "EngineFull",
    "EngineStopped",
    "Finish",
    "PromptLogprobs",
    "Request",
    "RequestHandle",
    "SlotPool",
    "Token",
]
