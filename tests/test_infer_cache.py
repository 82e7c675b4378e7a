"""Caches and the chunked extend path (design §7) against the native forward and a naive reference."""

import math

import pytest
import torch
from _reference import naive_block as _naive_block
from _reference import naive_chunk_block as _naive_chunk_block

from looplm.config import INJECTIONS, ModelConfig
from looplm.infer import FullCache, TerminalCache, extend, make_cache
from looplm.model import LoopedLM
from looplm.model.state import seeded_normal

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread


def _model(injection="parcae-nonorm", **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32, injection=injection, **kw
    )
    return LoopedLM(cfg).eval()


@pytest.mark.parametrize("injection", INJECTIONS)
def test_extend_over_empty_terminal_cache_equals_native_forward(injection):
    m = _model(injection)
    x = torch.randint(0, 50, (3, 24))
    with torch.no_grad():
        ref = m(x, 5, init="seeded").logits
    got = extend(m, x, TerminalCache(m.cfg, 3, 32), 5).logits
    assert (got - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("injection", ["parcae-nonorm", "ortho", "huginn-linear", "deq-qkv"])
def test_full_cache_incremental_decoding_equals_native_forward(injection):
    m = _model(injection)
    x = torch.randint(0, 50, (2, 20))
    with torch.no_grad():
        ref = m(x, 4, init="seeded").logits
    cache = FullCache(m.cfg, 2, 32, depth=4)
    first = extend(m, x[:, :7], cache, 4).logits  # prefill a chunk, then one token at a time
    steps = [extend(m, x[:, i : i + 1], cache, 4).logits for i in range(7, 20)]
    got = torch.cat([first, *steps], dim=1)
    assert (got - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("injection", ["parcae-nonorm", "ortho", "huginn-linear", "deq-qkv"])
def test_terminal_decoding_matches_naive_reference(injection):
    """Token-by-token terminal decoding vs an explicit loop: each token's layers attend to the earlier
    tokens' terminal K/V plus its own current-recurrence K/V, computed by hand (no SDPA, no masks)."""
    m = _model(injection)
    cfg, R, T = m.cfg, 3, 12
    x = torch.randint(0, 50, (1, T))
    cache = TerminalCache(cfg, 1, 32)
    got = torch.cat([extend(m, x[:, t : t + 1], cache, R).logits for t in range(T)], dim=1)[0]
    n_layers = cfg.n_prelude + cfg.n_core + cfg.n_coda
    K = [[] for _ in range(n_layers)]
    V = [[] for _ in range(n_layers)]
    ref = []
    with torch.no_grad():
        for t in range(T):
            h = m.embed.weight[x[0, t]]
            for i, blk in enumerate(m.prelude):
                h, k, v = _naive_block(blk, h, t, K[i], V[i], cfg)
                K[i].append(k), V[i].append(v)
            q = m.injection.prepare(h[None, None])[0, 0]
            offs = m.injection.qkv_offsets(h[None, None])
            s = seeded_normal(torch.tensor([0]), torch.tensor([[t]]), cfg.d_model)[0, 0] / math.sqrt(cfg.d_model)
            for r in range(R):
                s = m.injection(s[None, None], q[None, None])[0, 0]
                for j, blk in enumerate(m.core):
                    li = cfg.n_prelude + j
                    o = tuple(z[0, 0] for z in offs[j]) if offs else None
                    s, k, v = _naive_block(blk, s, t, K[li], V[li], cfg, o)
                    if r == R - 1:
                        K[li].append(k), V[li].append(v)
                s = m.injection.exit(s[None, None])[0, 0]
            for i, blk in enumerate(m.coda):
                li = cfg.n_prelude + cfg.n_core + i
                s, k, v = _naive_block(blk, s, t, K[li], V[li], cfg)
                K[li].append(k), V[li].append(v)
            ref.append(m.head(m.norm(s)))
    assert (got - torch.stack(ref)).abs().max() <= 1e-4


@pytest.mark.parametrize("R", [1, 5, 16])
def test_terminal_over_full_bytes(R):
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
    ratio = TerminalCache(cfg, 2, 32).nbytes / FullCache(cfg, 2, 32, depth=R).nbytes
    n = cfg.n_prelude + cfg.n_core + cfg.n_coda
    assert ratio == n / (cfg.n_prelude + R * cfg.n_core + cfg.n_coda)
    if R == 5:
        assert ratio == pytest.approx(1 / 3)


def test_bad_cache_requests():
    m = _model()
    with pytest.raises(ValueError, match="unknown cache mode"):
        make_cache("paged", m.cfg, 1, 16, 5)
    with pytest.raises(ValueError, match="exceeds the model context"):
        TerminalCache(m.cfg, 1, 64)
    cache = TerminalCache(m.cfg, 1, 8)
    with pytest.raises(ValueError, match="exceed the cache length"):
        extend(m, torch.zeros(1, 9, dtype=torch.long), cache, 5)
    with pytest.raises(ValueError, match="depth"):
        extend(m, torch.zeros(1, 2, dtype=torch.long), cache, 0)


def test_adaptive_depth_limits_equal_fixed_depth():
    m = _model("ortho")
    x = torch.randint(0, 50, (2, 10))

    def run(**kw):
        cache = TerminalCache(m.cfg, 2, 32)
        extend(m, x[:, :9], cache, 5)
        step = extend(m, x[:, 9:], cache, 6, **kw)
        return (step.logits, step.depths), cache

    (never, used_never), c1 = run(exit_tau=1e-30)
    ref_cache = TerminalCache(m.cfg, 2, 32)
    extend(m, x[:, :9], ref_cache, 5)
    ref6 = extend(m, x[:, 9:], ref_cache, 6).logits
    assert (used_never == 6).all() and (never - ref6).abs().max() <= 1e-6
    (always, used_always), c2 = run(exit_tau=1e9, min_depth=3)
    ref_cache = TerminalCache(m.cfg, 2, 32)
    extend(m, x[:, :9], ref_cache, 5)
    ref3 = extend(m, x[:, 9:], ref_cache, 3).logits
    assert (used_always == 3).all() and (always - ref3).abs().max() <= 1e-6
    for a, b in zip(c2.banks(), ref_cache.banks()):  # the kept terminal K/V are those of recurrence 3
        assert torch.equal(a.k[:, :, :10], b.k[:, :, :10]) and torch.equal(a.v[:, :, :10], b.v[:, :, :10])


def test_adaptive_depth_rows_match_fixed_depth_at_their_own_exit():
    """One-token decoding: each row's exit recurrence is the one its relative state change gives, computed
    here from the states of a plain per-recurrence loop (the row by hand, no exit rule in the model), and
    its logits equal a batch-1 run at that fixed depth."""
    from _reference import NaiveDecoder, first_exit, relative_changes

    m = _model("parcae-nonorm")
    x = torch.randint(0, 50, (6, 8))
    changes = []
    for row in range(6):  # delta^r of each row's decoded token over 24 recurrences, by hand
        ref = NaiveDecoder(m, "terminal", example_id=row)
        ref.chunk(x[row, :7].tolist(), 5)
        changes.append(relative_changes(ref.chunk(x[row, 7:].tolist(), 24)[2])[:, 0])
    for tau in (0.2, 0.1, 0.05, 0.03, 0.02, 0.01, 0.005, 0.002, 0.001):
        want = [first_exit(c, tau) for c in changes]
        if len(set(want)) > 1:
            break
    assert len(set(want)) > 1, "no threshold separated the rows' exit depths"
    cache = TerminalCache(m.cfg, 6, 32)
    extend(m, x[:, :7], cache, 5)
    step = extend(m, x[:, 7:], cache, 24, exit_tau=tau, min_depth=1)
    logits, used = step.logits, step.depths
    assert used[:, 0].tolist() == want
    for row in range(6):
        single = TerminalCache(m.cfg, 1, 32)
        ids = torch.tensor([row])
        extend(m, x[row : row + 1, :7], single, 5, example_ids=ids)
        ref = extend(m, x[row : row + 1, 7:], single, want[row], example_ids=ids).logits
        assert (logits[row] - ref[0]).abs().max() <= 1e-5


def test_adaptive_depth_bad_settings():
    m = _model()
    x = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="terminal cache"):
        extend(m, x, FullCache(m.cfg, 1, 8, depth=4), 4, exit_tau=0.1)
    with pytest.raises(ValueError, match="exit_tau"):
        extend(m, x, TerminalCache(m.cfg, 1, 8), 4, exit_tau=0.0)
    with pytest.raises(ValueError, match="min_depth"):
        extend(m, x, TerminalCache(m.cfg, 1, 8), 4, exit_tau=0.1, min_depth=5)


@pytest.mark.parametrize("injection", ["parcae-nonorm", "ortho", "deq-qkv"])
def test_terminal_chunk_matches_naive_masked_reference(injection):
    """A chunk of n > 1 tokens against a terminal prefix: the reference attends to the prefix's terminal
    K/V and the chunk's current-recurrence K/V through an explicit mask."""
    m = _model(injection)
    cfg, R, P, n = m.cfg, 3, 6, 5
    x = torch.randint(0, 50, (1, P + n))
    cache = TerminalCache(cfg, 1, 32)
    for t in range(P):
        extend(m, x[:, t : t + 1], cache, R)
    got = extend(m, x[:, P:], cache, R).logits[0]
    # the prefix's terminal K/V, read back from the cache (their correctness is the test above)
    layers = [*cache.prelude, *cache.core, *cache.coda]
    K = [[b.k[0, :, t] for t in range(P)] for b in layers]
    V = [[b.v[0, :, t] for t in range(P)] for b in layers]
    pos = list(range(P, P + n))
    with torch.no_grad():
        h = m.embed.weight[x[0, P:]]
        for i, blk in enumerate(m.prelude):
            h, _, _ = _naive_chunk_block(blk, h, pos, K[i], V[i], cfg)
        q = m.injection.prepare(h[None])[0]
        offs = m.injection.qkv_offsets(h[None])
        s = seeded_normal(torch.tensor([0]), torch.tensor([pos]), cfg.d_model)[0] / math.sqrt(cfg.d_model)
        for r in range(R):
            s = m.injection(s[None], q[None])[0]
            for j, blk in enumerate(m.core):
                o = tuple(z[0] for z in offs[j]) if offs else None
                s, _, _ = _naive_chunk_block(blk, s, pos, K[cfg.n_prelude + j], V[cfg.n_prelude + j], cfg, o)
            s = m.injection.exit(s[None])[0]
        for i, blk in enumerate(m.coda):
            li = cfg.n_prelude + cfg.n_core + i
            s, _, _ = _naive_chunk_block(blk, s, pos, K[li], V[li], cfg)
        ref = m.head(m.norm(s))
    assert (got - ref).abs().max() <= 1e-4


@pytest.mark.parametrize("injection", ["parcae-nonorm", "deq-qkv"])
@pytest.mark.parametrize("r_pre,r_dec", [(2, 4), (1, 3), (4, 2)])
def test_full_cache_with_other_decode_depth_matches_naive_reference(injection, r_pre, r_dec):
    """Full cache (a bank per layer visit, built at max(R_pre, R_dec) visits) with R_dec != R_pre.

    The rule, per token: a token that ran R recurrences has core K/V for visits 0..R-1; a later token at
    recurrence r reads each earlier token's recurrence-min(r, R - 1) K/V. So at R_dec > R_pre a decode
    reads the prompt's terminal K/V in the banks the prefill never reached (r >= R_pre), and at
    R_dec < R_pre it reads the prompt's recurrence-r K/V (r < R_dec), never the deeper banks. The
    reference keeps every token's per-recurrence K/V in lists and attends by hand (no cache, no SDPA)."""
    m = _model(injection)
    cfg, P, n_steps, n_chunk = m.cfg, 6, 4, 3
    T = P + n_steps + n_chunk
    x = torch.randint(0, 50, (1, T))
    cache = FullCache(cfg, 1, 32, depth=max(r_pre, r_dec))
    got = [extend(m, x[:, :P], cache, r_pre).logits]  # prefill at R_pre
    got += [
        extend(m, x[:, t : t + 1], cache, r_dec).logits for t in range(P, P + n_steps)
    ]  # one-token decodes at R_dec
    got.append(extend(m, x[:, P + n_steps :], cache, r_dec).logits)  # then a chunk at R_dec
    got = torch.cat(got, dim=1)[0]

    depth_of = [r_pre] * P + [r_dec] * (T - P)
    pre_kv = [([], []) for _ in range(cfg.n_prelude)]
    coda_kv = [([], []) for _ in range(cfg.n_coda)]
    core_kv = []  # core_kv[t][r][j] = (k, v) of token t at recurrence r, core layer j
    ref = []
    with torch.no_grad():
        for t in range(T):
            h = m.embed.weight[x[0, t]]
            for blk, (K, V) in zip(m.prelude, pre_kv):
                h, k, v = _naive_block(blk, h, t, K, V, cfg)
                K.append(k), V.append(v)
            q = m.injection.prepare(h[None, None])[0, 0]
            offs = m.injection.qkv_offsets(h[None, None])
            s = seeded_normal(torch.tensor([0]), torch.tensor([[t]]), cfg.d_model)[0, 0] / math.sqrt(cfg.d_model)
            mine = []
            for r in range(depth_of[t]):
                s = m.injection(s[None, None], q[None, None])[0, 0]
                visit = []
                for j, blk in enumerate(m.core):
                    read = [core_kv[u][min(r, depth_of[u] - 1)][j] for u in range(t)]
                    o = tuple(z[0, 0] for z in offs[j]) if offs else None
                    s, k, v = _naive_block(blk, s, t, [a for a, _ in read], [b for _, b in read], cfg, o)
                    visit.append((k, v))
                mine.append(visit)
                s = m.injection.exit(s[None, None])[0, 0]
            core_kv.append(mine)
            for blk, (K, V) in zip(m.coda, coda_kv):
                s, k, v = _naive_block(blk, s, t, K, V, cfg)
                K.append(k), V.append(v)
            ref.append(m.head(m.norm(s)))
    assert (got - torch.stack(ref)).abs().max() <= 1e-4


# -- the banks after a step with per-row depths or adaptive exit -----------------------------------------
def _naive_decode(m, token, pos, example_id, prefix, depth, exit_tau=None, min_depth=1, core_prefix=None):
    """One token at `pos` through the model by hand, attending to `prefix` (per physical layer, the
    stored (K list, V list) of earlier tokens; `core_prefix[r]` replaces the core layers' entries at
    recurrence r, for a full cache), with the exit rule written out. Returns (logits, prelude K/V,
    [per recurrence: core K/V per layer], coda K/V, recurrences used)."""
    cfg = m.cfg
    n_pre, n_core = cfg.n_prelude, cfg.n_core
    h = m.embed.weight[token]
    pre = []
    for i, blk in enumerate(m.prelude):
        h, k, v = _naive_block(blk, h, pos, *prefix[i], cfg)
        pre.append((k, v))
    q = m.injection.prepare(h[None, None])[0, 0]
    s = seeded_normal(torch.tensor([example_id]), torch.tensor([[pos]]), cfg.d_model)[0, 0] / math.sqrt(cfg.d_model)
    visits, used = [], depth
    for r in range(depth):
        prev = s
        s = m.injection(s[None, None], q[None, None])[0, 0]
        core = prefix[n_pre : n_pre + n_core] if core_prefix is None else core_prefix[r]
        visit = []
        for j, blk in enumerate(m.core):
            s, k, v = _naive_block(blk, s, pos, *core[j], cfg)
            visit.append((k, v))
        visits.append(visit)
        s = m.injection.exit(s[None, None])[0, 0]
        if exit_tau is not None and r + 1 >= min_depth and float((s - prev).norm() / prev.norm()) < exit_tau:
            used = r + 1
            break
    coda = []
    for i, blk in enumerate(m.coda):
        s, k, v = _naive_block(blk, s, pos, *prefix[n_pre + n_core + i], cfg)
        coda.append((k, v))
    return m.head(m.norm(s)), pre, visits, coda, used


def _prefilled(m, mode, lengths, depth=3, cache_depth=4):
    """A cache whose row b holds a random prompt of lengths[b] tokens, each row prefilled alone
    (example id b) through a one-row view, as the serving engine does; and one next token per row."""
    g = torch.Generator().manual_seed(3)
    cache = make_cache(mode, m.cfg, len(lengths), 32, cache_depth)
    for b, n in enumerate(lengths):
        extend(
            m,
            torch.randint(0, m.cfg.vocab_size, (1, n), generator=g),
            cache.view(slice(b, b + 1)),
            depth,
            example_ids=torch.tensor([b]),
        ).logits
    return cache, torch.randint(0, m.cfg.vocab_size, (len(lengths), 1), generator=g)


def _stored(banks, b, n):
    """Copies of row b's first n K/V per bank: (K list, V list) each."""
    return [
        ([bank.k[b, :, t].clone() for t in range(n)], [bank.v[b, :, t].clone() for t in range(n)]) for bank in banks
    ]


def _assert_holds(bank, b, pos, kv, prefix):
    k, v = kv
    assert (bank.k[b, :, pos] - k).abs().max() <= 1e-5 and (bank.v[b, :, pos] - v).abs().max() <= 1e-5
    assert torch.equal(bank.k[b, :, :pos], torch.stack(prefix[0], 1))  # earlier tokens untouched
    assert torch.equal(bank.v[b, :, :pos], torch.stack(prefix[1], 1))


@pytest.mark.parametrize("rule", ["per-row depth", "adaptive exit"])
def test_terminal_banks_hold_each_tokens_kv_from_its_own_exit_recurrence(rule):
    """One decode step over rows of different lengths (per-row positions) in which the rows stop at
    different recurrences: every bank must hold each token's K/V from the recurrence it stopped at,
    not from the later ones that other rows still ran, checked against the token computed by hand."""
    from _models import decisive_model

    m = decisive_model(vocab_size=50, max_seq_len=32)
    lengths = [5, 9, 7]
    cache, nxt = _prefilled(m, "terminal", lengths)
    prefix = [_stored(cache.banks(), b, n) for b, n in enumerate(lengths)]
    view = cache.view(slice(0, 3), max_len=max(lengths) + 1, length=torch.tensor(lengths))
    if rule == "per-row depth":
        kw, depths, taus = dict(depth=torch.tensor([1, 4, 6])), [1, 4, 6], [None] * 3
    else:  # a row with exit_tau 0 never exits: it runs to the step's depth. The exits (2, 5, 8) lie two or
        # more recurrences apart: a row that leaves the batch recurrences before the next one stops shows
        # whether the recurring rows' states still move (adjacent exits such as 3, 4 hide a broken copy)
        kw, depths, taus = dict(depth=8, exit_tau=torch.tensor([0.5, 0.02, 0.0])), [8] * 3, [0.5, 0.02, None]
    step = extend(m, nxt, view, example_ids=torch.arange(3), **kw)
    logits, used = step.logits, step.depths
    with torch.no_grad():
        refs = [_naive_decode(m, int(nxt[b, 0]), lengths[b], b, prefix[b], depths[b], taus[b]) for b in range(3)]
    assert used[:, 0].tolist() == [r[4] for r in refs]
    assert len(set(used[:, 0].tolist())) == 3, used  # every row stopped at its own recurrence
    if rule == "adaptive exit":
        assert used[:, 0].tolist() == [2, 5, 8]
    for b, (ref_logits, pre, visits, coda, depth) in enumerate(refs):
        assert (logits[b, 0] - ref_logits).abs().max() <= 1e-4
        want = [*pre, *visits[depth - 1], *coda]  # the core layers: the K/V of the exit recurrence
        for bank, kv, stored in zip(cache.banks(), want, prefix[b]):
            _assert_holds(bank, b, lengths[b], kv, stored)


def test_full_cache_banks_after_a_step_with_per_row_depths():
    """Full cache (4 visits): a row that ran r recurrences holds its recurrence-v K/V in visits v < r
    and its terminal K/V in the visits it did not reach (design §7)."""
    from _models import decisive_model

    m = decisive_model(vocab_size=50, max_seq_len=32)
    lengths = [6, 4, 5]
    cache, nxt = _prefilled(m, "full", lengths, depth=4, cache_depth=4)
    n_pre = m.cfg.n_prelude
    outer = [_stored([*cache.prelude, *cache.core[0], *cache.coda], b, n) for b, n in enumerate(lengths)]
    visits = [[_stored(cache.core[r], b, n) for r in range(4)] for b, n in enumerate(lengths)]
    view = cache.view(slice(0, 3), max_len=max(lengths) + 1, length=torch.tensor(lengths))
    depths = [1, 4, 2]
    logits = extend(m, nxt, view, torch.tensor(depths), example_ids=torch.arange(3)).logits
    for b, depth in enumerate(depths):
        pos = lengths[b]
        with torch.no_grad():  # recurrence r reads the prefix's visit-r bank
            ref, pre, mine, coda, _ = _naive_decode(m, int(nxt[b, 0]), pos, b, outer[b], depth, core_prefix=visits[b])
        assert (logits[b, 0] - ref).abs().max() <= 1e-4
        stored = [*outer[b][:n_pre], *outer[b][-len(coda) :]]
        for bank, kv, prefix in zip([*cache.prelude, *cache.coda], [*pre, *coda], stored):
            _assert_holds(bank, b, pos, kv, prefix)
        for visit in range(4):
            for j, kv in enumerate(mine[min(visit, depth - 1)]):
                _assert_holds(cache.core[visit][j], b, pos, kv, visits[b][visit][j])


def test_full_cache_chunk_with_per_row_depths_keeps_each_rows_own_visits():
    """A chunk of several tokens with per-row depths [3, 5] on a full cache of depth 3: the deeper row's
    recurrences 3 and 4 reuse visit bank 2 and must not overwrite the shallower row's entries there.
    Reference: each row run alone at its own fixed depth (issue: row 0's visit-2 bank was overwritten)."""
    from _models import decisive_model

    m = decisive_model(vocab_size=50, max_seq_len=32)
    x = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(3))
    cache = FullCache(m.cfg, 2, 32, depth=3)
    extend(m, x, cache, torch.tensor([3, 5]), example_ids=torch.arange(2))
    nxt = torch.tensor([[7], [9]])
    logits = extend(m, nxt, cache, 3, example_ids=torch.arange(2)).logits[:, -1]
    for b, depth in enumerate([3, 5]):
        alone = FullCache(m.cfg, 1, 32, depth=3)
        extend(m, x[b : b + 1], alone, depth, example_ids=torch.tensor([b]))
        for visit in range(3):
            for j in range(m.cfg.n_core):
                for mine, ref in zip(
                    (cache.core[visit][j].k, cache.core[visit][j].v), (alone.core[visit][j].k, alone.core[visit][j].v)
                ):
                    assert (mine[b, :, :6] - ref[0, :, :6]).abs().max() <= 1e-5, (b, visit, j)
        ref = extend(m, nxt[b : b + 1], alone, 3, example_ids=torch.tensor([b])).logits[0, -1]
        assert (logits[b] - ref).abs().max() <= 1e-4


