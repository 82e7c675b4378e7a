"""Independent references for the cached decode paths (design §7, §13, §15), written out by hand.

Nothing here calls the model's cached forward, its `Exits` bookkeeping or a cache class: attention is
an explicit softmax over lists of stored per-token K/V (no SDPA, no masks), the exit rule is the
documented one (a token stops once r >= min_depth and |s^r - s^(r-1)| / |s^(r-1)| < tau), and which
K/V an earlier token shows a later one is the protocol's rule, per token:

- inside one chunk, every token at recurrence r sees the chunk's recurrence-r K/V of the tokens still
  recurring, and a stopped token's K/V of its last recurrence (its terminal K/V, design §13);
- a token after the chunk sees, at recurrence r, an earlier token u's K/V of recurrence
  `u's last` (terminal cache) or `min(r, u's last)` (full cache sized for every depth it holds).

`NaiveDecoder` runs one sequence (a batch row alone) chunk by chunk under these rules; `plain_loop`
is the parallel forward without a cache, its recurrences written out with `run_prelude`,
`recurrence` and `run_coda`, with the freeze of stopped tokens. `sentencepiece_tokenizer` is a
SentencePiece-style tokenizer (Metaspace `▁` pieces), beside the byte and byte-level BPE ones.
"""

from __future__ import annotations

import functools
import math

import torch

from looplm.model.state import StateStart, seeded_normal


