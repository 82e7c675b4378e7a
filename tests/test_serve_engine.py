"""The continuous-batching engine, at the level of log-probabilities: every generated token's
log-probability, its top-k alternatives (by token) and its depth equal a replay of the request alone
(prefill alone, then one token at a time) to 1e-5, over mixed prompt lengths, prefill and decode
depths, adaptive exit, both caches and slot moves; with the full cache at one depth they equal the
native forward without a cache. Also: greedy and seeded-sampled text equal `generate` on each prompt
alone, slot bookkeeping, cancellation, stop strings, refusals and counters.

The model is `_models.decisive_model`: its argmax depends on context and depth, so a cache that
reads the wrong K/V changes log-probabilities far beyond the tolerance (and usually the text)."""

import random

import pytest
import torch
from _models import decisive_model
from _reference import DEPTH_CASES, decode_replay

from looplm.data import ByteTokenizer
from looplm.infer import extend, make_cache
from looplm.infer.generate import DepthRule, SamplingConfig, generate
from looplm.infer.prefill import Prefill
from looplm.serve import Engine, EngineConfig, EngineFull, EngineStopped, Finish, Request, Token
from looplm.errors import UserError
from looplm.serve.engine import PromptLogprobs
from looplm.serve.slots import SlotPool

TOK = ByteTokenizer()
TOL = 1e-5
pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def model():
    return decisive_model(TOK.vocab_size, max_depth=8)


def _alone(model, prompt: str, req: Request, mode: str, stats: dict | None = None) -> str:
    return generate(
        model, TOK, [prompt], req.rule, cache=mode, sampling=req.sampling, stats=stats, example_ids=[req.example_id]
    )[0]


@torch.no_grad()
def replay(model, req: Request, ids: list[int], mode: str, cache_depth: int) -> list[tuple[torch.Tensor, int]]:
    """(log-probabilities, depth) of the step that produced each of `ids`, from the request alone in a
    fresh one-row cache: its prompt prefilled at its prefill depth, then `ids` fed one at a time at
    its decode depth (with its exit rule)."""
    cache = make_cache(mode, model.cfg, 1, len(req.prompt_ids) + len(ids), cache_depth)
    example, rule = torch.tensor([req.example_id]), req.rule
    logits = extend(model, torch.tensor([req.prompt_ids]), cache, rule.prefill, example_ids=example).logits[0, -1]
    out = [(logits.log_softmax(-1), rule.prefill)]
    kw = {} if rule.exit_tau is None else dict(exit_tau=rule.exit_tau, min_depth=rule.min_depth)
    for t in ids[:-1]:
        step = extend(model, torch.tensor([[t]]), cache, rule.depth, example_ids=example, **kw)
        out.append((step.logits[0, -1].log_softmax(-1), int(step.depths)))
    return out


def assert_logprobs_equal(tokens: list[Token], ref: list[tuple[torch.Tensor, int]], k: int, greedy: bool) -> None:
    """Each token's depth, log-probability and top-k (compared by token id) against `ref`."""
    assert len(tokens) == len(ref)
    for i, (t, (lp, depth)) in enumerate(zip(tokens, ref)):
        assert t.depth == depth, i
        assert abs(t.logprob - float(lp[t.token_id])) <= TOL, (i, t.logprob, float(lp[t.token_id]))
        if greedy:
            assert float(lp[t.token_id]) >= float(lp.max()) - TOL, i
        if k:
            top = dict(t.top_logprobs)
            kth = float(lp.topk(k).values[-1])
            assert len(top) == k, i
            for tok, value in top.items():
                assert abs(value - float(lp[tok])) <= TOL and float(lp[tok]) >= kth - TOL, (i, tok, value)


def _run(engine: Engine, reqs: list[Request]) -> list[tuple[list[Token], Finish]]:
    handles = [engine.submit(r) for r in reqs]
    engine.run_until_done(handles)
    out = []
    for h in handles:
        events = list(h.events(timeout=1))
        out.append(([e for e in events if isinstance(e, Token)], events[-1]))
    return out


def _count_moves(engine: Engine) -> list:
    """Slot moves made by the engine's pool from now on: (freed slot, moved row's old slot, its length)."""
    moves = []
    release = engine.pool.release

    def recording(slot):
        n = engine.pool.lengths[-1]
        moved = release(slot)
        if moved is not None:
            moves.append((slot, moved, n))
        return moved

    engine.pool.release = recording
    return moves


def _prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefgh +=") for _ in range(rng.randint(1, 24))) for _ in range(n)]


@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_sixteen_requests_match_their_replay_alone(model, mode):
    """Different prompt lengths, example ids, decode and prefill depths, budgets; 5 slots, so rows
    join, finish and move while others decode. (Greedy: each token is the replay's argmax, so the
    text is `generate`'s on the prompt alone, which the tests below compare directly.)"""
    prompts = _prompts(16)
    rng = random.Random(1)
    reqs = [
        Request(
            TOK.encode(p),
            SamplingConfig(rng.randint(1, 24)),
            DepthRule(1 + i % 4, 1 + (3 * i) % 4),
            logprobs=3,
            example_id=i,
        )
        for i, p in enumerate(prompts)
    ]
    engine = Engine(model, TOK, EngineConfig(max_batch=5, depth=4, max_depth=4, cache=mode))
    moves = _count_moves(engine)
    results = _run(engine, reqs)
    assert len(moves) >= 3
    for (tokens, finish), req in zip(results, reqs):
        ids = [t.token_id for t in tokens]
        assert_logprobs_equal(tokens, replay(model, req, ids, mode, 4), 3, greedy=True)
        assert finish.text == TOK.decode(ids)
    assert engine.pool.running == 0 and sum(engine.finished.values()) == 16
    assert all(
        f.completion_tokens == r.sampling.max_new_tokens for (_, f), r in zip(results, reqs) if f.reason == "length"
    )
    assert sum(len(t) for t, _ in results) > 150  # few rows stop early at EOS: the comparison covers many steps


