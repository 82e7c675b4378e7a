"""Hugging Face Transformers integration (looplm.hf): export, from_pretrained, forward, generate, tokenizers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from _models import decisive_model
from _reference import DEPTH_CASES, DEPTH_IDS, SP_TEXTS, decode_replay, greedy_replay, sentencepiece_tokenizer

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import looplm.infer.generate as looplm_generate  # noqa: E402
from looplm import checkpoint as ckpt  # noqa: E402
from looplm.cli import main  # noqa: E402
from looplm.data import BPETokenizer, ByteTokenizer  # noqa: E402
from looplm.hf import LoopedCache, LoopedLMConfig, LoopedLMForCausalLM, export  # noqa: E402
from looplm.infer import extend, make_cache  # noqa: E402
from looplm.infer.generate import DepthRule, SamplingConfig  # noqa: E402
from looplm.model import LoopedLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread

TOK = ByteTokenizer()
PROMPTS = ["x", "a longer prompt", "mid size"]
TEXTS = ["hello world", "  two  spaces\n\ttab", "ünïcödé 日本 🎉", "literal <eos> and <pad>", "a"]


def write_checkpoint(path, model: LoopedLM, tokenizer) -> None:
    """A looplm checkpoint folder (weights, job config, tokenizer, manifest) as load_model reads it."""

    def populate(tmp):
        ckpt.save_tensors(tmp, "model.safetensors", model.state_dict())
        ckpt.write_json(tmp, "config.json", {"model": model.cfg.to_dict()})
        tokenizer.save(tmp)

    ckpt.write_atomic(path, populate)


def tiny_model(vocab_size=258, **fields) -> LoopedLM:
    """The exactness tests' model (its argmax moves with context and depth): 48 positions, depths to 16."""
    return decisive_model(vocab_size, max_seq_len=48, **fields)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(looplm model, exported folder) of a tiny byte-tokenizer checkpoint."""
    root = tmp_path_factory.mktemp("hf")
    model = tiny_model()
    write_checkpoint(root / "ckpt", model, TOK)
    export(root / "ckpt", root / "hf", num_steps=3)
    return model, root / "hf"


@pytest.fixture(scope="module")
def hf_model(exported):
    return AutoModelForCausalLM.from_pretrained(exported[1]).eval()


def padded_batch(prompts, tokenizer=TOK):
    enc = [tokenizer.encode(p) for p in prompts]
    L = max(map(len, enc))
    ids = torch.tensor([[tokenizer.pad_id] * (L - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (L - len(e)) + [1] * len(e) for e in enc])
    return ids, mask


# -- export and from_pretrained ----------------------------------------------------------------------
def test_export_writes_a_transformers_folder(exported):
    _, out = exported
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "looplm" and config["num_steps"] == 3 and config["eos_token_id"] == 256
    assert config["architectures"] == ["LoopedLMForCausalLM"]


@pytest.mark.parametrize("depth", [1, 3, 8])
def test_round_trip_logits_equal_the_native_forward(exported, hf_model, depth):
    model, _ = exported
    assert isinstance(hf_model, LoopedLMForCausalLM) and hf_model.dtype == torch.float32
    ids = torch.tensor([TOK.encode("hello looped world"), TOK.encode("another row of text")[:18]])
    with torch.no_grad():
        native = model(ids, depth, init="seeded", example_ids=torch.zeros(2, dtype=torch.long)).logits
        got = hf_model(ids, num_steps=depth).logits  # every row seeded as example 0: as if alone
    assert got.shape == native.shape
    assert (got - native).abs().max() <= 1e-5


def test_left_padding_in_the_parallel_forward(hf_model):
    """Every row of a left-padded batch equals its prompt alone, whatever row it is in."""
    ids, mask = padded_batch(["a longer row", "abc", "ab"])
    with torch.no_grad():
        padded = hf_model(ids, attention_mask=mask, num_steps=3).logits
        for row, prompt in enumerate(["a longer row", "abc", "ab"]):
            alone = hf_model(torch.tensor([TOK.encode(prompt)]), num_steps=3).logits
            assert (padded[row, -len(prompt) :] - alone[0]).abs().max() <= 1e-5, prompt
    with pytest.raises(ValueError, match="left padding only"):
        hf_model(ids, attention_mask=mask.flip(1), num_steps=3)


def test_save_pretrained_again_keeps_identical_tensors(exported, hf_model, tmp_path):
    _, out = exported
    hf_model.save_pretrained(tmp_path)
    first, second = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    assert first.keys() == second.keys() and len(first) == len(hf_model.model.state_dict())
    assert all(torch.equal(first[k], second[k]) for k in first)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert again.config.to_model_config() == hf_model.config.to_model_config()


def test_from_looplm_shares_the_parameters():
    model = tiny_model()
    hf = LoopedLMForCausalLM.from_looplm(model, TOK, num_steps=2)
    assert hf.model is model and hf.config.pad_token_id == TOK.pad_id and hf.config.num_steps == 2
    assert all(a is b for a, b in zip(hf.model.parameters(), model.parameters()))
    ids = torch.tensor([TOK.encode("shared")])
    with torch.no_grad():
        model.head.weight[7] = 0.0  # an edit of the looplm model is seen through the wrapper
        assert (hf(ids).logits[..., 7] == 0).all()
        assert not (hf(ids).logits[..., 8] == 0).any()


# -- generate --------------------------------------------------------------------------------------
def looplm_greedy_ids(model, prompts, rule, **kw) -> list[list[int]]:
    """Token ids chosen by looplm's own generate (its stats' `token_ids`: each row's, EOS excluded)."""
    stats: dict = {}
    # every row seeded as example 0, as the wrapper does: each prompt as if alone
    texts = looplm_generate.generate(model, TOK, prompts, rule, example_ids=[0] * len(prompts), stats=stats, **kw)
    rows = stats["token_ids"]
    assert [TOK.decode(r) for r in rows] == texts
    return rows


def cut_at_eos(out, prompt_len):
    rows = []
    for row in out[:, prompt_len:].tolist():
        rows.append(row[: row.index(TOK.eos_id)] if TOK.eos_id in row else row)
    return rows


@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_greedy_generate_equals_looplm_generate(exported, hf_model, monkeypatch, mode):
    model, _ = exported
    want = looplm_greedy_ids(model, PROMPTS, DepthRule(4, 2), cache=mode, sampling=SamplingConfig(max_new_tokens=10))
    ids, mask = padded_batch(PROMPTS)
    out = hf_model.generate(
        ids, attention_mask=mask, max_new_tokens=10, do_sample=False, num_steps=4, prefill_steps=2, cache_kind=mode
    )
    assert cut_at_eos(out, ids.shape[1]) == want


def test_generate_with_config_defaults_and_without_cache(exported, hf_model, monkeypatch):
    model, _ = exported
    sampling = SamplingConfig(max_new_tokens=6)
    terminal = looplm_greedy_ids(model, PROMPTS, DepthRule(3), cache="terminal", sampling=sampling)
    full = looplm_greedy_ids(model, PROMPTS, DepthRule(3), cache="full", sampling=sampling)
    ids, mask = padded_batch(PROMPTS)
    cached = hf_model.generate(ids, attention_mask=mask, max_new_tokens=6)  # config: num_steps 3, terminal
    assert cut_at_eos(cached, ids.shape[1]) == terminal
    # no cache: every step re-runs the sequence natively, which the full cache reproduces exactly
    recomputed = hf_model.generate(ids, attention_mask=mask, max_new_tokens=6, use_cache=False)
    assert cut_at_eos(recomputed, ids.shape[1]) == full


def looplm_step_logits(
    model, prompt: list[int], fed: list[int], mode: str, prefill: int, depth: int, example_id: int
) -> torch.Tensor:
    """[len(fed) + 1, V] logits of looplm's own cached path on one prompt alone (no padding): the
    prompt prefilled at `prefill`, then each token of `fed` at `depth`."""
    cache = make_cache(mode, model.cfg, 1, len(prompt) + len(fed), max(prefill, depth))
    ids = torch.tensor([example_id])
    steps = [extend(model, torch.tensor([prompt]), cache, prefill, example_ids=ids).logits[0, -1]]
    steps += [extend(model, torch.tensor([[t]]), cache, depth, example_ids=ids).logits[0, -1] for t in fed]
    return torch.stack(steps)


