"""Per-row depth and adaptive exit inside one batched one-token step (model/exits.py, design §13):
each row's logits and terminal K/V equal that row decoded alone at its own depth, and rows that
stopped leave the batch, so the core runs sum-of-depths row visits, not rows x deepest depth."""

from __future__ import annotations

import pytest
import torch

from looplm.config import ModelConfig
from looplm.infer import make_cache
from looplm.model import LoopedLM
from looplm.model.exits import DepthPlan

PROMPT = 9


def _model(**overrides) -> LoopedLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=50,
        d_model=32,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=64,
        max_seq_len=32,
        n_prelude=1,
        n_core=2,
        n_coda=1,
        **overrides,
    )
    return LoopedLM(cfg).eval()


def _prefilled(m, tokens, mode="terminal"):
    """A cache holding `tokens` [B, PROMPT] prefilled at depth 3 (every row in one batch)."""
    cache = make_cache(mode, m.cfg, tokens.shape[0], 16, 6)
    with torch.no_grad():
        m(tokens, 3, cache=cache, init="seeded", example_ids=torch.arange(tokens.shape[0]))
    return cache


def _alone(m, tokens, nxt, b, plan):
    """Row b decoded alone after its own prefill: (logits [V], used depth, core banks' K at the new position)."""
    cache = _prefilled(m, tokens)
    row = cache.view(slice(b, b + 1), length=PROMPT)
    with torch.no_grad():
        out = m(nxt[b : b + 1, None], plan, cache=row, init="seeded", example_ids=torch.tensor([b]))
    return out.logits[0, -1], int(out.depths[0, 0]), [bank.k[b, :, PROMPT].clone() for bank in cache.core]


def _rows_seen_by_the_core(m):
    seen = []
    hook = m.core[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[0]))
    return seen, hook


@pytest.mark.parametrize("per_row_length", [False, True])
def test_per_row_depths_equal_each_row_alone_and_cost_the_sum_of_depths(per_row_length):
    m = _model()
    tokens = torch.randint(0, 50, (3, PROMPT))
    nxt = torch.randint(0, 50, (3,))
    depths = torch.tensor([1, 4, 2])
    cache = _prefilled(m, tokens)
    if per_row_length:  # the serving engine's layout: per-row lengths
        cache.length = torch.full((3,), PROMPT)
    seen, hook = _rows_seen_by_the_core(m)
    with torch.no_grad():
        out = m(nxt[:, None], DepthPlan(depths), cache=cache, init="seeded", example_ids=torch.arange(3))
    hook.remove()
    assert seen == [3, 2, 1, 1]  # recurrence r runs the rows whose depth exceeds r: 1 + 4 + 2 visits
    assert out.depths[:, 0].tolist() == depths.tolist()
    for b in range(3):
        logits, used, keys = _alone(m, tokens, nxt, b, int(depths[b]))
        assert used == int(depths[b])
        assert (out.logits[b, -1] - logits).abs().max() <= 1e-5
        for bank, k in zip(cache.core, keys):  # the terminal bank holds the row's own last recurrence
            assert (bank.k[b, :, PROMPT] - k).abs().max() <= 1e-6


def test_adaptive_exit_rows_equal_each_row_alone():
    m = _model()
    tokens = torch.randint(0, 50, (4, PROMPT))
    nxt = torch.randint(0, 50, (4,))
    # per-row thresholds (0 = never exit), so rows stop at different depths
    taus = [0.3, 0.05, 0.01, 0.0]
    plan = DepthPlan(8, exit_tau=torch.tensor(taus), min_depth=1)
    cache = _prefilled(m, tokens)
    with torch.no_grad():
        out = m(nxt[:, None], plan, cache=cache, init="seeded", example_ids=torch.arange(4))
    used = out.depths[:, 0].tolist()
    assert len(set(used)) > 1, f"every row stopped at the same depth {used}: the test would not see compaction"
    for b in range(4):
        logits, alone_used, keys = _alone(m, tokens, nxt, b, DepthPlan(8, exit_tau=taus[b]) if taus[b] else 8)
        assert alone_used == used[b]
        assert (out.logits[b, -1] - logits).abs().max() <= 1e-5
        for bank, k in zip(cache.core, keys):
            assert (bank.k[b, :, PROMPT] - k).abs().max() <= 1e-6


