"""The serving engine's rows speculating together (`looplm.serve.speculation`, design §16), against
independent references:

- full cache: every request's greedy tokens equal the no-cache greedy decode of its prompt alone at
  its depth (the whole sequence re-run natively per token), over mixed prompt lengths and rows that
  join and leave the batch between rounds;
- terminal cache: every request's tokens are the argmax of a hand-written replay (`_reference`,
  explicit attention over stored K/V) in which the prompt is one chunk and each of its rounds'
  accepted windows [last, d_1..d_a] is one chunk (the window sizes are recorded from the run);
- a sampling row beside greedy rows leaves the greedy rows' tokens as they are, and is reproducible
  from its seed; a request that turns speculation off makes the steps plain while it runs; the
  acceptance counters reach `stats()`; bad settings are refused before queueing."""

from dataclasses import replace

import pytest
import torch
from _models import decisive_model
from _reference import window_replay_check

import looplm.serve.engine as engine_mod
from looplm.data import ByteTokenizer
from looplm.infer.decode import SamplingConfig
from looplm.infer.depth_rule import DepthRule
from looplm.infer.step import DecodeStep
from looplm.serve import Engine, EngineConfig, Request, Token

TOK = ByteTokenizer()
DEPTH = 4
pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def model():
    return decisive_model(TOK.vocab_size, max_seq_len=64, max_depth=8)


PROMPTS = ["a", "hello", "the quick brown f", "ab", "xyz xyz", "0123456789"]


def _requests(n_tokens: int, **fields) -> list[Request]:
    return [Request(TOK.encode(p), SamplingConfig(n_tokens), example_id=i + 2, **fields) for i, p in enumerate(PROMPTS)]


def _run(engine: Engine, reqs: list[Request], windows: dict | None = None, monkeypatch=None) -> list[list[int]]:
    """Each request's emitted token ids; with `windows`, records each request's accepted drafts per
    round (keyed by example id) from the engine's own rounds."""
    if windows is not None:
        real = engine_mod.speculative_round

        def recording(step, rows, n, **kw):
            result = real(step, rows, n, **kw)
            for b in range(n):  # the round's speculating rows (others ride along or are carried)
                if kw["members"][b]:
                    windows.setdefault(engine._rows[b].handle.request.example_id, []).append(len(result.tokens[b]) - 1)
            return result

        monkeypatch.setattr(engine_mod, "speculative_round", recording)
    # two waves: the second joins while the first is running (rows enter and leave between rounds)
    handles = [engine.submit(r) for r in reqs[:3]]
    engine.step()
    engine.step()
    handles += [engine.submit(r) for r in reqs[3:]]
    engine.run_until_done(handles)
    return [[e.token_id for e in h.events(timeout=1) if isinstance(e, Token)] for h in handles]


def _no_cache_greedy(model, prompt_ids, n, depth, example_id):
    ids = list(prompt_ids)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids]), depth, init="seeded", example_ids=torch.tensor([example_id])).logits
        nxt = int(logits[0, -1].argmax())
        if nxt == TOK.eos_id:
            break
        ids.append(nxt)
    return ids[len(prompt_ids) :]


@pytest.mark.parametrize(("k", "draft_depth"), [(3, 1), (4, 2)])
def test_full_cache_rows_speculating_together_equal_greedy_alone(model, k, draft_depth):
    n = 13
    engine = Engine(
        model, TOK, EngineConfig(max_batch=4, depth=DEPTH, cache="full", speculate=k, draft_depth=draft_depth)
    )
    got = _run(engine, _requests(n))
    for i, (prompt, ids) in enumerate(zip(PROMPTS, got)):
        assert ids == _no_cache_greedy(model, TOK.encode(prompt), n, DEPTH, i + 2), prompt
    s = engine.stats()
    assert s["speculative_drafted_total"] > s["speculative_accepted_total"] > 0  # drafts kept and rejected


def test_terminal_rows_speculating_together_equal_a_replay_of_their_windows(model, monkeypatch):
    n, windows = 17, {}
    engine = Engine(model, TOK, EngineConfig(max_batch=4, depth=DEPTH, speculate=3, draft_depth=1))
    got = _run(engine, _requests(n), windows, monkeypatch)
    for i, (prompt, ids) in enumerate(zip(PROMPTS, got)):
        assert windows[i + 2], prompt
        window_replay_check(model, TOK.encode(prompt), ids, windows[i + 2], DEPTH, n, TOK.eos_id, example_id=i + 2)
    assert any(a < 3 for w in windows.values() for a in w) and any(a > 0 for w in windows.values() for a in w)