@pytest.mark.parametrize("mode", ["terminal", "full"])
def test_generate_logits_equal_looplms_per_step_logits(exported, hf_model, mode):
    """Every step's logits (and greedy scores) of a left-padded batch, prefilled at 2 recurrences
    and decoded at 4, equal looplm's extend on each prompt alone (example id 0, whatever its row) to 1e-5."""
    model, _ = exported
    ids, mask = padded_batch(PROMPTS)
    out = hf_model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        num_steps=4,
        prefill_steps=2,
        cache_kind=mode,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    new = out.sequences[:, ids.shape[1] :]
    for row, prompt in enumerate(PROMPTS):
        chosen = new[row].tolist()
        n = chosen.index(TOK.eos_id) + 1 if TOK.eos_id in chosen else len(chosen)  # after EOS the row only pads
        want = looplm_step_logits(model, TOK.encode(prompt), chosen[: n - 1], mode, 2, 4, 0)
        got = torch.stack([step[row] for step in out.logits[:n]])
        scores = torch.stack([step[row] for step in out.scores[:n]])
        assert (got - want).abs().max() <= 1e-5 and (scores - want).abs().max() <= 1e-5
        assert chosen[:n] == want.argmax(-1).tolist()


@pytest.mark.parametrize(("mode", "prefill", "depth", "tau"), DEPTH_CASES, ids=DEPTH_IDS)
def test_generate_logits_equal_a_decode_by_hand(hf_model, mode, prefill, depth, tau):
    """`generate` over the depth matrix (prefill_steps below, equal to and above num_steps, both caches,
    adaptive exit): every step's logits of a left-padded batch equal each row decoded alone by hand
    (`_reference.NaiveDecoder`), to 1e-4."""
    ids, mask = padded_batch(PROMPTS[1:])
    out = hf_model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        num_steps=depth,
        prefill_steps=prefill,
        cache_kind=mode,
        exit_tau=tau,
        return_dict_in_generate=True,
        output_logits=True,
    )
    assert_rows_equal_a_decode_by_hand(hf_model, out, ids.shape[1], mode, prefill, depth, tau)


def assert_rows_equal_a_decode_by_hand(hf_model, out, prompt_len: int, mode, prefill, depth, tau) -> None:
    """Each row of a `generate` of PROMPTS[1:] (greedy, with `output_logits`): every step's logits
    equal the row decoded alone by hand (`_reference.NaiveDecoder`) to 1e-4, and so its tokens."""
    new = out.sequences[:, prompt_len:]
    for row, prompt in enumerate(PROMPTS[1:]):
        chosen = new[row].tolist()
        n = chosen.index(TOK.eos_id) + 1 if TOK.eos_id in chosen else len(chosen)
        want, used = decode_replay(
            hf_model.model, mode, TOK.encode(prompt), chosen[: n - 1], prefill, depth, example_id=0, exit_tau=tau
        )
        got = torch.stack([step[row] for step in out.logits[:n]])
        assert (got - want).abs().max() <= 1e-4, (row, (got - want).abs().amax(-1))
        assert chosen[:n] == want.argmax(-1).tolist()
        assert tau is None or min(used[1:]) < depth


@pytest.mark.parametrize(
    ("mode", "prefill", "depth", "tau"),
    [("terminal", 2, 5, None), ("full", 6, 3, None), ("full", 2, 5, None), ("terminal", 3, 8, 0.05)],
    ids=["terminal-pre2-dec5", "full-pre6-dec3", "full-pre2-dec5", "terminal-pre3-dec8-tau"],
)
def test_compiled_decode_logits_equal_a_decode_by_hand(hf_model, monkeypatch, mode, prefill, depth, tau):
    """`generate(compile_decode=True)`: the decode steps run looplm's `DecodeStep` compiled (Dynamo's
    graphs with the row kernels, run eagerly here to spare inductor's build), over a cache as long as the
    model context; every step's logits of a left-padded batch equal each row decoded alone by hand, to 1e-4."""
    import looplm.hf.modeling as modeling

    made, real = [], modeling.DecodeStep

    def traced_step(*args, **kwargs):
        made.append(real(*args, **kwargs, compile_options={"backend": "eager"}))
        return made[-1]

    monkeypatch.setattr(modeling, "DecodeStep", traced_step)
    ids, mask = padded_batch(PROMPTS[1:])
    kwargs = dict(num_steps=depth, prefill_steps=prefill, cache_kind=mode, exit_tau=tau, compile_decode=True)
    out = hf_model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
        **kwargs,
    )
    assert len(made) == 1 and made[0].compiled and made[0].cache.max_len == hf_model.config.max_seq_len
    assert_rows_equal_a_decode_by_hand(hf_model, out, ids.shape[1], mode, prefill, depth, tau)
    if tau is not None:  # the mean depth the wrapper reports is the rows' own, below the decode depth
        assert hf_model.last_generate_stats["mean_decode_depth"] < depth
    if mode == "terminal" and tau is None:  # a cache of the user's own takes the call's compile_decode
        own = LoopedCache()
        again = hf_model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache=own, **kwargs)
        assert own.compile and own.step is made[-1] and len(made) == 2
        assert torch.equal(again, out.sequences)


def test_a_chunk_appended_with_adaptive_exit_equals_a_decode_by_hand(hf_model):
    """The manual loop: a prompt through `use_cache=True`, then a 4-token chunk with exit_tau (its tokens
    stop at their own recurrences, frozen while the others go on), then one token: every logit equals
    the row decoded by hand, to 1e-4."""
    from _reference import NaiveDecoder

    ids = torch.tensor([TOK.encode("a prompt, then a chunk!")])
    with torch.no_grad():
        out = hf_model(ids[:, :16], use_cache=True, num_steps=6, prefill_steps=3)
        chunk = hf_model(ids[:, 16:20], cache=out.cache, num_steps=6, exit_tau=0.05)
        last = hf_model(ids[:, 20:21], cache=out.cache, num_steps=6)
    ref = NaiveDecoder(hf_model.model, "terminal")
    assert (out.logits[0] - ref.chunk(ids[0, :16].tolist(), 3)[0]).abs().max() <= 1e-4
    want, used, _ = ref.chunk(ids[0, 16:20].tolist(), 6, exit_tau=0.05)
    assert len(set(used.tolist())) > 1 and int(used.min()) < 6, used
    assert (chunk.logits[0] - want).abs().max() <= 1e-4
    assert (last.logits[0, 0] - ref.step(int(ids[0, 20]), 6)[0]).abs().max() <= 1e-4


def test_a_sentencepiece_checkpoint_exports_its_tokenizer_and_generates(tmp_path):
    """A SentencePiece-style tokenizer (`▁` word markers) through export: AutoTokenizer encodes and
    decodes like looplm's (any ids, spaces kept inside a text), and greedy generation decoded by it
    equals looplm's generate and the decode by hand."""
    sp = sentencepiece_tokenizer()
    model = tiny_model(vocab_size=sp.vocab_size)
    write_checkpoint(tmp_path / "ckpt", model, sp)
    export(tmp_path / "ckpt", tmp_path / "hf", num_steps=3)
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in SP_TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == sp.encode(text) and tok.decode(ids) == sp.decode(ids) == text
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        ids = torch.randint(0, sp.vocab_size, (12,), generator=g).tolist()
        assert tok.decode(ids, skip_special_tokens=True) == sp.decode(ids)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = "the quick brown"
    out = hf.generate(torch.tensor([sp.encode(prompt)]), max_new_tokens=8, do_sample=False)
    new = out[0, len(sp.encode(prompt)) :].tolist()
    new = new[: new.index(sp.eos_id)] if sp.eos_id in new else new
    assert new == greedy_replay(model, "terminal", sp.encode(prompt), 8, 3, 3, eos=sp.eos_id)[0]
    want = looplm_generate.generate(model, sp, [prompt], DepthRule(3), sampling=SamplingConfig(max_new_tokens=8))[0]
    assert tok.decode(new, skip_special_tokens=True) == want


def test_sampling_samples_and_return_dict_in_generate(hf_model):
    ids, mask = padded_batch(PROMPTS)

    def sample(seed):
        torch.manual_seed(seed)
        return hf_model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=6,
            do_sample=True,
            top_k=20,
            return_dict_in_generate=True,
            output_logits=True,
            num_steps=2,
        )

    a, b, c = sample(1), sample(1), sample(2)
    assert torch.equal(a.sequences, b.sequences) and a.sequences.shape[0] == 3  # seeded: reproducible
    assert not torch.equal(a.sequences, c.sequences)
    new = a.sequences[:, ids.shape[1] :]
    assert len(a.logits) == new.shape[1]
    assert isinstance(a.cache, LoopedCache) and a.cache.get_seq_length() == a.sequences.shape[1] - 1
    logits = torch.stack(a.logits, 1)  # [B, steps, V]
    live = torch.ones_like(new, dtype=torch.bool)
    for row in range(3):  # steps up to and including EOS
        if TOK.eos_id in new[row].tolist():
            live[row, new[row].tolist().index(TOK.eos_id) + 1 :] = False
    rank = (logits > logits.gather(-1, new[..., None])).sum(-1)  # how many tokens were more likely
    assert (rank[live] < 20).all()  # top_k: only the 20 most likely tokens are drawn
    assert (rank[live] > 0).sum() >= 3  # it samples: greedy decoding would always take rank 0