# -- chunks of more than one token: per-row depth and adaptive exit (design §7, §13) --------------------
def test_the_reference_decoder_is_the_native_forward_where_the_protocol_is_exact():
    """The hand-written decoder of `_reference` (used below and by generate, engine and Transformers tests):
    a prompt chunk is the parallel forward, and a full cache at one depth decodes like it too."""
    from _models import decisive_model
    from _reference import NaiveDecoder, plain_loop

    m = decisive_model(vocab_size=50, max_seq_len=32)
    x = torch.randint(0, 50, (1, 12))
    with torch.no_grad():
        native = m(x, 4, init="seeded").logits[0]
    assert (plain_loop(m, x, 4)[0][0] - native).abs().max() <= 1e-5
    for mode in ("terminal", "full"):
        ref = NaiveDecoder(m, mode)
        assert (ref.chunk(x[0, :7].tolist(), 4)[0] - native[:7]).abs().max() <= 1e-4
    steps = torch.stack([ref.step(int(t), 4)[0] for t in x[0, 7:]])  # the full cache, one token at a time
    assert (steps - native[7:]).abs().max() <= 1e-4


def _chunk_case(prefix: int):
    """A model, 2 rows of `prefix` + 6 tokens and a next token per row."""
    from _models import decisive_model

    m = decisive_model(vocab_size=50, max_seq_len=32)
    g = torch.Generator().manual_seed(5)
    return m, torch.randint(0, 50, (2, prefix + 6), generator=g), torch.randint(0, 50, (2, 1), generator=g)