def test_a_sampling_row_leaves_the_greedy_rows_as_they_are(model):
    n = 12
    plain = _run(
        Engine(model, TOK, EngineConfig(max_batch=4, depth=DEPTH, cache="full", speculate=3, draft_depth=2)),
        _requests(n),
    )
    mixed_reqs = _requests(n)
    mixed_reqs[1] = Request(TOK.encode(PROMPTS[1]), SamplingConfig(n, temperature=0.9, top_k=20, seed=5), example_id=3)

    def mixed():
        return _run(
            Engine(model, TOK, EngineConfig(max_batch=4, depth=DEPTH, cache="full", speculate=3, draft_depth=2)),
            mixed_reqs,
        )

    first, again = mixed(), mixed()
    assert [ids for i, ids in enumerate(first) if i != 1] == [ids for i, ids in enumerate(plain) if i != 1]
    assert first[1] == again[1] and len(first[1]) == n  # the sampled row: reproducible from its seed


def _mixed_requests(mode: str) -> list[Request]:
    """Requests of every kind a speculating engine (k 3, draft depth 1, 40-position slots) meets at once
    (adaptive exit with the terminal cache, which it needs)."""
    sampled = SamplingConfig(30, temperature=0.9, top_k=20, seed=5)
    return [
        Request(TOK.encode("hello"), sampled, example_id=2),  # speculates, sampled
        Request(TOK.encode("a"), SamplingConfig(36), example_id=3),  # speculates, greedy
        # plain (k = 0), greedy, up to its slot's last position: it rides along in the rounds short of room
        Request(TOK.encode("the quick brown fox j"), SamplingConfig(20), example_id=4, speculate=0),
        Request(TOK.encode("xyz"), replace(sampled, seed=9), rule=DepthRule(DEPTH + 2), example_id=5),  # own plan
        Request(TOK.encode("0123"), SamplingConfig(25), rule=DepthRule(DEPTH, exit_tau=0.1), example_id=6),  # plain
    ][: 5 if mode == "terminal" else 4]


@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_a_requests_tokens_do_not_depend_on_what_else_runs(model, monkeypatch, mode):
    """Each request's tokens, sampled ones from their seed and the terminal cache's windows included,
    are the same alone as beside requests of every other kind (another plan, no speculation, adaptive
    exit), joining at different times: a row's kind of step is its own. The mixed run has rounds that
    carry the plain row's step (the verify chunk's first position), and rounds and plain steps in
    which other rows ride along, one of them short of room (its entries saved and put back)."""
    config = EngineConfig(
        max_batch=8, depth=DEPTH, max_depth=DEPTH + 2, cache=mode, max_seq_len=40, speculate=3, draft_depth=1
    )
    alone = [_run(Engine(model, TOK, config), [r])[0] for r in _mixed_requests(mode)]
    passengers, saves = [], []
    real_round = engine_mod.speculative_round

    def recording(*args, members=None, **kw):
        passengers.append(members is not None and not all(members))
        return real_round(*args, members=members, **kw)

    monkeypatch.setattr(engine_mod, "speculative_round", recording)
    engine = Engine(model, TOK, config)
    real_save, real_speculate, carried = engine.pool.save, engine._speculate, []
    monkeypatch.setattr(engine.pool, "save", lambda *a: saves.append(a) or real_save(*a))
    monkeypatch.setattr(engine, "_speculate", lambda plan, m, c: carried.append(any(c)) or real_speculate(plan, m, c))
    assert _run(engine, _mixed_requests(mode)) == alone
    assert any(passengers) and saves and any(carried)
    assert alone[2] == _no_cache_greedy(model, TOK.encode("the quick brown fox j"), 20, DEPTH, 4) or mode == "terminal"


def test_drafted_and_accepted_count_the_speculating_rows_rounds(model, monkeypatch):
    """/metrics' speculative counters against the rounds recorded from the engine: drafts are k per
    speculating row and round (rows riding along were counted too), accepted drafts are each window's
    (the verifier's own token was counted as accepted)."""
    k, windows = 3, {}
    reqs = [Request(TOK.encode(p), SamplingConfig(24), example_id=i + 2) for i, p in enumerate(PROMPTS[:3])]
    reqs += [  # plain rows at another depth: plain steps of their own, riding along in the rounds
        Request(TOK.encode(p), SamplingConfig(24), rule=DepthRule(DEPTH + 1), example_id=i + 5, speculate=0)
        for i, p in enumerate(PROMPTS[3:5])
    ]
    engine = Engine(model, TOK, EngineConfig(max_batch=8, depth=DEPTH, max_depth=DEPTH + 1, speculate=k, draft_depth=1))
    _run(engine, reqs, windows, monkeypatch)
    assert sorted(windows) == [2, 3, 4]  # only the speculating requests take rounds
    assert engine.drafted_tokens == k * sum(len(w) for w in windows.values())
    assert engine.accepted_tokens == sum(sum(w) for w in windows.values()) > 0