def test_adaptive_exit_and_sampling_per_row_match_their_replay_alone(model):
    prompts = _prompts(8, seed=2)
    reqs = [
        Request(
            TOK.encode(p),
            SamplingConfig(12, temperature=0.9 if i % 3 == 0 else 0.0, top_k=20 if i % 4 == 0 else 0, seed=100 + i),
            DepthRule(6, exit_tau=0.05 if i % 2 else None, min_depth=1 + i % 3),
            logprobs=2,
            example_id=i,
        )
        for i, p in enumerate(prompts)
    ]
    engine = Engine(model, TOK, EngineConfig(max_batch=3, depth=6))
    results = _run(engine, reqs)
    for (tokens, finish), req, prompt in zip(results, reqs, prompts):
        ref = replay(model, req, [t.token_id for t in tokens], "terminal", 8)
        assert_logprobs_equal(tokens, ref, 2, greedy=req.sampling.temperature == 0)
        stats: dict = {}
        assert finish.text == _alone(model, prompt, req, "terminal", stats)
        assert finish.mean_decode_depth == pytest.approx(stats["mean_decode_depth"])
    depths = [t.depth for (tokens, _), r in zip(results, reqs) if r.rule.exit_tau for t in tokens[1:]]
    assert min(depths) < 6 and len(set(depths)) > 1  # the exit really fired, at different depths
    sampled = [(tokens, r) for (tokens, _), r in zip(results, reqs) if r.sampling.temperature > 0]
    assert any(t.logprob < max(v for _, v in t.top_logprobs) - 1e-3 for tokens, _ in sampled for t in tokens)


def test_reused_slot_beside_a_longer_sequence_reads_only_its_own_positions(model):
    """Two slots: a long sequence runs in slot 0 while slot 1 serves a long prompt, then a short one.
    The short one's decode view is cut at the long row's length, so the stale K/V the previous
    sequence left in slot 1 lie inside the attended view; its mask must stop at its own length."""
    long_run = Request(
        TOK.encode("the long one keeps going"), SamplingConfig(38), DepthRule(3), logprobs=2, example_id=0
    )
    previous = Request(TOK.encode("x" * 30), SamplingConfig(4), DepthRule(3), logprobs=2, example_id=1)
    short = Request(TOK.encode("ab"), SamplingConfig(20), DepthRule(3), logprobs=2, example_id=2)
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3))
    seen = []
    decode_view = engine.pool.decode_view

    def watching():
        view = decode_view()
        seen.append((list(engine.pool.lengths), view.max_len))
        return view

    engine.pool.decode_view = watching
    results = _run(engine, [long_run, previous, short])
    # at some step the short row decoded beside the long one, stale positions of slot 1 in view
    assert any(len(n) == 2 and n[1] < 20 < width for n, width in seen)
    assert engine.pool.cache.prelude[0].k[1, :, 22:33].abs().sum() > 0  # the previous sequence's K/V are there
    for (tokens, _), req in zip(results, (long_run, previous, short)):
        assert len(tokens) == req.sampling.max_new_tokens
        assert_logprobs_equal(tokens, replay(model, req, [t.token_id for t in tokens], "terminal", 8), 2, greedy=True)


@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_slot_release_moves_every_bank_and_position(model, mode):
    pool = SlotPool(model.cfg, 3, 16, mode=mode, depth=3, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    for bank in pool.cache.banks():
        bank.k.copy_(torch.randn(bank.k.shape, generator=g))
        bank.v.copy_(torch.randn(bank.v.shape, generator=g))
    assert len(pool.cache.banks()) == (4 if mode == "terminal" else 2 + 3 * 2)
    for _ in range(3):
        pool.claim()
    for slot, n in enumerate((5, 16, 9)):
        pool.set_length(slot, n)
    before = [(b.k.clone(), b.v.clone()) for b in pool.cache.banks()]
    assert pool.release(1) == 2 and pool.lengths == [5, 9]  # the last row (9 tokens) moves into slot 1
    for bank, (k, v) in zip(pool.cache.banks(), before):
        assert torch.equal(bank.k[1, :, :9], k[2, :, :9]) and torch.equal(bank.v[1, :, :9], v[2, :, :9])
        assert torch.equal(bank.k[0], k[0]) and torch.equal(bank.v[0], v[0])  # other rows untouched
    assert pool.release(1) is None and pool.lengths == [5]  # the last row leaves: nothing moves


def test_cancel_frees_the_slot_and_leaves_other_rows_exact(model):
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3))
    keep = Request(TOK.encode("keep going"), SamplingConfig(20), logprobs=1)
    drop = engine.submit(Request(TOK.encode("to be cancelled"), SamplingConfig(30)))
    kept = engine.submit(keep)
    engine.step()
    engine.step()
    assert engine.pool.running == 2
    drop.cancel()
    engine.step()
    assert drop.finish is not None and drop.finish.reason == "cancelled" and engine.pool.running == 1
    engine.run_until_done([kept])
    keep.rule = DepthRule(3)
    assert kept.finish.text == _alone(model, "keep going", keep, "terminal")
    tokens = [e for e in kept.events(timeout=1) if isinstance(e, Token)]
    assert_logprobs_equal(tokens, replay(model, keep, [t.token_id for t in tokens], "terminal", 8), 1, greedy=True)


def test_streamed_pieces_hold_back_stop_strings(model):
    prompt = "abc"
    free = _alone(model, prompt, Request([], SamplingConfig(20), DepthRule(3)), "terminal")
    stop = free[5:8]  # a string the model really produces: generation stops before it
    assert len(stop) == 3 and stop not in free[:7]
    req = Request(TOK.encode(prompt), SamplingConfig(20, stop=(stop,)), DepthRule(3))
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3))
    handle = engine.submit(req)
    engine.run_until_done([handle])
    events = list(handle.events(timeout=1))
    pieces = "".join(e.text for e in events if isinstance(e, Token))
    fin = events[-1]
    assert isinstance(fin, Finish) and fin.reason == "stop"
    assert fin.text == free[: free.index(stop)] == _alone(model, prompt, req, "terminal")
    assert pieces + fin.tail == fin.text
    assert all(stop not in e.text for e in events if isinstance(e, Token))