def test_full_cache_per_row_depths_fill_the_unreached_visits():
    m = _model()
    tokens = torch.randint(0, 50, (2, PROMPT))
    nxt = torch.randint(0, 50, (2,))
    cache = _prefilled(m, tokens, "full")
    with torch.no_grad():
        out = m(nxt[:, None], DepthPlan(torch.tensor([1, 3])), cache=cache, init="seeded", example_ids=torch.arange(2))
    # row 0 stopped after one recurrence: every deeper visit holds its terminal K/V (its recurrence-1 K/V)
    for visit in range(1, 6):
        for j in range(len(m.core)):
            assert torch.equal(cache.core[visit][j].k[0, :, PROMPT], cache.core[0][j].k[0, :, PROMPT])
    assert torch.equal(cache.core[3][0].k[1, :, PROMPT], cache.core[2][0].k[1, :, PROMPT])
    assert out.depths[:, 0].tolist() == [1, 3]


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (DepthPlan(0), "depth must be in 1..64, got 0"),
        (DepthPlan(torch.tensor([2, 0])), "depth must be in 1..64, got 0"),
        (DepthPlan(4, exit_tau=0.0), "exit_tau > 0"),
        (DepthPlan(4, exit_tau=0.1, min_depth=5), "min_depth <= depth"),
        (DepthPlan(4, exit_gate=0.5), "needs a model with an exit gate"),
        # fractional depths were truncated (2.5 ran 2 recurrences) where `model(tokens, 2.5)` is refused
        (DepthPlan(2.5), "depth must be an integer"),
        (DepthPlan(torch.tensor([2.5, 3.0])), "per-row depths must be an integer tensor"),
        (DepthPlan(torch.tensor([True, True])), "per-row depths must be an integer tensor"),  # not depths 1
        (DepthPlan(4, exit_tau=0.1, min_depth=2.5), "min_depth must be an integer"),
        (DepthPlan(4, exit_tau=torch.tensor([0.1]), min_depth=torch.tensor([2.5])), "min_depth must be an integer"),
        # per-row thresholds with one min_depth: still bounded by the plan's depth, not the model's max_depth
        (DepthPlan(4, exit_tau=torch.tensor([0.1]), min_depth=5), "min_depth must be in 1..4, got 5"),
    ],
)
def test_plans_are_checked_once(plan, message):
    m = _model()
    with pytest.raises(ValueError, match=message):
        m(torch.zeros(1, 3, dtype=torch.long), plan, cache=make_cache("terminal", m.cfg, 1, 8, 4))


def test_adaptive_exit_needs_the_terminal_cache():
    m = _model()
    with pytest.raises(ValueError, match="needs the terminal cache"):
        m(torch.zeros(1, 3, dtype=torch.long), DepthPlan(4, exit_tau=0.1), cache=make_cache("full", m.cfg, 1, 8, 4))
    # nor does the parallel forward without a cache exit adaptively: a stopped token's K/V would be recomputed
    # from its frozen state at every later recurrence instead of staying its terminal K/V
    with pytest.raises(ValueError, match="needs the terminal cache"):
        m(torch.zeros(1, 3, dtype=torch.long), DepthPlan(4, exit_tau=0.1))


def test_a_row_with_exit_tau_zero_never_exits_even_where_the_state_stops_changing():
    """A row's exit_tau of 0 never exits (the rule is change < tau, strict): a core that is exactly the
    identity (no injection, s0 = e, every block's output maps zeroed) leaves a relative change of exactly 0,
    and still that row runs every recurrence, while a row with exit_tau 0.5 stops at the first."""
    m = _model(injection="none", state_init="input")
    with torch.no_grad():
        for block in m.core:
            block.attn.wo.weight.zero_()
            block.ffn.w2.weight.zero_()
    tokens = torch.randint(0, 50, (2, 5))
    plan = DepthPlan(4, exit_tau=torch.tensor([0.0, 0.5]), min_depth=1)
    with torch.no_grad():
        out = m(tokens, plan, cache=make_cache("terminal", m.cfg, 2, 8, 4), return_states=True)
    assert torch.equal(out.states[-1], out.states[0])  # the identity core: zero change at every recurrence
    assert out.depths.tolist() == [[4] * 5, [1] * 5]