@pytest.mark.slow
def test_a_compiled_engine_rides_rows_along_as_the_eager_engine_does(model):
    """The compiled engine (padding rows of a batch bucket beside the passengers; Dynamo-traced graphs
    run by the eager backend, as tests/test_serve_engine.py's compiled engine) gives each request of
    the mix the tokens it gets alone on the eager engine."""
    config = EngineConfig(max_batch=4, depth=DEPTH, max_depth=DEPTH + 2, max_seq_len=40, speculate=3, draft_depth=1)
    reqs = _mixed_requests("terminal")[:4]
    alone = [_run(Engine(model, TOK, config), [r])[0] for r in reqs]
    compiled = Engine(model, TOK, replace(config, compile=True), compile_options={"backend": "eager"})
    assert _run(compiled, reqs) == alone


def test_a_request_that_asks_nothing_of_speculation_runs_plainly_below_the_draft_depth(model, monkeypatch):
    """A speculating engine (draft depth 2) takes a request at depth 2 that sets neither `speculate`
    nor `draft_depth`: the engine's default does not fit it, so it decodes plainly (the no-cache
    greedy tokens at depth 2) while rows at the engine's depth still speculate. A request that asks
    for the same draft depth itself is refused."""
    rounds = []
    real = engine_mod.speculative_round
    monkeypatch.setattr(engine_mod, "speculative_round", lambda *a, **kw: rounds.append(1) or real(*a, **kw))
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=DEPTH, cache="full", speculate=3, draft_depth=2))
    shallow = Request(TOK.encode("hello"), SamplingConfig(8), rule=DepthRule(2), example_id=3)
    (got,) = _run(engine, [shallow])
    assert got == _no_cache_greedy(model, shallow.prompt_ids, 8, 2, 3)
    assert rounds == [] and engine.stats()["speculative_drafted_total"] == 0
    deep = Request(TOK.encode("hello"), SamplingConfig(8), example_id=3)
    (got,) = _run(engine, [deep])
    assert got == _no_cache_greedy(model, deep.prompt_ids, 8, DEPTH, 3) and rounds
    with pytest.raises(ValueError, match="draft_depth must be in 1..1"):
        engine.submit(Request(TOK.encode("hi"), rule=DepthRule(2), draft_depth=2))


def test_a_speculation_that_never_fits_a_slot_is_refused(model):
    """k draft tokens need a verify chunk of k + 1 positions after the prompt's first token: in slots
    of 32 positions k = 30 is the most, for the engine's default (checked when the engine is built,
    before a compiled warm-up would write past the slot) and per request."""
    with pytest.raises(ValueError, match="speculate must be <= 30"):
        Engine(model, TOK, EngineConfig(depth=DEPTH, max_seq_len=32, speculate=31, draft_depth=1))
    engine = Engine(model, TOK, EngineConfig(depth=DEPTH, cache="full", max_seq_len=32, speculate=30, draft_depth=1))
    with pytest.raises(ValueError, match="speculate must be <= 30"):
        engine.submit(Request(TOK.encode("hi"), speculate=31))
    (got,) = _run(engine, [Request(TOK.encode("a"), SamplingConfig(12), example_id=2)])
    assert got == _no_cache_greedy(model, TOK.encode("a"), 12, DEPTH, 2)