def test_logprobs_match_the_native_forward_without_a_cache(model):
    """The full cache at the engine's one depth reproduces the native forward (seeded state of the
    request's example id) at every step: no cache involved in the reference."""
    reqs = [
        Request(TOK.encode("hello"), SamplingConfig(8), DepthRule(3), logprobs=3, example_id=4),
        Request(TOK.encode("a longer prompt of text"), SamplingConfig(6), DepthRule(3), logprobs=3, example_id=9),
    ]
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3, cache="full"))
    for (tokens, _), req in zip(_run(engine, reqs), reqs):
        seq, ref = list(req.prompt_ids), []
        for t in tokens:
            with torch.no_grad():
                out = model(torch.tensor([seq]), 3, init="seeded", example_ids=torch.tensor([req.example_id]))
            ref.append((out.logits[0, -1].log_softmax(-1), 3))
            seq.append(t.token_id)
        assert len(tokens) == req.sampling.max_new_tokens
        assert_logprobs_equal(tokens, ref, 3, greedy=True)


@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_prompt_logprobs_match_the_native_forward_without_a_cache(model, mode):
    """Each prompt token's score (and the top-k there) is the native no-cache forward's log-softmax at
    the request's prefill depth, seeded by its example id; emitted before the first token. max_tokens 0
    only scores the prompt and frees its slot."""
    reqs = [
        Request(TOK.encode("score this prompt"), SamplingConfig(0), DepthRule(2, 4), prompt_logprobs=3, example_id=5),
        Request(TOK.encode("and this one too"), SamplingConfig(4), DepthRule(3), prompt_logprobs=0, logprobs=0),
        Request(TOK.encode("x"), SamplingConfig(0), DepthRule(3), prompt_logprobs=2),
    ]
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3, max_depth=4, cache=mode))
    handles = [engine.submit(r) for r in reqs]
    engine.run_until_done(handles)
    for req, h in zip(reqs, handles):
        events = list(h.events(timeout=1))
        scores, fin = events[0], events[-1]
        assert isinstance(scores, PromptLogprobs) and isinstance(fin, Finish)
        with torch.no_grad():
            native = (
                model(
                    torch.tensor([req.prompt_ids]),
                    req.rule.prefill,
                    init="seeded",
                    example_ids=torch.tensor([req.example_id]),
                )
                .logits[0, :-1]
                .log_softmax(-1)
            )
        want = native.gather(-1, torch.tensor(req.prompt_ids[1:])[:, None])[:, 0]
        assert len(scores.logprobs) == len(req.prompt_ids) - 1
        assert torch.allclose(torch.tensor(scores.logprobs), want, atol=TOL, rtol=0)
        if req.prompt_logprobs:
            assert len(scores.top_logprobs) == len(scores.logprobs)
            for top, lp in zip(scores.top_logprobs, native):
                best = lp.topk(req.prompt_logprobs)
                assert [t for t, _ in top] == best.indices.tolist()
                assert torch.allclose(torch.tensor([v for _, v in top]), best.values, atol=TOL, rtol=0)
        else:
            assert scores.top_logprobs is None
        tokens = [e for e in events[1:-1] if isinstance(e, Token)]
        assert len(tokens) == len(events) - 2 and fin.completion_tokens == len(tokens)
        if req.sampling.max_new_tokens == 0:
            assert fin.reason == "length" and not tokens and fin.text == ""
        else:
            assert tokens and fin.text == _alone(model, "and this one too", req, mode)
    assert engine.pool.running == 0 and engine.finished["length"] >= 2


def test_max_tokens_zero_needs_prompt_logprobs(model):
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=3))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        engine.submit(Request(TOK.encode("abc"), SamplingConfig(0)))
    with pytest.raises(ValueError, match="prompt_logprobs must be in 0..20"):
        engine.submit(Request(TOK.encode("abc"), SamplingConfig(0), prompt_logprobs=21))
    with pytest.raises(ValueError, match="more than the context of 64"):
        engine.submit(Request([1] * 65, SamplingConfig(0), prompt_logprobs=0))
    engine.submit(Request([1] * 64, SamplingConfig(0), prompt_logprobs=0))  # a full context can be scored
    assert len(engine._pending) == 1


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(rule=DepthRule(0)), "depth must be in 1..8"),
        (dict(rule=DepthRule(9)), r"depth must be in 1..8 \(the server's max_depth, looplm serve --max-depth\), got 9"),
        (
            dict(rule=DepthRule(3, 20)),
            r"prefill_depth must be in 1..8 \(the server's max_depth, looplm serve --max-depth\)",
        ),
        (dict(sampling=SamplingConfig(0)), "max_new_tokens must be >= 1"),
        (dict(sampling=SamplingConfig(60)), "more than the context of 64"),
        (dict(sampling=SamplingConfig(16, temperature=-1.0)), "temperature must be >= 0"),
        (dict(rule=DepthRule(4, exit_tau=0.1, min_depth=6)), "min_depth 6 exceeds the decode depth 4"),
        (dict(logprobs=50), "logprobs must be in 0..20"),
    ],
)
def test_bad_requests_are_refused_before_queueing(model, fields, message):
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=3))
    with pytest.raises(ValueError, match=message):
        engine.submit(Request(TOK.encode("a prompt of some length"), **fields))
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.submit(Request([]))
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.submit(Request([TOK.vocab_size]))
    assert not engine._pending


