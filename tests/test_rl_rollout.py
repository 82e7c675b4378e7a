"""Rollouts (design §10): the scoring layout, saved endpoints against native forwards and an unbatched
terminal-KV replay, sampling log-probabilities, stop handling, rewards and problem sources."""

from __future__ import annotations

import json

import pytest
import torch

from looplm.data import ByteTokenizer, Example, TaskConfig
from looplm.infer.cache import make_cache
from looplm.infer.extend import extend
from looplm.model import LoopedLM
from looplm.rl import REWARDS, ProblemSource, get_reward, register_reward, rollout
from looplm.rl.rewards import answer_digits

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPTS = ["+12,34=", "+5,678=", "+9,9="]


@pytest.fixture
def model(tiny_model_config):
    return LoopedLM(tiny_model_config(vocab_size=ByteTokenizer().vocab_size, max_seq_len=48)).eval()


def test_layout_and_depth_one_endpoints_equal_the_native_forward(model):
    """At R = 1 terminal K/V are the only K/V, so every saved endpoint (prompt and completion)
    and every sampling log-prob must equal a native parallel forward over the scored rows."""
    tok = ByteTokenizer()
    ro = rollout(model, tok, PROMPTS, group_size=2, depth=1, max_new_tokens=6, seed=3)
    N, L = ro.tokens.shape
    assert N == 6 and ro.group_size == 2
    for i in range(N):
        prompt = tok.encode(PROMPTS[i // 2])
        P, T = len(prompt), ro.completion_lengths[i]
        row = prompt + ro.completions[i]
        assert ro.tokens[i, : P + T - 1].tolist() == row[:-1]
        assert ro.targets[i, : P + T - 1].tolist() == row[1:]
        assert ro.mask[i].nonzero()[:, 0].tolist() == list(range(P - 1, P + T - 1))
        assert (ro.tokens[i, P + T - 1 :] == tok.pad_id).all()
    native = model(ro.tokens, 1, init="seeded", example_ids=ro.example_ids)
    for i in range(N):
        n = int(ro.mask[i].nonzero().max()) + 1
        torch.testing.assert_close(ro.states.endpoints[i, :n], native.endpoint[i, :n], rtol=1e-5, atol=1e-5)
    logp = torch.log_softmax(native.logits, -1).gather(-1, ro.targets[..., None])[..., 0]
    torch.testing.assert_close(ro.logprobs[ro.mask], logp[ro.mask], rtol=1e-4, atol=1e-5)


def test_endpoints_at_depth_match_an_unbatched_terminal_replay(model):
    """R = 4: prompt endpoints equal the native forward (prefill is one parallel chunk); every
    endpoint equals a replay of that row alone (no padding) through a fresh terminal cache."""
    tok = ByteTokenizer()
    R = 4
    ro = rollout(model, tok, PROMPTS, group_size=2, depth=R, max_new_tokens=5, seed=11, first_example_id=40)
    native = model(ro.tokens, R, init="seeded", example_ids=ro.example_ids).endpoint
    for i in (0, 3, 5):
        prompt = tok.encode(PROMPTS[i // 2])
        P, T = len(prompt), ro.completion_lengths[i]
        torch.testing.assert_close(ro.states.endpoints[i, :P], native[i, :P], rtol=1e-5, atol=1e-5)
        cache = make_cache("terminal", model.cfg, 1, 48, R)
        ids = torch.tensor([40 + i])
        with torch.no_grad():
            zs = [extend(model, torch.tensor([prompt]), cache, R, example_ids=ids).endpoint[0]]
            for t in ro.completions[i][:-1]:
                zs.append(extend(model, torch.tensor([[t]]), cache, R, example_ids=ids).endpoint[0])
        torch.testing.assert_close(ro.states.endpoints[i, : P + T - 1], torch.cat(zs), rtol=1e-5, atol=1e-5)


def test_a_head_padded_past_the_tokenizer_samples_and_scores_only_its_ids(tiny_model_config):
    tok = ByteTokenizer()
    torch.manual_seed(0)
    model = LoopedLM(tiny_model_config(vocab_size=tok.vocab_size + 62, max_seq_len=48)).eval()
    with torch.no_grad():
        model.head.weight[tok.vocab_size :] *= 4  # padded rows that would win most draws
    ro = rollout(model, tok, PROMPTS, group_size=2, depth=2, max_new_tokens=6, seed=0)
    assert all(t < tok.vocab_size for c in ro.completions for t in c), ro.completions
    # the sampling log-probs are normalised over the tokenizer's ids: a native forward's, cut there
    native = model(ro.tokens, 2, init="seeded", example_ids=ro.example_ids).logits[..., : tok.vocab_size]
    logp = torch.log_softmax(native, -1).gather(-1, ro.targets[..., None])[..., 0]
    torch.testing.assert_close(ro.logprobs[ro.mask], logp[ro.mask], rtol=1e-4, atol=1e-4)


def test_stop_strings_end_a_row_and_are_cut_from_the_text(model):
    tok = ByteTokenizer()
    nl = tok.encode("\n")[0]
    with torch.no_grad():  # make the newline the likeliest token, so most rows stop early
        model.head.weight[nl] += 3 * model.head.weight.norm(dim=1).max()
    ro = rollout(model, tok, PROMPTS, group_size=4, depth=2, max_new_tokens=6, stop=("\n",), seed=0)
    assert any(ro.stopped)
    for c, text, stopped in zip(ro.completions, ro.texts, ro.stopped):
        if stopped:
            assert c[-1] == nl and "\n" not in tok.decode(c[:-1])
            assert text == tok.decode(c[:-1])
        else:
            assert len(c) == 6 and "\n" not in text
    with pytest.raises(ValueError, match="temperature"):
        rollout(model, tok, PROMPTS, group_size=2, depth=2, max_new_tokens=4, temperature=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        rollout(model, tok, PROMPTS, group_size=2, depth=2, max_new_tokens=45)


def test_an_eos_ends_a_row(model):
    """A sampled EOS ends its row as a stop string does: the EOS is the row's last action, nothing is
    sampled after it, and the mask covers exactly the completions (no test sampled an EOS before)."""
    tok = ByteTokenizer()
    with torch.no_grad():  # make the EOS likely, so most rows end by it
        model.head.weight[tok.eos_id] += 3 * model.head.weight.norm(dim=1).max()
    ro = rollout(model, tok, PROMPTS, group_size=4, depth=2, max_new_tokens=6, seed=0)
    assert any(ro.stopped)
    for c, text, stopped in zip(ro.completions, ro.texts, ro.stopped):
        assert (tok.eos_id in c) == stopped
        if stopped:
            assert c.index(tok.eos_id) == len(c) - 1 and text == tok.decode(c[:-1])
        else:
            assert len(c) == 6
    assert int(ro.mask.sum()) == sum(ro.completion_lengths)


def test_rewards_and_sources(tmp_path):
    ex = Example("+57,48=", "105", "add_msd", 2)
    assert get_reward("auto", "tasks")(ex, "105") == 1.0
    assert get_reward("exact", "tasks")(ex, "104") == 0.0
    assert answer_digits(ex, "104") == pytest.approx(2 / 3)
    assert answer_digits(ex, "1050") == pytest.approx(2 / 3)  # an extra character costs one
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}?", "answer": f"so #### {i},000"}) for i in range(5)))
    src = ProblemSource(str(path), prompt_template="Q: {question}\nA:", seed=1)
    drawn = [p for step in range(3) for p in src.draw(step, 2)]
    assert sorted(p.prompt for p in drawn[:5]) == [f"Q: q{i}?\nA:" for i in range(5)]  # one epoch, each once
    reward = get_reward("auto", str(path))
    assert reward(drawn[0].reference, f"it is {drawn[0].reference.gold[:-3]},000.") == 1.0
    assert reward(drawn[0].reference, "no idea") == 0.0
    tasks = ProblemSource("tasks", tasks=TaskConfig(kinds=("add_msd",), max_difficulty=2))
    assert [p.prompt for p in tasks.draw(3, 4)] == [p.prompt for p in tasks.draw(3, 4)]  # pure in (seed, step)
    assert [p.prompt for p in tasks.draw(3, 4)] != [p.prompt for p in tasks.draw(4, 4)]
    register_reward("always", lambda ref, text: 1.0)
    assert get_reward("always", "tasks")(ex, "") == 1.0
    REWARDS.pop("always")
    with pytest.raises(ValueError, match="unknown reward"):
        get_reward("nope", "tasks")
    # a built-in reward on the other kind of problem: it scored 0 always, or failed after a rollout
    with pytest.raises(ValueError, match="reward 'exact' checks generator tasks, not the problems of"):
        get_reward("exact", str(path))
    with pytest.raises(ValueError, match="reward 'final_number' checks GSM8K answers.*use digits or exact"):
        get_reward("final_number", "tasks")
    with pytest.raises(ValueError, match="neither 'tasks'"):
        ProblemSource(str(tmp_path / "missing.jsonl"))


def test_a_rollout_that_exactly_fills_the_context_is_accepted(model):
    """The last sampled token is never fed: prompt + max_new_tokens - 1 tokens must fit in max_seq_len,
    so a rollout that fills the context exactly runs, and one token more is refused."""
    tok = ByteTokenizer()
    P = len(tok.encode_prompt(PROMPTS[0]))
    ro = rollout(model, tok, PROMPTS[:1], group_size=2, depth=1, max_new_tokens=48 - P + 1, seed=0)
    assert ro.tokens.shape[1] <= 48
    with pytest.raises(ValueError, match="max_seq_len"):
        rollout(model, tok, PROMPTS[:1], group_size=2, depth=1, max_new_tokens=48 - P + 2, seed=0)


def test_sampling_logprobs_at_a_temperature_are_those_of_the_tempered_distribution(model):
    """At temperature T the rollout samples from softmax(logits / T): its saved log-probabilities equal
    a native forward's logits divided by T (every other rollout test samples at T = 1)."""
    tok = ByteTokenizer()
    ro = rollout(model, tok, PROMPTS, group_size=2, depth=1, max_new_tokens=5, temperature=0.5, seed=4)
    native = model(ro.tokens, 1, init="seeded", example_ids=ro.example_ids).logits
    logp = torch.log_softmax(native / 0.5, -1).gather(-1, ro.targets[..., None])[..., 0]
    torch.testing.assert_close(ro.logprobs[ro.mask], logp[ro.mask], rtol=1e-4, atol=1e-5)


def test_the_scoring_layout_is_as_wide_as_the_longest_row(model):
    """L is the longest prompt + completion - 1 (the last sampled token is never fed): no column of
    padding alone, which the update would score for nothing."""
    tok = ByteTokenizer()
    ro = rollout(model, tok, PROMPTS, group_size=2, depth=1, max_new_tokens=4, seed=5)
    want = max(len(tok.encode(PROMPTS[i // 2])) + n - 1 for i, n in enumerate(ro.completion_lengths))
    assert ro.tokens.shape == ro.targets.shape == ro.mask.shape == (6, want)
    assert ro.states.endpoints.shape == (6, want, model.cfg.d_model)


def test_answer_digits_reads_the_stripped_first_line_and_charges_only_extra_characters():
    """Partial credit: a short answer loses only its missing characters (no charge for length), the
    first line is read with surrounding spaces stripped, and what follows the line is ignored."""
    ex = Example("+57,48=", "105", "add_msd", 2)
    assert answer_digits(ex, "10") == pytest.approx(2 / 3)
    assert answer_digits(ex, " 105 ") == 1.0
    assert answer_digits(ex, "105\n999") == 1.0
    assert answer_digits(ex, "") == 0.0


def test_a_jsonl_source_reshuffles_every_epoch(tmp_path):
    """Each epoch of a GSM8K-format source visits every item once, in an order drawn afresh for the
    epoch (seeded by (seed, epoch)), so successive epochs do not repeat one fixed order."""
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) for i in range(8)))
    src = ProblemSource(str(path), prompt_template="{question}", seed=2)
    walk = [p.prompt for step in range(6) for p in src.draw(step, 4)]  # three epochs of 8
    epochs = [walk[i : i + 8] for i in range(0, 24, 8)]
    assert all(sorted(e) == sorted(f"q{i}" for i in range(8)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3


def test_a_groups_completions_do_not_depend_on_the_other_prompts_of_the_batch(model):
    """With one seed per prompt, each group samples from its own generator: prompt B's group is the same
    rolled out beside A or alone (data-parallel RL splits the prompts over ranks)."""
    tok = ByteTokenizer()
    both = rollout(model, tok, PROMPTS[:2], group_size=2, depth=2, max_new_tokens=5, seed=[3, 8])
    alone = rollout(model, tok, PROMPTS[1:2], group_size=2, depth=2, max_new_tokens=5, seed=[8])
    assert both.completions[2:] == alone.completions
    first = rollout(model, tok, PROMPTS[:1], group_size=2, depth=2, max_new_tokens=5, seed=[3])
    assert both.completions[:2] == first.completions
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        rollout(model, tok, PROMPTS, group_size=2, depth=2, max_new_tokens=5, seed=[3, 8])


def test_token_hash_covers_the_shape():
    """The same ids laid out in another shape are other rows: the hash differs even where the bytes of
    tokens + example ids line up ([1, 5] + 1 id against [2, 2] + 2 ids)."""
    from looplm.rl import token_hash

    a = token_hash(torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([6]))
    b = token_hash(torch.tensor([[1, 2], [3, 4]]), torch.tensor([5, 6]))
    assert a != b


def test_answer_digits_is_never_negative():
    """A long wrong answer loses more for its extra characters than it has hits: the reward is floored at 0."""
    ex = Example("+57,48=", "105", "add_msd", 2)
    assert answer_digits(ex, "99999") == 0.0
    assert answer_digits(ex, "1059") == pytest.approx(2 / 3)  # above the floor: 3 hits - 1 extra


def test_problem_draws_depend_on_the_seed(tmp_path):
    """Two RL runs with different seeds see different prompts, from the generator and from a JSONL file."""
    tasks = TaskConfig(kinds=("add_msd",), max_difficulty=3)
    draw = lambda seed: [p.prompt for p in ProblemSource("tasks", tasks=tasks, seed=seed).draw(0, 8)]  # noqa: E731
    assert draw(0) != draw(1)
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) for i in range(8)))
    walk = lambda seed: [p.prompt for p in ProblemSource(str(path), prompt_template="{question}", seed=seed).draw(0, 8)]  # noqa: E731
    assert walk(1) != walk(2)
    assert sorted(walk(1)) == sorted(walk(2))