def test_decode_counters_count_the_tokens_rows_emitted_not_all_their_window_decided(model):
    """Rows that stop inside an accepted window (max_tokens of 2, 3, 5 with k = 6) emit only what
    they may: the decoded-token counter (tokens/s, mean decode depth) counts those, so it equals
    the tokens generated less each request's first token (which its prefill chose)."""
    engine = Engine(model, TOK, EngineConfig(max_batch=4, depth=DEPTH, cache="full", speculate=6, draft_depth=3))
    reqs = [Request(TOK.encode(p), SamplingConfig(n), example_id=i) for i, (p, n) in enumerate(zip(PROMPTS, (2, 3, 5)))]
    finishes = engine.generate(reqs)
    stats = engine.stats()
    assert stats["speculative_accepted_total"] > sum(f.completion_tokens - 1 for f in finishes)  # windows overshot
    assert stats["generated_tokens_total"] == sum(f.completion_tokens for f in finishes) == 10
    assert engine.decoded_tokens == 10 - len(reqs)
    assert engine.decode_depth_sum == DEPTH * engine.decoded_tokens


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(speculate=-1), "speculate must be >= 0"),
        (dict(speculate=2, draft_depth=DEPTH), f"draft_depth must be in 1..{DEPTH - 1}"),
        (dict(speculate=2, draft_depth=0), f"draft_depth must be in 1..{DEPTH - 1}"),
        # speculate asked for at a depth the engine's draft depth (2) is not below: refused, not run plainly
        (dict(speculate=2, rule=DepthRule(2)), "draft_depth must be in 1..1"),
    ],
)
def test_bad_speculation_settings_are_refused_before_queueing(model, fields, message):
    engine = Engine(model, TOK, EngineConfig(depth=DEPTH))
    with pytest.raises(ValueError, match=message):
        engine.submit(Request(TOK.encode("hi"), **fields))
    assert engine.waiting == 0


def test_the_api_takes_speculation_per_request_and_reports_acceptance(model):
    """Over HTTP: `speculate`/`draft_depth` in the body reach the engine (a bad draft depth is a 400
    naming it), and /metrics carries the acceptance counters."""
    fastapi = pytest.importorskip("fastapi")  # noqa: F841
    from fastapi.testclient import TestClient

    from looplm.serve.api import create_app

    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=DEPTH, cache="full"))
    with TestClient(create_app(engine, "m")) as client:
        body = {"model": "m", "prompt": "hello", "max_tokens": 9, "temperature": 0, "speculate": 3, "draft_depth": 1}
        got = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        want = TOK.decode(_no_cache_greedy(model, TOK.encode("hello"), 9, DEPTH, 0))
        assert got == want
        bad = client.post("/v1/completions", json={**body, "draft_depth": DEPTH})
        assert bad.status_code == 400 and "draft_depth" in bad.json()["error"]["message"]
        metrics = client.get("/metrics").text
    drafted = [line for line in metrics.splitlines() if line.startswith("looplm_speculative_drafted_total")]
    assert drafted and float(drafted[0].split()[-1]) > 0
    assert "looplm_speculative_acceptance_rate" in metrics


def test_looplm_serve_takes_speculate_and_checks_it_before_loading(tmp_path, capsys):
    """`looplm serve --speculate K --draft-depth r`: a draft depth at or above --depth is one error line
    naming both options, before any checkpoint is read (the folder does not exist)."""
    from looplm import cli

    code = cli.main(["serve", str(tmp_path / "missing"), "--depth", "4", "--speculate", "3", "--draft-depth", "4"])
    err = capsys.readouterr().err
    assert code == 2 and "--draft-depth must be in 1..3 (below --depth 4), got 4" in err, err


def test_sampling_rows_speculating_together_each_sample_what_they_sample_alone(model):
    """Two sampled requests (their own seeds and settings) in one round: each row's acceptance rule weighs
    its drafts by its own draft distribution and its own verifier settings, so each request's tokens are
    those it samples alone (a row judged by another row's q or p samples something else)."""
    config = EngineConfig(max_batch=4, depth=DEPTH, cache="full", speculate=3, draft_depth=1)
    reqs = [
        Request(TOK.encode("hello"), SamplingConfig(14, temperature=0.8, top_k=30, seed=5), example_id=2),
        Request(TOK.encode("the quick brown f"), SamplingConfig(14, temperature=1.2, seed=7), example_id=3),
        Request(TOK.encode("ab"), SamplingConfig(14, temperature=1.0, top_p=0.9, seed=9), example_id=4),
    ]
    alone = [_run(Engine(model, TOK, config), [r])[0] for r in reqs]
    assert _run(Engine(model, TOK, config), reqs) == alone


# -- found by mutating the speculating engine ---------------------------------------------------------------
def test_speculated_tokens_carry_the_verifiers_logprobs_and_depth(model):
    """Every token of a speculating request (full cache: its round's verify chunk is the parallel forward)
    reports the log-probability, top alternatives and depth of the native no-cache forward at the
    request's depth on the tokens before it: an accepted draft's are the verifier's at its own position
    in the chunk, not the chunk's first position's, and its depth is the verifier's, not the draft's."""
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=DEPTH, cache="full", speculate=3, draft_depth=1))
    reqs = [
        Request(TOK.encode(p), SamplingConfig(16), logprobs=2, example_id=i + 2) for i, p in enumerate(PROMPTS[1:3])
    ]
    handles = [engine.submit(r) for r in reqs]
    engine.run_until_done(handles)
    assert engine.accepted_tokens > 0  # some tokens were accepted drafts
    for req, h in zip(reqs, handles):
        tokens = [e for e in h.events(timeout=1) if isinstance(e, Token)]
        seq = list(req.prompt_ids)
        for t in tokens:
            with torch.no_grad():
                logits = model(torch.tensor([seq]), DEPTH, init="seeded", example_ids=torch.tensor([req.example_id]))
            lp = logits.logits[0, -1].log_softmax(-1)
            assert t.depth == DEPTH and abs(t.logprob - float(lp[t.token_id])) <= 1e-4
            assert [i for i, _ in t.top_logprobs] == lp.topk(2).indices.tolist()
            seq.append(t.token_id)


