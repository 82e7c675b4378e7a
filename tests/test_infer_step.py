"""`DecodeStep` (the static-shape one-token step, design §16) against the model's cached forward:
`extend` one token at a time on a twin cache (same prefill, same tokens). Per-token logits to 1e-5 and
every bank of the cache afterwards, in the terminal and the full cache, with left padding (`first` >
0), per-row lengths (`write_at` differing per row), per-row depths and adaptive exit. The compiled
step (one module-scoped instance, compiled once) equals the eager step, on the exit path and, with
several recurrences per graph (`unroll`), on the fixed-depth path and a verify chunk resumed from
its drafts' states."""

import time

import pytest
import torch
from _models import decisive_model

from looplm.infer import extend, make_cache
from looplm.infer.step import DecodeStep, StepRows, step_compile_options

TOL = 1e-5
V = 50
pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def model():
    """Context- and depth-sensitive (`_models`), TINY_MODEL-sized (vocab 50, 32 positions)."""
    return decisive_model(V, max_seq_len=32, max_depth=8)


def _twins(model, mode, prompts, depth, cache_depth=6, B=None):
    """Two identical caches holding the left-padded `prompts` prefilled at `depth`, and (tokens, pad)."""
    B, L = len(prompts), max(len(p) for p in prompts)
    pad = torch.tensor([L - len(p) for p in prompts])
    tokens = torch.zeros(B, L, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, L - len(p) :] = torch.tensor(p)
    cache = make_cache(mode, model.cfg, B, 32, cache_depth)
    extend(model, tokens, cache, depth, example_ids=torch.arange(B), pad=pad)
    twin = cache.take(torch.arange(B))
    return cache, twin, pad, L


def assert_banks_equal(a, b, tol=TOL):
    for i, (x, y) in enumerate(zip(a.banks(), b.banks(), strict=True)):
        assert (x.k - y.k).abs().max() <= tol and (x.v - y.v).abs().max() <= tol, i


def _prompts(B, seed=0, lo=2, hi=9):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, V, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(B)
    ]


@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_step_with_left_padding_equals_extend_token_by_token(model, mode):
    """Rows of different prompt lengths (first = pad > 0), all rows at depth R."""
    prompts = _prompts(3, seed=1)
    R = 4
    cache, twin, pad, L = _twins(model, mode, prompts, depth=3, cache_depth=R)
    step = DecodeStep(model, cache)
    ids = torch.arange(3)
    feed = torch.randint(0, V, (3, 6))
    for t in range(6):
        tok = feed[:, t]
        got, used = step(StepRows(tok, torch.full((3,), L + t), pad, ids), R)
        twin.length = L + t
        ref = extend(model, tok[:, None], twin, R, example_ids=ids, pad=pad)
        assert (got - ref.logits[:, -1]).abs().max() <= TOL, t
        assert used.tolist() == ref.depths[:, 0].tolist() == [R] * 3
        assert_banks_equal(cache, twin)


@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_a_step_over_a_shorter_key_range_equals_extend(model, mode):
    """`keys=K` (attend over positions [0, K) only, the serving engine's compiled steps): the same
    logits and banks as `extend` over the whole cache while every row ends inside K, K the exact end
    included; eagerly a K that cuts off a row's own position is an error."""
    prompts = _prompts(3, seed=4)
    R = 4
    cache, twin, pad, L = _twins(model, mode, prompts, depth=3, cache_depth=R)
    step = DecodeStep(model, cache)
    ids = torch.arange(3)
    for t in range(5):
        tok = torch.randint(0, V, (3,))
        keys = L + t + 1 if t % 2 else 16  # the exact end, then a rounded one
        got, _ = step(StepRows(tok, torch.full((3,), L + t), pad, ids), R, keys=keys)
        twin.length = L + t
        ref = extend(model, tok[:, None], twin, R, example_ids=ids, pad=pad)
        assert (got - ref.logits[:, -1]).abs().max() <= TOL, t
        assert_banks_equal(cache, twin)
    with pytest.raises(IndexError):  # eagerly a write outside the key range cannot land
        step(StepRows(tok, torch.full((3,), L + 5), pad, ids), R, keys=L + 5)
    with pytest.raises(ValueError, match="keys must be in"):
        step(StepRows(tok, torch.full((3,), L + 4), pad, ids), R, keys=33)