@pytest.mark.parametrize("prefix", [0, 5])
def test_adaptive_exit_inside_a_chunk_freezes_each_token_at_its_own_exit(prefix):
    """A chunk of 6 tokens with exit_tau, after `prefix` cached tokens: tokens stop at different
    recurrences while the others go on. Each token's depth, each logit and the terminal K/V it leaves
    (seen by the next decoded token) equal a hand-written loop in which a stopped token's state stays
    frozen and the tokens still recurring read its exit recurrence's K/V (design §13)."""
    from _reference import NaiveDecoder

    m, x, nxt = _chunk_case(prefix)
    refs, tau = None, None
    for tau in (0.1, 0.05, 0.03, 0.02):  # a threshold at which the tokens stop at several depths before 10
        refs = []
        for b in range(2):
            ref = NaiveDecoder(m, "terminal", example_id=b)
            if prefix:
                ref.chunk(x[b, :prefix].tolist(), 3)
            refs.append((ref, *ref.chunk(x[b, prefix:].tolist(), 10, exit_tau=tau)[:2]))
        used = torch.stack([r[2] for r in refs])
        if len(set(used.flatten().tolist())) >= 3 and int(used.max()) < 10:
            break
    assert len(set(used.flatten().tolist())) >= 3 and int(used.max()) < 10, used
    cache = TerminalCache(m.cfg, 2, 32)
    if prefix:
        extend(m, x[:, :prefix], cache, 3)
    out = extend(m, x[:, prefix:], cache, 10, exit_tau=tau)
    assert torch.equal(out.depths, used)
    want = torch.stack([r[1] for r in refs])
    assert (out.logits - want).abs().max() <= 1e-4, (out.logits - want).abs().amax(-1)
    step = extend(m, nxt, cache, 4).logits[:, 0]  # reads each chunk token's exit-recurrence K/V
    for b, (ref, _, _) in enumerate(refs):
        assert (step[b] - ref.step(int(nxt[b, 0]), 4)[0]).abs().max() <= 1e-4