def test_a_carried_rows_tokens_are_decoded_tokens(model, monkeypatch):
    """A plain row carried by a round (its step is the verify chunk's first position) emits decoded
    tokens like any other step: the decoded-token counter (tokens/s, mean decode depth) equals the tokens
    generated less each request's first token (which its prefill chose)."""
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=DEPTH, cache="full", speculate=3, draft_depth=1))
    carried, real = [], engine._speculate
    monkeypatch.setattr(engine, "_speculate", lambda plan, m, c: carried.append(any(c)) or real(plan, m, c))
    reqs = [
        Request(TOK.encode("hello"), SamplingConfig(12), example_id=2),
        Request(TOK.encode("the quick brown f"), SamplingConfig(12), example_id=3, speculate=0),
    ]
    finishes = engine.generate(reqs)
    assert any(carried)
    assert engine.decoded_tokens == sum(f.completion_tokens for f in finishes) - len(reqs)
    assert engine.decode_depth_sum == DEPTH * engine.decoded_tokens
    s = engine.stats()
    assert s["speculative_acceptance_rate"] == pytest.approx(engine.accepted_tokens / engine.drafted_tokens)


def test_a_key_range_round_attends_over_its_verify_chunk(model):
    """With `key_range` a round's steps attend over the positions its rows fill including the verify
    chunk of k + 1 tokens (not one token): rows whose chunks cross a 16-position boundary give the
    no-cache greedy tokens. The engine's step runs eagerly here (the same key ranges, no compiling)."""
    config = EngineConfig(
        max_batch=2, depth=DEPTH, cache="full", compile=True, key_range=True, speculate=3, draft_depth=1
    )
    engine = Engine(model, TOK, config)
    engine._step = DecodeStep(model, engine.pool.cache, vocab=engine.vocab)  # eager, honouring `keys`
    engine._prefill_step = None  # the eager prefill
    reqs = [Request(TOK.encode(p), SamplingConfig(20), example_id=i + 2) for i, p in enumerate(["hello", "ab"])]
    got = _run(engine, reqs)
    for req, ids in zip(reqs, got):
        assert ids == _no_cache_greedy(model, req.prompt_ids, 20, DEPTH, req.example_id)
    assert engine.drafted_tokens > 0


@pytest.mark.parametrize("key_range", [False, True])
def test_a_warm_up_runs_every_step_a_speculating_engine_serves(model, key_range):
    """A compiled speculating engine's `warm_up` runs its step with every signature serving uses (chunk
    shape, depth, fill, key range): the draft step (fill False) and the verify chunk of k + 1 tokens per
    batch bucket, so no request compiles a graph. The step is recorded (and run eagerly) instead of
    compiled; the prefill runs eagerly too."""
    config = EngineConfig(
        max_batch=2, depth=DEPTH, max_seq_len=32, compile=True, key_range=key_range, speculate=3, draft_depth=1
    )
    engine = Engine(model, TOK, config)
    eager = DecodeStep(model, engine.pool.cache, vocab=engine.vocab)
    calls = []

    def recording(rows, depth, *, fill=True, keys=None, **kw):
        calls.append((tuple(rows.tokens.shape), depth, fill, keys is None, rows.depth is None, rows.exits))
        return eager(rows, depth, fill=fill, keys=keys, **kw)

    recording.key_range = eager.key_range
    engine._step, engine._prefill_step = recording, None
    engine.warm_up()
    warmed = set(calls)
    calls.clear()
    reqs = [Request(TOK.encode(p), SamplingConfig(12), example_id=i) for i, p in enumerate(["hello", "abc", "xy"])]
    engine.generate(reqs)
    assert {c[0] for c in calls} >= {(1,), (2,), (1, 4), (2, 4)}  # drafts and chunks of buckets 1 and 2
    assert set(calls) <= warmed