@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_key_range_views_are_dynamic_unless_the_step_keeps_static_keys(model, mode):
    """A compiled step's `keys` views carry a dynamic key length (one graph for every K), except with
    `static_keys` (a graph per K: the engine's prefill, whose K is its bucket); each bank is cut once
    (the terminal cache's recurrences share their banks' views)."""
    cache, *_ = _twins(model, mode, _prompts(2, seed=1), depth=2, cache_depth=3)
    for static, want in ((False, {2}), (True, set())):
        step = DecodeStep(model, cache, compile=True, static_keys=static)
        banks = step.banks(2, keys=16)
        for k, v, *_ in [*banks["prelude"], *(layer for visit in banks["core"] for layer in visit)]:
            assert k.shape[2] == v.shape[2] == 16
            assert set(getattr(k, "_dynamo_weak_dynamic_indices", set())) == want
        ids = {id(k) for visit in banks["core_kv"] for k, _ in visit}
        assert len(ids) == (model.cfg.n_core if mode == "terminal" else model.cfg.n_core * 3)


def _per_row(model, mode, *, depth=None, tau=None, floor=None, loop_depth, cache_depth=6, steps=5, check_depths=True):
    """Per-row lengths: a uniform prefill of 8, then row b writes at 8 - offset_b + t (rows overwrite
    their own tails, so the rows' lengths differ); the twin runs `extend` with per-row `cache.length`."""
    B = 4
    prompts = [torch.randint(0, V, (8,)).tolist() for _ in range(B)]
    cache, twin, _, L = _twins(model, mode, prompts, depth=3, cache_depth=cache_depth)
    offsets = torch.tensor([0, 3, 1, 5])
    zero = torch.zeros(B, dtype=torch.long)
    ids = torch.tensor([4, 1, 7, 2])
    step = DecodeStep(model, cache)
    seen_depths = set()
    for t in range(steps):
        tok = torch.randint(0, V, (B,))
        at = L - offsets + t
        rows = StepRows(
            tok,
            at,
            zero,
            ids,
            depth=depth,
            exit_tau=tau,
            min_depth=floor,
            lowest=int(floor.min()) if floor is not None else (int(depth.min()) if depth is not None else 1),
        )
        got, used = step(rows, loop_depth)
        twin.length = at.clone()
        kw = {} if tau is None else dict(exit_tau=tau, min_depth=floor)
        ref = extend(model, tok[:, None], twin, loop_depth if depth is None else depth, example_ids=ids, **kw)
        assert (got - ref.logits[:, -1]).abs().max() <= TOL, t
        assert used.tolist() == ref.depths[:, 0].tolist(), t
        seen_depths |= set(used.tolist())
        assert_banks_equal(cache, twin)
    return seen_depths


@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_step_with_per_row_lengths_equals_extend(model, mode):
    _per_row(model, mode, loop_depth=5)


@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_step_with_per_row_depths_equals_extend(model, mode):
    """Rows at 1, 5, 3, 6 recurrences in one step (full cache of depth 6: the shallow rows' unreached
    visits take their terminal K/V)."""
    depth = torch.tensor([1, 5, 3, 6])
    assert _per_row(model, mode, depth=depth, loop_depth=6) == {1, 3, 5, 6}


def test_step_with_adaptive_exit_equals_extend(model):
    """Terminal cache, per-row exit_tau (0 = never) and min_depth: each row stops at the recurrence the
    model's own exit rule gives, and its frozen state's K/V stay its terminal K/V."""
    depth = torch.tensor([8, 8, 6, 8])
    tau = torch.tensor([0.3, 0.0, 0.3, 0.15])
    floor = torch.tensor([1, 1, 2, 3])
    seen = _per_row(model, "terminal", depth=depth, tau=tau, floor=floor, loop_depth=8, steps=6)
    assert len(seen) >= 3 and min(seen) < 6, seen  # rows did exit at different recurrences


