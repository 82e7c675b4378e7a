"""The continuous-batching engine: outputs equal `generate` on each prompt alone (terminal and full
cache, mixed lengths, depths, adaptive exit and seeded sampling), slots are reused without leaks,
cancelled rows free their slot, streamed text equals the final text, bad requests are refused."""

import random

import pytest
import torch

from looplm.config import ModelConfig
from looplm.data import ByteTokenizer
from looplm.infer.generate import SamplingConfig, generate
from looplm.model import LoopedLM
from looplm.serve import Engine, EngineConfig, EngineFull, EngineStopped, Finish, Request, Token

TOK = ByteTokenizer()
pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64,
                      max_depth=8)
    return LoopedLM(cfg).eval()


def _alone(model, prompt: str, req: Request, mode: str, stats: dict | None = None) -> str:
    sampling = SamplingConfig(max_new_tokens=req.max_tokens, temperature=req.temperature, top_k=req.top_k,
                              top_p=req.top_p, seed=req.seed, stop=req.stop, exit_tau=req.exit_tau,
                              min_depth=req.min_depth)
    return generate(model, TOK, [prompt], depth=req.depth, prefill_depth=req.prefill_depth, cache_mode=mode,
                    sampling=sampling, stats=stats)[0]


def _prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefgh +=") for _ in range(rng.randint(1, 24))) for _ in range(n)]


@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_sixteen_requests_equal_generate_alone(model, mode):
    """Different prompt lengths, decode and prefill depths, budgets; 5 slots so rows join, finish and
    move while others decode."""
    prompts = _prompts(16)
    rng = random.Random(1)
    reqs = [Request(TOK.encode(p), max_tokens=rng.randint(1, 24), depth=1 + i % 4, prefill_depth=1 + (3 * i) % 4)
            for i, p in enumerate(prompts)]
    engine = Engine(model, TOK, EngineConfig(max_batch=5, depth=4, max_depth=4, cache=mode))
    finishes = engine.generate(reqs)
    assert [f.text for f in finishes] == [_alone(model, p, r, mode) for p, r in zip(prompts, reqs)]
    assert engine.pool.running == 0 and sum(engine.finished.values()) == 16
    assert all(f.completion_tokens == r.max_tokens for f, r in zip(finishes, reqs) if f.reason == "length")


def test_adaptive_exit_and_sampling_per_row_equal_generate_alone(model):
    prompts = _prompts(8, seed=2)
    reqs = [Request(TOK.encode(p), max_tokens=12, depth=6, exit_tau=0.05 if i % 2 else None, min_depth=1 + i % 3,
                    temperature=0.9 if i % 3 == 0 else 0.0, top_k=20 if i % 4 == 0 else 0, seed=100 + i)
            for i, p in enumerate(prompts)]
    engine = Engine(model, TOK, EngineConfig(max_batch=3, depth=6))
    finishes = engine.generate(reqs)
    for p, r, f in zip(prompts, reqs, finishes):
        stats: dict = {}
        assert f.text == _alone(model, p, r, "terminal", stats)
        assert f.mean_decode_depth == pytest.approx(stats["mean_decode_depth"])
    assert any(f.mean_decode_depth < 6 for f in finishes)  # the exit really fired


def test_reused_slot_does_not_read_the_previous_sequence(model):
    """One slot: a long sequence, then a short one. Its cache positions past the short prompt still
    hold the long one's K/V; the short one's text must equal its run in a fresh engine."""
    long_req = Request(TOK.encode("x" * 40), max_tokens=20)
    short_req = Request(TOK.encode("ab"), max_tokens=20)
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=3))
    engine.generate([long_req])
    assert engine.pool.cache.prelude[0].k[0, :, 40:59].abs().sum() > 0  # stale K/V really is there
    reused = engine.generate([short_req])[0].text
    fresh = Engine(model, TOK, EngineConfig(max_batch=1, depth=3)).generate([short_req])[0].text
    assert reused == fresh == _alone(model, "ab", Request([], max_tokens=20, depth=3), "terminal")


def test_cancel_frees_the_slot_and_leaves_other_rows_exact(model):
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3))
    keep = Request(TOK.encode("keep going"), max_tokens=20, stop=())
    drop = engine.submit(Request(TOK.encode("to be cancelled"), max_tokens=30))
    kept = engine.submit(keep)
    engine.step()
    engine.step()
    assert engine.pool.running == 2
    drop.cancel()
    engine.step()
    assert drop.finish is not None and drop.finish.reason == "cancelled" and engine.pool.running == 1
    engine.run_until_done([kept])
    assert kept.finish.text == _alone(model, "keep going", Request([], max_tokens=20, depth=3), "terminal")


def test_streamed_pieces_hold_back_stop_strings(model):
    prompt = "abc"
    free = _alone(model, prompt, Request([], max_tokens=20, depth=3), "terminal")
    stop = free[5:8]  # a string the model really produces: generation stops before it
    assert len(stop) == 3 and stop not in free[:7]
    req = Request(TOK.encode(prompt), max_tokens=20, depth=3, stop=(stop,))
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3))
    handle = engine.submit(req)
    engine.run_until_done([handle])
    events = list(handle.events(timeout=5))
    pieces = "".join(e.text for e in events if isinstance(e, Token))
    fin = events[-1]
    assert isinstance(fin, Finish) and fin.reason == "stop"
    assert fin.text == free[:free.index(stop)] == _alone(model, prompt, req, "terminal")
    assert pieces + fin.tail == fin.text
    assert all(stop not in e.text for e in events if isinstance(e, Token))


