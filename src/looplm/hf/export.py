"""`export(checkpoint, out)`: a looplm checkpoint as a transformers model folder.

The folder holds config.json (`LoopedLMConfig`), model.safetensors and the tokenizer files of a
`PreTrainedTokenizerFast` (with looplm's chat template), so `AutoModelForCausalLM.from_pretrained(out)` and
`AutoTokenizer.from_pretrained(out)` load it offline (after `import looplm`). It also holds
looplm_export.json (source, tokenizer name, the checkpoint's job config and data record) and looplm_tokenizer/
(looplm's own tokenizer files), so `looplm eval/generate/analyze OUT` read the folder as a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from looplm.checkpoint import HF_EXPORT_INFO, HF_LOOPLM_TOKENIZER, follow_umask
from looplm.data.chat import CHAT_TEMPLATE_JINJA
from looplm.data.tokenizer import EOS_TOKEN, PAD_TOKEN, BPETokenizer, ByteTokenizer, Tokenizer
from looplm.errors import UserError


def _byte_symbols() -> list[str]:
    """The printable character standing for each byte 0..255 in byte-level vocabularies: printable
    Latin-1 bytes stand for themselves, the others are shifted to 256, 257, ... in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    symbols, shift = [], 0
    for b in range(256):
        if b in keep:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + shift))
            shift += 1
    return symbols


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A fast tokenizer equal to looplm's ByteTokenizer: ids 0..255 are the UTF-8 bytes, 256 `<eos>`,
    257 `<pad>`; no special token is added and left padding is the default."""
    vocab = {symbol: b for b, symbol in enumerate(_byte_symbols())}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    assert backend.token_to_id(EOS_TOKEN) == 256 and backend.token_to_id(PAD_TOKEN) == 257
    return _wrap(backend, 256, 257)


def _wrap(backend: HFTokenizer, eos_id: int, pad_id: int, bos_id: int | None = None) -> PreTrainedTokenizerFast:
    # split_special_tokens: a literal "<eos>" in text stays text, as in looplm's tokenizers. The special
    # tokens added to every text are the BOS policy's and nothing else (`Tokenizer.encode_prompt`).
    if bos_id is None:
        backend.post_processor = None
    else:
        bos = backend.id_to_token(bos_id)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)]
        )
    extra = {} if bos_id is None else {"bos_token": backend.id_to_token(bos_id)}
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=backend.id_to_token(eos_id),
        pad_token=backend.id_to_token(pad_id),
        padding_side="left",
        split_special_tokens=True,
        clean_up_tokenization_spaces=False,
        **extra,
    )


def hf_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers tokenizer of a looplm tokenizer (byte or BPE)."""
    if isinstance(tokenizer, ByteTokenizer):
        return byte_tokenizer()
    if isinstance(tokenizer, BPETokenizer):
        return _wrap(HFTokenizer.from_str(tokenizer.backend_json), tokenizer.eos_id, tokenizer.pad_id, tokenizer.bos_id)
    raise UserError(f"cannot export tokenizer {tokenizer!r}: expected a looplm ByteTokenizer or BPETokenizer")


def export(
    checkpoint: str | Path,
    out: str | Path,
    *,
    num_steps: int | None = None,
    prefill_steps: int | None = None,
    cache_kind: str = "terminal",
) -> Path:
    """Write the looplm checkpoint (a checkpoint or run folder) as a transformers folder `out`;
    `num_steps` (default 5, or the model's max_depth when smaller), `prefill_steps` and `cache_kind` become the config's generation defaults (named
    as its keys; `LoopedLMConfig.depth_rule` maps them to looplm's `DepthRule`, which checks them)."""
    import torch

    from looplm.checkpoint import load_data, load_model
    from looplm.hf.modeling import LoopedLMForCausalLM

    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / HF_EXPORT_INFO).is_file())):
        raise UserError(
            f"{out} exists and is not empty (nor an earlier `looplm export`): export into a new or empty folder"
        )
    model, tokenizer, job = load_model(checkpoint)
    fields = {"prefill_steps": prefill_steps, "cache_kind": cache_kind, "bos_token_id": tokenizer.bos_id}
    fields["num_steps"] = min(5, model.cfg.max_depth) if num_steps is None else num_steps
    hf = LoopedLMForCausalLM.from_looplm(model, tokenizer, dtype=next(model.parameters()).dtype, **fields)
    out.mkdir(parents=True, exist_ok=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' "Writing model shards" bar for a one-file model
    try:
        with torch.no_grad():
            hf.save_pretrained(out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    follow_umask(*out.glob("*.safetensors"))  # transformers writes them with safetensors' 0600
    hf_tok = hf_tokenizer(tokenizer)
    hf_tok.chat_template = CHAT_TEMPLATE_JINJA  # the template `looplm serve` documents (vLLM's chat endpoint reads it)
    hf_tok.model_max_length = model.cfg.max_seq_len  # so truncation=True cuts at the context (not at 1e30)
    hf_tok.save_pretrained(out)
    # for looplm's own commands (looplm.checkpoint.load_model): its tokenizer files (whose names
    # collide with transformers' ones, hence a subfolder) and the training job (held-out data)
    tokenizer.save(out / HF_LOOPLM_TOKENIZER)
    info = {"source": str(Path(checkpoint).resolve()), "tokenizer": tokenizer.name}
    if "data" in job:  # a job that records its training data (not a bare HF folder's)
        info["job"] = dict(job)
        info["data"] = load_data(checkpoint).to_dict()
    (out / HF_EXPORT_INFO).write_text(json.dumps(info, indent=1, default=str) + "\n")
    return out
