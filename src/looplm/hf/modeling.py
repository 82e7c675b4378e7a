"""`LoopedLMForCausalLM`: a transformers causal-LM adapter over `looplm.model.LoopedLM`.

Thin on purpose: a forward without a cache is `LoopedLM.forward` (autograd, labels), a forward
with a `LoopedCache` is `LoopedLM`'s cached forward on a looplm terminal (or full) KV cache, so
`model.generate(...)` prefills at `prefill_steps` and decodes every token at `num_steps`
recurrences exactly like `looplm.infer.generate.generate`. With `compile_decode=True` (a `generate`
or forward keyword, or the config's field) the one-token decode steps run looplm's compiled
`DecodeStep` (static shapes over a cache as long as the model context; design §16), as
`looplm generate --compile` does.

The initial recurrent state is always the "seeded" one: a hash of (example id, position), every row
example 0 unless `example_ids` say otherwise, so results are deterministic and a row's output does
not depend on the batch it is in (each row is what `looplm generate` gives its prompt alone).
Without a cache a forward is the native parallel forward at `num_steps` (what the full cache
computes when prefill_steps = num_steps, without exit): `prefill_steps` and `exit_tau` belong to
cached decoding, and passing them to a forward without a cache is an error.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import CausalLMOutputWithPast

from looplm.hf.configuration import LoopedLMConfig
from looplm.infer.cache import KVCache, make_cache
from looplm.infer.depth_rule import CACHE_KINDS, DepthRule
from looplm.infer.step import DecodeStep, StepRows
from looplm.model import LoopedLM

SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)


class LoopedCache(Cache):
    """A transformers `Cache` holding one looplm KV cache (`TerminalCache` or `FullCache`).

    The looplm cache is preallocated at the first forward, when the batch size is known:
    `max_len` tokens (default: the model context), for `kind` "terminal" or "full" (default: the
    call's `cache_kind`, else the config's). It also remembers each row's left padding, taken from
    the prompt's attention mask. `compile=True`: one-token decode steps run a compiled looplm
    `DecodeStep` (created with the looplm cache; give no `max_len`, so every call's cache spans the
    model context and reuses the compiled graphs). Beam reordering, cropping and batch expansion are
    not supported."""

    def __init__(self, kind: str | None = None, max_len: int | None = None, compile: bool = False):
        super().__init__(layers=[])
        if kind is not None and kind not in CACHE_KINDS:
            raise ValueError(f"unknown cache kind {kind!r}; choose terminal or full")
        self.kind, self.max_len, self.compile = kind, max_len, compile
        self.inner: KVCache | None = None
        self.step: DecodeStep | None = None  # the compiled one-token step (compile=True), made with `inner`
        self.pad: torch.Tensor | None = None  # [B] left-padding tokens per row
        self.decode_depth: int | None = None  # recurrences per decoded token (num_steps of the call)
        # per decode step (a chunk appended after the prompt): each row's recurrences summed over its
        # tokens [B] (adaptive exit: < decode_depth a token), whether the row was still generating [B]
        # (generate: it has not fed an end of sequence), and the chunk's tokens
        self.depths_used: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self.eos_ids: torch.Tensor | None = None  # generate's end-of-sequence ids (None: no row finishes)
        self.finished: torch.Tensor | None = None  # [B] rows that fed an end of sequence

    def allocate(self, config: LoopedLMConfig, batch: int, depth: int, kind: str, device, dtype) -> None:
        kind = self.kind or kind
        max_len = self.max_len or config.max_seq_len
        self.inner = make_cache(kind, config.to_model_config(), batch, max_len, depth, device=device, dtype=dtype)
        self.kind = kind

    def decode_step(self, model: LoopedLM, tokens: torch.Tensor, rule: DepthRule, example_ids: torch.Tensor):
        """Append one token per row (`tokens` [B]) through the compiled `DecodeStep`; returns (fp32
        logits [B, 1, V], recurrences used [B])."""
        inner = self.inner
        if self.step is None:
            self.step = DecodeStep(model, inner, compile=True)
        B, device = tokens.shape[0], tokens.device
        first = self.pad if self.pad is not None else torch.zeros(B, dtype=torch.long, device=device)
        write_at = torch.full((B,), inner.length, dtype=torch.long, device=device)
        logits, used = self.step(StepRows.under(rule, tokens, write_at, first, example_ids), rule.depth)
        inner.length += 1
        return logits[:, None], used

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        return -1 if self.inner is None else self.inner.batch

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.inner is None else self.inner.length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1 if self.inner is None else self.inner.max_len

    @property
    def nbytes(self) -> int:
        return 0 if self.inner is None else self.inner.nbytes

    def reset(self) -> None:
        self.inner, self.step, self.pad, self.decode_depth, self.depths_used = None, None, None, None, []
        self.finished = None

    def record(self, used: torch.Tensor, fed: torch.Tensor, depth: int) -> None:
        """A decode step's recurrences `used` [B, n] for the tokens `fed` [B, n] (no device sync). A row
        that feeds one of `eos_ids` has finished: transformers feeds it padding from then on, and
        looplm's `generate` takes it out of the batch, so its steps from there on do not count."""
        self.decode_depth = depth
        if self.eos_ids is not None:
            ended = torch.isin(fed, self.eos_ids.to(fed.device)).any(1)
            self.finished = ended if self.finished is None else self.finished | ended
        live = torch.ones_like(used[:, 0], dtype=torch.bool) if self.finished is None else ~self.finished
        self.depths_used.append((used.float().sum(1), live, used.shape[1]))

    @property
    def mean_decode_depth(self) -> float | None:
        """Mean recurrences per token over the decode steps (chunks appended after the prompt) of the rows
        still generating, as `looplm.infer.generate.generate` reports it in `stats`; the decode depth
        when there were none."""
        total = sum(float((used * live).sum()) for used, live, _ in self.depths_used)
        count = sum(int(live.sum()) * n for _, live, n in self.depths_used)
        if not count:
            return None if self.decode_depth is None else float(self.decode_depth)
        return total / count

    def _unsupported(self, what: str):
        raise NotImplementedError(
            f"LoopedCache does not support {what} (looplm supports greedy and sampled "
            "generation only: no beam search, assisted or contrastive decoding)"
        )

    def update(self, *args, **kwargs):
        self._unsupported("per-layer update(); it is written by the model's cached forward")

    def reorder_cache(self, beam_idx):
        self._unsupported("beam reordering")

    def crop(self, tokens_to_remove: int) -> None:
        self._unsupported("cropping")

    def batch_repeat_interleave(self, repeats: int):
        self._unsupported("batch expansion")

    def batch_select_indices(self, indices):
        self._unsupported("batch selection")

    def __repr__(self) -> str:
        return (
            f"LoopedCache(kind={self.kind!r}, length={self.get_seq_length()}, max_len={self.get_max_length()}"
            f"{', compile=True' if self.compile else ''})"
        )