def test_logprobs_match_a_no_cache_forward(model):
    """The reported log-probs are log-softmax of the native forward (seeded state, example 0) at
    each step, recomputed without a cache (the full cache reproduces the native forward exactly;
    the terminal cache is the paper's approximation of it)."""
    ids = TOK.encode("hello")
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3, cache="full"))
    handle = engine.submit(Request(ids, max_tokens=6, depth=3, logprobs=3))
    engine.run_until_done([handle])
    tokens = [e for e in handle.events(timeout=5) if isinstance(e, Token)]
    seq = list(ids)
    for t in tokens:
        with torch.no_grad():
            lp = model(torch.tensor([seq]), 3, init="seeded").logits[0, -1].log_softmax(-1)
        assert t.token_id == int(lp.argmax())
        assert t.logprob == pytest.approx(float(lp[t.token_id]), abs=1e-4)
        top = lp.topk(3)
        assert [i for i, _ in t.top_logprobs] == top.indices.tolist()
        seq.append(t.token_id)


@pytest.mark.parametrize(("fields", "message"), [
    (dict(depth=0), "depth must be in 1..8"),
    (dict(depth=9), "depth must be in 1..8"),
    (dict(prefill_depth=20), "prefill_depth must be in 1..8"),
    (dict(max_tokens=0), "max_new_tokens must be >= 1"),
    (dict(max_tokens=60), "more than the context of 64"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(exit_tau=0.1, min_depth=6, depth=4), "min_depth 6 exceeds the decode depth 4"),
    (dict(logprobs=50), "logprobs must be in 0..20"),
])
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
        full.submit(Request(TOK.encode("a"), exit_tau=0.1))
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=3, max_queue=2))
    engine.submit(Request(TOK.encode("a")))
    engine.submit(Request(TOK.encode("b")))
    with pytest.raises(EngineFull, match="max_queue 2"):
        engine.submit(Request(TOK.encode("c")))


def test_threaded_engine_and_stats(model):
    engine = Engine(model, TOK, EngineConfig(max_batch=4, depth=3)).start()
    try:
        handles = [engine.submit(Request(TOK.encode(p), max_tokens=8)) for p in _prompts(6, seed=3)]
        finishes = [[e for e in h.events(timeout=30)][-1] for h in handles]
    finally:
        engine.shutdown()
    assert all(f.reason in ("stop", "length") for f in finishes)
    s = engine.stats()
    assert s["generated_tokens_total"] == sum(f.completion_tokens for f in finishes)
    assert s["running_sequences"] == 0 and s["cache_bytes_in_use"] == 0 and s["mean_decode_depth"] == 3.0
    per_token = 2 * model.cfg.n_kv_heads * model.cfg.head_dim * 4  # K and V, fp32
    assert s["cache_bytes_capacity"] == 4 * 4 * 64 * per_token  # 4 banks (1/2/1 blocks) x 4 slots x 64 positions


def test_a_raising_event_sink_fails_its_request_only(model):
    """A consumer whose sink raises (e.g. its event loop has closed) ends its own request with an
    error; the engine thread lives on and the other rows stay exact."""
    engine = Engine(model, TOK, EngineConfig(max_batch=2, depth=3))
    good = engine.submit(Request(TOK.encode("keep going"), max_tokens=12))

    def broken(event):
        raise RuntimeError("the consumer is gone")

    bad = engine.submit(Request(TOK.encode("a broken consumer"), max_tokens=12), sink=broken)
    engine.start()
    try:
        events = list(good.events(timeout=30))
        assert events[-1].text == _alone(model, "keep going", Request([], max_tokens=12, depth=3), "terminal")
        after = engine.submit(Request(TOK.encode("after"), max_tokens=4))
        assert [e for e in after.events(timeout=30)][-1].reason in ("stop", "length")
        assert bad.finish is not None and bad.finish.reason == "error" and "the consumer is gone" in bad.finish.error
        assert engine._thread.is_alive() and engine.pool.running == 0 and engine.finished.get("error") == 1
    finally:
        engine.shutdown()


def test_submit_after_shutdown_fails_fast(model):
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=3)).start()
    engine.shutdown()
    with pytest.raises(match="shut down"):
        engine.submit(Request(TOK.encode("too late")))
    assert not engine._pending
    engine.start()  # a restarted engine takes requests again
    try:
        assert [e for e in engine.submit(Request(TOK.encode("again"), max_tokens=2)).events(timeout=30)][-1].reason
    finally:
        engine.shutdown()


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_outside_the_generators_range_is_refused_before_queueing(model, seed):
    engine = Engine(model, TOK, EngineConfig(max_batch=1, depth=3))
    with pytest.raises(ValueError, match="seed must be in"):
        engine.submit(Request(TOK.encode("a"), temperature=1.0, seed=seed))
    assert not engine._pending
    for edge in (2**64 - 1, -(2**63)):  # torch.Generator's own limits are accepted
        assert engine.generate([Request(TOK.encode("a"), max_tokens=2, temperature=1.0, seed=edge)])[0].reason
