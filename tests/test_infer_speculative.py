"""Self-speculative decoding (`looplm.infer.speculative`, design §16) against independent references:

- full cache, greedy: token for token the no-cache greedy decode at the verifier's depth (and plain
  `generate`), over several k, draft depths, prompt lengths, stops and EOS inside accepted windows,
  with the verify resumed from the drafts' states (the default) and rerun from recurrence 1;
- the resumed verify chunk itself: its logits and banks against a rerun from recurrence 1, `extend`
  of the chunk on a cache copied before the drafts, and the no-cache forward (whose state after
  recurrence r_d is the drafts');
- terminal cache, greedy: each emitted token is the argmax of a replay through `extend` in which the
  prompt is one chunk and each verify round's accepted window [last, d_1..d_n] is one chunk (the
  window sizes come from an instrumented run; the replay never calls speculative_decode);
- the acceptance rule (`accept`): the first emitted token is distributed as the verifier's p;
- end to end sampling: the first two tokens are distributed as plain sampling's, computed exactly."""

import collections

import pytest
import torch
from _models import decisive_model
from _reference import window_replay_check

import looplm.infer.generate as gen_mod
import looplm.infer.speculative as spec_mod
from looplm.data import ByteTokenizer
from looplm.errors import UserError
from looplm.infer import extend, make_cache
from looplm.infer.decode import SamplingConfig, probabilities
from looplm.infer.generate import DepthRule, Speculation, generate
from looplm.infer.step import DecodeStep, StepRows

TOK = ByteTokenizer()
DEPTH = 4
pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread


class _EosTokenizer(ByteTokenizer):
    """Bytes, with EOS moved to a given id (-1: no EOS), to end generation at a chosen token."""

    def __init__(self, eos: int):
        self._eos = eos

    @property
    def eos_id(self) -> int:
        return self._eos


@pytest.fixture(scope="module")
def model():
    return decisive_model(TOK.vocab_size, max_seq_len=48)


def _no_cache_greedy(model, prompt_ids, n, depth, eos, example_id=0):
    """Reference: the whole sequence re-run natively (no cache) for every new token; ids until EOS."""
    ids = list(prompt_ids)
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids]), depth, init="seeded", example_ids=torch.tensor([example_id])).logits
        nxt = int(logits[0, -1].argmax())
        if nxt == eos:
            break
        ids.append(nxt)
    return ids[len(prompt_ids) :]


def _spec(monkeypatch, model, prompt, *, k, draft_depth, mode, n, tok=TOK, stop=(), depth=DEPTH, reuse=True, **kw):
    """generate with speculation, instrumented: (text, emitted ids (EOS included), windows [(k_i, n_i)], stats)."""
    emitted, windows = [], []
    real_accept, real_decode = spec_mod.accept, gen_mod.speculative_decode

    def accept(drafts, p, q, g):
        n_acc, nxt = real_accept(drafts, p, q, g)
        windows.append((drafts.shape[0], n_acc))
        return n_acc, nxt

    def decode(*a, emit, **k_):
        return real_decode(*a, emit=lambda t: emitted.append(t) or emit(t), **k_)

    monkeypatch.setattr(spec_mod, "accept", accept)
    monkeypatch.setattr(gen_mod, "speculative_decode", decode)
    stats = {}
    text = generate(
        model,
        tok,
        [prompt],
        DepthRule(depth),
        cache=mode,
        stats=stats,
        speculate=Speculation(k, draft_depth, reuse),
        sampling=SamplingConfig(max_new_tokens=n, stop=stop),
        **kw,
    )[0]
    monkeypatch.undo()
    return text, emitted, windows, stats


CASES = [(1, 1, 13), (2, 1, 13), (3, 2, 13), (5, 3, 11), (4, 1, 30)]


@pytest.mark.parametrize(("k", "draft_depth", "n", "reuse"), [(*c, True) for c in CASES] + [(3, 2, 13, False)])
def test_full_cache_speculative_greedy_equals_plain_greedy(monkeypatch, model, k, draft_depth, n, reuse):
    """max_new_tokens is never a multiple of k + 1; prompts of 1, 5 and 17 bytes. `reuse`: the verify
    resumes from the drafts' states (the default), or reruns every recurrence."""
    rejected = accepted = 0
    for prompt in ["a", "hello", "the quick brown f"]:
        ids = TOK.encode(prompt)
        want = _no_cache_greedy(model, ids, n, DEPTH, TOK.eos_id)
        text, emitted, windows, stats = _spec(
            monkeypatch, model, prompt, k=k, draft_depth=draft_depth, mode="full", n=n, reuse=reuse
        )
        assert [t for t in emitted if t != TOK.eos_id] == want, (prompt, emitted, want)
        plain = generate(
            model, TOK, [prompt], DepthRule(DEPTH), cache="full", sampling=SamplingConfig(max_new_tokens=n)
        )
        assert text == plain[0] == TOK.decode(want)
        rejected += sum(kd - a for kd, a in windows)
        accepted += sum(a for _, a in windows)
        assert stats["speculation"]["accepted"] == sum(a for _, a in windows)
    assert rejected > 0 and accepted > 0  # both paths of the rule ran (draft depth << verifier depth)


