"""The OpenAI request bodies the server accepts, as pydantic models, and the chat template.

Fields follow OpenAI's completions and chat completions APIs; looplm's extensions (`depth`,
`prefill_depth`, `exit_tau`, `min_depth`, `top_k`, `speculate`, `draft_depth`) ride in the same body
(the openai client sends them through `extra_body`). Parameters the engine does not implement are accepted only at their
neutral value, so a client never gets silently different behaviour; a chat request's fields in
`IGNORED_CHAT_FIELDS` (OpenAI's, about tools, formats and bookkeeping) are accepted and ignored; any
other field is refused by name (a misspelt `depth` would otherwise serve at the server's depth).
`null` for a field means its default, as in OpenAI's API.
"""

from __future__ import annotations

import difflib
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from looplm.data.chat import CHAT_STOP, CHAT_TEMPLATE
from looplm.infer.decode import SamplingConfig
from looplm.infer.depth_rule import DepthRule

IGNORED_CHAT_FIELDS = frozenset(
    {
        "audio",
        "function_call",
        "functions",
        "metadata",
        "modalities",
        "parallel_tool_calls",
        "prediction",
        "prompt_cache_key",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "service_tier",
        "store",
        "tool_choice",
        "tools",
        "verbosity",
        "web_search_options",
    }
)
"""Fields of OpenAI's chat completions request that looplm accepts and ignores (whatever their value):
no tool calls, audio or structured output are produced, and nothing is stored. Every field of OpenAI's
completions request is one of `CompletionRequest`'s."""


def _unpaired_surrogate(value, path: str = "") -> str | None:
    """The path of the first string in a JSON body that is not Unicode text (a lone surrogate, which JSON's
    \\ud800 escapes can spell), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _unpaired_surrogate(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}".lstrip("."))
        if found:
            return found
    return None


class StreamOptions(BaseModel):
    """OpenAI's `stream_options` (with `stream: true` only)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    """A last chunk with the usage of the whole reply (and `usage: null` in the others)."""
    include_obfuscation: bool = False
    """OpenAI's padding of chunks against side channels: accepted and ignored (nothing is padded)."""


class _Common(BaseModel):
    # after `_known_fields`, only the ignored ones are left; strict: a bool, number or id list of another JSON
    # type (`"5"`, `true`) is refused, as OpenAI refuses it, not converted
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)  # NaN: "a finite number"
    ignored_fields: ClassVar[frozenset[str]] = frozenset()

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict | None = None
    user: str | None = None
    # looplm extensions
    depth: int | None = Field(None, ge=1)
    prefill_depth: int | None = Field(None, ge=1)
    exit_tau: float | None = Field(None, gt=0.0)
    min_depth: int = Field(1, ge=1)
    speculate: int | None = Field(None, ge=0)
    """Self-speculative decoding: draft tokens per verify chunk (0 = off); default: the server's."""
    draft_depth: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data):
        """Refuses fields neither looplm nor OpenAI's API defines, naming them (null ones too: a typo is a
        typo). Then, as OpenAI reads `null` for an optional field as "not given" (clients send it), drops
        such fields so their defaults apply; a required field sent as null is then reported missing."""
        if not isinstance(data, dict):
            return data
        known = cls.model_fields.keys() | cls.ignored_fields
        unknown = [k for k in data if k not in known]
        if unknown:
            own = sorted(cls.model_fields)
            named = ", ".join(
                repr(k) + "".join(f" (did you mean {m!r}?)" for m in difflib.get_close_matches(k, own, 1))
                for k in unknown
            )
            raise PydanticCustomError(
                "unknown_field", "unknown field(s) {named} for this endpoint", {"named": named, "first": unknown[0]}
            )
        bad = _unpaired_surrogate(data)
        if bad:
            raise PydanticCustomError(
                "invalid_text", "{field}: contains an unpaired surrogate (not Unicode text)", {"field": bad}
            )
        return {k: v for k, v in data.items() if v is not None}

    @model_validator(mode="after")
    def _neutral_only(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        if self.frequency_penalty or self.presence_penalty:
            raise ValueError("frequency_penalty and presence_penalty are not supported (use 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return tuple(stops)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self, max_tokens: int, stop: tuple[str, ...], seed: int) -> SamplingConfig:
        """A choice's sampling settings (`looplm.serve.Request.sampling`)."""
        return SamplingConfig(
            max_new_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=seed,
            stop=stop,
        )

    def depth_rule(self, default_depth: int) -> DepthRule:
        """The request's recurrences (`looplm.serve.Request.rule`): its `depth`, else `default_depth` (the server's)."""
        depth = default_depth if self.depth is None else self.depth
        return DepthRule(depth, self.prefill_depth, self.exit_tau, self.min_depth)

    def speculation(self) -> dict:
        """The request's self-speculation settings (`looplm.serve.Request.speculate`, `draft_depth`)."""
        return dict(speculate=self.speculate, draft_depth=self.draft_depth)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(16, ge=0)
    """0 only with echo: the prompt is scored, nothing generated (how lm-eval's `local-completions` scores)."""
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, prompt):
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must not be an empty list")
        return prompt

    @model_validator(mode="after")
    def _unsupported(self):
        if self.best_of not in (None, self.n):
            raise ValueError("best_of is not supported (leave it unset)")
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported")
        if self.max_tokens == 0 and not self.echo:  # nothing would be returned
            raise ValueError("max_tokens must be >= 1 (0 only with echo: true, to score the prompt)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """Each prompt as text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Common):
    ignored_fields: ClassVar[frozenset[str]] = IGNORED_CHAT_FIELDS
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def budget(self, prompt_tokens: int, context: int) -> int:
        """max_completion_tokens or max_tokens; unset: the rest of the context (at least 1)."""
        return self.max_completion_tokens or self.max_tokens or max(1, context - prompt_tokens + 1)

    def render(self) -> str:
        """The prompt text: the documented template `CHAT_TEMPLATE`, then `assistant:`."""
        turns = "".join(
            CHAT_TEMPLATE.format(role="system" if m.role == "developer" else m.role, content=m.text())
            for m in self.messages
        )
        return turns + "assistant:"

    def stop_strings(self) -> tuple[str, ...]:
        return super().stop_strings() + CHAT_STOP

    def logprob_count(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs: true")
            return None
        return self.top_logprobs or 0