@pytest.mark.parametrize("prefix", [0, 5])
def test_per_row_depths_on_a_chunk_equal_each_row_at_its_own_depth(prefix):
    """A 6-token chunk with per-row depths [2, 7]: each row's logits equal the row alone at its own
    depth (over an empty cache: the native forward), and the next decoded token reads the row's K/V of
    that depth, not of the deepest row's."""
    from _reference import NaiveDecoder

    m, x, nxt = _chunk_case(prefix)
    depths = [2, 7]
    cache = TerminalCache(m.cfg, 2, 32)
    if prefix:
        extend(m, x[:, :prefix], cache, 3)
    out = extend(m, x[:, prefix:], cache, torch.tensor(depths))
    assert out.depths.tolist() == [[d] * 6 for d in depths]
    step = extend(m, nxt, cache, 4).logits[:, 0]
    for b, depth in enumerate(depths):
        ref = NaiveDecoder(m, "terminal", example_id=b)
        if prefix:
            ref.chunk(x[b, :prefix].tolist(), 3)
        else:
            with torch.no_grad():
                native = m(x[b : b + 1], depth, init="seeded", example_ids=torch.tensor([b])).logits[0]
            assert (out.logits[b] - native).abs().max() <= 1e-4
        assert (out.logits[b] - ref.chunk(x[b, prefix:].tolist(), depth)[0]).abs().max() <= 1e-4
        assert (step[b] - ref.step(int(nxt[b, 0]), 4)[0]).abs().max() <= 1e-4