@pytest.mark.parametrize(
    ("k", "draft_depth", "cache_depth", "prompt"),
    [(4, 1, DEPTH, "the quick brown f"), (3, 3, DEPTH, "a"), (4, 2, 6, "hello")],
)
@torch.no_grad()
def test_a_verify_resumed_from_the_drafts_equals_a_verify_from_scratch(model, k, draft_depth, cache_depth, prompt):
    """The full cache's reuse (design §16) against two references that never resume: the same verify
    chunk rerun at every recurrence after the same drafts (a twin of the cache), and `extend` of the
    chunk on a copy of the cache taken before any draft ran. Logits and every bank to 1e-5. Also the
    claim the reuse rests on: a draft's state after recurrence r_d is the parallel forward's state
    after recurrence r_d at its position (no cache at all), and the resumed logits are its logits."""
    ids, ex, pad = TOK.encode(prompt), torch.tensor([2]), torch.tensor([0])
    L = len(ids)
    cache = make_cache("full", model.cfg, 1, 48, cache_depth)
    tok = extend(model, torch.tensor([ids]), cache, DEPTH, example_ids=ex).logits[:, -1].argmax(-1)
    before = cache.take(torch.tensor([0]))
    step = DecodeStep(model, cache)
    fed, states = [tok], []
    for i in range(k):  # the drafts of one round: last, d_1 .. d_{k-1} fed at depth r_d, d_k proposed
        logits, _, z = step(StepRows(tok, torch.tensor([L + i]), pad, ex), draft_depth, fill=False, endpoint=True)
        tok = logits.argmax(-1)
        fed.append(tok)
        states.append(z)
    chunk = torch.cat(fed)[None]  # [1, k + 1]
    twin = cache.take(torch.tensor([0]))
    rows = StepRows(chunk, torch.tensor([L]), pad, ex)
    got, used = step(rows, DEPTH, resume=(torch.stack(states, 1), draft_depth))
    assert used.tolist() == [DEPTH]
    rerun, _ = DecodeStep(model, twin)(rows, DEPTH)
    scratch = extend(model, chunk, before, DEPTH, example_ids=ex).logits
    assert (got - rerun).abs().max() <= 1e-5 and (got - scratch).abs().max() <= 1e-5
    for a, b in zip(cache.banks(), before.banks(), strict=True):  # before: positions past L + k never written
        assert (a.k - b.k).abs().max() <= 1e-5 and (a.v - b.v).abs().max() <= 1e-5
    native = model(torch.cat([torch.tensor([ids]), chunk], 1), DEPTH, init="seeded", example_ids=ex, return_states=True)
    assert (torch.stack(states, 1) - native.states[draft_depth - 1][:, L : L + k]).abs().max() <= 1e-5
    assert (native.states[draft_depth][:, L : L + k] - torch.stack(states, 1)).abs().max() > 1e-3  # depth matters
    assert (got - native.logits[:, L:]).abs().max() <= 1e-5


def test_resume_is_checked(model):
    cache = make_cache("terminal", model.cfg, 1, 48, DEPTH)
    rows = StepRows(torch.zeros(1, 3, dtype=torch.long), torch.tensor([0]), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="full cache"):
        DecodeStep(model, cache)(rows, DEPTH, resume=(torch.zeros(1, 2, model.cfg.d_model), 1))
    step = DecodeStep(model, make_cache("full", model.cfg, 1, 48, DEPTH))
    for states, r0 in ((torch.zeros(1, 4, model.cfg.d_model), 1), (torch.zeros(1, 2, model.cfg.d_model), DEPTH)):
        with pytest.raises(ValueError, match="resume from recurrence"):
            step(rows, DEPTH, resume=(states, r0))


def _window_positions(emitted, windows):
    """Indices of emitted tokens that were accepted drafts at position >= 2 of their window (a stop
    there ends the window in its middle)."""
    out, p = [], 0
    for _, n_acc in windows:
        out += [p + j for j in range(2, n_acc + 1)]
        p += n_acc + 1
    return [i for i in out if i < len(emitted)]