def test_full_cache_refuses_adaptive_exit_and_the_queue_is_bounded(model):
    full = Engine(model, TOK, EngineConfig(max_batch=1, depth=3, cache="full"))
    with pytest.raises(ValueError, match="needs the terminal cache"):
        full.submit(Request(TOK.encode("a"), rule=DepthRule(3, exit_tau=0.1)))
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=3, max_queue=2))
    engine.submit(Request(TOK.encode("a")))
    engine.submit(Request(TOK.encode("b")))
    with pytest.raises(EngineFull, match="max_queue 2"):
        engine.submit(Request(TOK.encode("c")))


def test_threaded_engine_and_stats(model):
    engine = Engine(model, TOK, EngineConfig(max_batch=4, depth=3)).start()
    assert engine.stats()["mean_decode_depth"] == 0.0  # no decode step yet: a number, not NaN
    try:
        reqs = [
            Request(TOK.encode(p), SamplingConfig(8), DepthRule(2 + 3 * (i % 2)))
            for i, p in enumerate(_prompts(6, seed=3))
        ]
        handles = [engine.submit(r) for r in reqs]
        finishes = [[e for e in h.events(timeout=60)][-1] for h in handles]
    finally:
        engine.shutdown()
    assert all(f.reason in ("stop", "length") for f in finishes)
    s = engine.stats()
    assert s["generated_tokens_total"] == sum(f.completion_tokens for f in finishes)
    # decode steps per request: one per token after the first, plus the one that produced an EOS
    steps = [f.completion_tokens - (f.reason == "length") for f in finishes]
    want = sum(n * r.rule.depth for n, r in zip(steps, reqs)) / sum(steps)
    assert s["running_sequences"] == 0 and s["cache_bytes_in_use"] == 0
    assert s["mean_decode_depth"] == pytest.approx(want, rel=1e-12) and 2 < want < 5
    per_token = 2 * model.cfg.n_kv_heads * model.cfg.head_dim * 4  # K and V, fp32
    assert s["cache_bytes_capacity"] == 4 * 4 * 64 * per_token  # 4 banks (1/2/1 blocks) x 4 slots x 64 positions


def test_the_engine_splits_its_busy_time_between_prefills_and_decode_steps(model, monkeypatch):
    """stats' prefill_seconds_total and decode_seconds_total: a clock that moves 10 s in each prompt's
    prefill and 1 s in each decode step makes both exact (the number of each from the calls)."""
    import looplm.serve.engine as engine_mod

    class Clock:
        now = 0.0

        def perf_counter(self):
            return self.now

        monotonic = perf_counter

    clock, calls = Clock(), {"prefill": 0, "decode": 0}
    real_prefill, real_decode = Engine._prefill, Engine._decode

    def prefill(self, handle):
        calls["prefill"] += 1
        clock.now += 10.0
        return real_prefill(self, handle)

    def decode(self):
        calls["decode"] += 1
        clock.now += 1.0
        return real_decode(self)

    monkeypatch.setattr(engine_mod, "time", clock)
    monkeypatch.setattr(Engine, "_prefill", prefill)
    monkeypatch.setattr(Engine, "_decode", decode)
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=2))
    engine.generate([Request(TOK.encode(p), SamplingConfig(5), DepthRule(2)) for p in _prompts(3, seed=1)])
    s = engine.stats()
    assert calls["prefill"] == 3 and calls["decode"] >= 4  # 2 slots for 3 prompts: the third waits
    assert s["prefill_seconds_total"] == 10.0 * calls["prefill"]
    assert s["decode_seconds_total"] == 1.0 * calls["decode"]


def test_a_raising_event_sink_fails_its_request_only(model):
    """A consumer whose sink raises (e.g. its event loop has closed) ends its own request with an
    error; the engine thread lives on and the other rows stay exact."""
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3))
    good = engine.submit(Request(TOK.encode("keep going"), SamplingConfig(12)))

    def broken(event):
        raise RuntimeError("the consumer is gone")

    bad = engine.submit(Request(TOK.encode("a broken consumer"), SamplingConfig(12)), sink=broken)
    engine.start()
    try:
        events = list(good.events(timeout=30))
        assert events[-1].text == _alone(model, "keep going", Request([], SamplingConfig(12), DepthRule(3)), "terminal")
        after = engine.submit(Request(TOK.encode("after"), SamplingConfig(4)))
        assert [e for e in after.events(timeout=30)][-1].reason in ("stop", "length")
        assert bad.finish is not None and bad.finish.reason == "error" and "the consumer is gone" in bad.finish.error
        assert engine._thread.is_alive() and engine.pool.running == 0 and engine.finished.get("error") == 1
    finally:
        engine.shutdown()


def test_submit_after_shutdown_fails_fast(model):
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=3)).start()
    engine.shutdown()
    with pytest.raises(EngineStopped, match="shut down"):
        engine.submit(Request(TOK.encode("too late")))
    assert not engine._pending
    engine.start()  # a restarted engine takes requests again
    try:
        assert [e for e in engine.submit(Request(TOK.encode("again"), SamplingConfig(2))).events(timeout=30)][-1].reason
    finally:
        engine.shutdown()


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_outside_the_generators_range_is_refused_before_queueing(model, seed):
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=3))
    with pytest.raises(ValueError, match="seed must be in"):
        engine.submit(Request(TOK.encode("a"), SamplingConfig(16, temperature=1.0, seed=seed)))
    assert not engine._pending
    for edge in (2**64 - 1, -(2**63)):  # torch.Generator's own limits are accepted
        assert engine.generate([Request(TOK.encode("a"), SamplingConfig(2, temperature=1.0, seed=edge))])[0].reason