# -- bookkeeping: the chunk's positions and mask, the cache's bounds, views and taken rows ---------------
def test_chunk_positions_and_mask_with_left_padding_by_hand():
    """`chunk(n, pad)` after c cached tokens: a real token sits at c + i - pad_b and attends to its row's
    real keys up to itself; a pad query sees itself only (no query has an empty row, which is NaN for
    attention kernels that do not special-case it) and sits at position 0."""
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
    pad = torch.tensor([0, 2, 5])
    for c, n in ((0, 6), (3, 4)):
        cache = TerminalCache(cfg, 3, 32)
        cache.length = c
        positions, mask = cache.chunk(n, pad, "cpu")
        assert mask.shape == (3, 1, n, c + n)
        for b in range(3):
            for i in range(n):
                q = c + i  # the query's cache position
                assert int(positions[b, i]) == max(0, q - int(pad[b])), (c, b, i)
                if q < pad[b]:
                    want = [key == q for key in range(c + n)]
                else:
                    want = [pad[b] <= key <= q for key in range(c + n)]
                assert mask[b, 0, i].tolist() == want, (c, b, i)


def test_a_chunk_may_fill_the_cache_to_its_last_position():
    """A chunk ending exactly at `max_len` fits (one more is refused): the logits equal the native forward
    (a full cache at the chunks' depth is exact)."""
    m = _model()
    x = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        ref = m(x, 3, init="seeded").logits
    cache = FullCache(m.cfg, 2, 8, depth=3)
    got = torch.cat([extend(m, x[:, :5], cache, 3).logits, extend(m, x[:, 5:], cache, 3).logits], 1)
    assert cache.length == 8 and (got - ref).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="exceed the cache length"):
        extend(m, x[:, :1], cache, 3)