@pytest.mark.parametrize("mode", ["full", "terminal"])
def test_stop_and_eos_inside_an_accepted_window(monkeypatch, model, mode):
    """EOS, and a stop string, that fall on an accepted draft in the middle of a window: the speculative
    output is the free output cut there (full cache: also plain greedy's)."""
    n, stops = 30, 0
    for prompt in ["the quick brown f", "a", "ab"]:
        free, emitted, windows, _ = _spec(
            monkeypatch, model, prompt, k=4, draft_depth=2, mode=mode, n=n, tok=_EosTokenizer(-1)
        )
        inside = [i for i in _window_positions(emitted, windows) if emitted[i] not in emitted[:i]]  # first occurrences
        assert inside, windows
        i = inside[0]
        eos_tok = _EosTokenizer(emitted[i])  # EOS = that token: generation ends before it
        cut, got, _, _ = _spec(monkeypatch, model, prompt, k=4, draft_depth=2, mode=mode, n=n, tok=eos_tok)
        assert got == emitted[: i + 1] and cut == TOK.decode(emitted[:i])
        if mode == "full":
            plain = generate(
                model, eos_tok, [prompt], DepthRule(DEPTH), cache=mode, sampling=SamplingConfig(max_new_tokens=n)
            )
            assert plain == [cut]
        for i in inside:  # a stop string that the token at i completes (its new text, first seen there)
            before, after = TOK.decode(emitted[:i]), TOK.decode(emitted[: i + 1])
            stop = after[len(before) :]
            if after.startswith(before) and stop and "\ufffd" not in stop and free.find(stop) == len(before):
                break
        else:
            continue
        text, got, _, _ = _spec(
            monkeypatch, model, prompt, k=4, draft_depth=2, mode=mode, n=n, tok=_EosTokenizer(-1), stop=(stop,)
        )
        assert got == emitted[: i + 1] and text == before, (stop, text, before)
        stops += 1
    assert stops, "no printable token mid-window: pick other prompts"


# -- terminal cache: the accepted windows replayed as chunks (_reference.window_replay_check) ---------------
@pytest.mark.parametrize(("k", "draft_depth", "n"), CASES)
def test_terminal_speculative_equals_a_replay_of_its_windows(monkeypatch, model, k, draft_depth, n):
    for e, prompt in enumerate(["a", "hello", "the quick brown f"]):
        text, emitted, windows, _ = _spec(
            monkeypatch, model, prompt, k=k, draft_depth=draft_depth, mode="terminal", n=n, example_ids=[e + 3]
        )
        assert windows and text == TOK.decode([t for t in emitted if t != TOK.eos_id])
        window_replay_check(
            model, TOK.encode(prompt), emitted, [a for _, a in windows], DEPTH, n, TOK.eos_id, example_id=e + 3
        )


def test_batched_speculation_equals_each_prompt_alone(model):
    prompts = ["a", "hello", "the quick brown f"]
    spec = Speculation(3, 1)
    cfg = SamplingConfig(max_new_tokens=12)
    stats = {}
    batch = generate(
        model, TOK, prompts, DepthRule(DEPTH), speculate=spec, sampling=cfg, stats=stats, example_ids=[5, 6, 7]
    )
    alone = [
        generate(model, TOK, [p], DepthRule(DEPTH), speculate=spec, sampling=cfg, example_ids=[5 + i])[0]
        for i, p in enumerate(prompts)
    ]
    assert batch == alone
    s = stats["speculation"]
    assert stats["acceptance_rate"] == s["accepted"] / s["drafted"]
    assert stats["tokens_per_verify"] == (s["accepted"] + s["rounds"]) / s["rounds"]