# -- compiled vs eager ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled(model):
    """One compiled step (inductor, windows of 2, one graph up to depth 3) on a terminal cache of 4 rows, traced once for the exit path (per-row depth,
    exit_tau, min_depth tensors: tau 0 and depth = max reproduce a plain row). (step, compile seconds)"""
    torch.manual_seed(5)
    cache, _, _, _ = _twins(model, "terminal", _prompts(4, seed=3), depth=3)
    # windows of 2: smaller graphs to compile; fixed depths up to 3 run as one graph
    step = DecodeStep(model, cache, compile=True, unroll=2, whole=3)
    start = time.perf_counter()
    step(_compiled_rows(torch.zeros(4, dtype=torch.long), torch.full((4,), 8), torch.zeros(4, dtype=torch.long)), 6)
    return step, time.perf_counter() - start


def _compiled_rows(tok, at, first):
    return StepRows(
        tok,
        at,
        first,
        torch.tensor([0, 1, 2, 3]),
        depth=torch.tensor([6, 6, 2, 4]),
        exit_tau=torch.tensor([0.0, 0.25, 0.0, 0.3]),
        min_depth=torch.tensor([1, 2, 1, 1]),
        lowest=1,
    )


@pytest.mark.slow
def test_compiled_step_equals_the_eager_step(model, compiled):
    """Left padding, per-row lengths, per-row depths and adaptive exit through one compiled graph: the
    logits (1e-5), the recurrences used and every bank equal the eager step on a twin cache."""
    step, seconds = compiled
    print(f"compile + first step: {seconds:.1f} s")
    for seed, (prompt_len, offsets) in enumerate([((3, 8, 5, 6), (0, 0, 0, 0)), ((8, 8, 8, 8), (0, 4, 2, 1))]):
        torch.manual_seed(seed)
        prompts = [torch.randint(0, V, (n,)).tolist() for n in prompt_len]
        cache, twin, pad, L = _twins(model, "terminal", prompts, depth=3)
        step.reset(cache)
        eager = DecodeStep(model, twin)
        offsets = torch.tensor(offsets)
        first = pad if offsets.eq(0).all() else torch.zeros(4, dtype=torch.long)
        for t in range(4):
            tok = torch.randint(0, V, (4,))
            rows = _compiled_rows(tok, L - offsets + t, first)
            got, used = step(rows, 6)
            ref, ref_used = eager(rows, 6)
            assert (got - ref).abs().max() <= TOL, (seed, t)
            assert used.tolist() == ref_used.tolist(), (seed, t)
            assert_banks_equal(cache, twin)
        # the fixed-depth path, unrolled: depth 7 = three windows of 2, then one recurrence, compiled by
        # inductor on the same prelude and coda graphs; against the eager step one recurrence at a time
        # and a shallow step (depth 3) as one graph; against the eager step in pieces
        plain = DecodeStep(model, twin, unroll=1, whole=0)
        for t, R in ((4, 7), (5, 7), (6, 3)):
            rows = StepRows(torch.randint(0, V, (4,)), L - offsets + t, first, torch.tensor([0, 1, 2, 3]))
            got, _ = step(rows, R)
            ref, _ = plain(rows, R)
            assert (got - ref).abs().max() <= TOL, (seed, t)
            assert_banks_equal(cache, twin)


def test_a_step_reset_onto_a_cache_of_another_length_equals_a_fresh_step(model):
    prompts = _prompts(2, seed=4)
    cache, twin, pad, L = _twins(model, "terminal", prompts, depth=3)
    step = DecodeStep(model, make_cache("terminal", model.cfg, 2, 12, 4))  # made for a 12-position cache
    step.reset(cache)  # the 32-position one
    rows = StepRows(torch.tensor([3, 4]), torch.full((2,), L), pad, torch.arange(2))
    got, _ = step(rows, 4)
    ref, _ = DecodeStep(model, twin)(rows, 4)
    assert (got - ref).abs().max() <= TOL