@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_requests_deeper_than_the_engine_default_match_a_decode_by_hand(model, mode):
    """An engine whose default depth (2) is below its max_depth (8) runs, together, requests from the
    depth matrix (`_reference.DEPTH_CASES`: prefill depth below, equal to and above the decode depth,
    adaptive exit): each token's id, depth and log-probability equal the request decoded alone by hand
    (`NaiveDecoder`, which holds every visit a full cache sized for the deepest request would), to 1e-4."""
    engine = Engine(model, TOK, EngineConfig(max_batch=4, depth=2, max_depth=8, cache=mode))
    cases = [c for c in DEPTH_CASES if c[0] == mode]
    prompts = ["deep request", "xy", "the third prompt", "four"]
    reqs = [
        Request(TOK.encode(prompts[i]), SamplingConfig(8), DepthRule(dec, pre, exit_tau=tau), logprobs=0, example_id=i)
        for i, (_, pre, dec, tau) in enumerate(cases)
    ]
    events = {i: [] for i in range(len(reqs))}
    handles = [engine.submit(r, sink=events[i].append) for i, r in enumerate(reqs)]
    engine.run_until_done(handles)
    for i, (req, (_, pre, dec, tau)) in enumerate(zip(reqs, cases)):
        tokens = [e for e in events[i] if isinstance(e, Token)]
        ids = [t.token_id for t in tokens]
        logits, used = decode_replay(model, mode, req.prompt_ids, ids[:-1], pre, dec, example_id=i, exit_tau=tau)
        lp = logits.log_softmax(-1)
        assert ids == lp.argmax(-1).tolist(), i
        assert [t.depth for t in tokens] == used, i
        assert tau is None or min(used[1:]) < dec  # the adaptive request did exit early
        got = torch.tensor([t.logprob for t in tokens])
        assert (got - lp[torch.arange(len(ids)), ids]).abs().max() <= 1e-4, i


# -- the compiled static step ---------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[False, True], ids=["whole-slot", "key-range"])
def compiled_engine(model, request):
    """One engine whose decode steps and prefills run compiled (`EngineConfig(compile=True)`), attending
    over the whole slot or (`key_range`) over what its longest row filled: 4 slots; the tests
    keep 3-4 rows on the exit path (per-row depths, exit_tau) so one graph set (bucket 4) serves them.
    Its step traces with Dynamo as `compile=True` does but runs the captured (rewritten) graphs eagerly,
    not through inductor: this
    tests the engine's plumbing (buckets, padding rows, per-row inputs) without minutes of code
    generation; inductor's numerics are tests/test_infer_step.py's compiled-step test."""
    engine = Engine(
        model,
        TOK,
        EngineConfig(max_batch=4, depth=4, max_depth=6, max_seq_len=32, compile=True, key_range=request.param),
        compile_options={"backend": "eager"},
    )
    assert engine.buckets() == [1, 2, 4]
    assert engine.prefill_buckets() == [32]  # prompts prefill as one chunk of 32 (the slots' length)
    assert engine.warm_up() > 0  # every bucket traced up front; its writes into free slots must not show below
    return engine


def test_a_warmed_up_compiled_engine_compiles_nothing_while_serving(model, compiled_engine):
    """After `warm_up` (the fixture's, before any request), rows at the engine's depth in batch buckets 4,
    2 and 1 (rows finishing one after another) run the graphs it traced: Dynamo compiles no new graph
    (a warm-up whose inputs alias each other would leave every bucket to compile on its first request)."""
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    reqs = [
        Request(TOK.encode(p), SamplingConfig(n), example_id=i)
        for i, (p, n) in enumerate(zip(["a", "hello world", "x+y="], [3, 5, 8]))
    ]
    finishes = [f for _, f in _run(compiled_engine, reqs)]
    assert [f.completion_tokens for f in finishes] == [3, 5, 8]
    assert counters["stats"]["unique_graphs"] == before


@pytest.mark.slow
def test_compiled_engine_equals_the_eager_engine(model, compiled_engine):
    """Mixed prompt lengths, decode depths, prefill depths and exit rules (tau 0 = never): tokens, depths
    and log-probabilities (1e-5) equal the eager engine's; then each against its replay alone."""
    import time

    prompts = ["a", "hello world", "x+y=", "the quick brown"]
    reqs = [
        Request(TOK.encode(p), SamplingConfig(7), DepthRule(d, pd, exit_tau=tau, min_depth=2), logprobs=2, example_id=i)
        for i, (p, d, pd, tau) in enumerate(zip(prompts, [4, 6, 2, 5], [3, 6, 2, 4], [0.05, None, 0.1, None]))
    ]
    eager = Engine(model, TOK, EngineConfig(max_batch=4, depth=4, max_depth=6))
    start = time.perf_counter()
    got = _run(compiled_engine, reqs)
    print(f"compiled engine (compile included): {time.perf_counter() - start:.1f} s")
    want = _run(eager, reqs)
    for (tokens, finish), (ref_tokens, ref_finish), req in zip(got, want, reqs):
        assert [t.token_id for t in tokens] == [t.token_id for t in ref_tokens]
        assert [t.depth for t in tokens] == [t.depth for t in ref_tokens]
        for t, r in zip(tokens, ref_tokens):
            assert abs(t.logprob - r.logprob) <= TOL
            assert dict(t.top_logprobs).keys() == dict(r.top_logprobs).keys()
        assert finish.text == ref_finish.text
        assert_logprobs_equal(tokens, replay(model, req, [t.token_id for t in tokens], "terminal", 6), 2, greedy=True)
    assert sum(len(t) for t, _ in got) >= 16


def test_key_range_needs_a_compiled_engine(model):
    """`key_range` shortens compiled steps only: without `compile` it is refused, named as serve's options."""
    with pytest.raises(UserError, match="--key-range is for compiled steps: add --compile"):
        EngineConfig(key_range=True).check(prefix="--")
    with pytest.raises(UserError, match="key_range is for compiled steps"):
        Engine(model, TOK, EngineConfig(key_range=True))


