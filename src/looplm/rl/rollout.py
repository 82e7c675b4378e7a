"""Rollouts with terminal-KV decoding that save every token's endpoint (design §10, "Rollout").

G completions per prompt are sampled at depth R under the current parameters. Each fed token's
endpoint z^R (the state that entered the coda) is kept, stamped with the parameter version it was
computed under and a hash of the token ids, so the update can reuse it instead of replaying the R
recurrences, and can refuse it once it no longer describes the model or the tokens.

The rollout is returned in the layout the update scores in parallel: each row is
prompt + completion without its last token (the last sampled token is never fed), right-padded,
positions 0.. from the row's first real token; `mask` marks the positions whose next token is a
completion token. The initial state of every token is seeded by (example id, position) exactly as
in decoding, so a native forward on these rows recomputes the same trajectory start.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from looplm.data import Tokenizer
from looplm.errors import UserError
from looplm.infer.cache import make_cache
from looplm.infer.extend import extend
from looplm.infer.decode import TextStream, token_vocab
from looplm.infer.step import DecodeStep, StepRows


class SavedStateError(ValueError):
    """Saved rollout states that are missing, stale or do not belong to the tokens being scored."""


def parameter_version(model: torch.nn.Module) -> str:
    """A stamp that changes whenever any parameter is modified in place (an optimizer step,
    `load_state_dict`, `copy_`): torch bumps a tensor's version counter on every in-place write.
    Writes that bypass the counter are not seen: a fused optimizer's kernel (`AdamW(fused=True)`),
    a write through `.data`, `module.to(dtype)`. `looplm rl` steps a non-fused AdamW; a loop of your
    own around `score_and_backward` must too, or roll out afresh after every update."""
    versions = ",".join(f"{p._version}" for p in model.parameters())
    return f"{id(model):x}:" + hashlib.sha256(versions.encode()).hexdigest()[:16]


def token_hash(tokens: torch.Tensor, example_ids: torch.Tensor) -> str:
    """SHA-256 of the token ids, their shape and the rows' example ids (which seed s0)."""
    h = hashlib.sha256(str(tuple(tokens.shape)).encode())
    h.update(tokens.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    h.update(example_ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


@dataclass
class SavedStates:
    """Endpoints z^R of every token of a rollout, with what they were computed from."""

    endpoints: torch.Tensor | None
    """[N, L, d]: the state that entered the coda, per token of the scoring layout (zeros at padding)."""
    depth: int
    """Recurrences R the endpoints were computed with."""
    version: str
    """`parameter_version` of the model when the rollout ran."""
    tokens: str
    """`token_hash` of the rows the endpoints belong to."""


def check_saved_states(
    states: SavedStates | None, model, tokens: torch.Tensor, example_ids: torch.Tensor, depth: int
) -> torch.Tensor:
    """The saved endpoints if they describe `model` (unchanged since the rollout), these tokens and
    this depth; SavedStateError otherwise (design §10: saved states live until the next optimizer step)."""
    if states is None or states.endpoints is None:
        raise SavedStateError(
            "rollout-state reuse needs the endpoints saved during the rollout, and none were "
            "given; roll out with the current model or use the 'recompute' estimator"
        )
    now = parameter_version(model)
    if states.version != now:
        raise SavedStateError(
            f"stale saved states: they were computed at parameter version {states.version}, the "
            f"model is now at {now} (its parameters changed since the rollout); roll out again"
        )
    if states.tokens != token_hash(tokens, example_ids):
        raise SavedStateError("saved states do not belong to these tokens (token hash mismatch)")
    if states.depth != depth:
        raise SavedStateError(f"saved states were computed at depth {states.depth}, the update runs at depth {depth}")
    expected = (*tokens.shape, model.cfg.d_model)
    if tuple(states.endpoints.shape) != expected:
        raise SavedStateError(f"saved endpoints have shape {tuple(states.endpoints.shape)}, expected {expected}")
    return states.endpoints


@dataclass
class Rollout:
    """G sampled completions per prompt, in the parallel scoring layout (see the module doc)."""

    tokens: torch.Tensor
    """[N, L] prompt + completion[:-1], right-padded with the tokenizer's pad id."""
    targets: torch.Tensor
    """[N, L] the next token of each position (pad where there is none)."""
    mask: torch.Tensor
    """[N, L] True where the next token is a completion token (the policy's actions)."""
    example_ids: torch.Tensor
    """[N] ids that seed each row's initial state."""
    logprobs: torch.Tensor
    """[N, L] log-probability of each action under the sampling distribution (0 off the mask)."""
    prompt_lengths: list[int]
    completions: list[list[int]]
    """Sampled token ids per row, including the EOS or the token that completed a stop string."""
    texts: list[str]
    """Completion texts cut before the first stop string (what rewards read)."""
    group_size: int
    states: SavedStates
    stopped: list[bool]
    """Whether each row ended by EOS or a stop string (False: cut at max_new_tokens)."""

    @property
    def completion_lengths(self) -> list[int]:
        return [len(c) for c in self.completions]


@torch.no_grad()
def rollout(
    model,
    tokenizer: Tokenizer,
    prompts: Sequence[str],
    *,
    group_size: int,
    depth: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    stop: Sequence[str] = (),
    seed: int | Sequence[int] = 0,
    first_example_id: int = 0,
) -> Rollout:
    """Sample `group_size` completions of every prompt at `depth` with a terminal KV cache, saving
    each fed token's endpoint. Rows are grouped: row i*G + j is completion j of prompt i.

    `seed`: one int seeds one generator for the whole batch; a sequence gives one seed per prompt,
    and each prompt's group then samples from its own generator, so a group's completions do not
    depend on which other prompts share the batch (data-parallel RL splits the prompts over ranks)."""
    if group_size < 1:
        raise UserError(f"group_size must be >= 1, got {group_size}")
    if temperature <= 0:
        raise UserError(f"RL rollouts sample: temperature must be > 0, got {temperature}")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts:
        raise UserError("no prompts given")
    if not isinstance(seed, int) and len(seed) != len(prompts):
        raise UserError(f"{len(seed)} seeds for {len(prompts)} prompts; give one seed, or one per prompt")
    encoded = [tokenizer.encode_prompt(p) for p in prompts for _ in range(group_size)]
    if any(not ids for ids in encoded):
        raise UserError("a prompt is empty")
    longest = max(len(ids) for ids in encoded)
    if longest + max_new_tokens - 1 > model.cfg.max_seq_len:
        raise UserError(
            f"a prompt has {longest} tokens; with max_new_tokens {max_new_tokens} it exceeds the "
            f"context max_seq_len={model.cfg.max_seq_len}"
        )
    device = next(model.parameters()).device
    N, P = len(encoded), longest
    pad = torch.tensor([P - len(ids) for ids in encoded], device=device)
    left = torch.full((N, P), tokenizer.pad_id, dtype=torch.long, device=device)
    for i, ids in enumerate(encoded):
        left[i, P - len(ids) :] = torch.tensor(ids, device=device)
    ids_arg = first_example_id + torch.arange(N, device=device)
    cache = make_cache(
        "terminal", model.cfg, N, P + max_new_tokens - 1, depth, device=device, dtype=next(model.parameters()).dtype
    )
    out = extend(model, left, cache, depth, example_ids=ids_arg, pad=pad)
    vocab = token_vocab(model, tokenizer)  # a padded head's rows past the tokenizer are no actions
    logits, z_prompt = out.logits[:, -1, :vocab], out.endpoint
    if isinstance(seed, int):
        gens = [torch.Generator(device=device).manual_seed(seed)]
    else:
        gens = [torch.Generator(device=device).manual_seed(int(s)) for s in seed]
    rows_per_gen = N // len(gens)
    fed_z: list[torch.Tensor] = []  # endpoint of completion token j, [N, d], for j fed
    chosen, chosen_lp = [], []
    done = [False] * N
    ended = [False] * N
    lengths = [0] * N
    streams = [TextStream(tokenizer, stop, context=ids) for ids in encoded]  # stop strings, at a cost per token
    step = DecodeStep(model, cache, vocab=vocab)  # the decode step generate runs (design §16), returning endpoints
    for t in range(max_new_tokens):
        logp = torch.log_softmax(logits / temperature, dim=-1)
        probs = logp.exp()
        nxt = torch.cat(
            [
                torch.multinomial(probs[k * rows_per_gen : (k + 1) * rows_per_gen], 1, generator=g)[:, 0]
                for k, g in enumerate(gens)
            ]
        )
        chosen.append(nxt.tolist())
        chosen_lp.append(logp.gather(-1, nxt[:, None])[:, 0])
        for i in range(N):
            if done[i]:
                continue
            lengths[i] += 1
            if chosen[-1][i] == tokenizer.eos_id or streams[i].push(chosen[-1][i])[1]:
                done[i] = ended[i] = True
        if all(done) or t + 1 == max_new_tokens:
            break
        logits, _, z = step(StepRows(nxt, torch.full((N,), P + t, device=device), pad, ids_arg), depth, endpoint=True)
        fed_z.append(z)

    # the scoring layout: real tokens first, positions 0.. (the same seeds as in decoding)
    completions = [[chosen[j][i] for j in range(lengths[i])] for i in range(N)]
    L = max(len(e) + len(c) - 1 for e, c in zip(encoded, completions))
    d = model.cfg.d_model
    tokens = torch.full((N, L), tokenizer.pad_id, dtype=torch.long, device=device)
    targets = torch.full_like(tokens, tokenizer.pad_id)
    mask = torch.zeros(N, L, dtype=torch.bool, device=device)
    logprobs = torch.zeros(N, L, dtype=torch.float32, device=device)
    endpoints = torch.zeros(N, L, d, dtype=z_prompt.dtype, device=device)
    for i, (p_ids, c_ids) in enumerate(zip(encoded, completions)):
        row = p_ids + c_ids
        n_in, n_p = len(row) - 1, len(p_ids)
        tokens[i, :n_in] = torch.tensor(row[:-1], device=device)
        targets[i, :n_in] = torch.tensor(row[1:], device=device)
        mask[i, n_p - 1 : n_in] = True
        logprobs[i, n_p - 1 : n_in] = torch.stack([chosen_lp[j][i] for j in range(len(c_ids))])
        endpoints[i, :n_p] = z_prompt[i, P - n_p :]
        for j in range(len(c_ids) - 1):
            endpoints[i, n_p + j] = fed_z[j][i]
    for stream in streams:
        stream.finish()
    texts = [stream.text for stream in streams]
    states = SavedStates(endpoints, depth, parameter_version(model), token_hash(tokens, ids_arg))
    return Rollout(
        tokens,
        targets,
        mask,
        ids_arg,
        logprobs,
        [len(e) for e in encoded],
        completions,
        texts,
        group_size,
        states,
        ended,
    )
