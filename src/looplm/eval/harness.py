"""lm-evaluation-harness model adapter (optional extra: `pip install -c constraints.txt -e ".[lm-eval]"`).

    looplm-lm-eval --model looplm --model_args checkpoint=runs/tiny,depth=5,cache=terminal --tasks ...

`looplm-lm-eval` is lm-eval's own command line after `import looplm.eval.harness`, which registers the
model name (`lm_eval` alone does not know it; `looplm.eval.harness_cli`). Every request is scored by
decoding with a KV cache, as in the paper's protocol (design §8): prefill the context at
`prefill_depth`, then feed the continuation one token at a time at `depth`; an empty context starts
from the text-start token (BOS, else EOS), as lm-eval's own models do. `loglikelihood_rolling` scores
lm-eval's rolling windows (`get_rolling_token_windows`, context length 1: disjoint windows of the
model's context, the last one after a full context) the same way, so a long document costs one decode
step per token.
"""

from __future__ import annotations

import zlib

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from looplm.checkpoint import load_model, resolve_device
from looplm.config import check_depth
from looplm.errors import UserError
from looplm.eval.choice import score_continuation, score_tokens, split_context
from looplm.eval.generation import greedy_generate
from looplm.infer.decode import token_vocab


@register_model("looplm")
class LoopLMHarness(LM):
    """`checkpoint` (run or checkpoint folder) or an already loaded `model` + `tokenizer`."""

    # what lm-eval itself adds to every model's arguments (from its --batch_size, --max_batch_size)
    HARNESS_ARGS = ("batch_size", "max_batch_size")

    def __init__(
        self,
        checkpoint: str | None = None,
        model=None,
        tokenizer=None,
        depth: int = 5,
        prefill_depth: int | None = None,
        cache: str = "terminal",
        device: str = "auto",
        max_gen_toks: int = 64,
        **others,
    ):
        super().__init__()
        unknown = [k for k in others if k not in self.HARNESS_ARGS]
        if unknown:  # a misspelt depth= would otherwise evaluate at the default depth, silently
            known = "checkpoint, depth, prefill_depth, cache, max_gen_toks; the device is lm-eval's --device"
            raise UserError(f"unknown model_args: {', '.join(unknown)} (known: {known})")
        if cache not in ("terminal", "full"):
            raise UserError(f"model_args cache must be terminal or full, got {cache!r}")
        device = resolve_device(
            str(device)
        )  # auto: CUDA when available; lm-eval's --device cuda on a CPU machine: one line
        if model is None:
            if checkpoint is None:
                raise UserError("looplm harness model needs checkpoint=PATH")
            model, tokenizer, _ = load_model(checkpoint, device)
        self.model, self.tokenizer = model.eval(), tokenizer
        # lm-eval hands model_args over as strings or numbers: checked as the depths they name
        depth, prefill_depth, max_gen_toks = _integer(depth), _integer(prefill_depth), _integer(max_gen_toks)
        check_depth("model_args depth", depth, model.cfg.max_depth)
        if prefill_depth is not None:
            check_depth("model_args prefill_depth", prefill_depth, model.cfg.max_depth)
        if isinstance(max_gen_toks, bool) or not isinstance(max_gen_toks, int) or max_gen_toks < 1:
            raise UserError(f"model_args max_gen_toks must be >= 1, got {max_gen_toks!r}")
        self.depth, self.prefill_depth, self.cache = depth, prefill_depth, cache
        self._device, self.max_gen_toks = device, max_gen_toks

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> LoopLMHarness:
        """lm-eval's `--model_args k=v,...` (with its own --batch_size, --device, ...): see `create_from_arg_obj`."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> LoopLMHarness:
        """The adapter from lm-eval's model_args `arg_dict` and its own settings `additional_config` (None
        values dropped, as lm-eval does); a device in both is refused in one line, where Python would raise
        "got multiple values for keyword argument 'device'" whichever way lm-eval read the model_args."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        if "device" in arg_dict and "device" in extra:
            raise UserError("give the device as --device (lm-eval's option), not in --model_args")
        return cls(**arg_dict, **extra)

    def _score(self, context: str, continuation: str, example_id: int) -> tuple[float, bool]:
        # as lm-eval's own models: the context's trailing whitespace starts the continuation, and a
        # context too long for the model keeps its last tokens
        context, continuation = split_context(context, continuation)
        if not self.tokenizer.encode_prompt(context):  # an empty context: the text-start token
            ids = self.tokenizer.encode(continuation)
            return self._score_ids([self._text_start], ids, example_id)
        return score_continuation(
            self.model,
            self.tokenizer,
            context,
            continuation,
            example_id=example_id,
            truncate=True,
            **self._decoding,
        )

    @property
    def _depths(self) -> dict:
        """How every request is decoded: the depths and the cache, as the scoring and generation
        functions take them."""
        return {"depth": self.depth, "prefill_depth": self.prefill_depth, "cache": self.cache}

    @property
    def _decoding(self) -> dict:
        """`_depths` and the device: the keywords of the scoring functions."""
        return {**self._depths, "device": self._device}

    @property
    def _text_start(self) -> int:
        """What an empty context starts from (lm-eval's prefix token): BOS, else EOS."""
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.tokenizer.eos_id

    def _score_ids(self, ctx_ids: list[int], target: list[int], example_id: int) -> tuple[float, bool]:
        return score_tokens(
            self.model,
            ctx_ids,
            target,
            example_id=example_id,
            vocab=token_vocab(self.model, self.tokenizer),
            **self._decoding,
        )

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return [self._score(*req.args[:2], example_id=stable_id(req.args[0])) for req in requests]

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for req in requests:
            text, total = req.args[0], 0.0
            example_id = stable_id(text)
            windows = get_rolling_token_windows(
                self.tokenizer.encode(text), self._text_start, self.model.cfg.max_seq_len, context_len=1
            )
            for ctx, pred in map(make_disjoint_window, windows):
                total += self._score_ids(ctx, pred, example_id)[0]
            out.append(total)
        return out

    def generate_until(self, requests) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args[0], dict(req.args[1] if len(req.args) > 1 else {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            # as lm-eval's own models: a context too long for the new tokens keeps its last tokens
            n = max(1, min(int(kwargs.get("max_gen_toks", self.max_gen_toks)), self.model.cfg.max_seq_len))
            ids = self.tokenizer.encode_prompt(context) or [self._text_start]
            out += greedy_generate(
                self.model,
                self.tokenizer,
                [ids[-(self.model.cfg.max_seq_len - n + 1) :]],
                [stable_id(context)],
                max_new_tokens=n,
                stop=tuple(until),
                **self._depths,
            )
        return out


def _integer(value):
    """An int from lm-eval's model_args value (None stays None; anything else is checked by the caller)."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return value


def stable_id(context: str) -> int:
    """Example id for the seeded initial state: a hash of the context, so the choices of one item
    share it and the result does not depend on the order in which the harness sends requests."""
    return zlib.crc32(context.encode("utf-8")) & 0x7FFFFFFF
