"""What a run says before it starts: one line on the model and where it runs, and the warnings a
user should see before waiting (a paper-size preset on a CPU, a tokenizer other than the one asked for)."""

from __future__ import annotations

import dataclasses

import torch

from looplm.config import MODEL_PRESETS, ModelConfig

# A generous figure for a many-core CPU in fp32; a laptop is 10-20x slower, so the estimate is a floor.
CPU_FLOPS_PER_S = 1e12
PAPER_PRESETS = ("S", "M", "L")


def format_params(n: int) -> str:
    """0.87 M, 303.58 M, 2.49 B."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def count_params(cfg: ModelConfig) -> int:
    """Parameters of a LoopedLM of `cfg`, counted on the meta device (no memory, instant at any size)."""
    from looplm.model import LoopedLM

    with torch.device("meta"):
        return sum(p.numel() for p in LoopedLM(cfg).parameters())


def model_line(
    n_params: int,
    vocab: int,
    tokenizer,
    context: int,
    device,
    precision: str,
    rows: int | None = None,
    world_size: int = 1,
    extra: str = "",
    label: str = "model",
) -> str:
    """'model: 0.87 M params, vocab 258 (byte), context 256, device cpu, fp32'; `rows` (the training row
    length) is shown where it is shorter than the context, a padded vocabulary says how much is used."""
    used = tokenizer.vocab_size
    vocab_text = f"vocab {vocab:,} ({tokenizer.name}{f', {used:,} used' if used != vocab else ''})"
    ctx = f"context {context:,}" + (f" (rows of {rows:,})" if rows is not None and rows != context else "")
    where = f"device {device}" + (f" x {world_size} ranks" if world_size > 1 else "")
    return ", ".join(
        filter(None, [f"{label}: {format_params(n_params)} params", vocab_text, ctx, extra, where, precision])
    )


def precision_name(dtype: torch.dtype) -> str:
    return "fp32" if dtype == torch.float32 else "bf16 autocast"


def preset_of(cfg: ModelConfig) -> str | None:
    """The name of the model preset `cfg` has the shape of (the vocabulary aside), or None."""
    for name, preset in MODEL_PRESETS.items():
        if dataclasses.replace(cfg, vocab_size=preset.vocab_size) == preset:
            return name
    return None


def _duration(seconds: float) -> str:
    days = seconds / 86400
    if days >= 2:
        return f"{days:,.0f} days"
    return f"{seconds / 3600:.0f} hours"


def cpu_warning(
    cfg: ModelConfig, n_params: int, steps: int, tokens_per_step: int, flops_per_token: float, device
) -> str | None:
    """A warning line for a paper-size preset (S, M, L) about to train on a CPU, with the work its
    remaining `steps` are and how long that takes at CPU_FLOPS_PER_S; None otherwise."""
    name = preset_of(cfg)
    if torch.device(device).type != "cpu" or name not in PAPER_PRESETS or steps <= 0:
        return None
    flops = flops_per_token * tokens_per_step * steps
    return (
        f"warning: preset {name} on a CPU: {steps:,} steps of a {format_params(n_params)}-parameter model "
        f"({tokens_per_step:,} tokens a step, {flops:.1e} FLOPs) take about "
        f"{_duration(flops / CPU_FLOPS_PER_S)} even at {CPU_FLOPS_PER_S / 1e12:g} TFLOP/s; use a GPU "
        "(--train.device cuda) or the tiny preset"
    )


def tokenizer_warning(
    source: str, folder_tok, requested: str, bpe_vocab_size: int, requested_tok=None, trained_as: str | None = None
) -> str | None:
    """A warning line when a `looplm tokenize` folder's tokenizer replaces the one the job asks for
    (data.tokenizer, data.bpe_vocab_size), e.g. the S preset's 64,256-token BPE; None when they agree.
    `requested_tok`: the tokenizer data.tokenizer names, where it is a file (or byte); `trained_as`: the
    tokenizer the folder was asked to train ("bpe-N"; a small corpus gives fewer than N ids)."""
    if requested == "bpe":
        if folder_tok.name == "bpe" and (
            folder_tok.vocab_size == bpe_vocab_size or trained_as == f"bpe-{bpe_vocab_size}"
        ):
            return None
        asked = f"bpe, vocabulary {bpe_vocab_size:,}"
    else:
        if requested_tok is not None and requested_tok.fingerprint() == folder_tok.fingerprint():
            return None
        asked = f"{requested}, vocabulary {requested_tok.vocab_size:,}" if requested_tok is not None else requested
    return (
        f"warning: data.source {source} is a `looplm tokenize` folder: the run uses its tokenizer "
        f"({folder_tok.name}, vocabulary {folder_tok.vocab_size:,}), not data.tokenizer's ({asked})"
    )