# -- bookkeeping the other tests do not reach (found by mutating the engine) ---------------------------
@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_a_saved_range_restored_puts_back_every_bank(model, mode):
    """`SlotPool.save` / `restore` (a row riding along a speculative round short of room): K and V of
    every bank come back; a restore that wrote V only went unnoticed by the token-level tests."""
    pool = SlotPool(model.cfg, 2, 16, mode=mode, depth=3, device="cpu", dtype=torch.float32)
    torch.manual_seed(0)
    for bank in pool.cache.banks():
        bank.k.normal_(), bank.v.normal_()
    before = [(b.k.clone(), b.v.clone()) for b in pool.cache.banks()]
    saved = pool.save(1, 4, 9)
    for bank in pool.cache.banks():
        bank.k[1, :, 4:12] = 0.0
        bank.v[1, :, 4:12] = 0.0
    pool.restore(1, 4, saved)
    for bank, (k, v) in zip(pool.cache.banks(), before):
        assert torch.equal(bank.k[:, :, :9], k[:, :, :9]) and torch.equal(bank.v[:, :, :9], v[:, :, :9])
        assert torch.equal(bank.k[0], k[0]) and (bank.k[1, :, 9:12] == 0).all()  # only [4, 9) of slot 1


def test_an_eos_is_no_generated_token(model):
    """generated_tokens_total counts the tokens the requests received: an EOS that ends a request is
    none of them (the threaded-engine test has no request that ends by EOS). The model is made to end
    some requests: its EOS wins where one of its greedy tokens would."""
    import collections
    import copy

    prompts, stats = _prompts(6, seed=4), {}
    generate(model, TOK, prompts, DepthRule(3), sampling=SamplingConfig(12), stats=stats, example_ids=list(range(6)))
    for token, _ in collections.Counter(t for row in stats["token_ids"] for t in row).most_common():
        eos_model = copy.deepcopy(model)
        with torch.no_grad():
            eos_model.head.weight[TOK.eos_id] = 1.5 * eos_model.head.weight[token]
        engine = Engine(eos_model, TOK, EngineConfig(max_batch=3, depth=3))
        finishes = engine.generate(
            [Request(TOK.encode(p), SamplingConfig(12), example_id=i) for i, p in enumerate(prompts)]
        )
        if 0 < sum(f.reason == "stop" for f in finishes) < len(finishes):
            break
    else:
        raise AssertionError("no token of the greedy texts makes some requests (not all) end by EOS")
    assert engine.stats()["generated_tokens_total"] == sum(f.completion_tokens for f in finishes)


def test_cancelling_two_rows_at_once_stops_both(model):
    """Rows 0 and 2 cancelled together: finishing row 0 moves row 2 into slot 0, which must be looked
    at again; it was skipped, decoded one more step and emitted a token after its cancel."""
    engine = Engine(model, TOK, EngineConfig(max_batch=3, depth=3))
    events: list[list] = [[], [], []]
    handles = [
        engine.submit(Request(TOK.encode(p), SamplingConfig(20), example_id=i), sink=events[i].append)
        for i, p in enumerate(_prompts(3))
    ]
    engine.step()
    engine.step()
    counts = [len(e) for e in events]
    assert all(n >= 2 for n in counts)  # tokens so far
    handles[0].cancel(), handles[2].cancel()
    engine.step()
    for i in (0, 2):
        assert [type(e) for e in events[i][counts[i] :]] == [Finish]  # nothing after the cancel but its end
        assert events[i][-1].reason == "cancelled" and events[i][-1].completion_tokens == counts[i]
    assert engine.running == 1


# -- failures, prefill arms, scheduling edges and counters (found by mutating the engine) ---------------
def test_a_failed_decode_step_fails_every_running_row(model):
    """A decode step that raises on the engine's thread ends every running row as an error
    (the step's state is lost for all of them), not only the row in slot 0."""
    engine = Engine(model, TOK, EngineConfig(max_batch=3, depth=3))
    handles = [engine.submit(Request(TOK.encode(p), SamplingConfig(20))) for p in _prompts(3)]
    decode, calls = engine._decode, []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the step broke")
        decode()

    engine._decode = failing_once
    engine.start()  # its first step admits all three, then fails
    try:
        finishes = [list(h.events(timeout=30))[-1] for h in handles]
    finally:
        engine.shutdown()
    assert [(f.reason, f.error) for f in finishes] == [("error", "RuntimeError: the step broke")] * 3
    assert engine.finished == {"error": 3} and engine.pool.running == 0


def test_the_slot_of_a_failed_prefill_serves_the_next_request(model):
    """A prefill that raises after claiming its slot gives the slot back; with one slot the
    next request runs (it waited forever: the engine went idle with a request unfinished)."""
    calls = []

    class FailingOnce(Prefill):
        def __call__(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("the prefill failed")
            return super().__call__(*args, **kwargs)

    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=3), prefill=FailingOnce())
    broken = engine.submit(Request(TOK.encode("hello"), SamplingConfig(4)))
    after = engine.submit(Request(TOK.encode("abc"), SamplingConfig(6)))
    engine.run_until_done([broken, after])
    assert broken.finish.reason == "error" and "the prefill failed" in broken.finish.error
    assert after.finish.text == _alone(model, "abc", Request([], SamplingConfig(6), DepthRule(3)), "terminal")
    assert engine.pool.running == 0 and engine.finished["error"] == 1


def test_a_prefill_that_fails_after_its_row_joined_finishes_it_once(model):
    """When choosing the first token raises (the row already holds its slot), the request
    gets one Finish (an error) and is counted once; the other request is untouched."""
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3))
    accept, calls = engine._accept, []

    def failing_first(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("choosing broke")
        return accept(*args, **kwargs)

    engine._accept = failing_first
    events: list = []
    bad = engine.submit(Request(TOK.encode("hello"), SamplingConfig(4)), sink=events.append)
    good = engine.submit(Request(TOK.encode("abc"), SamplingConfig(6)))
    engine.run_until_done([bad, good])
    assert [type(e) for e in events] == [Finish] and events[0].reason == "error" and "choosing broke" in events[0].error
    assert good.finish.text == _alone(model, "abc", Request([], SamplingConfig(6), DepthRule(3)), "terminal")
    assert engine.finished["error"] == 1 and sum(engine.finished.values()) == 2 and engine.pool.running == 0


def test_a_prompt_only_scored_for_a_broken_sink_is_an_error(model):
    """A request with max_tokens 0 whose sink raised on its prompt scores ends as an error
    (with the sink's message), as a decoding request with a broken sink does, not as "length"."""
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=3))

    def broken(event):
        raise RuntimeError("the consumer is gone")

    handle = engine.submit(Request(TOK.encode("score me"), SamplingConfig(0), prompt_logprobs=0), sink=broken)
    engine.run_until_done([handle])
    assert handle.finish.reason == "error" and "the consumer is gone" in handle.finish.error
    assert engine.finished == {"error": 1} and engine.pool.running == 0