def test_user_cache_and_text_generation_pipeline(exported, hf_model, monkeypatch):
    ids, mask = padded_batch(PROMPTS)
    own = hf_model.generate(ids, attention_mask=mask, max_new_tokens=4, cache=LoopedCache("full"))
    assert torch.equal(own, hf_model.generate(ids, attention_mask=mask, max_new_tokens=4, cache_kind="full"))
    from transformers import pipeline

    generator = pipeline("text-generation", model=hf_model, tokenizer=AutoTokenizer.from_pretrained(exported[1]))
    got = generator("hello", max_new_tokens=6, do_sample=False, return_full_text=False)[0]["generated_text"]
    want = looplm_greedy_ids(exported[0], ["hello"], DepthRule(3), sampling=SamplingConfig(max_new_tokens=6))
    assert got == TOK.decode(want[0])


def test_adaptive_exit_with_tiny_tau_equals_fixed_depth(hf_model):
    ids, mask = padded_batch(PROMPTS)
    fixed = hf_model.generate(ids, attention_mask=mask, max_new_tokens=5, num_steps=4)
    never = hf_model.generate(ids, attention_mask=mask, max_new_tokens=5, num_steps=4, exit_tau=1e-30)
    assert torch.equal(fixed, never)
    with pytest.raises(ValueError, match="terminal cache"):
        hf_model.generate(ids, attention_mask=mask, max_new_tokens=3, exit_tau=0.1, cache_kind="full")


def test_the_configs_adaptive_exit_applies_to_cached_decoding_only(exported, hf_model):
    """A config's exit_tau and min_depth (documented as applying to cached decoding only) refused forwards and
    `generate(use_cache=False)` that never use them ("needs the terminal cache", "min_depth 4 exceeds the decode
    depth 2"), and no call could turn the config's exit off (exit_tau=0 was refused). References: the native
    forward, and the same calls on the exported model without an exit in its config."""
    model, path = exported
    adaptive = AutoModelForCausalLM.from_pretrained(path, exit_tau=0.3, min_depth=2).eval()
    assert (adaptive.config.exit_tau, adaptive.config.min_depth) == (0.3, 2)
    ids = torch.tensor([TOK.encode("hello looped world")])
    for depth, kind in ((3, "full"), (1, "terminal")):  # a full-cache kind; a depth below min_depth
        with torch.no_grad():
            native = model(ids, depth, init="seeded", example_ids=torch.zeros(1, dtype=torch.long)).logits
            got = adaptive(ids, num_steps=depth, cache_kind=kind).logits
        assert (got - native).abs().max() <= 1e-5
    batch, mask = padded_batch(PROMPTS)
    kw = dict(attention_mask=mask, max_new_tokens=4)
    no_cache = adaptive.generate(batch, use_cache=False, num_steps=1, **kw)
    assert torch.equal(no_cache, hf_model.generate(batch, use_cache=False, num_steps=1, **kw))
    for kind in ("full", "terminal"):  # exit_tau=0: the config's exit off for this call
        off = adaptive.generate(batch, exit_tau=0, cache_kind=kind, **kw)
        assert torch.equal(off, hf_model.generate(batch, cache_kind=kind, **kw))
        assert adaptive.last_generate_stats["mean_decode_depth"] == 3
    with pytest.raises(ValueError, match="needs the terminal cache"):  # cached decoding does take the config's
        adaptive.generate(batch, cache_kind="full", **kw)
    with pytest.raises(ValueError, match="min_depth 2 exceeds the decode depth 1"):
        adaptive.generate(batch, num_steps=1, **kw)


def test_generate_checks_the_length_before_its_first_step(hf_model, monkeypatch):
    """Without a cache, or with one the user gave, generate ran its steps up to the limit and only then failed
    ("sequence length 49 exceeds the context"), losing the work; with a cache it started, it refused at once."""
    steps = []
    forward = hf_model.forward
    monkeypatch.setattr(hf_model, "forward", lambda *a, **k: (steps.append(1), forward(*a, **k))[1])
    ids, mask = padded_batch(PROMPTS)
    with pytest.raises(ValueError, match=r"prompt plus new tokens \(75\) exceed the model context max_seq_len=48"):
        hf_model.generate(ids, attention_mask=mask, max_new_tokens=60, use_cache=False)
    cache = LoopedCache("terminal", max_len=20)
    with pytest.raises(ValueError, match=r"\(25\) exceed the given LoopedCache's max_len=20"):
        hf_model.generate(ids, attention_mask=mask, max_new_tokens=10, cache=cache)
    assert steps == []
    hf_model.generate(ids, attention_mask=mask, max_new_tokens=5, cache=LoopedCache("terminal", max_len=20))


def test_unsupported_generation_is_a_clear_error(hf_model):
    ids, mask = padded_batch(PROMPTS)
    with pytest.raises(ValueError, match="greedy search and sampling only"):
        hf_model.generate(ids, attention_mask=mask, max_new_tokens=3, num_beams=2)
    with pytest.raises(ValueError, match=r"num_steps must be in 1\.\.16 \(the config's max_depth\), got 0"):
        hf_model.generate(ids, attention_mask=mask, max_new_tokens=3, num_steps=0)
    with pytest.raises(ValueError, match="exceed the model context"):
        hf_model.generate(ids, attention_mask=mask, max_new_tokens=60)
    with pytest.raises(ValueError, match="own cache"):
        hf_model.generate(ids, attention_mask=mask, max_new_tokens=3, cache_implementation="static")


# -- forward: labels and errors ------------------------------------------------------------------------
def test_labels_give_the_mean_shifted_cross_entropy(hf_model):
    ids = torch.tensor([TOK.encode("the loss of a row"), TOK.encode("another loss row!")])
    labels = ids.clone()
    labels[1, :5] = -100
    out = hf_model(ids, labels=labels, num_steps=2)
    logits = out.logits.detach()
    want = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    keep = labels[:, 1:] != -100
    per_token = -logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    assert torch.allclose(out.loss, want, atol=1e-6) and torch.allclose(out.loss, per_token[keep].mean(), atol=1e-5)
    out.loss.backward()
    assert hf_model.model.head.weight.grad is not None
    hf_model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("depth", [0, 17, 2.5])
def test_depth_out_of_range(hf_model, depth):
    with pytest.raises(ValueError, match=r"num_steps must be (an integer )?in 1\.\.16 \(the config's max_depth\)"):
        hf_model(torch.tensor([[1, 2, 3]]), num_steps=depth)


def test_config_of_another_model_type_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32}))
    with pytest.raises(ValueError, match="model_type 'gpt2', not 'looplm'"):
        LoopedLMForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not 'looplm'"):
        LoopedLMConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="cache_kind"):
        LoopedLMConfig(cache_kind="paged")
    with pytest.raises(ValueError, match="not divisible"):
        LoopedLMConfig(d_model=30)