class _Clock:
    """A `time` stand-in whose perf_counter moves only when told (`tick`)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def test_the_first_round_is_timed_from_the_decode_start_and_counts_its_tokens(monkeypatch, model):
    """`generate`'s first_step_seconds with speculation counts from the decode's start, as a plain first
    step does (what precedes the first round, building and resetting the step, compiling it when
    compiled, is in it), and first_step_tokens are the tokens decided by the first round's end: the
    prompt's next token, its accepted drafts and the verifier's token. A clock moves 100 s in the
    step's reset and 1 s at each acceptance, so every figure is known exactly."""
    clock, accepted = _Clock(), []
    real_accept = spec_mod.accept

    def accept(drafts, p, q, g):
        n, nxt = real_accept(drafts, p, q, g)
        accepted.append(n)
        clock.tick(1.0)
        return n, nxt

    class SlowReset(DecodeStep):
        def reset(self, cache):
            clock.tick(100.0)
            super().reset(cache)

    monkeypatch.setattr(spec_mod, "accept", accept)
    monkeypatch.setattr(spec_mod, "time", clock)
    monkeypatch.setattr(gen_mod, "time", clock)
    stats = {}
    cfg = SamplingConfig(max_new_tokens=14)
    generate(
        model,
        TOK,
        ["hello"],
        DepthRule(DEPTH),
        speculate=Speculation(3, 1),
        sampling=cfg,
        stats=stats,
        step=SlowReset(model),
    )
    assert len(accepted) >= 2  # several rounds
    assert stats["decode_seconds"] == 100.0 + len(accepted)
    assert stats["first_step_seconds"] == 101.0
    assert stats["first_step_tokens"] == 2 + accepted[0]


def test_the_first_rounds_tokens_are_those_emitted_when_the_row_stops_inside_it(model):
    """A row that stops inside the first round's accepted window (here `emit` says stop at the second
    token) has emitted 2 tokens by the round's end, whatever the round decided."""
    ids = TOK.encode("hello")
    cache = make_cache("full", model.cfg, 1, 48, DEPTH)
    first = extend(model, torch.tensor([ids]), cache, DEPTH, example_ids=torch.tensor([0])).logits[:, -1]
    out, stats = [], spec_mod.SpeculationStats()
    spec_mod.speculative_decode(
        DecodeStep(model, cache),
        first,
        length=len(ids),
        depth=DEPTH,
        draft_depth=2,
        k=4,
        sampling=SamplingConfig(max_new_tokens=20),
        generator=None,
        pad=torch.tensor([0]),
        example_ids=torch.tensor([0]),
        emit=lambda t: out.append(t) or len(out) == 2,
        stats=stats,
    )
    assert stats.rounds == 1 and stats.accepted >= 1  # the round decided 2 + accepted > 2 tokens
    assert len(out) == 2 and stats.first_round_tokens == 2


@pytest.mark.parametrize(("k", "draft_depth", "message"), [(0, 2, "k >= 1"), (-3, 2, "k >= 1"), (2, DEPTH, "1..3")])
def test_speculative_decode_checks_its_settings_before_it_emits(model, k, draft_depth, message):
    cache = make_cache("full", model.cfg, 1, 48, DEPTH)
    first = extend(model, torch.tensor([TOK.encode("hi")]), cache, DEPTH, example_ids=torch.tensor([0])).logits[:, -1]
    out = []
    with pytest.raises(UserError, match=message):
        spec_mod.speculative_decode(
            DecodeStep(model, cache),
            first,
            length=2,
            depth=DEPTH,
            draft_depth=draft_depth,
            k=k,
            sampling=SamplingConfig(max_new_tokens=8),
            generator=None,
            pad=torch.tensor([0]),
            example_ids=torch.tensor([0]),
            emit=lambda t: out.append(t) or False,
            stats=spec_mod.SpeculationStats(),
        )
    assert out == []


def test_speculation_settings_are_checked(model):
    for spec, msg in (
        (Speculation(0, 1), "k >= 1"),
        (Speculation(2, 0), "draft_depth must be in 1..3"),
        (Speculation(2, DEPTH), "draft_depth must be in 1..3"),
    ):
        with pytest.raises(UserError, match=msg):
            generate(model, TOK, ["ab"], DepthRule(DEPTH), speculate=spec)
    with pytest.raises(UserError, match="exit_tau"):
        generate(model, TOK, ["ab"], DepthRule(DEPTH, exit_tau=0.1), speculate=Speculation(2, 1))


# -- the sampling rule ------------------------------------------------------------------------------------
P = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05], [0.1, 0.1, 0.2, 0.3, 0.3], [0.2, 0.2, 0.2, 0.2, 0.2]])
Q = torch.tensor([[0.1, 0.1, 0.4, 0.2, 0.2], [0.3, 0.3, 0.2, 0.1, 0.1]])


def test_accept_greedy_keeps_the_agreeing_prefix():
    logits = torch.log(P)  # argmaxes 0, 3 (tie 3/4: first), 0
    assert [int(x) for x in spec_mod.accept(torch.tensor([0, 3]), logits, None, None)] == [2, 0]
    assert [int(x) for x in spec_mod.accept(torch.tensor([0, 1]), logits, None, None)] == [1, 3]
    assert [int(x) for x in spec_mod.accept(torch.tensor([2, 3]), logits, None, None)] == [
        0,
        0,
    ]  # no later agreement counts