@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_a_view_without_a_length_starts_empty(mode):
    """`view(rows)` without `length` is an empty cache over those rows (a serving slot's prefill), whatever
    the pointer of the cache it views: its chunk equals the native forward of that row alone."""
    m = _model()
    x, y = torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (1, 5))
    cache = make_cache(mode, m.cfg, 2, 32, 3)
    extend(m, x, cache, 3)
    view = cache.view(slice(1, 2))
    assert view.length == 0
    got = extend(m, y, view, 3, example_ids=torch.tensor([1])).logits
    with torch.no_grad():
        ref = m(y, 3, init="seeded", example_ids=torch.tensor([1])).logits
    assert (got - ref).abs().max() <= 1e-5
    assert cache.length == 7 and view.length == 5


@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_take_keeps_each_taken_rows_own_length(mode):
    """`take(rows)` of a cache with per-row lengths carries each taken row's length in the new order, so a
    one-token step on the taken rows equals the same step on the rows in place."""
    from _models import decisive_model

    m = decisive_model(vocab_size=50, max_seq_len=32)
    lengths = [5, 9, 7]
    cache, nxt = _prefilled(m, mode, lengths, cache_depth=4)
    cache.length = torch.tensor(lengths)
    rows = torch.tensor([2, 0])
    taken = cache.take(rows)
    assert taken.length.tolist() == [7, 5] and taken.batch == 2
    got = extend(m, nxt[rows], taken, 4, example_ids=rows).logits
    ref = extend(m, nxt, cache, 4, example_ids=torch.arange(3)).logits[rows]
    assert (got - ref).abs().max() <= 1e-5