def test_missing_weights_are_an_error(exported, tmp_path):
    _, out = exported
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((out / name).read_bytes())
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights.pop("model.head.weight")
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['model.head.weight'\]"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(OSError):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_weights_the_config_has_no_place_for_are_an_error(exported, tmp_path):
    """config.json saying `tie_embeddings` over a checkpoint with its own head: the head's weights were
    dropped with transformers' warning only, and the logits were those of another model."""
    _, out = exported
    (tmp_path / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    config = json.loads((out / "config.json").read_text())
    assert "model.head.weight" in load_file(str(out / "model.safetensors")) and not config["tie_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_embeddings": True}))
    with pytest.raises(ValueError, match=r"gives no place to \(\['model.head.weight'\]\)"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_cache_misuse_is_an_error(hf_model):
    cache = LoopedCache("terminal", max_len=16)
    ids = torch.tensor([[1, 2, 3]])
    hf_model(ids, cache=cache, num_steps=2)
    assert cache.get_seq_length() == 3
    with pytest.raises(ValueError, match="holds 1 rows, input_ids has 2"):
        hf_model(torch.tensor([[4], [5]]), cache=cache)
    with pytest.raises(NotImplementedError, match="beam"):
        cache.reorder_cache(torch.tensor([0]))
    with pytest.raises(ValueError, match="LoopedCache"):
        hf_model(ids, cache=object())


# -- tokenizers ------------------------------------------------------------------------------------------
def test_example_ids_are_one_per_row_as_a_list_or_a_tensor(hf_model):
    """A list raised AttributeError ('list' object has no attribute 'to'), one id for two rows was broadcast."""
    ids = torch.tensor([TOK.encode("hello"), TOK.encode("world")])
    with torch.no_grad():
        ref = hf_model(ids, example_ids=torch.tensor([3, 4])).logits
        assert torch.equal(hf_model(ids, example_ids=[3, 4]).logits, ref)
        with pytest.raises(ValueError, match="example_ids has 1 entries for 2 rows"):
            hf_model(ids, example_ids=torch.tensor([3]))


def test_the_exported_tokenizer_knows_the_model_context(exported):
    """transformers' default model_max_length is 1e30, so `truncation=True` kept prompts past the context."""
    model, path = exported
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.model_max_length == model.cfg.max_seq_len == 48
    assert len(tok("x" * 100, truncation=True)["input_ids"]) == 48


def test_auto_tokenizer_matches_the_byte_tokenizer(exported):
    tok = AutoTokenizer.from_pretrained(exported[1])
    assert (tok.eos_token_id, tok.pad_token_id, len(tok), tok.padding_side) == (256, 257, 258, "left")
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == TOK.encode(text)
        assert tok.decode(ids) == text == TOK.decode(ids)
    assert tok.decode([104, 105, 256, 257], skip_special_tokens=True) == "hi"
    batch = tok(["ab", "abcd"], padding=True, return_tensors="pt")
    assert batch["input_ids"][0].tolist() == [257, 257, 97, 98] and batch["attention_mask"][0].tolist() == [0, 0, 1, 1]


def test_byte_tokenizer_symbols_are_the_byte_level_alphabet():
    """Guards against: byte 0xAD (soft hyphen, not printable) kept as itself. Each byte's token is GPT-2's
    bytes_to_unicode symbol (written out here), so every UTF-8 byte of a text encodes to its own id."""
    from looplm.hf.export import byte_tokenizer

    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    symbol = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    tok = byte_tokenizer()
    assert tok.convert_ids_to_tokens(list(range(256))) == [symbol[b] for b in range(256)]
    text = "".join(map(chr, range(1, 0x100))) + " \u00ad\u00e9\u65e5\U0001f389"  # every continuation byte
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == TOK.encode(text) and tok.decode(ids) == text


def test_bpe_checkpoint_exports_its_tokenizer(tmp_path):
    bpe = BPETokenizer.train(["the cat sat on the mat", "the dog ate the log"] * 20, vocab_size=300)
    model = tiny_model(vocab_size=bpe.vocab_size)
    write_checkpoint(tmp_path / "ckpt", model, bpe)
    export(tmp_path / "ckpt", tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in ["the cat ate the mat", "unseen wörds <eos>"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == bpe.encode(text) and tok.decode(ids) == bpe.decode(ids)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert (hf.config.eos_token_id, hf.config.pad_token_id) == (bpe.eos_id, bpe.pad_id)
    ids = torch.tensor([bpe.encode("the cat")])
    with torch.no_grad():
        assert (hf(ids).logits - model(ids, 5, init="seeded").logits).abs().max() <= 1e-5


# -- CLI and registration ----------------------------------------------------------------------------------
def test_cli_export(tmp_path, capsys):
    write_checkpoint(tmp_path / "ckpt", tiny_model(), TOK)
    assert main(["export", tmp_path / "ckpt", tmp_path / "hf", "--num-steps", "4", "--cache", "full"]) == 0
    assert "wrote" in capsys.readouterr().out
    config = AutoConfig.from_pretrained(tmp_path / "hf")
    assert (config.num_steps, config.cache_kind) == (4, "full")
    assert main(["export", tmp_path / "nowhere", tmp_path / "hf2"]) == 2
    assert "error:" in capsys.readouterr().err
    # the default num_steps (5) is capped at a shallower model's max_depth: it was refused there
    write_checkpoint(tmp_path / "shallow", tiny_model(max_depth=4), TOK)
    assert main(["export", tmp_path / "shallow", tmp_path / "hf3"]) == 0, capsys.readouterr().err
    assert AutoConfig.from_pretrained(tmp_path / "hf3").num_steps == 4


def test_cli_export_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["export", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--num-steps" in out and "Hugging Face" in out


@pytest.mark.slow
def test_import_looplm_hf_registers_the_model_type_and_import_looplm_stays_light():
    code = (
        "import sys, looplm; assert 'transformers' not in sys.modules; "
        "from transformers import AutoConfig; "
        "import transformers.models.auto.configuration_auto as auto; assert 'looplm' not in auto.CONFIG_MAPPING; "
        "import looplm.hf; from transformers import AutoModelForCausalLM; "
        "cfg = AutoConfig.for_model('looplm', d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64); "
        "print(type(AutoModelForCausalLM.from_config(cfg)).__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "LoopedLMForCausalLM"


def test_config_carries_every_model_field_with_its_default():
    """LoopedLMConfig spells out ModelConfig's fields for transformers; keep the two in step."""
    import dataclasses

    from looplm.config import ModelConfig
    from looplm.hf import LoopedLMConfig

    hf = LoopedLMConfig()
    for f in dataclasses.fields(ModelConfig):
        assert getattr(hf, f.name) == f.default, f.name


# -- the manual decoding loop ------------------------------------------------------------------------
def context_bound(model: LoopedLM) -> LoopedLM:
    """`model` with its matrices scaled up, so each token's logits move by far more than the test's
    tolerance when its context changes (a tiny random model barely attends)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and name != "embed.weight":
                p.mul_(3.0)
    return model


@pytest.mark.parametrize(("kind", "depth"), [("full", 3), ("terminal", 1)])
def test_use_cache_returns_the_cache_the_manual_loop_continues(kind, depth):
    """`out = m(ids, use_cache=True)`, then `m(next, past_key_values=out.past_key_values)` token by token:
    every step's logits equal the no-cache forward over the whole sequence. The full cache reproduces
    it exactly; so does the terminal cache at one recurrence, where the terminal K/V are the only K/V."""
    hf = LoopedLMForCausalLM.from_looplm(context_bound(tiny_model()), num_steps=depth, cache_kind=kind).eval()
    ids = torch.tensor([TOK.encode("a context that matters"), TOK.encode("another row of context")])
    n = 16
    with torch.no_grad():
        whole = hf(ids).logits
        out = hf(ids[:, :n], use_cache=True)
        assert isinstance(out.cache, LoopedCache) and out.cache.kind == kind and out.cache.get_seq_length() == n
        steps = [out.logits]
        for j in range(n, ids.shape[1]):
            out = hf(ids[:, j : j + 1], past_key_values=out.past_key_values)
            steps.append(out.logits)
        alone = hf(ids[:, -1:]).logits  # the last token without its context
    # logits reach |27| here (scaled weights, 3 recurrences): errors of float reduction order scale with
    # the largest logit, so the bound is 1e-5 of it (a step without its context is off by > 0.1)
    assert (torch.cat(steps, 1) - whole).abs().max() <= 1e-5 * whole.abs().max()
    assert (alone[:, -1] - whole[:, -1]).abs().max() > 0.1  # the context really moves the logits
    assert out.cache.get_seq_length() == ids.shape[1]


def test_use_cache_in_training_mode_is_an_error():
    hf = LoopedLMForCausalLM.from_looplm(tiny_model(), num_steps=2).train()
    with pytest.raises(ValueError, match="eval mode"):
        hf(torch.tensor([[1, 2, 3]]), use_cache=True)
    assert hf(torch.tensor([[1, 2, 3]])).cache is None  # the config's use_cache default keeps the native forward


def test_prefill_steps_and_exit_tau_without_a_cache_are_refused(hf_model):
    """Without a cache a forward (and `generate(use_cache=False)`, which runs it per step) is the native
    forward at num_steps: a prefill depth or an exit threshold it cannot honour is an error, not ignored."""
    ids = torch.tensor([TOK.encode("abc")])
    for kw in (dict(exit_tau=0.3), dict(prefill_steps=1)):
        with pytest.raises(ValueError, match="cached decoding"):
            hf_model(ids, num_steps=3, **kw)
        with pytest.raises(ValueError, match="cached decoding"):
            hf_model.generate(ids, max_new_tokens=2, use_cache=False, num_steps=3, **kw)
    hf_model(ids, num_steps=3, prefill_steps=3)  # the same depth: nothing ignored


def test_the_config_answers_what_transformers_and_peft_read(hf_model):
    cfg = hf_model.config
    assert cfg.num_hidden_layers == cfg.n_prelude + cfg.n_core + cfg.n_coda == 4
    assert cfg.head_dim == cfg.d_model // cfg.n_heads


def test_logits_to_keep_takes_a_count_or_positions(hf_model):
    ids = torch.tensor([TOK.encode("hello looped")])
    with torch.no_grad():
        every = hf_model(ids, num_steps=2).logits
        assert torch.equal(hf_model(ids, num_steps=2, logits_to_keep=3).logits, every[:, -3:])
        keep = torch.tensor([0, 5])
        assert torch.equal(hf_model(ids, num_steps=2, logits_to_keep=keep).logits, every[:, keep])


def test_a_bad_override_at_load_is_refused_at_load(exported):
    """`from_pretrained(folder, num_steps=99)` (max_depth 16) fails then, not at the next load of what it saved."""
    _, out = exported
    with pytest.raises(ValueError, match="num_steps must be in 1..16"):
        AutoModelForCausalLM.from_pretrained(out, num_steps=99)
    with pytest.raises(ValueError, match="num_steps must be in 1..16"):
        AutoConfig.from_pretrained(out, num_steps=99)


def test_resize_token_embeddings_keeps_looplms_config_and_refuses_value_embeddings(tmp_path):
    hf = LoopedLMForCausalLM.from_looplm(tiny_model(), TOK, num_steps=2).eval()
    hf.resize_token_embeddings(264)
    assert hf.model.cfg.vocab_size == hf.config.vocab_size == 264
    ids = torch.tensor([[97, 262, 98]])  # a new id
    with torch.no_grad():
        logits = hf(ids).logits
    assert logits.shape[-1] == 264
    hf.save_pretrained(tmp_path / "resized")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "resized").eval()
    with torch.no_grad():
        assert (again(ids).logits - logits).abs().max() <= 1e-5
    hf.resize_token_embeddings(266, pad_to_multiple_of=64)  # 266 tokens in 320 rows: the rest no token
    assert hf.config.vocab_size == 320 and hf.config.tokenizer_vocab_size == 266
    with torch.no_grad():
        assert torch.isinf(hf(ids).logits[..., 266:]).all() and not torch.isinf(hf(ids).logits[..., :266]).any()
    with_values = LoopedLMForCausalLM.from_looplm(tiny_model(value_embeds="odd"), TOK, num_steps=2)
    with pytest.raises(ValueError, match="value embeddings"):
        with_values.resize_token_embeddings(264)
    # padding alone (no new_num_tokens): the tokenizer keeps its 258 ids, the rows past them are no token
    padded = LoopedLMForCausalLM.from_looplm(tiny_model(), TOK, num_steps=2).eval()
    padded.resize_token_embeddings(pad_to_multiple_of=64)
    assert padded.config.vocab_size == 320 and padded.config.tokenizer_vocab_size == TOK.vocab_size
    with torch.no_grad():
        assert torch.isinf(padded(ids[:, :1]).logits[..., TOK.vocab_size :]).all()


def test_a_refused_prompt_leaves_the_cache_empty_for_the_next_prompt():
    """A first call refused (too long for the cache) used to leave the cache allocated at length 0, so
    the next prompt ran as a decode chunk at num_steps (not prefill_steps), or was refused for the
    failed call's padding. The prompt now prefills as on a fresh cache (`_reference.NaiveDecoder`)."""
    from _reference import NaiveDecoder

    model = decisive_model(TOK.vocab_size, max_seq_len=48)
    hf = LoopedLMForCausalLM.from_looplm(model, TOK, num_steps=4, prefill_steps=1).eval()
    prompt = TOK.encode("a prompt")
    cache = LoopedCache("terminal", max_len=10)
    with torch.no_grad():
        with pytest.raises(ValueError, match="exceed the cache length"):
            hf(torch.tensor([TOK.encode("a prompt that is too long")]), cache=cache)
        got = hf(torch.tensor([prompt]), cache=cache).logits[0]
    want, _, _ = NaiveDecoder(model, "terminal").chunk(prompt, 1)
    assert (got - want).abs().max() <= 1e-4
    cache = LoopedCache("terminal", max_len=10)  # a padded batch refused, then another one
    long, long_mask = padded_batch(["a prompt that is too long", "ab"])
    short, short_mask = padded_batch(["abc", "ab"])
    with torch.no_grad():
        with pytest.raises(ValueError, match="exceed the cache length"):
            hf(long, attention_mask=long_mask, cache=cache)
        assert hf(short, attention_mask=short_mask, cache=cache).logits.shape[:2] == (2, 3)


def test_a_vocabulary_padded_past_the_tokenizer_is_never_chosen(tmp_path):
    """A checkpoint whose embedding has 300 rows over the byte tokenizer's 258 ids (rows here made to
    win the argmax): the export records `tokenizer_vocab_size`, the wrapper's logits are -inf past it,
    and greedy `generate` gives `looplm generate`'s tokens, which are chosen over the tokenizer's ids."""
    model = tiny_model(vocab_size=300)
    with torch.no_grad():
        model.head.weight[258:] = 8 * model.head.weight[:42]
    write_checkpoint(tmp_path / "ckpt", model, TOK)
    export(tmp_path / "ckpt", tmp_path / "hf", num_steps=3)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.tokenizer_vocab_size == 258
    ids = torch.tensor([TOK.encode("hello looped")])
    with torch.no_grad():
        logits = hf(ids).logits
        native = model(ids, 3, init="seeded", example_ids=torch.zeros(1, dtype=torch.long)).logits
    assert int(native[0].argmax(-1).max()) >= 258  # the padded rows would win somewhere
    assert torch.isinf(logits[..., 258:]).all() and (logits[..., :258] - native[..., :258]).abs().max() <= 1e-5
    out = hf.generate(ids, max_new_tokens=8, do_sample=False)
    want = looplm_generate.generate(
        model, TOK, ["hello looped"], DepthRule(3), sampling=SamplingConfig(max_new_tokens=8)
    )
    assert TOK.decode(cut_at_eos(out, ids.shape[1])[0]) == want[0] and int(out.max()) < 258


def test_compile_decode_false_overrides_the_configs_true():
    """Kills H10 (modeling.py `_compile_decode` -> `config.compile_decode or bool(asked)`): a call's
    compile_decode=False wins over the config's True (no compiled step), for a forward's cache and generate's."""
    model = decisive_model(TOK.vocab_size, max_seq_len=48)
    hf = LoopedLMForCausalLM.from_looplm(model, TOK, num_steps=3, compile_decode=True).eval()
    ids = torch.tensor([TOK.encode("mid size")])
    with torch.no_grad():
        assert hf(ids, use_cache=True).cache.compile is True
        assert hf(ids, use_cache=True, compile_decode=False).cache.compile is False
    # one new token: the prompt's prefill only, so nothing is compiled either way
    out = hf.generate(ids, max_new_tokens=1, do_sample=False, compile_decode=False, return_dict_in_generate=True)
    assert out.cache.compile is False


def test_byte_tokenizer_maps_every_byte_as_gpt2_byte_level_does():
    """Kills E02 (export.py `_byte_symbols` keep range 0xAE -> 0xAF): the exported byte tokenizer's vocabulary
    is GPT-2's byte-to-unicode table (the one its ByteLevel pre-tokenizer and decoder use), and text made of every
    byte that UTF-8 text holds encodes and decodes as looplm's ByteTokenizer does."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from looplm.hf.export import byte_tokenizer

    tok = byte_tokenizer()
    vocab = tok.get_vocab()
    assert {symbol: vocab.get(symbol) for symbol in bytes_to_unicode().values()} == {
        symbol: b for b, symbol in bytes_to_unicode().items()
    }
    # every byte value valid in UTF-8: ASCII, 2-, 3- and 4-byte characters (leads C2..F4, continuations 80..BF)
    chars = [chr(c) for c in range(1, 0x800)] + [chr(c) for c in range(0x800, 0x10000, 61) if not 0xD800 <= c < 0xE000]
    chars += [chr(c) for c in range(0x10000, 0x110000, 4099)]
    text = "".join(chars) + "®"
    assert {b for b in text.encode()} >= set(range(1, 0x80)) | set(range(0x80, 0xC0)) | set(range(0xC2, 0xF5))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == TOK.encode(text)
    assert tok.decode(ids) == text


# -- the wrapper's checks and bookkeeping ------------------------------------------------------------------
def test_an_attention_mask_row_without_a_real_token_is_refused(hf_model):
    """A row of the mask that is all padding has nothing to predict from: refused in the native forward
    and at a cache's prefill, not run over padding alone."""
    ids, mask = padded_batch(["abc", "ab"])
    mask[1] = 0
    with pytest.raises(ValueError, match="no real token"):
        hf_model(ids, attention_mask=mask, num_steps=2)
    with torch.no_grad(), pytest.raises(ValueError, match="no real token"):
        hf_model(ids, attention_mask=mask, cache=LoopedCache("terminal", max_len=8), num_steps=2)


def test_an_appended_token_must_match_the_caches_padding(hf_model):
    """A cache filled with a left-padded prompt: the next call's mask must repeat that padding (a mask
    of all ones says there was none) and mark the appended tokens as real (a padding token appended
    to a cache is an error, even a single one)."""
    ids, mask = padded_batch(["a longer", "ab"])
    B, c = ids.shape
    with torch.no_grad():
        cache = hf_model(ids, attention_mask=mask, use_cache=True, num_steps=2).cache
        nxt = torch.tensor([[97], [98]])
        with pytest.raises(ValueError, match="does not match the padding"):
            hf_model(nxt, attention_mask=torch.ones(B, c + 1, dtype=torch.long), cache=cache, num_steps=2)
        with pytest.raises(ValueError, match="cannot be padding"):
            hf_model(nxt, attention_mask=torch.cat([mask, torch.zeros(B, 1, dtype=torch.long)], 1), cache=cache)
        # the right mask is accepted (and the refused calls appended nothing)
        ok = hf_model(nxt, attention_mask=torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], 1), cache=cache)
    assert ok.logits.shape[:2] == (2, 1) and cache.get_seq_length() == c + 1


def test_prefill_steps_without_a_cache_are_compared_with_the_calls_num_steps(hf_model):
    """Without a cache, prefill_steps equal to the call's num_steps is no conflict (config num_steps is 3
    here); equal to the config's num_steps but not the call's, it is refused."""
    ids = torch.tensor([TOK.encode("abc")])
    with torch.no_grad():
        same = hf_model(ids, num_steps=2, prefill_steps=2).logits
        assert torch.equal(same, hf_model(ids, num_steps=2).logits)
        with pytest.raises(ValueError, match="cached decoding"):
            hf_model(ids, num_steps=2, prefill_steps=3)


def test_a_full_cache_of_the_users_own_refuses_adaptive_exit(hf_model):
    """The rule is checked against the kind of the cache the call is given (here "full", the config's is
    "terminal"): adaptive exit needs the terminal cache."""
    ids = torch.tensor([TOK.encode("abc")])
    with torch.no_grad(), pytest.raises(ValueError, match="terminal cache"):
        hf_model(ids, cache=LoopedCache("full", max_len=8), num_steps=3, exit_tau=0.1)


def test_a_forward_without_a_cache_runs_num_steps_not_the_configs_prefill_steps():
    """A config with prefill_steps 2 and num_steps 4: the native forward runs every token at 4, the
    looplm forward at 4 recurrences (prefill_steps is for cached decoding)."""
    model = tiny_model()
    hf = LoopedLMForCausalLM.from_looplm(model, TOK, num_steps=4, prefill_steps=2).eval()
    ids = torch.tensor([TOK.encode("a longer prompt")])
    with torch.no_grad():
        want = model(ids, 4, init="seeded", example_ids=torch.zeros(1, dtype=torch.long)).logits
        other = model(ids, 2, init="seeded", example_ids=torch.zeros(1, dtype=torch.long)).logits
        got = hf(ids).logits
    assert (want - other).abs().max() > 0.1
    assert (got - want).abs().max() <= 1e-5


def test_generate_may_fill_the_model_context(hf_model, exported):
    """Prompt plus new tokens of max_seq_len + 1 (the last token is never fed, so the cache holds
    max_seq_len) is allowed, as looplm's generate allows it, and gives its tokens; one more is refused."""
    model, _ = exported
    L = hf_model.config.max_seq_len
    prompt = "a prompt"
    ids = torch.tensor([TOK.encode(prompt)])
    room = L - ids.shape[1] + 1
    out = hf_model.generate(ids, max_new_tokens=room, do_sample=False)
    assert out.shape[1] == L + 1 and TOK.eos_id not in out[0].tolist()  # no early end: the cache is filled
    want = looplm_greedy_ids(model, [prompt], DepthRule(3), sampling=SamplingConfig(max_new_tokens=room))
    assert cut_at_eos(out, ids.shape[1]) == want
    with pytest.raises(ValueError, match="exceed the model context"):
        hf_model.generate(ids, max_new_tokens=room + 1, do_sample=False)


def test_a_chunk_appended_to_a_compiled_cache_runs_the_models_forward(hf_model, monkeypatch):
    """A cache with compile=True runs one-token appends through the compiled step; a chunk of several
    tokens goes through the model's forward: all of its logits, equal to the row decoded by hand."""
    import looplm.hf.modeling as modeling
    from _reference import NaiveDecoder

    real = modeling.DecodeStep
    monkeypatch.setattr(modeling, "DecodeStep", lambda *a, **k: real(*a, **k, compile_options={"backend": "eager"}))
    ids = torch.tensor([TOK.encode("a prompt, then a chunk!")])
    cache = LoopedCache("terminal", compile=True)
    with torch.no_grad():
        hf_model(ids[:, :10], cache=cache, num_steps=3)
        chunk = hf_model(ids[:, 10:14], cache=cache, num_steps=3)
    ref = NaiveDecoder(hf_model.model, "terminal")
    ref.chunk(ids[0, :10].tolist(), 3)
    want = ref.chunk(ids[0, 10:14].tolist(), 3)[0]
    assert chunk.logits.shape[1] == 4 and cache.get_seq_length() == 14
    assert (chunk.logits[0] - want).abs().max() <= 1e-4


def test_a_chunks_mean_depth_is_the_mean_over_its_tokens(hf_model):
    """The manual loop: a 4-token chunk appended with adaptive exit reports the mean of its tokens'
    recurrences (the row decoded by hand), not their sum; a token appended after it counts as one
    token of five, not as one call of two (the mean per token, as `generate` reports it)."""
    from _reference import NaiveDecoder

    ids = torch.tensor([TOK.encode("a prompt, then a chunk!")])
    with torch.no_grad():
        out = hf_model(ids[:, :16], use_cache=True, num_steps=6, prefill_steps=3)
        hf_model(ids[:, 16:20], cache=out.cache, num_steps=6, exit_tau=0.05)
    ref = NaiveDecoder(hf_model.model, "terminal")
    ref.chunk(ids[0, :16].tolist(), 3)
    _, used, _ = ref.chunk(ids[0, 16:20].tolist(), 6, exit_tau=0.05)
    assert out.cache.mean_decode_depth == pytest.approx(float(used.float().mean()), abs=1e-9)
    with torch.no_grad():
        hf_model(ids[:, 20:21], cache=out.cache, num_steps=6)
    _, last, _ = ref.chunk(ids[0, 20:21].tolist(), 6)
    assert float(last.float().mean()) != float(used.float().mean())  # per call and per token differ here
    want = (float(used.float().sum()) + float(last.float().sum())) / 5
    assert out.cache.mean_decode_depth == pytest.approx(want, abs=1e-9)


def test_tokenizer_vocab_size_is_set_only_for_rows_past_the_tokenizer(tmp_path):
    """`tokenizer_vocab_size` says the embedding has rows no token reaches; it stays None (every row a
    token) when the tokenizer spans the embedding: at `from_looplm`, in an export's config.json, after
    `resize_token_embeddings` to exactly the new tokenizer's size. A resize that only pads a padded
    embedding keeps the tokenizer's size, not the old number of rows."""
    assert LoopedLMForCausalLM.from_looplm(tiny_model(), TOK).config.tokenizer_vocab_size is None
    write_checkpoint(tmp_path / "ckpt", tiny_model(), TOK)
    export(tmp_path / "ckpt", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tokenizer_vocab_size"] is None
    hf = LoopedLMForCausalLM.from_looplm(tiny_model(), TOK).eval()
    hf.resize_token_embeddings(264)
    assert hf.config.vocab_size == 264 and hf.config.tokenizer_vocab_size is None

    padded = LoopedLMForCausalLM.from_looplm(tiny_model(vocab_size=300), TOK, num_steps=2).eval()
    assert padded.config.tokenizer_vocab_size == TOK.vocab_size
    padded.resize_token_embeddings(pad_to_multiple_of=64)
    assert padded.config.vocab_size == 320 and padded.config.tokenizer_vocab_size == TOK.vocab_size
    with torch.no_grad():
        logits = padded(torch.tensor([[97, 98]])).logits
    assert torch.isinf(logits[..., TOK.vocab_size :]).all() and not torch.isinf(logits[..., : TOK.vocab_size]).any()


def test_tokenizer_vocab_size_is_checked_against_the_vocabulary(exported):
    """`tokenizer_vocab_size` is refused out of 1..vocab_size (in a config and as a load override) and
    accepted at both ends, vocab_size included (every row a token, nothing masked)."""
    for bad in (0, 259, True, 2.5):
        with pytest.raises(ValueError, match=r"tokenizer_vocab_size must be in 1\.\.258"):
            LoopedLMConfig(vocab_size=258, tokenizer_vocab_size=bad)
    with pytest.raises(ValueError, match=r"tokenizer_vocab_size must be in 1\.\.258"):
        AutoConfig.from_pretrained(exported[1], tokenizer_vocab_size=300)
    for ok in (1, 258):
        assert LoopedLMConfig(vocab_size=258, tokenizer_vocab_size=ok).tokenizer_vocab_size == ok
    hf = LoopedLMForCausalLM.from_looplm(tiny_model(), TOK, tokenizer_vocab_size=258).eval()
    with torch.no_grad():
        assert not torch.isinf(hf(torch.tensor([[97, 98]])).logits).any()


# -- the exported tokenizer and record ----------------------------------------------------------------
def test_exported_tokenizer_decodes_spaces_before_punctuation_as_written(tmp_path):
    """Transformers' clean-up (applied to a tokenizer whose model is not BPE, here a SentencePiece-style Unigram) would
    drop the space before punctuation and contractions (" ," -> ","); the exported tokenizer decodes as looplm's does,
    the text itself."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    text = "Well , then . Is it ? Yes ! It 's n't what I 'm , we 're or you 've said ."
    backend = HFTokenizer(models.Unigram())
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=120, special_tokens=["<eos>", "<pad>", "<unk>"], unk_token="<unk>", show_progress=False
    )
    backend.train_from_iterator([text] * 20, trainer=trainer)
    unigram = BPETokenizer(backend)  # looplm's wrapper takes any `tokenizers` model
    write_checkpoint(tmp_path / "ckpt", tiny_model(vocab_size=unigram.vocab_size), unigram)
    tok = AutoTokenizer.from_pretrained(export(tmp_path / "ckpt", tmp_path / "hf"))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == unigram.encode(text)
    assert tok.decode(ids) == text == unigram.decode(ids)
    assert tok.batch_decode([ids])[0] == text


def test_export_leaves_transformers_progress_bars_as_it_found_them(tmp_path):
    """Export hides transformers' progress bar while it saves, then restores the caller's setting, enabled or
    disabled."""
    from transformers.utils import logging as hf_logging

    write_checkpoint(tmp_path / "ckpt", tiny_model(), TOK)
    was = hf_logging.is_progress_bar_enabled()
    try:
        for enabled in (True, False):
            (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
            export(tmp_path / "ckpt", tmp_path / f"hf-{enabled}")
            assert hf_logging.is_progress_bar_enabled() is enabled
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


# -- the cache, the checks and the config --------------------------------------------------------------------
def test_a_cache_of_an_unknown_kind_is_refused_when_made():
    """Q01: `LoopedCache("paged")` is refused at once, not left to fail at its first forward."""
    with pytest.raises(ValueError, match="unknown cache kind 'paged'"):
        LoopedCache("paged")


def test_a_cache_without_a_kind_keeps_the_kind_its_prompt_chose(hf_model):
    """Q02: a `LoopedCache()` filled by a call with cache_kind="full" is a full cache from then on: its kind says so,
    and a later call's exit_tau (terminal cache only) is refused by it, not checked against the config's "terminal"."""
    cache = LoopedCache()
    ids = torch.tensor([TOK.encode("abc")])
    with torch.no_grad():
        hf_model(ids, cache=cache, cache_kind="full", num_steps=2)
        assert cache.kind == "full" and type(cache.inner).__name__ == "FullCache"
        with pytest.raises(ValueError, match="terminal cache"):
            hf_model(torch.tensor([[97]]), cache=cache, num_steps=2, exit_tau=0.1)
    assert cache.get_seq_length() == 3


def test_cache_reports_its_rows_length_and_room(hf_model):
    """Q03, Q04: before its prompt a cache reports no rows and no room (-1); after it, the batch of the prompt, the
    tokens it holds and the length it was allocated with (the model context without a `max_len`)."""
    for max_len, room in ((None, hf_model.config.max_seq_len), (12, 12)):
        cache = LoopedCache("terminal", max_len=max_len)
        assert (cache.batch_size, cache.get_seq_length(), cache.get_max_length()) == (-1, 0, -1)
        with torch.no_grad():
            hf_model(torch.tensor([TOK.encode("abcde"), TOK.encode("vwxyz")]), cache=cache, num_steps=2)
        assert (cache.batch_size, cache.get_seq_length(), cache.get_max_length()) == (2, 5, room)
        assert f"length=5, max_len={room}" in repr(cache)


def test_a_prompt_without_a_mask_continues_under_a_mask_of_ones(hf_model):
    """Q06: a prompt run without an attention_mask (no padding), then the usual next call with a mask of ones over the
    cached and new tokens: accepted (ones mean no padding), and the same logits as without it, which are the full
    forward's (full cache at prefill depth = num_steps)."""
    ids = torch.tensor([TOK.encode("a prompt!"), TOK.encode("row two..")])
    B, c = ids.shape
    nxt = torch.tensor([[97], [98]])
    with torch.no_grad():
        masked = hf_model(ids, use_cache=True, cache_kind="full", num_steps=2)
        step = hf_model(nxt, attention_mask=torch.ones(B, c + 1, dtype=torch.long), cache=masked.cache, num_steps=2)
        whole = hf_model(torch.cat([ids, nxt], 1), num_steps=2).logits
    assert (step.logits[:, 0] - whole[:, -1]).abs().max() <= 1e-5
    assert masked.cache.pad is None


def test_an_attention_mask_of_another_shape_is_refused(hf_model):
    """Q07: a 2D mask one column longer than input_ids (zeros, then ones: a valid left padding of its own length) is
    refused, in the native forward and at a cache's prefill, not read as one more padding token."""
    ids, mask = padded_batch(["abc", "ab"])
    longer = torch.cat([torch.zeros(2, 1, dtype=torch.long), mask], 1)
    with pytest.raises(ValueError, match="shape of input_ids"):
        hf_model(ids, attention_mask=longer, num_steps=2)
    with torch.no_grad(), pytest.raises(ValueError, match="shape of input_ids"):
        hf_model(ids, attention_mask=longer, cache=LoopedCache("terminal", max_len=8), num_steps=2)


def test_forward_arguments_looplm_cannot_honour_are_refused(hf_model):
    """Q09, Q10, Q11, Q13: a cache given twice (`cache` and `past_key_values`), return_dict=False, output_hidden_states
    and labels of another shape are errors, not silently dropped or broadcast."""
    ids = torch.tensor([TOK.encode("abcd")])
    with torch.no_grad():
        with pytest.raises(ValueError, match="not both"):
            hf_model(ids, cache=LoopedCache("terminal", max_len=8), past_key_values=LoopedCache("terminal", max_len=8))
        with pytest.raises(ValueError, match="return_dict=False"):
            hf_model(ids, return_dict=False)
        with pytest.raises(ValueError, match="hidden states"):
            hf_model(ids, output_hidden_states=True)
        with pytest.raises(ValueError, match="labels must have the shape"):
            hf_model(ids, labels=ids[:, :3])


def test_a_caches_own_kind_wins_over_the_calls_cache_kind(hf_model):
    """Q12: a `LoopedCache("full")` given with cache_kind="terminal" is still a full cache: adaptive exit is refused for
    it (the rule is checked against the cache the call runs on)."""
    ids = torch.tensor([TOK.encode("abc")])
    with torch.no_grad(), pytest.raises(ValueError, match="terminal cache"):
        hf_model(ids, cache=LoopedCache("full", max_len=8), cache_kind="terminal", num_steps=3, exit_tau=0.1)


def test_a_chunk_appended_under_a_mask_equals_the_full_forward(hf_model):
    """Q14, Q27: a left-padded prompt in a full cache, then a 3-token chunk whose mask covers the cached and the new
    tokens: accepted, and its logits equal the full forward over the whole padded sequence; a chunk whose mask marks one
    of its new tokens as padding is refused."""
    ids, mask = padded_batch(["a longer", "ab"])
    B, c = ids.shape
    chunk = torch.tensor([TOK.encode("xyz"), TOK.encode("uvw")])
    full_mask = torch.cat([mask, torch.ones(B, 3, dtype=torch.long)], 1)
    with torch.no_grad():
        cache = hf_model(ids, attention_mask=mask, use_cache=True, cache_kind="full", num_steps=2).cache
        bad = full_mask.clone()
        bad[1, c + 1] = 0
        with pytest.raises(ValueError, match="cannot be padding"):
            hf_model(chunk, attention_mask=bad, cache=cache, num_steps=2)
        got = hf_model(chunk, attention_mask=full_mask, cache=cache, num_steps=2).logits
        whole = hf_model(torch.cat([ids, chunk], 1), attention_mask=full_mask, num_steps=2).logits
    assert got.shape[:2] == (B, 3) and (got - whole[:, c:]).abs().max() <= 1e-5


def test_a_one_token_prompt_of_a_compiled_cache_prefills_at_prefill_steps(hf_model, monkeypatch):
    """Q15: with compile_decode, a prompt of one token is still the prompt: the model's forward at prefill_steps, not
    the compiled decode step at num_steps; every step's logits equal the decode by hand."""
    import looplm.hf.modeling as modeling

    real = modeling.DecodeStep
    monkeypatch.setattr(modeling, "DecodeStep", lambda *a, **k: real(*a, **k, compile_options={"backend": "eager"}))
    ids = torch.tensor([TOK.encode("x")])
    out = hf_model.generate(
        ids, max_new_tokens=4, do_sample=False, num_steps=2, prefill_steps=6, compile_decode=True,
        return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    fed = out.sequences[0, 1:-1].tolist()
    want, _ = decode_replay(hf_model.model, "terminal", [ids[0, 0].item()], fed, 6, 2)
    assert (torch.cat(out.logits) - want).abs().max() <= 1e-4
    assert out.cache.step is not None  # the decode steps did run compiled


def test_generate_refuses_a_chunked_prefill_and_a_filled_cache(hf_model):
    """Q16, Q17: prefill_chunk_size (later chunks of the prompt would run at the decode depth) and a `LoopedCache` that
    already holds tokens (generate would continue it as if it were empty) are refused."""
    ids = torch.tensor([TOK.encode("a prompt")])
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        hf_model.generate(ids, max_new_tokens=3, do_sample=False, prefill_chunk_size=4)
    cache = LoopedCache("terminal")
    with torch.no_grad():
        hf_model(ids, cache=cache)
    with pytest.raises(ValueError, match="empty LoopedCache"):
        hf_model.generate(ids, max_new_tokens=3, do_sample=False, cache=cache)
    assert cache.get_seq_length() == ids.shape[1]


def test_a_users_compiled_cache_stays_compiled_through_generate(hf_model, monkeypatch):
    """Q18: a `LoopedCache(compile=True)` of the user's own keeps running its decode steps compiled when the call does
    not say compile_decode (the call may add compilation, never take the cache's away)."""
    import looplm.hf.modeling as modeling

    real = modeling.DecodeStep
    monkeypatch.setattr(modeling, "DecodeStep", lambda *a, **k: real(*a, **k, compile_options={"backend": "eager"}))
    own = LoopedCache(compile=True)
    ids = torch.tensor([TOK.encode("mid size")])
    got = hf_model.generate(ids, max_new_tokens=4, do_sample=False, cache=own)
    assert own.compile and own.step is not None
    assert torch.equal(got, hf_model.generate(ids, max_new_tokens=4, do_sample=False))


def test_generates_own_cache_is_as_long_as_the_generation(hf_model):
    """Q19: without compile_decode generate's cache holds the prompt and the new tokens it feeds (prompt +
    max_new_tokens - 1), not the whole model context."""
    ids = torch.tensor([TOK.encode("a prompt")])
    out = hf_model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    assert out.cache.get_max_length() == ids.shape[1] + 5 - 1 < hf_model.config.max_seq_len


def test_generate_ends_rows_at_every_end_of_sequence_id(hf_model):
    """Q05, Q30: `generate(eos_token_id=[256, t])` ends a row at either id; the cache learns both (its `finished` rows,
    which the mean depth leaves out, are the rows that fed one), not the first id alone nor the model's default
    generation config."""
    ids, mask = padded_batch(PROMPTS)
    plain = hf_model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)[:, ids.shape[1] :]
    t = plain[0, 1].item()  # row 0's second token: an end of sequence for this call
    assert t != TOK.eos_id
    for own in (None, LoopedCache()):
        out = hf_model.generate(
            ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=[TOK.eos_id, t],
            return_dict_in_generate=True, **({} if own is None else {"cache": own}),
        )  # fmt: skip
        cache = out.cache if own is None else own
        assert cache.eos_ids.tolist() == [TOK.eos_id, t]
        new = out.sequences[:, ids.shape[1] :]
        fed = new[:, :-1]  # the last token is never fed
        ended = torch.isin(fed, torch.tensor([TOK.eos_id, t])).any(1)
        assert bool(ended[0]) and torch.equal(cache.finished, ended)


def test_from_looplm_keeps_the_callers_token_ids():
    """Q20: token ids given to `from_looplm` win over the tokenizer's."""
    hf = LoopedLMForCausalLM.from_looplm(tiny_model(), TOK, eos_token_id=10, pad_token_id=11)
    assert (hf.config.eos_token_id, hf.config.pad_token_id) == (10, 11)


def test_from_pretrained_returns_the_loading_info_when_asked(exported):
    """Q21: `output_loading_info=True` gives (model, info), as transformers' `from_pretrained` does."""
    model, info = AutoModelForCausalLM.from_pretrained(exported[1], output_loading_info=True)
    assert isinstance(model, LoopedLMForCausalLM) and not info["missing_keys"] and not info["unexpected_keys"]


def test_weights_of_the_wrong_shape_are_an_error_even_when_ignored(exported):
    """Q22: `ignore_mismatched_sizes=True` over a checkpoint whose embedding does not fit the config would initialise it
    at random; the wrapper refuses it."""
    with pytest.raises(ValueError, match=r"wrong shape \[\('model\."):
        AutoModelForCausalLM.from_pretrained(exported[1], vocab_size=300, ignore_mismatched_sizes=True)


def test_a_looplm_model_of_another_shape_than_the_config_is_refused():
    """Q23: wrapping a LoopedLM whose config differs from the HF config in any field (not only the vocabulary) is
    refused."""
    import dataclasses

    model = tiny_model()
    other = LoopedLMConfig.from_model_config(dataclasses.replace(model.cfg, max_depth=8))
    with pytest.raises(ValueError, match="does not match the HF config"):
        LoopedLMForCausalLM(other, model=model)


def test_cache_edits_transformers_may_ask_for_are_refused():
    """Q24, Q25: cropping and batch expansion (assisted decoding, beam search) raise, never no-op on a cache that would
    then hold the wrong tokens or rows."""
    cache = LoopedCache()
    with pytest.raises(NotImplementedError, match="cropping"):
        cache.crop(1)
    with pytest.raises(NotImplementedError, match="batch expansion"):
        cache.batch_repeat_interleave(2)


def test_a_prompt_that_fails_in_the_model_leaves_the_cache_empty(hf_model):
    """Q28: a prompt that fails inside the model (a token id past the vocabulary: IndexError, not a ValueError) leaves
    the cache empty, so the next prompt prefills as on a fresh cache."""
    cache = LoopedCache("terminal", max_len=16)
    ids = torch.tensor([TOK.encode("abc")])
    with torch.no_grad():
        with pytest.raises(IndexError):
            hf_model(torch.tensor([[97, 5000]]), cache=cache, num_steps=2)
        assert cache.get_seq_length() == 0 and cache.inner is None
        got = hf_model(ids, cache=cache, num_steps=2, prefill_steps=4).logits
    want, _ = decode_replay(hf_model.model, "terminal", ids[0].tolist(), [], 4, 2)
    assert (got[0, -1] - want[0]).abs().max() <= 1e-4


def test_a_bfloat16_model_generates_on_a_bfloat16_cache():
    """Q29: the cache is allocated in the model's dtype: a bfloat16 wrapper generates, its cache holds bfloat16, and it
    gives looplm's generate's tokens on the same bfloat16 model."""
    model = tiny_model().to(torch.bfloat16)
    hf = LoopedLMForCausalLM.from_looplm(model, TOK, num_steps=2).eval()
    ids = torch.tensor([TOK.encode("a prompt")])
    out = hf.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    assert out.cache.nbytes == out.cache.inner.nbytes and out.cache.inner.nbytes > 0
    assert hf.model.embed.weight.dtype == torch.bfloat16
    want = looplm_greedy_ids(model, ["a prompt"], DepthRule(2), sampling=SamplingConfig(max_new_tokens=5))
    assert cut_at_eos(out.sequences, ids.shape[1]) == want


def test_config_refuses_a_setting_by_its_config_name(exported):
    """Q31, Q34: a bad prefill_steps is named as the config spells it; a model field overridden at load (`n_heads` that
    does not divide d_model) is refused at load, as a test-time field is."""
    hf = LoopedLMForCausalLM.from_looplm(tiny_model(), TOK)
    with torch.no_grad(), pytest.raises(ValueError, match=r"prefill_steps must be in 1\.\.16"):
        hf(torch.tensor([[1, 2]]), cache=LoopedCache(), prefill_steps=99)
    with pytest.raises(ValueError, match="not divisible"):
        AutoConfig.from_pretrained(exported[1], n_heads=5)


def test_config_answers_transformers_names_with_looplms_fields():
    """Q35, Q36: transformers' names read looplm's fields (num_key_value_heads is n_kv_heads, not n_heads), and the
    default token ids are looplm's ByteTokenizer's."""
    cfg = LoopedLMConfig(d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=48)
    got = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size)
    assert got == (32, 4, 2, 64) and cfg.max_position_embeddings == 48
    assert (cfg.eos_token_id, cfg.pad_token_id) == (TOK.eos_id, TOK.pad_id)