def test_accept_emits_tokens_distributed_as_the_verifier():
    """Drafts d_i ~ q_i; the first emitted token (d_1 if kept, else the correction) must follow p_0,
    and the second, given d_1 was kept, p_1. A rule that always accepts gives q_0 (off by 0.4); one that
    resamples from p instead of the residual puts 0.3 instead of 0.4 on token 0."""
    g = torch.Generator().manual_seed(0)
    N = 4000
    first, second = torch.zeros(5), torch.zeros(5)
    for _ in range(N):
        drafts = torch.multinomial(Q, 1, generator=g)[:, 0]
        n, nxt = spec_mod.accept(drafts, P, Q, g)
        emitted = [*drafts[:n].tolist(), int(nxt)]
        first[emitted[0]] += 1
        if n >= 1:
            second[emitted[1]] += 1
    first, second = first / N, second / second.sum()
    assert (first - P[0]).abs().max() < 0.03, first
    assert (second - P[1]).abs().max() < 0.05, second


def test_accept_when_p_equals_q_keeps_everything_and_draws_the_bonus_from_p():
    g = torch.Generator().manual_seed(1)
    bonus = collections.Counter()
    for _ in range(2000):
        n, nxt = spec_mod.accept(torch.tensor([2, 4]), P, P[:2], g)
        assert n == 2
        bonus[int(nxt)] += 1
    assert all(abs(bonus[t] / 2000 - 0.2) < 0.04 for t in range(5)), bonus


@pytest.mark.slow
@torch.no_grad()
def test_speculative_sampling_matches_plain_sampling_end_to_end():
    """A 6-token model at temperature 1: the first two tokens under speculation (k = 1, drafts at depth 1,
    verified at 4) against their exact distribution under plain sampling, computed from `extend`. (Here
    drafting from the residual matters: resampling from p instead puts the pair 0.1 (total variation)
    away, always accepting 0.2; 1000 draws: 6-10 s, so slow-marked.)"""
    V, R = 6, 4
    m = decisive_model(V, max_seq_len=16, seed=0)
    cfg = SamplingConfig(max_new_tokens=3, temperature=1.0)
    prompt = torch.tensor([[1, 4, 2]])
    ex, pad = torch.tensor([0]), torch.tensor([0])

    def prefilled():
        cache = make_cache("terminal", m.cfg, 1, 6, R)
        return cache, extend(m, prompt, cache, R, example_ids=ex).logits[:, -1]

    cache, logits = prefilled()
    p0 = probabilities(logits, cfg)[0]
    exact = torch.zeros(V, V)
    for t0 in range(V):
        c = cache.take(torch.tensor([0]))
        exact[t0] = p0[t0] * probabilities(extend(m, torch.tensor([[t0]]), c, R, example_ids=ex).logits[:, -1], cfg)[0]
    g = torch.Generator().manual_seed(0)
    N = 1000
    counts = torch.zeros(V, V)
    stats = spec_mod.SpeculationStats()
    step = DecodeStep(m, cache)
    for _ in range(N):
        c = cache.take(torch.tensor([0]))
        step.reset(c)
        got = []
        spec_mod.speculative_decode(
            step,
            logits,
            length=3,
            depth=R,
            draft_depth=1,
            k=1,
            sampling=cfg,
            generator=g,
            pad=pad,
            example_ids=ex,
            emit=lambda t: got.append(t) or len(got) == 2,
            stats=stats,
        )
        counts[got[0], got[1]] += 1
    assert 0.5 < stats.acceptance_rate < 0.9, stats  # drafts are rejected often enough for the residual to matter
    tv = 0.5 * float((counts / N - exact).abs().sum())
    print(f"total variation {tv:.3f}, acceptance {stats.acceptance_rate:.2f}")
    assert tv < 0.06, (counts / N, exact)


# -- the defaults, the budget and the cache's room ---------------------------------------------------------
def test_speculation_defaults():
    """The documented defaults: 4 drafts per verify at depth 2, the verify resumed from the drafts' states."""
    assert (Speculation().k, Speculation().draft_depth, Speculation().reuse) == (4, 2, True)