@pytest.mark.parametrize("q", [0.0, 1.0])
def test_exit_gate_thresholds_zero_and_one_are_allowed(q):
    """q is a probability threshold in [0, 1], both ends allowed: q = 0 is reached at the first recurrence
    (every cumulative probability is >= 0), so the coda reads s^1: the logits of the fixed depth 1; q = 1 is
    reached at the last (where the cumulative probability is the whole mass; no hazard here rounds to 1):
    the fixed depth 4."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32, exit_gate=True)
    m = LoopedLM(cfg).eval()
    with torch.no_grad():
        for p in m.exit_gate.parameters():
            p.add_(torch.randn_like(p))
    tokens = torch.randint(0, 50, (2, 6))
    want_depth = 1 if q == 0.0 else 4
    with torch.no_grad():
        out = m(tokens, DepthPlan(4, exit_gate=q), init="seeded")
        want = m(tokens, want_depth, init="seeded").logits
    assert out.depths.unique().tolist() == [want_depth]
    torch.testing.assert_close(out.logits, want, rtol=1e-5, atol=1e-5)


def test_a_forward_with_per_row_depths_backpropagates_as_each_row_alone():
    # Exits.after changed `active` in place after torch.where kept it for backward: the forward was
    # right and .backward() failed. Reference: each row's own int-depth forward, its own gradient.
    m = _model().train()
    tokens = torch.randint(0, 50, (2, 5))
    out = m(tokens, DepthPlan(torch.tensor([3, 1])), init="seeded", example_ids=torch.arange(2))
    out.logits.square().sum().backward()
    got = m.core[0].ffn.w1.weight.grad.clone()
    m.zero_grad()
    for b, depth in enumerate((3, 1)):
        alone = m(tokens[b : b + 1], depth, init="seeded", example_ids=torch.tensor([b]))
        alone.logits.square().sum().backward()
    torch.testing.assert_close(got, m.core[0].ffn.w1.weight.grad, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="bptt_window"):  # it was silently full backprop here
        m(tokens, DepthPlan(torch.tensor([3, 1])), bptt_window=1)


def test_the_exit_gate_returns_only_the_states_asked_for():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32, exit_gate=True)
    m = LoopedLM(cfg).eval()
    with torch.no_grad():
        out = m(torch.randint(0, 50, (1, 6)), DepthPlan(4, exit_gate=0.5), return_states=True, keep_states=1)
        every = m(torch.randint(0, 50, (1, 6)), DepthPlan(4, exit_gate=0.5), return_states=True)
    assert len(out.states) == 1 and len(every.states) == 4


@pytest.mark.parametrize("overrides", [dict(injection="deq-qkv"), dict(value_embeds="odd")])
def test_compacted_rows_read_their_own_rows_of_the_context(overrides):
    """In a one-token step the rows still recurring take their own rows of the per-forward context
    (`Context.select`): DEQ-QKV's Q/K/V offsets and the core's value embeddings. Reference: each row
    decoded alone at its own depth (no compaction)."""
    m = _model(**overrides)
    tokens = torch.randint(0, 50, (3, PROMPT))
    nxt = torch.randint(0, 50, (3,))
    depths = torch.tensor([1, 4, 2])
    cache = _prefilled(m, tokens)
    with torch.no_grad():
        out = m(nxt[:, None], DepthPlan(depths), cache=cache, init="seeded", example_ids=torch.arange(3))
    for b in range(3):
        logits, used, _ = _alone(m, tokens, nxt, b, int(depths[b]))
        assert used == int(depths[b])
        assert (out.logits[b, -1] - logits).abs().max() <= 1e-5, b


def test_a_prefill_with_per_row_depths_keeps_each_rows_terminal_kv():
    """A multi-token chunk with per-row depths: a row that stopped must not write the visits it skips
    (`slot(keep=active)`), so its terminal K/V are those of its own last recurrence. Reference: each row
    prefilled alone at its integer depth, then the same next token decoded on both caches."""
    m = _model()
    tokens = torch.randint(0, 50, (2, PROMPT))
    nxt = torch.randint(0, 50, (2, 1))
    depths = (1, 3)
    cache = make_cache("terminal", m.cfg, 2, 16, 6)
    kw = dict(init="seeded", example_ids=torch.arange(2))
    with torch.no_grad():
        m(tokens, DepthPlan(torch.tensor(depths)), cache=cache, **kw)
        out = m(nxt, 2, cache=cache, **kw)
    for b, depth in enumerate(depths):
        alone = make_cache("terminal", m.cfg, 1, 16, 6)
        kw_b = dict(init="seeded", example_ids=torch.tensor([b]))
        with torch.no_grad():
            m(tokens[b : b + 1], depth, cache=alone, **kw_b)
            want = m(nxt[b : b + 1], 2, cache=alone, **kw_b).logits
        assert (out.logits[b] - want[0]).abs().max() <= 1e-5, b


def test_a_cached_chunk_without_logits_still_writes_the_coda_kv():
    """`compute_logits=False` with a cache skips only the head: the coda's K/V of the chunk are written,
    so the next token's logits equal the parallel forward over the whole sequence (full cache)."""
    m = _model()
    tokens = torch.randint(0, 50, (1, PROMPT + 1))
    kw = dict(init="seeded", example_ids=torch.tensor([0]))
    cache = make_cache("full", m.cfg, 1, 16, 3)
    with torch.no_grad():
        assert m(tokens[:, :PROMPT], 3, cache=cache, compute_logits=False, **kw).logits is None
        got = m(tokens[:, PROMPT:], 3, cache=cache, **kw).logits[0, -1]
        want = m(tokens, 3, **kw).logits[0, -1]
    assert (got - want).abs().max() <= 1e-5