@pytest.mark.parametrize(("mode", "cache_depth"), [("terminal", 4), ("full", 4), ("full", 6)])
def test_a_chunk_per_row_equals_extend_of_the_chunk(model, mode, cache_depth):
    """The verify chunk of self-speculation: n tokens per row in one step (left-padded rows at their
    own first position) equal `extend` of the same chunk on the twin cache: every position's logits
    and every bank, the full cache deeper than the chunk's depth included (its unreached visits filled)."""
    prompts = _prompts(3, seed=7)
    cache, twin, pad, L = _twins(model, mode, prompts, depth=4, cache_depth=cache_depth)
    step = DecodeStep(model, cache)
    ids = torch.arange(3)
    chunk = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(8))
    got, used = step(StepRows(chunk, torch.full((3,), L), pad, ids), 4)
    ref = extend(model, chunk, twin, 4, example_ids=ids, pad=pad)
    assert got.shape == ref.logits.shape
    assert (got - ref.logits).abs().max() <= TOL
    assert_banks_equal(cache, twin)
    with pytest.raises(ValueError, match="one fixed depth"):
        step(StepRows(chunk, torch.full((3,), L), pad, ids, depth=torch.tensor([4, 3, 4])), 4)


# -- the fixed-depth path unrolled (`unroll`), and a verify chunk resumed from drafts, compiled ----------
UNROLL = 3


@pytest.fixture(scope="module")
def traced_unrolled(model):
    """A step with unroll = 3 traced by Dynamo (graphs and recompiles as `compile=True` makes them) whose
    captured (rewritten) graphs run eagerly, not compiled by inductor: these tests are about which windows run on which banks,
    which inductor's kernels do not change (inductor runs the unrolled path in the compiled-step test
    above); it spares the suite cold compiles of tens of seconds each."""
    return DecodeStep(model, compile=True, unroll=UNROLL, compile_options={"backend": "eager"})


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "cache_depth", "stepper"), [("terminal", 6, "traced_unrolled"), ("full", 6, "traced_unrolled")]
)
def test_compiled_unrolled_steps_equal_the_eager_step(model, request, mode, cache_depth, stepper):
    """Depths 7 = 2 x 3 + 1 and 5 = 3 + 2 (windows of 3, then a window of 2 or one recurrence; the full
    cache of depth 6 ends a window at its last visit, and depth 7 runs past it) through the compiled step,
    against the eager step without unrolling on a twin cache: logits (1e-5) and every bank."""
    step = request.getfixturevalue(stepper)
    prompts = _prompts(2, seed=11)
    cache, twin, pad, L = _twins(model, mode, prompts, depth=3, cache_depth=cache_depth)
    step.reset(cache)
    eager = DecodeStep(model, twin)
    ids = torch.arange(2)
    g = torch.Generator().manual_seed(12)
    for t, R in enumerate([7, 5, 7]):
        rows = StepRows(torch.randint(0, V, (2,), generator=g), torch.full((2,), L + t), pad, ids)
        got, _ = step(rows, R)
        ref, _ = eager(rows, R)
        assert (got - ref).abs().max() <= TOL, (t, R)
        assert_banks_equal(cache, twin)