def _direct(model, prompt, *, mode, max_len, n, k, draft_depth, cache_depth=DEPTH, sampling=None, generator=None):
    """speculative_decode called directly on a cache of `max_len` positions after `extend` prefilled the
    prompt (example id 0): (emitted ids, windows [(drafts, accepted)], stats)."""
    ids = TOK.encode(prompt)
    cache = make_cache(mode, model.cfg, 1, max_len, cache_depth)
    first = extend(model, torch.tensor([ids]), cache, DEPTH, example_ids=torch.tensor([0])).logits[:, -1]
    out, windows, stats = [], [], spec_mod.SpeculationStats()
    real = spec_mod.accept

    def accept(drafts, p, q, g):
        n_acc, nxt = real(drafts, p, q, g)
        windows.append((drafts.shape[0], n_acc))
        return n_acc, nxt

    spec_mod.accept = accept
    try:
        spec_mod.speculative_decode(
            DecodeStep(model, cache),
            first,
            length=len(ids),
            depth=DEPTH,
            draft_depth=draft_depth,
            k=k,
            sampling=sampling or SamplingConfig(max_new_tokens=n),
            generator=generator,
            pad=torch.tensor([0]),
            example_ids=torch.tensor([0]),
            emit=lambda t: out.append(t) or False,
            stats=stats,
        )
    finally:
        spec_mod.accept = real
    return out, windows, stats


@pytest.mark.parametrize(("k", "n"), [(3, 9), (4, 11), (2, 8)])
def test_an_eager_round_drafts_only_what_may_still_be_emitted(model, k, n):
    """Eagerly (a cache far longer than the budget) a round drafts min(k, tokens still to emit - 1): the
    verifier's own token is the last one; `drafted` counts those drafts, not k per round."""
    out, windows, stats = _direct(model, "hello", mode="full", max_len=48, n=n, k=k, draft_depth=2)
    assert out == _no_cache_greedy(model, TOK.encode("hello"), n, DEPTH, -1)
    emitted = 1
    for drafted, accepted in windows:
        assert drafted == min(k, n - emitted - 1), windows
        emitted += accepted + 1
    assert any(d < k for d, _ in windows)  # the budget cut a round short
    assert stats.drafted == sum(d for d, _ in windows) and stats.accepted == sum(a for _, a in windows)


@pytest.mark.parametrize(("prompt", "k", "room"), [("hello", 2, 4), ("hello", 3, 6), ("hello", 4, 6)])
def test_a_cache_shorter_than_the_budget_bounds_the_drafts(model, prompt, k, room):
    """A full cache of L + room positions under a budget of 30 tokens: the rounds draft only what the cache
    can hold (a verify chunk never writes past it) and the row emits room + 1 tokens (the last one is never
    fed), the no-cache greedy tokens. (Here no round fills the cache exactly: see the next test.)"""
    ids = TOK.encode(prompt)
    out, windows, _ = _direct(model, prompt, mode="full", max_len=len(ids) + room, n=30, k=k, draft_depth=2)
    assert out == _no_cache_greedy(model, ids, room + 1, DEPTH, -1)
    assert any(d < k for d, _ in windows)  # the room, not k, bounded a round


@pytest.mark.parametrize(("prompt", "k", "room"), [("a", 2, 3), ("a", 4, 5), ("hello", 1, 5)])
def test_a_round_that_fills_the_cache_ends_the_decode(model, prompt, k, room):
    """BUG (speculative_decode): when a round's drafts are all accepted and its chunk reaches the cache's
    last position, `length == max_len` and the next pass takes the `n_draft < 1` branch, whose plain step
    writes `last` at position max_len: IndexError. Nothing can be fed any more; the decode should end with
    the room + 1 tokens emitted (as when the last round leaves one position: the plain step fills it)."""
    ids = TOK.encode(prompt)
    out, windows, _ = _direct(model, prompt, mode="full", max_len=len(ids) + room, n=30, k=k, draft_depth=2)
    assert out == _no_cache_greedy(model, ids, room + 1, DEPTH, -1)


class _CappedFullReplay:
    """The hand-written decoder (`_reference.NaiveDecoder`) for a full cache of `visits` banks per core
    layer used deeper than that: a token at recurrence r reads the prefix's visit-r K/V for r < visits - 1,
    else each prefix token's last recurrence (the cache's last bank, which every deeper visit overwrites)."""

    def __init__(self, model, visits):
        from _reference import NaiveDecoder

        class Capped(NaiveDecoder):
            def _core_prefix(self, r, j):
                pairs = [visits_[r if r < visits - 1 else -1][j] for visits_ in self.core]
                return [k for k, _ in pairs], [v for _, v in pairs]

        self.ref = Capped(model, "full", 0)

    def chunk(self, ids):
        return self.ref.chunk(list(ids), DEPTH)[0]