def test_per_row_depths_keep_the_last_states_asked_for():
    """`keep_states` k with per-row depths (`with_exits`): exactly the last k of the per-recurrence states."""
    m = _model()
    tokens = torch.randint(0, 50, (2, 6))
    plan = DepthPlan(torch.tensor([4, 2]))
    kw = dict(init="seeded", example_ids=torch.arange(2), return_states=True)
    with torch.no_grad():
        every = m(tokens, plan, **kw).states
        kept = m(tokens, plan, keep_states=2, **kw).states
    assert len(every) == 4 and len(kept) == 2
    for a, b in zip(kept, every[-2:]):
        assert torch.equal(a, b)


def test_the_exit_gate_reads_every_state_whatever_keep_states():
    """The exit gate picks each token's exit recurrence from every state, also when the caller keeps only
    the last k (`keep_states`): the endpoint, the logits and the depths are those without `keep_states`,
    and the kept states are the last k of them."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32, exit_gate=True)
    m = LoopedLM(cfg).eval()
    with torch.no_grad():
        for p in m.exit_gate.parameters():  # a gate that exits tokens at different recurrences
            p.add_(torch.randn_like(p))
    tokens = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        every = m(tokens, DepthPlan(4, exit_gate=0.5), init="seeded", return_states=True)
        kept = m(tokens, DepthPlan(4, exit_gate=0.5), init="seeded", return_states=True, keep_states=2)
    assert len(set(every.depths.flatten().tolist())) > 1, "the gate picked one depth: the test would not see it"
    assert torch.equal(kept.depths, every.depths)
    torch.testing.assert_close(kept.logits, every.logits, rtol=0, atol=0)
    assert len(kept.states) == 2
    for a, b in zip(kept.states, every.states[-2:]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("min_depth", [1, 2, 3])
def test_an_exit_threshold_no_change_misses_stops_every_token_at_min_depth(min_depth):
    """exit_tau 1e9: every token stops at the first recurrence it may, r = min_depth (1..depth, both ends
    allowed): its logits and terminal K/V are those of the fixed depth min_depth."""
    m = _model()
    tokens = torch.randint(0, 50, (2, 6))
    got, fixed = make_cache("terminal", m.cfg, 2, 8, 3), make_cache("terminal", m.cfg, 2, 8, 3)
    with torch.no_grad():
        out = m(tokens, DepthPlan(3, exit_tau=1e9, min_depth=min_depth), cache=got, init="seeded")
        want = m(tokens, min_depth, cache=fixed, init="seeded")
    assert out.depths.unique().tolist() == [min_depth]
    assert (out.logits - want.logits).abs().max() <= 1e-5
    for a, b in zip(got.core, fixed.core):
        assert (a.k - b.k).abs().max() <= 1e-5


def test_the_exit_gate_takes_one_fixed_depth():
    """The gate reads each token's cumulative exit probability over one recurrence loop: per-row depths
    (as exit_tau) are refused with it."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32, exit_gate=True)
    m = LoopedLM(cfg).eval()
    for plan in (DepthPlan(torch.tensor([2, 3]), exit_gate=0.5), DepthPlan(3, exit_tau=0.1, exit_gate=0.5)):
        with pytest.raises(ValueError, match="exit_gate needs one fixed depth"):
            m(torch.zeros(2, 3, dtype=torch.long), plan, cache=make_cache("terminal", m.cfg, 2, 8, 4))