def test_a_stopped_tokens_core_write_keeps_its_terminal_entry():
    """`slot("core", j, r, keep)`: a token still recurring (keep True) writes its K/V; a stopped one keeps
    its terminal K/V: in the full cache its entry of visit r - 1 (so chunk siblings read what a later token
    will), at visit 0 or past the cache's visits (the shared last bank) and in the terminal cache its own
    entry. Checked on the bank after `update` and on what attention reads, against `torch.where` by hand."""
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
    g = torch.Generator().manual_seed(6)
    keep = torch.tensor([[True, False, True], [False, False, True]])
    for cache, r, source in (
        (FullCache(cfg, 2, 8, depth=3), 1, lambda c: c.core[0][1]),
        (FullCache(cfg, 2, 8, depth=3), 2, lambda c: c.core[1][1]),
        (FullCache(cfg, 2, 8, depth=3), 0, lambda c: c.core[0][1]),
        (FullCache(cfg, 2, 8, depth=3), 4, lambda c: c.core[2][1]),
        (TerminalCache(cfg, 2, 8), 2, lambda c: c.core[1]),
    ):
        for bank in cache.banks():
            bank.k.normal_(generator=g), bank.v.normal_(generator=g)
        cache.length = 2
        old_k, old_v = source(cache).k[:, :, 2:5].clone(), source(cache).v[:, :, 2:5].clone()
        k, v = torch.randn(2, 2, 3, 8, generator=g), torch.randn(2, 2, 3, 8, generator=g)
        read_k, read_v = cache.slot("core", 1, r, keep).update(k, v)
        bank = cache.core_read(r, 1)
        want_k = torch.where(keep[:, None, :, None], k, old_k)
        want_v = torch.where(keep[:, None, :, None], v, old_v)
        assert torch.equal(bank.k[:, :, 2:5], want_k) and torch.equal(bank.v[:, :, 2:5], want_v), (cache.mode, r)
        assert torch.equal(read_k[:, :, 2:], want_k) and torch.equal(read_v[:, :, 2:], want_v), (cache.mode, r)
        assert read_k.shape[2] == 5


def test_extend_hands_its_seed_to_the_seeded_initial_state():
    """`extend(..., seed=k)` starts from the seeded state of seed k: the native forward with the same
    seed, and not the default seed's state."""
    m = _model()
    x, ids = torch.randint(0, 50, (2, 12)), torch.tensor([4, 9])
    with torch.no_grad():
        ref = m(x, 3, init="seeded", example_ids=ids, seed=7).logits
        seed0 = m(x, 3, init="seeded", example_ids=ids).logits
    got = extend(m, x, TerminalCache(m.cfg, 2, 32), 3, example_ids=ids, seed=7).logits
    assert (got - ref).abs().max() <= 1e-5
    assert (got - seed0).abs().max() > 1e-3