@pytest.mark.parametrize("prompt", ["hello", "the quick brown f"])
def test_a_full_cache_shallower_than_the_draft_depth_is_verified_from_scratch(model, prompt):
    """A full cache of 2 visits under drafts at depth 3 (verified at 4): the drafts' states are not the
    verifier's there, so the verify reruns every recurrence (no resume, which would be refused); the
    tokens are a replay (the prompt, then each accepted window, as chunks) on the capped cache's rule."""
    out, windows, _ = _direct(model, prompt, mode="full", max_len=48, n=12, k=3, draft_depth=3, cache_depth=2)
    ref = _CappedFullReplay(model, 2)
    predicted, p = [int(ref.chunk(TOK.encode(prompt))[-1].argmax())], 0
    sizes = [a for _, a in windows]
    while p < len(out):
        window = out[p : p + (sizes.pop(0) if sizes else 0) + 1]
        predicted += [int(x) for x in ref.chunk(window).argmax(-1)]
        p += len(window)
    assert len(out) == 12 and out == predicted[:12]


@pytest.mark.parametrize("mode", ["full", "terminal"])
def test_a_budget_of_one_token_is_the_prompts_next_token(model, mode):
    """max_new_tokens 1: the prompt's logits decide the one token; no round runs (none could: the cache
    has no position for the token, which is never fed)."""
    stats = {}
    got = generate(
        model,
        TOK,
        ["hello"],
        DepthRule(DEPTH),
        cache=mode,
        stats=stats,
        speculate=Speculation(3, 2),
        sampling=SamplingConfig(max_new_tokens=1),
    )
    assert got == [TOK.decode(_no_cache_greedy(model, TOK.encode("hello"), 1, DEPTH, TOK.eos_id))]
    assert stats["speculation"] == {"rounds": 0, "drafted": 0, "accepted": 0} and stats["decoded_tokens"] == 1


def test_a_budget_of_one_token_emits_one_token_whatever_room_the_cache_has(model):
    """speculative_decode with max_new_tokens 1 on a cache with room to spare emits the prompt's next token
    and stops: the budget, not the cache's end, ends it (`generate` sizes its cache to the budget, so
    only a direct call tells the two apart)."""
    out, windows, stats = _direct(model, "hello", mode="full", max_len=48, n=1, k=3, draft_depth=2)
    assert out == _no_cache_greedy(model, TOK.encode("hello"), 1, DEPTH, TOK.eos_id)
    assert windows == [] and stats.rounds == 0


@pytest.mark.parametrize("mode", ["full", "terminal"])
def test_sampled_speculation_is_reproducible_from_its_seed_and_top_k_one_is_greedy(model, mode):
    """Speculative sampling draws its drafts, the acceptance coins and the corrections from the row's
    seeded generator: one seed, one text (the global RNG moves in between); another seed, another text.
    With top_k 1 the verifier's distribution is its argmax: the text is plain greedy decoding's (full
    cache), whatever the coins (a p with mass off its argmax would let other tokens through)."""

    def sampled(seed, top_k=0):
        cfg = SamplingConfig(max_new_tokens=16, temperature=1.0, top_k=top_k, seed=seed)
        return generate(model, TOK, ["hello"], DepthRule(DEPTH), cache=mode, speculate=Speculation(3, 1), sampling=cfg)

    first = sampled(3)
    torch.rand(7)
    assert sampled(3) == first != sampled(4)
    if mode == "full":
        greedy = TOK.decode(_no_cache_greedy(model, TOK.encode("hello"), 16, DEPTH, TOK.eos_id))
        assert [sampled(s, top_k=1)[0] for s in (0, 1, 2)] == [greedy] * 3


def test_speculation_refuses_the_exit_gate():
    """The verifier runs one fixed depth: a rule with the model's exit gate is refused, as exit_tau is."""
    from looplm.config import ModelConfig
    from looplm.model import LoopedLM

    cfg = ModelConfig(vocab_size=TOK.vocab_size, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, exit_gate=True)
    gated = LoopedLM(cfg).eval()
    with pytest.raises(UserError, match="exit_gate"):
        generate(gated, TOK, ["ab"], DepthRule(DEPTH, exit_gate=0.5), speculate=Speculation(2, 1))


