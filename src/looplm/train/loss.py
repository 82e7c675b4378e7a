"""The training objective of a microbatch: summed next-token cross-entropy at a drawn depth (design §6).

Two computations of the same sum: `full` takes the model's [B, L, V] fp32 logits and
`F.cross_entropy`; `chunked` lets the model run its head and the cross-entropy in row chunks
(`LoopedLM.cross_entropy_sum`), so the fp32 logits of the whole microbatch and their gradient
never exist (4.2 GB at 8 x 2048 tokens, V = 64256). The trainer uses chunked on CUDA; the CPU
default stays `full`, whose losses earlier CPU runs recorded bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from looplm.data import IGNORE_INDEX, Batch
from looplm.train.config import TrainConfig


def loss_kind(t: TrainConfig, device: torch.device) -> str:
    """'chunked' or 'full' for `t.cross_entropy` on `device` (auto: chunked on CUDA)."""
    kind = t.cross_entropy
    if kind not in ("auto", "full", "chunked"):
        raise ValueError(f"unknown cross_entropy {kind!r}; choose auto, full or chunked")
    return kind if kind != "auto" else ("chunked" if device.type == "cuda" else "full")


def parse_kernel_options(items: tuple[str, ...]) -> dict:
    """{"fwd_BLOCK_M": 128, "PRESCALE_QK": False, ...} from ("fwd_BLOCK_M=128", "PRESCALE_QK=false", ...):
    integers, or true/false."""
    options: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"flex kernel option {item!r} is not KEY=VALUE")
        low = value.strip().lower()
        if low in ("true", "false"):
            options[key.strip()] = low == "true"
        else:
            try:
                options[key.strip()] = int(value)
            except ValueError:
                raise ValueError(f"flex kernel option {item!r}: the value must be an integer, true or false") from None
    return options


def cross_entropy_sum(model, batch: Batch, depth: int, autocast, *, loss: str = "full", **forward_kw) -> torch.Tensor:
    """fp32 sum of next-token CE over the batch's supervised targets at `depth`; `forward_kw` go to the
    model's forward (bptt_window, state0, init, example_ids, attention, flex_options)."""
    with autocast:
        if loss == "chunked":
            return model(
                batch.inputs,
                depth,
                doc_ids=batch.doc_ids,
                positions=batch.positions,
                targets=batch.targets,
                **forward_kw,
            ).ce_sum
        out = model(batch.inputs, depth, doc_ids=batch.doc_ids, positions=batch.positions, **forward_kw)
    return F.cross_entropy(
        out.logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def microbatch_loss(
    model,
    batch: Batch,
    depth: int,
    bptt_window,
    state0,
    autocast,
    attention: str = "sdpa",
    *,
    loss: str = "full",
    flex_options: dict | None = None,
) -> torch.Tensor:
    """The training loss of one microbatch: CE sum at `depth` with backprop window `bptt_window` from the
    initial state `state0`."""
    kw = {"flex_options": flex_options} if attention == "flex" else {}
    return cross_entropy_sum(
        model, batch, depth, autocast, loss=loss, bptt_window=bptt_window, state0=state0, attention=attention, **kw
    )