# -- one block by hand ---------------------------------------------------------------------------------
def rope(x, pos, base):
    hd = x.shape[-1]
    inv = [1.0 / base ** (2 * i / hd) for i in range(hd // 2)]
    ang = torch.tensor([pos * f for f in inv], dtype=torch.float64)
    c, s = ang.cos().float(), ang.sin().float()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def naive_chunk_block(block, x, positions, keys, values, cfg, offsets=None, frozen=None):
    """A block for a chunk x [n, d] at `positions`: each token attends to the stored prefix K/V
    (lists of [H_kv, hd]) and to the chunk's own K/V through an explicit causal mask; `frozen[i]`, when
    not None, is the (k, v) chunk token i shows instead of its own (a stopped token's terminal K/V).
    Returns (out [n, d], K [n, H_kv, hd], V [n, H_kv, hd])."""
    H, Hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    n, P = x.shape[0], len(keys)
    a = block.attn
    h = block.attn_norm(x)
    q, k, v = h @ a.wq.weight.T, h @ a.wk.weight.T, h @ a.wv.weight.T
    if offsets is not None:
        q, k, v = q + offsets[0], k + offsets[1], v + offsets[2]
    q = torch.stack([rope(q[i].view(H, hd), positions[i], cfg.rope_base) for i in range(n)])  # [n, H, hd]
    k = torch.stack([rope(k[i].view(Hkv, hd), positions[i], cfg.rope_base) for i in range(n)])
    v = v.view(n, Hkv, hd)
    if frozen is not None:
        k = torch.stack([k[i] if f is None else f[0] for i, f in enumerate(frozen)])
        v = torch.stack([v[i] if f is None else f[1] for i, f in enumerate(frozen)])
    K = torch.cat([torch.stack(keys), k]) if keys else k  # [P + n, Hkv, hd]
    V = torch.cat([torch.stack(values), v]) if values else v
    mask = torch.ones(n, P + n, dtype=torch.bool)
    mask[:, P:] = torch.ones(n, n, dtype=torch.bool).tril()
    out = []
    for head in range(H):
        g = head // (H // Hkv)
        scores = (q[:, head] @ K[:, g].T) / math.sqrt(hd)
        w = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out.append(w @ V[:, g])
    hres = x + torch.cat(out, dim=-1) @ a.wo.weight.T
    return hres + block.ffn(block.ffn_norm(hres)), k, v


def naive_block(block, x, pos, keys, values, cfg, offsets=None):
    """One block for a single token [d] attending to stored keys/values (lists of [H_kv, hd])."""
    out, k, v = naive_chunk_block(
        block, x[None], [pos], keys, values, cfg, None if offsets is None else tuple(o[None] for o in offsets)
    )
    return out[0], k[0], v[0]


def _plain(cfg) -> None:
    """The hand-written block covers looplm's own architecture (design §1-2), not the §14 switches."""
    assert (cfg.block_norm, cfg.qk_bias, cfg.value_embeds, cfg.qk_norm, cfg.ffn_act) == (
        "pre",
        False,
        "none",
        False,
        "swiglu",
    ), cfg
    assert cfg.state_init == "normal" and not cfg.state_std and not cfg.exit_gate, cfg
    assert cfg.embed_scale == 1 and not cfg.post_loop_norm and not cfg.coda_proj, cfg


# -- a sequence decoded by hand ------------------------------------------------------------------------
class NaiveDecoder:
    """One sequence through `model` chunk by chunk under the protocol's rules (module docstring), with
    the example id's seeded initial state at each absolute position.

    `mode`: "terminal" or "full" (the full cache as if sized for every depth it holds)."""

    def __init__(self, model, mode: str, example_id: int = 0):
        assert mode in ("terminal", "full")
        _plain(model.cfg)
        self.m, self.mode, self.example_id = model, mode, example_id
        cfg = model.cfg
        self.prelude = [([], []) for _ in range(cfg.n_prelude)]  # per layer: (K list, V list)
        self.coda = [([], []) for _ in range(cfg.n_coda)]
        self.core: list[list[list[tuple]]] = []  # core[t][r][j] = (k, v) of token t at recurrence r, layer j
        self.length = 0

    def _core_prefix(self, r: int, j: int):
        """What the earlier tokens show core layer j at recurrence r."""
        ks, vs = [], []
        for visits in self.core:
            k, v = visits[-1 if self.mode == "terminal" else min(r, len(visits) - 1)][j]
            ks.append(k), vs.append(v)
        return ks, vs

    @torch.no_grad()
    def chunk(self, ids, depth: int, exit_tau: float | None = None, min_depth: int = 1):
        """Append the tokens `ids` as one chunk at `depth` recurrences (adaptive exit with `exit_tau`).
        Returns (logits [n, V], used [n] recurrences, states [R, n, d]: s^1.. of every recurrence run,
        frozen tokens included, with s^0 first)."""
        m, cfg = self.m, self.m.cfg
        n = len(ids)
        pos = list(range(self.length, self.length + n))
        h = m.embed.weight[torch.tensor(ids)]
        for blk, (K, V) in zip(m.prelude, self.prelude):
            h, k, v = naive_chunk_block(blk, h, pos, K, V, cfg)
            K.extend(k), V.extend(v)
        q = m.injection.prepare(h[None])[0]
        offs = m.injection.qkv_offsets(h[None])
        s = seeded_normal(torch.tensor([self.example_id]), torch.tensor([pos]), cfg.d_model)[0] / math.sqrt(cfg.d_model)
        states = [s]
        active = torch.ones(n, dtype=torch.bool)
        used = torch.full((n,), depth)
        mine = [[] for _ in range(n)]  # per chunk token: its recurrences' K/V while it recurs
        for r in range(depth):
            prev = s
            s = m.injection(s[None], q[None])[0]
            visit = []
            for j, blk in enumerate(m.core):
                o = tuple(z[0] for z in offs[j]) if offs else None
                frozen = [None if active[t] else mine[t][-1][j] for t in range(n)]
                s, k, v = naive_chunk_block(blk, s, pos, *self._core_prefix(r, j), cfg, o, frozen)
                visit.append((k, v))
            s = m.injection.exit(s[None])[0]
            s = torch.where(active[:, None], s, prev)  # a stopped token's state stays frozen
            for t in range(n):
                if active[t]:
                    mine[t].append([(k[t], v[t]) for k, v in visit])
            stop = active & (r + 1 >= depth)
            if exit_tau is not None:
                change = (s - prev).norm(dim=-1) / prev.norm(dim=-1)
                stop |= active & (change < exit_tau) & (r + 1 >= min_depth)
            used[stop] = r + 1
            active &= ~stop
            states.append(s)
        for blk, (K, V) in zip(m.coda, self.coda):
            s, k, v = naive_chunk_block(blk, s, pos, K, V, cfg)
            K.extend(k), V.extend(v)
        self.core.extend(mine)
        self.length += n
        return m.head(m.norm(s)).float(), used, torch.stack(states)

    def step(self, token: int, depth: int, exit_tau: float | None = None, min_depth: int = 1):
        """One decoded token: (logits [V], recurrences used)."""
        logits, used, _ = self.chunk([token], depth, exit_tau, min_depth)
        return logits[0], int(used[0])


def relative_changes(states: torch.Tensor) -> torch.Tensor:
    """delta^r = |s^r - s^(r-1)| / |s^(r-1)| for r = 1..R from states [R + 1, ..., d]: [R, ...]."""
    return (states[1:] - states[:-1]).norm(dim=-1) / states[:-1].norm(dim=-1)


def first_exit(changes, tau: float, min_depth: int = 1) -> int:
    """The exit recurrence (1-based) of a token with relative changes `changes` [R]: the first
    r >= min_depth with delta^r < tau, else R."""
    for r, c in enumerate(changes.tolist(), start=1):
        if r >= min_depth and c < tau:
            return r
    return len(changes)


def decode_replay(
    model,
    mode: str,
    prompt: list[int],
    fed: list[int],
    prefill: int,
    depth: int,
    *,
    example_id: int = 0,
    exit_tau: float | None = None,
    min_depth: int = 1,
):
    """Logits [len(fed) + 1, V] and depths of a prompt prefilled at `prefill` and each token of `fed`
    decoded at `depth` (the row alone, by hand): row i scores the token after prompt + fed[:i]."""
    ref = NaiveDecoder(model, mode, example_id)
    logits, _, _ = ref.chunk(prompt, prefill)
    steps, used = [logits[-1]], [prefill]
    for t in fed:
        lg, u = ref.step(t, depth, exit_tau, min_depth)
        steps.append(lg), used.append(u)
    return torch.stack(steps), used


def greedy_replay(
    model,
    mode: str,
    prompt: list[int],
    n: int,
    prefill: int,
    depth: int,
    *,
    eos: int | None = None,
    example_id: int = 0,
    exit_tau: float | None = None,
    min_depth: int = 1,
):
    """Greedy ids (cut before `eos`) and each chosen token's log-probability, by hand."""
    ref = NaiveDecoder(model, mode, example_id)
    logits = ref.chunk(prompt, prefill)[0][-1]
    ids, lps = [], []
    for i in range(n):
        lp = logits.log_softmax(-1)
        tok = int(lp.argmax())
        if tok == eos:
            break
        ids.append(tok), lps.append(float(lp[tok]))
        if i + 1 < n:
            logits = ref.step(tok, depth, exit_tau, min_depth)[0]
    return ids, lps


# -- the parallel forward's recurrences written out -------------------------------------------------------
@torch.no_grad()
def plain_loop(
    model,
    tokens: torch.Tensor,
    depth: int,
    *,
    exit_tau=None,
    min_depth: int = 1,
    per_row_depth: list[int] | None = None,
    example_ids: torch.Tensor | None = None,
):
    """The no-cache forward of `tokens` [B, L] with the seeded initial state, one recurrence at a time
    through the model's public pieces, freezing each token once it stops (per-row depths or the exit
    rule). Returns (logits [B, L, V], used [B, L], states [R + 1, B, L, d] with s^0 first)."""
    B, L = tokens.shape
    ctx, s = model.begin(tokens, StateStart("seeded", example_ids=example_ids))
    limit = torch.full((B, L), depth) if per_row_depth is None else torch.tensor(per_row_depth)[:, None].expand(B, L)
    active = torch.ones(B, L, dtype=torch.bool)
    used = limit.clone()
    states = [s]
    for r in range(int(limit.max())):
        prev = s
        s = torch.where(active[..., None], model.recurrence(s, ctx), prev)
        stop = active & (r + 1 >= limit)
        if exit_tau is not None:
            stop |= active & ((s - prev).norm(dim=-1) / prev.norm(dim=-1) < exit_tau) & (r + 1 >= min_depth)
        used[stop] = r + 1
        active &= ~stop
        states.append(s)
    return model.run_coda(s, ctx.rope, ctx.mask, ctx), used, torch.stack(states)


# -- a SentencePiece-style tokenizer -------------------------------------------------------------------
SP_TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a looped model reuses the same blocks again and again",
    "stop here, then go on: the end is near",
    "café au lait, déjà vu and naïve words",
    "numbers 1 2 3 and more text for the pieces",
]


@functools.lru_cache(maxsize=None)
def sentencepiece_tokenizer():
    """A SentencePiece-style BPE (HF `tokenizers`): the Metaspace pre-tokenizer marks each word's
    leading space as `▁` and its decoder turns them back into spaces (dropping the first one), so a
    token's text depends on the tokens before it; `<eos>`, `<pad>` and `<unk>` are special. Wrapped
    by looplm's `BPETokenizer` (which takes any `tokenizers` backend)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from looplm.data import BPETokenizer

    backend = HFTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=160, special_tokens=["<eos>", "<pad>", "<unk>"], show_progress=False)
    backend.train_from_iterator(SP_TEXTS * 4, trainer=trainer)
    tok = BPETokenizer(backend)
    assert not tok._byte_level and any(backend.id_to_token(i).startswith("\u2581") for i in range(tok.vocab_size))
    return tok


# -- the depth-and-cache matrix the decode loops are checked on ---------------------------------------------
@torch.no_grad()
def window_replay_check(model, prompt_ids, emitted, sizes, depth, n, eos, example_id=0):
    """The prompt as one chunk, then each verify round's accepted window [last, d_1..d_a] as one chunk at
    `depth` (the final plain step, if any, a chunk of one); every emitted token must be the argmax of
    the chunk logits at its position, and EOS (or the budget) must end the output. `sizes`: the
    drafts accepted in each round, in order (self-speculation with the terminal cache, design §16)."""
    ref = NaiveDecoder(model, "terminal", example_id)
    predicted = [int(ref.chunk(list(prompt_ids), depth)[0][-1].argmax())]
    sizes = list(sizes)
    p = 0
    while p < len(emitted) and emitted[p] != eos:
        a = sizes.pop(0) if sizes else 0
        chunk = emitted[p : p + a + 1]
        logits = ref.chunk(chunk, depth)[0]
        predicted += [int(x) for x in logits.argmax(-1)]
        p += len(chunk)
    assert emitted == predicted[: len(emitted)], (emitted, predicted)
    assert emitted[-1] == eos or len(emitted) == n


DEPTH_CASES = [
    # (cache, prefill depth, decode depth, exit_tau): prefill < = > decode in both caches, and adaptive exit
    ("terminal", 2, 5, None),
    ("terminal", 4, 4, None),
    ("terminal", 6, 3, None),
    ("full", 2, 5, None),
    ("full", 4, 4, None),
    ("full", 6, 3, None),
    ("terminal", 3, 8, 0.05),
]
DEPTH_IDS = [f"{c}-pre{p}-dec{d}" + ("-tau" if t else "") for c, p, d, t in DEPTH_CASES]