def test_batched_speculation_reports_every_prompts_tokens_and_streams_each_row(monkeypatch, model):
    """Several prompts under `speculate` (one at a time): decoded_tokens and token_ids cover every prompt,
    decode_seconds is the sum of their decodes, first_step_* are the first prompt's first round (a clock
    that moves 1 s per verify makes them exact), and `on_token` streams each prompt's text to its own row."""
    clock, accepted = _Clock(), []
    real_accept = spec_mod.accept

    def accept(drafts, p, q, g):
        n_acc, nxt = real_accept(drafts, p, q, g)
        accepted.append(n_acc)
        clock.tick(1.0)
        return n_acc, nxt

    starts, real_decode = [], gen_mod.speculative_decode  # each prompt's first round

    def decode(*a, **kw):
        starts.append(len(accepted))
        return real_decode(*a, **kw)

    monkeypatch.setattr(spec_mod, "accept", accept)
    monkeypatch.setattr(gen_mod, "speculative_decode", decode)
    monkeypatch.setattr(spec_mod, "time", clock)
    monkeypatch.setattr(gen_mod, "time", clock)
    prompts, cfg, spec = ["hello", "a", "the quick brown f"], SamplingConfig(max_new_tokens=10), Speculation(3, 1)
    pieces, stats = collections.defaultdict(str), {}
    texts = generate(
        model,
        TOK,
        prompts,
        DepthRule(DEPTH),
        cache="full",
        speculate=spec,
        sampling=cfg,
        stats=stats,
        on_token=lambda row, piece: pieces.__setitem__(row, pieces[row] + piece),
    )
    first_accepted = accepted[0]
    assert accepted[starts[0]] != accepted[starts[-1]]  # the first and the last prompt's first rounds differ
    want = [_no_cache_greedy(model, TOK.encode(p), 10, DEPTH, TOK.eos_id) for p in prompts]
    assert texts == [TOK.decode(ids) for ids in want] and dict(pieces) == dict(enumerate(texts))
    assert stats["token_ids"] == want and stats["decoded_tokens"] == sum(map(len, want))
    assert stats["decode_seconds"] == len(accepted) == stats["speculation"]["rounds"]
    assert stats["first_step_seconds"] == 1.0 and stats["first_step_tokens"] == 2 + first_accepted


@pytest.mark.parametrize("reuse", [True, False])
def test_generate_passes_the_reuse_setting_to_the_verify(monkeypatch, model, reuse):
    """`Speculation(reuse=False)` reruns every recurrence of each verify chunk (no `resume`); the default
    resumes it from the drafts' states (full cache). Every verify chunk (the steps fed a chunk [1, n])
    is recorded."""
    resumes, real_call = [], DecodeStep.__call__

    def call(self, rows, depth, *a, resume=None, **kw):
        if rows.tokens.dim() > 1:  # a chunk [1, n]
            resumes.append(resume is not None)
        return real_call(self, rows, depth, *a, resume=resume, **kw)

    monkeypatch.setattr(DecodeStep, "__call__", call)
    cfg, spec = SamplingConfig(max_new_tokens=10), Speculation(3, 2, reuse)
    generate(model, TOK, ["hello"], DepthRule(DEPTH), cache="full", speculate=spec, sampling=cfg)
    assert resumes and set(resumes) == {reuse}


def test_batched_speculation_seeds_each_prompt_with_its_own_example_id(model):
    """Under `speculate` each prompt runs alone, seeded by its own example id: the same prompt with ids 0
    and 6 (which decode differently here) gives each id's no-cache greedy tokens."""
    stats, cfg = {}, SamplingConfig(max_new_tokens=12)
    spec = Speculation(3, 1)
    generate(
        model,
        TOK,
        ["a", "a"],
        DepthRule(DEPTH),
        cache="full",
        speculate=spec,
        sampling=cfg,
        stats=stats,
        example_ids=[0, 6],
    )
    want = [_no_cache_greedy(model, TOK.encode("a"), 12, DEPTH, TOK.eos_id, example_id=e) for e in (0, 6)]
    assert want[0] != want[1] and stats["token_ids"] == want


def test_the_last_token_by_a_plain_step_equals_no_cache_greedy(monkeypatch, model):
    """When one token is left to emit, the round is a plain one-token step at the verifier's depth from the
    cache's length (no drafts): over budgets 2..9 that step runs, and every output is the no-cache greedy."""
    plain, real_call = [], DecodeStep.__call__

    def call(self, rows, depth, *a, **kw):
        plain.append(rows.tokens.dim() == 1 and depth == DEPTH)
        return real_call(self, rows, depth, *a, **kw)

    monkeypatch.setattr(DecodeStep, "__call__", call)
    for n in range(2, 10):
        stats, cfg = {}, SamplingConfig(max_new_tokens=n)
        generate(
            model,
            TOK,
            ["hello"],
            DepthRule(DEPTH),
            cache="full",
            speculate=Speculation(3, 1),
            sampling=cfg,
            stats=stats,
        )
        assert stats["token_ids"] == [_no_cache_greedy(model, TOK.encode("hello"), n, DEPTH, TOK.eos_id)], n
    assert any(plain)