def test_a_cheap_prefill_arm_gives_the_first_token_its_own_depth(model):
    """With `Prefill("r1")` the prompt runs one recurrence whatever the request's prefill
    depth, so the first token's depth is 1 (not the request's 4); every token equals a by-hand decode
    prefilled at depth 1 (`decode_replay`)."""
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3, max_depth=4), prefill=Prefill("r1"))
    req = Request(TOK.encode("cheap prefill"), SamplingConfig(5), DepthRule(3, 4), logprobs=0, example_id=2)
    ((tokens, _),) = _run(engine, [req])
    ids = [t.token_id for t in tokens]
    logits, used = decode_replay(model, "terminal", req.prompt_ids, ids[:-1], 1, 3, example_id=2)
    lp = logits.log_softmax(-1)
    assert [t.depth for t in tokens] == used == [1, 3, 3, 3, 3]
    assert ids == lp.argmax(-1).tolist()
    assert (torch.tensor([t.logprob for t in tokens]) - lp[torch.arange(len(ids)), ids]).abs().max() <= 1e-4


def test_tokens_per_second_counts_the_steps_of_the_window(model, monkeypatch):
    """Stats' tokens_per_second is the tokens of the decode steps in the last
    `window_s` over the time since the first of them (the window's length when one step is in it).
    A fake clock puts three one-token steps at t = 1, 2, 3."""
    import looplm.serve.engine as engine_mod

    class Clock:
        now = 0.0

        def perf_counter(self):
            return self.now

        monotonic = perf_counter

    clock = Clock()
    monkeypatch.setattr(engine_mod, "time", clock)
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=2))
    decode = engine._decode

    def ticking():
        clock.now += 1.0
        decode()

    engine._decode = ticking
    (finish,) = engine.generate([Request(TOK.encode("abc"), SamplingConfig(4), DepthRule(2))])
    assert finish.completion_tokens == 4 and engine.decoded_tokens == 3  # steps at t = 1, 2, 3
    assert engine.stats(10.0)["tokens_per_second"] == pytest.approx(3 / 2)  # since t = 1
    clock.now = 12.5  # only the step at t = 3 is in the last 10 s
    assert engine.stats(10.0)["tokens_per_second"] == pytest.approx(1 / 10)
    clock.now = 20.0
    assert engine.stats(10.0)["tokens_per_second"] == 0.0


def test_a_compiled_step_runs_at_the_smallest_bucket_that_holds_its_rows(model):
    """N running rows run at the smallest of 1, 2, 4, ... max_batch that holds them."""
    engine = Engine(model, TOK, EngineConfig(max_batch=6, depth=3))
    assert engine.buckets() == [1, 2, 4, 6]
    assert [engine._bucket(n) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]


def test_logprobs_zero_gives_no_alternatives_and_twenty_gives_twenty(model):
    """`logprobs` 0 is the chosen token's log-probability alone (top_logprobs None, as
    a prompt's scores with prompt_logprobs 0); 20, OpenAI's most, is accepted and gives the 20 most
    likely tokens of the replay alone."""
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3))
    reqs = [Request(TOK.encode("top"), SamplingConfig(3), DepthRule(3), logprobs=n) for n in (0, 20)]
    (none, _), (twenty, _) = _run(engine, reqs)
    assert none and all(t.logprob is not None and t.top_logprobs is None for t in none)
    assert_logprobs_equal(twenty, replay(model, reqs[1], [t.token_id for t in twenty], "terminal", 8), 20, greedy=True)


def test_a_request_without_decode_steps_reports_its_decode_depth(model):
    """A request that ends at its first token (max_tokens 1) ran no decode step; its
    mean_decode_depth is its decode depth (5), not 0, nor its prefill depth."""
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=3, max_depth=6))
    (finish,) = engine.generate([Request(TOK.encode("one"), SamplingConfig(1), DepthRule(5, 2))])
    assert finish.completion_tokens == 1 and finish.mean_decode_depth == 5.0


def test_an_adaptive_row_at_a_rounds_depth_is_not_carried_by_the_round(model):
    """A plain row at a speculating row's depth but with adaptive exit cannot take its step
    from the verify chunk (which runs every position at the full depth): it steps plainly, exiting
    early, and equals its by-hand decode with the exit rule."""
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=4, max_depth=4, speculate=3, draft_depth=1))
    spec = Request(TOK.encode("speculating row"), SamplingConfig(12), example_id=1)
    tau = Request(TOK.encode("exits early"), SamplingConfig(12), DepthRule(4, exit_tau=0.2), logprobs=0, example_id=2)
    _, (tokens, _) = _run(engine, [spec, tau])
    ids = [t.token_id for t in tokens]
    logits, used = decode_replay(model, "terminal", tau.prompt_ids, ids[:-1], 4, 4, example_id=2, exit_tau=0.2)
    assert engine.drafted_tokens > 0 and min(used[1:]) < 4  # a round ran, and the exit fired
    assert ids == logits.argmax(-1).tolist() and [t.depth for t in tokens] == used