def _eos_ids(generation_config) -> torch.Tensor | None:
    """The end-of-sequence ids a generation stops a row at (an int, a list or None in the config)."""
    eos = generation_config.eos_token_id
    if eos is None:
        return None
    return torch.tensor([eos] if isinstance(eos, int) else list(eos), dtype=torch.long)


def left_padding(attention_mask: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor | None:
    """Left-padding counts [B] from a 2D 0/1 attention mask [B, L], or None when there is none.
    Raises ValueError for masks that are not left padding (zeros, then ones)."""
    if attention_mask is None:
        return None
    if attention_mask.ndim != 2 or tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(
            f"attention_mask must be 2D with the shape of input_ids {tuple(shape)}, got {tuple(attention_mask.shape)}"
        )
    real = attention_mask.bool()
    B, L = real.shape
    pad = L - real.sum(1)
    if not torch.equal(real, torch.arange(L, device=real.device)[None, :] >= pad[:, None]):
        raise ValueError(
            "looplm supports left padding only: each attention_mask row must be zeros, then ones "
            "(use padding_side='left')"
        )
    if bool((pad == L).any()):
        raise ValueError("an attention_mask row has no real token")
    return pad if bool(pad.any()) else None


class LoopedLMPreTrainedModel(PreTrainedModel):
    config_class = LoopedLMConfig
    config: LoopedLMConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False
    _no_split_modules = ["Block"]
    _supports_sdpa = True

    def _init_weights(self, module):
        """LoopedLM initialises itself (design §1) when it is built; nothing to add here."""


class LoopedLMForCausalLM(LoopedLMPreTrainedModel, GenerationMixin):
    """A looplm `LoopedLM` (the `model` submodule) as a transformers causal LM.

    forward(input_ids, attention_mask, cache, labels, num_steps, ...) -> CausalLMOutputWithPast.
    Generation kwargs (or config fields): `num_steps` (R_dec), `prefill_steps` (R_pre),
    `cache_kind` ("terminal" | "full"), `exit_tau` / `min_depth` (adaptive decode depth),
    `exit_gate_threshold` (a gated model's threshold exit, with or without a cache; its decode
    steps run the model's forward, compiled or not),
    `compile_decode` (one-token decode steps through looplm's compiled `DecodeStep`).
    """

    def __init__(self, config: LoopedLMConfig, model: LoopedLM | None = None):
        super().__init__(config)
        cfg = config.to_model_config()
        if model is not None and model.cfg != cfg:
            raise ValueError(f"the LoopedLM's config {model.cfg} does not match the HF config {cfg}")
        self.model = model if model is not None else LoopedLM(cfg)
        self.post_init()

    @classmethod
    def from_looplm(cls, model: LoopedLM, tokenizer=None, **kwargs) -> "LoopedLMForCausalLM":
        """Wrap an existing LoopedLM (shares its parameters); `kwargs` set config fields (num_steps=...)."""
        if tokenizer is not None:
            kwargs.setdefault("eos_token_id", tokenizer.eos_id)
            kwargs.setdefault("pad_token_id", tokenizer.pad_id)
            if tokenizer.vocab_size < model.cfg.vocab_size:  # a padded embedding: rows no token reaches
                kwargs.setdefault("tokenizer_vocab_size", tokenizer.vocab_size)
        config = LoopedLMConfig.from_model_config(model.cfg, **kwargs)
        return cls(config, model=model)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """As `PreTrainedModel.from_pretrained`, but weights missing from the checkpoint (or of the
        wrong shape) are an error, never a random initialisation; and so are weights the model has
        no place for (the config does not describe the checkpoint: e.g. `tie_embeddings` set over an
        untied head, whose weights would be dropped)."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        missing = sorted(info.get("missing_keys") or [])
        mismatched = list(info.get("mismatched_keys") or [])
        unexpected = sorted(info.get("unexpected_keys") or [])
        where = args[0] if args else ""
        if missing or mismatched:
            raise ValueError(
                f"{where}: the checkpoint does not hold every weight of the looplm "
                f"model (missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                f"wrong shape {mismatched[:3]})"
            )
        if unexpected:
            raise ValueError(
                f"{where}: the checkpoint holds weights its config gives no place to "
                f"({unexpected[:3]}{'...' if len(unexpected) > 3 else ''}): config.json does not describe it"
            )
        return (model, info) if want_info else model

    def get_input_embeddings(self):
        return self.model.embed

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
        """transformers' resize of the embedding (and an untied head), with looplm's own config
        following and `tokenizer_vocab_size` set to `new_num_tokens` when `pad_to_multiple_of` pads
        past it; refused for value embeddings (their per-layer tables are indexed by token too)."""
        if self.config.value_embeds != "none":
            raise ValueError(
                f"resize_token_embeddings does not resize value embeddings (value_embeds="
                f"{self.config.value_embeds!r}): their tables are indexed by token id as the embedding is"
            )
        tokens = self.config.tokenizer_vocab_size or self.config.vocab_size  # every row a token until now
        embed = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        self.model.cfg = dataclasses.replace(self.model.cfg, vocab_size=embed.num_embeddings)
        # new_num_tokens is the tokenizer's size (rows past it, padding to a multiple, are no token)
        n = tokens if new_num_tokens is None else new_num_tokens
        self.config.tokenizer_vocab_size = n if n is not None and n < embed.num_embeddings else None
        return embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.head

    def set_output_embeddings(self, value):
        self.model.head = value

    # -- forward ----------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: LoopedCache | None = None,
        labels: torch.LongTensor | None = None,
        num_steps: int | None = None,
        prefill_steps: int | None = None,
        cache_kind: str | None = None,
        exit_tau: float | None = None,
        min_depth: int | None = None,
        exit_gate_threshold: float | None = None,
        example_ids: torch.Tensor | None = None,
        compile_decode: bool | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: LoopedCache | None = None,
    ) -> CausalLMOutputWithPast:
        """Next-token logits [B, L, V] (fp32) at `num_steps` recurrences (default config.num_steps).

        `attention_mask` [B, L]: left padding only (zeros, then ones); padded rows match the same
        prompt unpadded. `labels` [B, L]: mean next-token cross-entropy (shifted inside, -100
        ignored). With a `LoopedCache` (`cache`, or its old name `past_key_values`) the tokens are
        appended to it by the model's cached forward (no autograd): the first chunk of an empty
        cache runs at `prefill_steps` (default num_steps), later ones at `num_steps`.
        `example_ids` [B] seed each row's initial state (default: every row 0). `compile_decode` (default
        config.compile_decode): a cache this call starts runs its one-token appends through the
        compiled `DecodeStep` (`LoopedCache(compile=True)`). `use_cache=True` without a
        cache starts one (a `LoopedCache` of `cache_kind`, returned as `.cache`/`.past_key_values`, so
        the usual loop `out = m(ids, use_cache=True)`, `m(next, past_key_values=out.past_key_values)`
        continues it); only in eval mode, as the cached forward has no autograd. Unset, `use_cache`
        keeps the native forward (the config's `use_cache` is for `generate`).
        """
        if inputs_embeds is not None:
            raise ValueError("looplm takes input_ids, not inputs_embeds")
        if input_ids is None:
            raise ValueError("input_ids is required")
        if output_attentions or output_hidden_states:
            raise ValueError("looplm does not return attentions or hidden states")
        if return_dict is False:
            raise ValueError("looplm returns a CausalLMOutputWithPast only (return_dict=False is not supported)")
        if cache is None:
            cache = past_key_values
        elif past_key_values is not None:
            raise ValueError("pass either cache or past_key_values, not both")
        if cache is not None and not isinstance(cache, LoopedCache):
            raise ValueError(f"looplm needs a looplm.hf.LoopedCache, got {type(cache).__name__}")
        cfg = self.config
        kind = (cache.kind if cache is not None else None) or cache_kind or cfg.cache_kind
        cached = cache is not None or bool(use_cache)
        rule = cfg.depth_rule(num_steps, prefill_steps, exit_tau, min_depth, exit_gate_threshold, cached=cached)
        rule = cfg.check_rule(rule, kind)
        if cache is None and use_cache:
            if self.training:
                raise ValueError(
                    "use_cache=True needs eval mode (model.eval()): the cached forward runs without autograd"
                )
            cache = LoopedCache(kind, compile=self._compile_decode(compile_decode))
        B, n = input_ids.shape
        if example_ids is None:  # every row as if alone: its output does not depend on the batch
            example_ids = torch.zeros(B, dtype=torch.long, device=input_ids.device)
        else:  # a list or tensor of one id per row (one for several rows was broadcast silently)
            example_ids = torch.as_tensor(example_ids, dtype=torch.long, device=input_ids.device).reshape(-1)
            if example_ids.shape[0] != B:
                raise ValueError(f"example_ids has {example_ids.shape[0]} entries for {B} rows: give one per row")

        if cache is None:
            if exit_tau or (prefill_steps is not None and prefill_steps != rule.depth):
                raise ValueError(
                    "prefill_steps and exit_tau are for cached decoding (use_cache=True): a forward "
                    f"without a cache runs every token at num_steps={rule.depth}"
                )
            pad = left_padding(attention_mask, (B, n))
            positions = doc_ids = None
            if pad is not None:
                idx = torch.arange(n, device=input_ids.device)[None, :]
                positions = (idx - pad[:, None]).clamp(min=0)
                doc_ids = (idx >= pad[:, None]).long()  # padding and real tokens never see each other
            logits = self.model(
                input_ids,
                rule.prefill_plan(rule.depth),  # num_steps, and the exit gate's threshold when set
                doc_ids=doc_ids,
                positions=positions,
                init="seeded",
                example_ids=example_ids,
            ).logits
        else:
            logits = self._extend(input_ids, attention_mask, cache, rule, kind, example_ids)

        n_tok = cfg.tokenizer_vocab_size
        if n_tok is not None and n_tok < logits.shape[-1]:  # rows past the tokenizer are never a token
            logits = logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= n_tok, float("-inf"))
        loss = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(
                    f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(labels.shape)}"
                )
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        if isinstance(logits_to_keep, torch.Tensor):  # positions to keep (transformers allows either)
            logits = logits[:, logits_to_keep]
        elif logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)

    def _extend(self, input_ids, attention_mask, cache: LoopedCache, rule: DepthRule, kind: str, example_ids):
        if cache.inner is not None:
            return self._append(input_ids, attention_mask, cache, rule, kind, example_ids)
        try:  # the prompt: a refused or failed prefill leaves the cache empty, for the next call's prompt
            return self._append(input_ids, attention_mask, cache, rule, kind, example_ids)
        except BaseException:
            cache.reset()
            raise

    def _append(self, input_ids, attention_mask, cache: LoopedCache, rule: DepthRule, kind: str, example_ids):
        B, n = input_ids.shape
        if cache.inner is None:  # the prompt: allocate the looplm cache and prefill
            cache.allocate(self.config, B, rule.deepest, kind, input_ids.device, self.model.embed.weight.dtype)
            cache.pad = left_padding(attention_mask, (B, n))
            plan = rule.prefill_plan()
        else:
            c = cache.inner.length
            if B != cache.inner.batch:
                raise ValueError(f"the cache holds {cache.inner.batch} rows, input_ids has {B}")
            if attention_mask is not None:
                if tuple(attention_mask.shape) != (B, c + n):
                    raise ValueError(
                        f"attention_mask must cover the {c} cached and {n} new tokens, "
                        f"got shape {tuple(attention_mask.shape)}"
                    )
                if not bool(attention_mask[:, c:].bool().all()):
                    raise ValueError("tokens appended to a cache cannot be padding")
                old = left_padding(attention_mask[:, :c], (B, c)) if c else None
                if (old is None) != (cache.pad is None) or (old is not None and not torch.equal(old, cache.pad)):
                    raise ValueError("the attention_mask does not match the padding the cache was filled with")
            plan = rule.decode_plan()
        if cache.inner.length + n > cache.inner.max_len:
            raise ValueError(
                f"{cache.inner.length} cached + {n} new tokens exceed the cache length "
                f"{cache.inner.max_len} (the model context is max_seq_len={self.config.max_seq_len})"
            )
        first = cache.inner.length == 0
        if not first and n == 1 and cache.compile and rule.exit_gate is None:  # the step has no exit gate
            logits, used = cache.decode_step(self.model, input_ids[:, 0], rule, example_ids)
        else:
            with torch.no_grad():
                out = self.model(
                    input_ids, plan, cache=cache.inner, pad=cache.pad, init="seeded", example_ids=example_ids
                )
            logits, used = out.logits, out.depths
        if not first:  # a decode step: each row's depth (tensors: no device sync here)
            cache.record(used.reshape(B, -1), input_ids, rule.depth)
        elif cache.decode_depth is None:
            cache.decode_depth = rule.depth
        return logits

    # -- generate ---------------------------------------------------------------------------------
    last_generate_stats: dict | None = None
    _generation_cache: LoopedCache | None = None

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate`; afterwards `model.last_generate_stats` is
        {"mean_decode_depth": ...} (the mean recurrences per decoded token, as looplm's `generate`
        reports in `stats`: below num_steps with adaptive exit), or None when no cache was used.
        With return_dict_in_generate=True the output's `cache.mean_decode_depth` holds it too."""
        self.last_generate_stats, self._generation_cache = None, None
        try:
            out = super().generate(*args, **kwargs)
        finally:
            cache, self._generation_cache = self._generation_cache, None
        if cache is not None and cache.inner is not None:
            self.last_generate_stats = {
                "mean_decode_depth": cache.mean_decode_depth,
                "decode_steps": len(cache.depths_used),
            }
        return out

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    ):
        if generation_mode not in SUPPORTED_MODES or generation_config.num_beams > 1:
            raise ValueError(
                f"looplm generate supports greedy search and sampling only, not {generation_mode} "
                f"(num_beams={generation_config.num_beams}); use num_beams=1 and no assistant, "
                "contrastive or DoLa decoding"
            )
        if generation_config.prefill_chunk_size is not None:
            raise ValueError("looplm generate does not support prefill_chunk_size (the prompt is prefilled at once)")
        if generation_config.cache_implementation is not None:
            raise ValueError(
                "looplm uses its own cache; choose it with cache_kind='terminal' or 'full', "
                f"not cache_implementation={generation_config.cache_implementation!r}"
            )
        if max_cache_length > self.config.max_seq_len:  # with or without a cache: checked before any step
            raise ValueError(
                f"prompt plus new tokens ({max_cache_length + 1}) exceed the model context "
                f"max_seq_len={self.config.max_seq_len}; lower max_new_tokens"
            )
        user = model_kwargs.get("cache")
        if user is not None:
            if not isinstance(user, LoopedCache):
                raise ValueError(f"looplm needs a looplm.hf.LoopedCache, got {type(user).__name__}")
            if user.inner is not None:
                raise ValueError("looplm generate needs an empty LoopedCache (it cannot continue a filled one)")
            if user.max_len is not None and max_cache_length > user.max_len:
                raise ValueError(
                    f"prompt plus new tokens ({max_cache_length + 1}) exceed the given LoopedCache's "
                    f"max_len={user.max_len}; lower max_new_tokens or give a longer cache"
                )
            user._is_user_defined = True
            if model_kwargs.get("compile_decode"):  # asked for by this call: the user's cache takes it
                user.compile = True
            user.eos_ids = _eos_ids(generation_config)
            self._generation_cache = user
            return
        if generation_config.use_cache is False:
            # every step re-runs the whole sequence natively: the full cache's tokens at num_steps
            # (prefill_steps and exit_tau, which need a cache, are refused by the forward)
            return
        compile = self._compile_decode(model_kwargs.get("compile_decode"))
        # compiled: the cache spans the model context, so each call's step has the shapes of the last
        model_kwargs["cache"] = self._generation_cache = LoopedCache(
            model_kwargs.get("cache_kind"), max_len=None if compile else max_cache_length, compile=compile
        )
        self._generation_cache.eos_ids = _eos_ids(generation_config)

    def _compile_decode(self, asked: bool | None) -> bool:
        """Whether a cache started now runs its decode steps compiled: as asked, else the config's field."""
        return self.config.compile_decode if asked is None else asked

    def prepare_inputs_for_generation(
        self,
        input_ids,
        next_sequence_length=None,
        cache=None,
        attention_mask=None,
        inputs_embeds=None,
        is_first_iteration=False,
        **kwargs,
    ):
        if inputs_embeds is not None:
            raise ValueError("looplm generate takes input_ids, not inputs_embeds")
        if isinstance(cache, LoopedCache) and cache.inner is not None:
            input_ids = input_ids[:, cache.inner.length :]  # only what the cache lacks
        elif next_sequence_length is not None:
            input_ids = input_ids[:, -next_sequence_length:]
        if self.device.type != "meta" and input_ids.device != self.device:  # inputs follow the model
            input_ids = input_ids.to(self.device)
            attention_mask = attention_mask.to(self.device) if attention_mask is not None else None
        inputs = {"input_ids": input_ids.contiguous(), "attention_mask": attention_mask}
        if cache is not None:
            inputs["cache"] = cache
        for key, value in kwargs.items():
            if key not in ("labels", "next_sequence_length", "position_ids") and key not in inputs:
                inputs[key] = value
        return inputs