@pytest.mark.parametrize(("mode", "depth"), [("terminal", 3), ("full", 3), ("full", 2)])
def test_a_shallow_step_is_one_graph_and_equals_extend(model, traced_unrolled, monkeypatch, mode, depth):
    """A one-token step at a fixed depth of at most `whole` recurrences (a draft) runs prelude,
    recurrences and coda as one compiled call, not three: the logits (1e-5), the state entering the
    coda and every bank equal `extend` at that depth on a twin cache (the full cache's deeper visits
    filled with terminal K/V)."""
    step = traced_unrolled
    prompts = _prompts(2, seed=21)
    cache, twin, pad, L = _twins(model, mode, prompts, depth=3, cache_depth=6)
    step.reset(cache)
    calls = {"shallow": 0, "pieces": 0}
    shallow = step.shallow

    def counted(*args, **kwargs):
        calls["shallow"] += 1
        return shallow(*args, **kwargs)

    def refused(*args, **kwargs):
        calls["pieces"] += 1
        raise AssertionError("a shallow step ran a piece of the long path")

    monkeypatch.setattr(step, "shallow", counted)
    for piece in ("begin", "recur", "recur_many", "end"):
        monkeypatch.setattr(step, piece, refused)
    ids = torch.arange(2)
    g = torch.Generator().manual_seed(22)
    for t in range(3):
        tok = torch.randint(0, V, (2,), generator=g)
        got, used, z = step(StepRows(tok, torch.full((2,), L + t), pad, ids), depth, endpoint=True)
        twin.length = L + t
        ref = extend(model, tok[:, None], twin, depth, example_ids=ids, pad=pad)
        assert (got - ref.logits[:, -1]).abs().max() <= TOL, t
        assert (z - ref.endpoint[:, -1]).abs().max() <= TOL, t
        assert used.tolist() == [depth] * 2
        assert_banks_equal(cache, twin)
    assert calls == {"shallow": 3, "pieces": 0}


@pytest.mark.parametrize(("mode", "depth"), [("terminal", 3), ("full", 3), ("full", 7)])
def test_drafts_feed_each_argmax_on_and_equal_extend(model, traced_unrolled, monkeypatch, mode, depth):
    """`DecodeStep.drafts`: k greedy one-token steps, each fed the argmax of the one before, against
    `extend` token by token at that depth on a twin cache with the argmax taken there: the tokens, the
    states entering the coda (1e-5) and the banks the drafts write. At a shallow depth (at most `whole`,
    inside a full cache's visits) the k steps are one call of one graph; past the full cache's 6 visits
    (depth 7) one step at a time. A full cache's visits past a shallow depth keep what they held (the
    verifier writes them)."""
    step, k = traced_unrolled, 4
    cache, twin, pad, L = _twins(model, mode, _prompts(2, seed=23), depth=3, cache_depth=6)
    before = cache.take(torch.arange(2))
    step.reset(cache)
    shallow = depth <= step.whole and (mode == "terminal" or depth <= cache.depth)
    calls = {"drafts": 0, "pieces": 0}
    drafts = step.greedy_drafts

    def counted(*args, **kwargs):
        calls["drafts"] += 1
        return drafts(*args, **kwargs)

    def piece(name):
        run = getattr(step, name)

        def counted_piece(*args, **kwargs):
            calls["pieces"] += 1
            return run(*args, **kwargs)

        return counted_piece

    monkeypatch.setattr(step, "greedy_drafts", counted)
    for name in ("shallow", "begin", "recur", "recur_many", "end"):
        monkeypatch.setattr(step, name, piece(name))
    ids, first = torch.arange(2), torch.tensor([11, 23])
    tokens, states = step.drafts(StepRows(first, torch.full((2,), L), pad, ids), depth, k, endpoint=True)
    assert (calls["drafts"], calls["pieces"] > 0) == ((1, False) if shallow else (0, True))
    fed = first
    for i in range(k):
        twin.length = L + i
        ref = extend(model, fed[:, None], twin, depth, example_ids=ids, pad=pad)
        assert (states[:, i] - ref.endpoint[:, -1]).abs().max() <= TOL, i
        fed = ref.logits[:, -1].argmax(-1)
        assert tokens[:, i].tolist() == fed.tolist(), i
    assert tokens.shape == (2, k) and states.shape == (2, k, model.cfg.d_model)
    if mode == "full" and depth < cache.depth:  # visits depth.. untouched; the rest as extend wrote them
        twin.core[depth:] = before.core[depth:]
    assert_banks_equal(cache, twin)