def test_a_row_with_just_room_for_its_verify_chunk_speculates(model):
    """A row speculates while its slot holds the verify chunk of k + 1 tokens after its
    length (length + k + 1 <= max_len). A 12-token prompt in a 16-position slot with k = 3 has room
    for exactly one round, its first decode step: 3 drafts; one token more and none. (The full cache:
    speculation there is exactly greedy decoding.)"""
    config = EngineConfig(max_batch=1, depth=4, max_seq_len=16, speculate=3, draft_depth=1, cache="full")
    for n, drafts in ((12, 3), (13, 0)):
        engine = Engine(model, TOK, config)
        req = Request(TOK.encode("abcdefghijklm"[:n]), SamplingConfig(16 - n + 1))
        (finish,) = engine.generate([req])
        assert finish.completion_tokens >= 2 and engine.drafted_tokens == drafts, n
        assert finish.text == _alone(model, "abcdefghijklm"[:n], Request([], req.sampling, DepthRule(4)), "full")


def test_a_plain_row_with_just_room_for_the_chunk_rides_in_the_round(model):
    """A plain row at a round's depth takes its step inside the round while its slot has
    room for the chunk (length + k + 1 <= max_len), so no plain sub-step runs for it then: every plain
    sub-step's rows are short of that room."""
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=4, max_seq_len=16, speculate=3, draft_depth=1))
    plain_lengths = []
    real = engine._plain

    def recording(members):
        plain_lengths.extend(n for n, m in zip(engine.pool.lengths, members) if m)
        return real(members)

    engine._plain = recording
    spec = Request(TOK.encode("a"), SamplingConfig(10), example_id=1)
    plain = Request(TOK.encode("b" * 12), SamplingConfig(5), speculate=0, example_id=2)
    engine.generate([spec, plain])
    assert engine.drafted_tokens > 0 and plain_lengths  # rounds ran; the plain row stepped alone later
    assert all(n + 3 + 1 > engine.max_len for n in plain_lengths), plain_lengths


def test_compiled_rows_at_different_depths_without_exit_keep_their_depths(model, compiled_engine):
    """Compiled rows at decode depths 2 and 6 (no adaptive exit) run each at its own depth:
    tokens, depths and log-probabilities equal each request's replay alone."""
    reqs = [
        Request(TOK.encode(p), SamplingConfig(5), DepthRule(d), logprobs=2, example_id=i)
        for i, (p, d) in enumerate(zip(["shallow one", "deep one"], [2, 6]))
    ]
    for (tokens, _), req in zip(_run(compiled_engine, reqs), reqs):
        assert [t.depth for t in tokens[1:]] == [req.rule.depth] * (len(tokens) - 1)
        assert_logprobs_equal(tokens, replay(model, req, [t.token_id for t in tokens], "terminal", 6), 2, greedy=True)


def test_a_compiled_prefill_runs_the_prefill_arms_depth(model, compiled_engine, monkeypatch):
    """The compiled engine's prefill chunk runs the arm's teacher depth (`Prefill("r1")`: 1
    recurrence, whatever the request's prefill depth 4): its first token equals a by-hand prefill at 1."""
    monkeypatch.setattr(compiled_engine, "prefill", Prefill("r1"))
    req = Request(TOK.encode("cheap prefill"), SamplingConfig(2), DepthRule(4, 4), logprobs=0, example_id=3)
    ((tokens, _),) = _run(compiled_engine, [req])
    logits, used = decode_replay(model, "terminal", req.prompt_ids, [], 1, 4, example_id=3)
    lp = logits[0].log_softmax(-1)
    assert tokens[0].depth == 1 and tokens[0].token_id == int(lp.argmax())
    assert abs(tokens[0].logprob - float(lp.max())) <= 1e-4


# -- slot accounting, finish reasons and text (found by mutating slots, speculation and the engine) ----------
@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_cache_bytes_in_use_count_each_running_rows_cached_positions(model, mode):
    """`bytes_in_use` (/metrics' cache_bytes_in_use) is the running rows' cached positions times one
    position's K and V in every bank (2 x n_kv_heads x head_dim fp32 values per bank), not a bound such
    as the longest row's length per row; a full pool refuses another claim, and only running slots are
    released (a negative slot would copy the pool's last row, not the last running one)."""
    pool = SlotPool(model.cfg, 3, 16, mode=mode, depth=3, device="cpu", dtype=torch.float32)
    per_position = len(pool.cache.banks()) * 2 * model.cfg.n_kv_heads * model.cfg.head_dim * 4
    assert pool.nbytes == 3 * 16 * per_position and pool.bytes_in_use == 0
    for _ in range(3):
        pool.claim()
    for slot, n in enumerate((5, 16, 9)):
        pool.set_length(slot, n)
    assert pool.bytes_in_use == (5 + 16 + 9) * per_position
    with pytest.raises(RuntimeError, match="no free slot"):
        pool.claim()
    for slot in (-1, 3):
        with pytest.raises(IndexError, match="is not running"):
            pool.release(slot)
    pool.release(1)
    assert pool.lengths == [5, 9] and pool.bytes_in_use == 14 * per_position


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop(model):
    """A stop string whose last token is the request's max_tokens-th ends the request as "stop" (its text
    cut before the stop string), not "length": the same request with room to spare says how many tokens
    it takes to complete the stop string."""
    prompt = "abc"
    free = _alone(model, prompt, Request([], SamplingConfig(20), DepthRule(3)), "terminal")
    stop = free[5:8]
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=3))
    (roomy,) = engine.generate([Request(TOK.encode(prompt), SamplingConfig(20, stop=(stop,)), DepthRule(3))])
    assert roomy.reason == "stop" and roomy.completion_tokens < 20
    n = roomy.completion_tokens  # the token that completed the stop string
    (exact,) = engine.generate([Request(TOK.encode(prompt), SamplingConfig(n, stop=(stop,)), DepthRule(3))])
    assert (exact.reason, exact.text, exact.completion_tokens) == ("stop", free[: free.index(stop)], n)