@pytest.mark.slow
def test_compiled_resumed_chunk_equals_the_eager_one(model, traced_unrolled):
    """Self-speculation's round on the full cache through the compiled unrolled step: drafts at depth 4
    (one graph: `whole`), then the verify chunk resumed from their states (the last draft catching up
    alone: a window of 3, then one recurrence) to depth 6 (a window of 2), against the eager step; a
    second round compiles no graph."""
    from torch._dynamo.utils import counters

    step = traced_unrolled
    cache, twin, pad, L = _twins(model, "full", _prompts(1, seed=13), depth=6, cache_depth=6)
    ids, r_d, k = torch.tensor([3]), 4, 3
    eager = DecodeStep(model, twin)
    step.reset(cache)
    g = torch.Generator().manual_seed(14)
    for round_ in range(2):
        at = L + round_ * (k + 1)
        fed = torch.randint(0, V, (1, k + 1), generator=g)
        states, ref_states = [], []
        for i in range(k):
            rows = StepRows(fed[:, i], torch.tensor([at + i]), pad, ids)
            got, _, z = step(rows, r_d, fill=False, endpoint=True)
            ref, _, ref_z = eager(rows, r_d, fill=False, endpoint=True)
            assert (got - ref).abs().max() <= TOL and (z - ref_z).abs().max() <= TOL
            states.append(z)
            ref_states.append(ref_z)
        rows = StepRows(fed, torch.tensor([at]), pad, ids)
        graphs = counters["stats"]["unique_graphs"]
        got, _ = step(rows, 6, resume=(torch.stack(states, 1), r_d))
        if round_ == 1:  # the first round compiled every graph a round runs
            assert counters["stats"]["unique_graphs"] == graphs
        ref, _ = eager(rows, 6, resume=(torch.stack(ref_states, 1), r_d))
        assert (got - ref).abs().max() <= TOL
        assert_banks_equal(cache, twin)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_cuda_graph_step_equals_the_eager_step(model, mode):
    """On CUDA the compiled step replays CUDA graphs (`reduce-overhead`): no piece may be skipped (the
    cache banks it writes are static inputs), its logits and banks equal the eager step's, and the
    logits a step returned survive the next step's replay (they are copies out of the graphs' pool)."""
    from torch._dynamo.utils import counters

    cuda = torch.device("cuda")
    net = decisive_model(V, max_seq_len=32, max_depth=8).to(cuda)
    tokens = torch.randint(0, V, (2, 7), device=cuda)
    pad, L = torch.tensor([0, 3], device=cuda), 7
    cache = make_cache(mode, net.cfg, 2, 32, 6, device=cuda)
    extend(net, tokens, cache, 3, example_ids=torch.arange(2, device=cuda), pad=pad)
    twin = cache.take(torch.arange(2, device=cuda))
    skips = counters["inductor"]["cudagraph_skips"]
    graphs, eager = DecodeStep(net, cache, compile=True), DecodeStep(net, twin)
    assert graphs.graphs
    kept = []
    for t in range(4):
        rows = StepRows(
            torch.randint(0, V, (2,), device=cuda),
            torch.full((2,), L + t, device=cuda),
            pad,
            torch.arange(2, device=cuda),
        )
        got, _ = graphs(rows, 6)
        ref, _ = eager(rows, 6)
        assert (got - ref).abs().max() <= 1e-4, t
        assert_banks_equal(cache, twin, tol=1e-4)
        kept.append((got, got.clone()))
    assert all(torch.equal(a, b) for a, b in kept)  # no returned tensor was overwritten by a later replay
    assert counters["inductor"]["cudagraph_skips"] == skips


def test_compile_options_merge_with_the_defaults_and_never_give_a_mode_and_options():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
    wrapper = {"cpp_wrapper": True, "size_asserts": False}
    assert step_compile_options(cpu) == {"options": wrapper}
    assert step_compile_options(cuda) == {"mode": "reduce-overhead"}
    # inductor options merge key by key (the C++ wrapper stays); on CUDA the graphs come along as an option
    assert step_compile_options(cpu, {"options": {"freezing": True}}) == {"options": {**wrapper, "freezing": True}}
    assert step_compile_options(cuda, {"options": {"freezing": True}}) == {
        "options": {"triton.cudagraphs": True, "freezing": True}
    }
    assert step_compile_options(cuda, {"mode": None, "options": {"triton.cudagraphs": False}}) == {
        "options": {"triton.cudagraphs": False}
    }
    # a mode replaces the defaults; other arguments are kept
    assert step_compile_options(cuda, {"mode": "default"}) == {"mode": "default"}
    assert step_compile_options(cpu, {"mode": "max-autotune"}) == {"mode": "max-autotune"}
    assert step_compile_options(cpu, {"backend": "eager"}) == {"options": wrapper, "backend": "eager"}
    for device, given in ((cpu, {"options": {}}), (cuda, {"options": {}}), (cuda, {}), (cpu, {"mode": "default"})):
        got = step_compile_options(device, given)
        assert not ("mode" in got and "options" in got), got  # torch.compile refuses both


def test_a_full_cache_step_in_which_every_row_stops_at_the_lowest_depth():
    """Every row at depth 1: the loop ends after the first visit, so the step's fill alone writes
    visits 2..D of the full cache, which a later deeper step reads. A fill starting one visit late
    went unnoticed (mixed depths run the loop to every visit); against `extend` on a twin cache."""
    torch.manual_seed(0)
    m = decisive_model(50, max_seq_len=32, max_depth=8)
    B, L, ids = 2, 5, torch.arange(2)
    a = make_cache("full", m.cfg, B, 32, 6)
    extend(m, torch.randint(0, 50, (B, L)), a, 6, example_ids=ids)
    b = a.take(torch.arange(B))
    step, pad = DecodeStep(m, a), torch.zeros(B, dtype=torch.long)
    for t, d in enumerate([1, 6]):
        tok = torch.randint(0, 50, (B,))
        got, _ = step(StepRows(tok, torch.full((B,), L + t), pad, ids, depth=torch.full((B,), d)), 6)
        want = extend(m, tok[:, None], b, torch.full((B,), d), example_ids=ids).logits[:, -1]
        assert (got - want).abs().max() <= 1e-5, f"step {t} at depth {d}"


@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_a_step_with_a_smaller_vocab_returns_those_tokens_logits_only(model, mode):
    """`vocab=k` (a tokenizer smaller than the model's padded embedding): a one-token step and a chunk
    per row return the first k logits of `extend`'s, [B, k] and [B, n, k], not the whole head."""
    k = 37
    cache, twin, pad, L = _twins(model, mode, _prompts(2, seed=21), depth=3, cache_depth=4)
    step, ids = DecodeStep(model, cache, vocab=k), torch.arange(2)
    tok = torch.tensor([5, 9])
    got, _ = step(StepRows(tok, torch.full((2,), L), pad, ids), 4)
    ref = extend(model, tok[:, None], twin, 4, example_ids=ids, pad=pad).logits[:, -1]
    assert got.shape == (2, k) and (got - ref[:, :k]).abs().max() <= TOL
    chunk = torch.tensor([[1, 2, 3], [4, 5, 6]])
    got, _ = step(StepRows(chunk, torch.full((2,), L + 1), pad, ids), 4)
    ref = extend(model, chunk, twin, 4, example_ids=ids, pad=pad).logits
    assert got.shape == (2, 3, k) and (got - ref[..., :k]).abs().max() <= TOL


@pytest.mark.parametrize("max_len", [32, 20])
def test_key_range_rounds_up_to_a_multiple_of_16_within_the_cache(model, max_len):
    """`key_range(needed)`: the fewest multiple of 16 positions that hold `needed`, capped at the cache
    (a range rounded down would cut off the rows' last positions)."""
    step = DecodeStep(model, make_cache("terminal", model.cfg, 1, max_len, 4))
    for needed in range(1, max_len + 1):
        want = min(max_len, 16 * ((needed + 15) // 16))
        assert step.key_range(needed) == want, needed
        assert step.key_range(needed) >= needed
