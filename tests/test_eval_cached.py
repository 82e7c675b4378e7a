"""Evaluation helpers against direct references."""

import math

import pytest
import torch
import torch.nn.functional as F

from looplm.config import ModelConfig
from looplm.data import ByteTokenizer, Example
from looplm.errors import UserError
from looplm.eval.perplexity import native_perplexity
from looplm.eval.tasks import task_accuracy
from looplm.infer import make_cache
from looplm.model import LoopedLM


class _Data:
    """A tiny in-memory stand-in for PackedDataset (inputs, targets, no documents)."""

    def __init__(self, tokens):
        self.tokens = tokens

    def __len__(self):
        return self.tokens.shape[0]

    def get_batch(self, idx):
        from looplm.data import Batch

        x = self.tokens[idx]
        return Batch(
            inputs=x[:, :-1],
            targets=x[:, 1:],
            doc_ids=torch.zeros_like(x[:, :-1]),
            positions=torch.arange(x.shape[1] - 1).expand(len(idx), -1),
            example_ids=torch.tensor(idx),
        )


def test_native_perplexity_and_state_change_match_a_direct_computation():
    torch.manual_seed(0)
    m = LoopedLM(ModelConfig(vocab_size=20, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)).eval()
    toks = torch.randint(0, 20, (5, 13))
    got = native_perplexity(m, _Data(toks), [1, 3], batch_size=2)
    with torch.no_grad():
        out = m(toks[:, :-1], 3, init="seeded", example_ids=torch.arange(5), return_states=True)
    ce = F.cross_entropy(out.logits.flatten(0, 1), toks[:, 1:].flatten())
    assert math.isclose(got[3]["ppl"], math.exp(ce.item()), rel_tol=1e-5)
    prev, last = out.states[1], out.states[2]
    change = ((last - prev).norm(dim=-1) / prev.norm(dim=-1)).mean().item()
    assert math.isclose(got[3]["state_change"], change, rel_tol=1e-5)
    assert got[1]["state_change"] is None


def test_task_accuracy_equals_greedy_decoding():
    """Teacher-forced argmax over the answer span agrees with greedy decoding of it, per example."""
    torch.manual_seed(1)
    tok = ByteTokenizer()
    m = LoopedLM(
        ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
    ).eval()
    examples = [Example(f"+{a},{b}=", str(a + b), "add_msd", 1) for a, b in [(1, 2), (3, 4), (5, 5), (9, 9)]]
    with torch.no_grad():
        greedy = []
        for i, ex in enumerate(examples):
            ids = tok.encode(ex.prompt)
            target = tok.encode(ex.answer + "\n")
            ok = True
            for t in target:
                logits = m(torch.tensor([ids]), 2, init="seeded", example_ids=torch.tensor([i])).logits
                ok &= int(logits[0, -1].argmax()) == t
                ids.append(t)
            greedy.append(ok)
    got = task_accuracy(m, tok, examples, [2], batch_size=3)[2]
    assert got["acc"] == sum(greedy) / len(greedy)


class _Packed:
    """Hand-made packed rows: (token ids, document lengths, unsupervised positions, whether the row's last
    document continues into the next row). Targets are -100 at each document's last token (the next token
    lies in another document) and at the unsupervised positions; positions restart at each document."""

    def __init__(self, rows, vocab=50, seed=0):
        from looplm.data import Batch

        g = torch.Generator().manual_seed(seed)
        self.batches = []
        for i, (lengths, unsupervised, continues) in enumerate(rows):
            L = sum(lengths)
            x = torch.randint(0, vocab, (1, L + 1), generator=g)
            doc = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
            pos = torch.cat([torch.arange(n) for n in lengths])[None]
            y = x[:, 1:].clone()
            ends = torch.tensor(lengths).cumsum(0) - 1
            y[0, ends[:-1] if continues else ends] = -100
            y[0, list(unsupervised)] = -100
            self.batches.append(
                Batch(inputs=x[:, :-1], targets=y, doc_ids=doc, positions=pos, example_ids=torch.tensor([i]))
            )

    def __len__(self):
        return len(self.batches)

    def get_batch(self, idx):
        (i,) = idx
        return self.batches[i]


class _Keep:
    """`data` with every target outside `keep` (a set of (row, t)) set to -100."""

    def __init__(self, data, keep):
        self.data, self.keep = data, keep

    def __len__(self):
        return len(self.data)

    def get_batch(self, idx):
        from looplm.data import Batch

        b = self.data.get_batch(idx)
        y = torch.full_like(b.targets, -100)
        for row, t in self.keep:
            if row == idx[0]:
                y[0, t] = b.targets[0, t]
        return Batch(b.inputs, y, b.doc_ids, b.positions, b.example_ids)


# Rows of 16 positions (midpoint 8). Target t is y[t] = x[t + 1], scored by the logits at input t; the
# second half is 8 <= t < 16. Row 0: documents [0,5) [5,11) [11,14) [14,16+) (the last continues into the
# next row), targets 4, 10, 13 cross a document end and 12 is unsupervised -> {8, 9, 11, 14, 15}.
# Row 1: [0,11) [11,14) [14,16), all documents end in the row -> {8, 9, 11, 12, 14}.
# Row 2: [0,8) [8,16), a document starting exactly at the midpoint -> {8, ..., 14}.
_ROWS = [((5, 6, 3, 2), (12,), True), ((11, 3, 2), (), False), ((8, 8), (), False)]
_SCORED = {(0, t) for t in (8, 9, 11, 14, 15)} | {(1, t) for t in (8, 9, 11, 12, 14)} | {(2, t) for t in range(8, 15)}


def _tiny(vocab=50, max_seq_len=32, seed=0):
    torch.manual_seed(seed)
    return LoopedLM(
        ModelConfig(vocab_size=vocab, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=max_seq_len)
    ).eval()


def test_sharing_rows_score_every_second_half_target_and_full_cache_equals_native():
    """The row-halves protocol scores every supervised target of the second half of each row (chunk and
    decode alike), and with the full cache it equals the native forward (document-masked) on them."""
    from looplm.eval.cached import cached_perplexity

    m, data = _tiny(), _Packed(_ROWS)
    candidates = {(i, t) for i in range(len(data)) for t in range(16) if data.get_batch([i]).targets[0, t] != -100}
    assert _SCORED <= candidates

    def n_scored(keep, mode, stepwise):  # how many of the targets in `keep` the protocol scores
        try:
            return cached_perplexity(m, _Keep(data, keep), 2, mode, stepwise=stepwise)["tokens"]
        except ValueError:  # nothing scored
            return 0

    for mode, stepwise in (("full", False), ("terminal", False), ("terminal", True)):
        # every pair of _SCORED is scored and no other supervised target is: the scored set is _SCORED
        assert n_scored(_SCORED, mode, stepwise) == len(_SCORED), (mode, stepwise)
        assert n_scored(candidates - _SCORED, mode, stepwise) == 0, (mode, stepwise)
    total = 0.0
    with torch.no_grad():
        for i in range(len(data)):
            b = data.get_batch([i])
            logits = m(
                b.inputs, 3, doc_ids=b.doc_ids, positions=b.positions, init="seeded", example_ids=b.example_ids
            ).logits[0]
            for row, t in _SCORED:
                if row == i:
                    total += F.cross_entropy(logits[t], b.targets[0, t]).item()
    ref = total / len(_SCORED)
    for stepwise in (False, True):
        got = cached_perplexity(m, data, 3, "full", stepwise=stepwise)
        assert got["tokens"] == len(_SCORED)
        assert math.isclose(got["loss"], ref, rel_tol=1e-5)


def _terminal_reference_ce(m, data, depth, stepwise):
    """Mean CE over `_SCORED` with the terminal cache, target by target: a fresh cache per target, the
    target's document prefilled from its start up to the midpoint (if it starts before it), then the
    document's second-half inputs up to the target's input fed as one chunk or one token at a time."""
    from looplm.infer import TerminalCache, extend

    total = 0.0
    for i, t in sorted(_SCORED):
        b = data.get_batch([i])
        doc = b.doc_ids[0]
        start = int((doc == doc[t]).nonzero()[0, 0])
        first = max(start, 8)
        cache = TerminalCache(m.cfg, 1, 16)
        if start < first:
            extend(m, b.inputs[:, start:first], cache, depth, example_ids=b.example_ids)
        if stepwise:
            for u in range(first, t + 1):
                logits = extend(m, b.inputs[:, u : u + 1], cache, depth, example_ids=b.example_ids).logits
        else:
            logits = extend(m, b.inputs[:, first : t + 1], cache, depth, example_ids=b.example_ids).logits
        total += F.cross_entropy(logits[0, -1], b.targets[0, t]).item()
    return total / len(_SCORED)


def _native_ce(m, data, depth):
    total = 0.0
    with torch.no_grad():
        for i, t in _SCORED:
            b = data.get_batch([i])
            logits = m(
                b.inputs, depth, doc_ids=b.doc_ids, positions=b.positions, init="seeded", example_ids=b.example_ids
            ).logits[0]
            total += F.cross_entropy(logits[t], b.targets[0, t]).item()
    return total / len(_SCORED)


def test_sharing_table_penalties_match_independent_ces():
    """Penalties from separately computed CEs: full = the native forward, terminal = a per-target loop."""
    from looplm.eval.cached import sharing_table

    m, data = _tiny(), _Packed(_ROWS)
    table = sharing_table(m, data, [1, 3])
    for R in (1, 3):
        full = math.exp(_native_ce(m, data, R))
        chunk = math.exp(_terminal_reference_ce(m, data, R, stepwise=False))
        decode = math.exp(_terminal_reference_ce(m, data, R, stepwise=True))
        row = table[R]
        assert row["tokens"] == len(_SCORED)
        assert math.isclose(row["full_ppl"], full, rel_tol=1e-5)
        assert math.isclose(row["terminal_ppl"], chunk, rel_tol=1e-5)
        assert math.isclose(row["cacheeval_terminal_ppl"], decode, rel_tol=1e-5)
        assert math.isclose(row["sharing_penalty"], 100 * (chunk / full - 1), abs_tol=1e-3)
        assert math.isclose(row["cacheeval_penalty"], 100 * (decode / full - 1), abs_tol=1e-3)
    assert abs(table[1]["sharing_penalty"]) < 1e-6 and abs(table[1]["cacheeval_penalty"]) < 1e-6  # one bank per layer
    assert table[3]["terminal_ppl"] != table[3]["full_ppl"]  # an untrained model at R = 3 does depend on the banks


def _packed_text(tmp_path):
    """Held-out rows of 48 byte tokens packed from short documents of three lengths."""
    from looplm.data import build_datasets

    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(16):
        (docs / f"{i}.txt").write_text("fox %d jumps. " % i * (1 + i % 3))
    return build_datasets(str(docs), ByteTokenizer(), seq_len=48, holdout=0.5, cache_dir=tmp_path / "cache")[1]


def _native_score(m, val, rows: int, scored) -> tuple[float, int]:
    """(CE sum, count) of one document-masked native forward per row at R = 3 over the targets that
    `scored(doc ids of the row)` marks ([48] booleans)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(rows):
            b = val.get_batch([i])
            logits = m(
                b.inputs, 3, doc_ids=b.doc_ids, positions=b.positions, init="seeded", example_ids=b.example_ids
            ).logits
            t = torch.where(scored(b.doc_ids[0].tolist()), b.targets[0], -100)
            total += F.cross_entropy(logits[0], t, ignore_index=-100, reduction="sum").item()
            count += int((t != -100).sum())
    return total, count


def test_cached_perplexity_full_cache_equals_native_on_packed_text(tmp_path):
    """Real packed rows: the full cache (chunk and decode) equals one document-masked native forward over
    each row, scored on the supervised targets t >= L // 2."""
    from looplm.eval.cached import cached_perplexity

    val = _packed_text(tmp_path)
    rows = min(4, len(val))
    assert any(len(set(val.get_batch([i]).doc_ids[0, 24:].tolist())) > 1 for i in range(rows))  # packed halves
    m = _tiny(ByteTokenizer().vocab_size, 48)
    total, count = _native_score(m, val, rows, lambda doc: torch.arange(48) >= 24)
    for stepwise in (False, True):
        got = cached_perplexity(m, val, 3, "full", max_sequences=rows, stepwise=stepwise)
        assert got["tokens"] == count
        assert math.isclose(got["ppl"], math.exp(total / count), rel_tol=1e-5)


def test_a_decode_time_exit_rule_needs_stepwise_scoring(tmp_path):
    """Adaptive exit (exit_tau, min_depth) is a rule of one-token decoding: a chunk scored in parallel
    would ignore it and report the fixed depth, so it is refused there by name."""
    from looplm.eval.cached import cached_perplexity

    val = _packed_text(tmp_path)
    m = _tiny(ByteTokenizer().vocab_size, 48)
    for rule in ({"exit_tau": 0.1}, {"min_depth": 2}):
        with pytest.raises(UserError, match=f"{next(iter(rule))} .* stepwise=True"):
            cached_perplexity(m, val, 3, "terminal", max_sequences=1, **rule)
    got = cached_perplexity(m, val, 3, "terminal", max_sequences=1, stepwise=True, exit_tau=1e9)
    assert got["mean_decode_depth"] == 1.0  # every decoded token stops after one recurrence


def test_prefilled_only_scores_the_documents_a_prefill_reaches(tmp_path):
    """What compares prefill arms: of the second-half targets, only those of documents that begin
    before the midpoint (their first part is the prompt an arm prefills); written out from doc ids."""
    from looplm.eval.cached import cached_perplexity

    val = _packed_text(tmp_path)
    rows = min(4, len(val))
    m = _tiny(ByteTokenizer().vocab_size, 48)
    # the targets from 24 on of the document at position 23, which goes on past the midpoint
    total, count = _native_score(
        m, val, rows, lambda doc: torch.tensor([t >= 24 and doc[t] == doc[23] for t in range(48)])
    )
    every = cached_perplexity(m, val, 3, "full", max_sequences=rows)["tokens"]
    got = cached_perplexity(m, val, 3, "full", max_sequences=rows, prefilled_only=True)
    assert 0 < got["tokens"] == count < every
    assert math.isclose(got["ppl"], math.exp(total / count), rel_tol=1e-5)


def test_cacheeval_span_protocol(tmp_path):
    """App. D.4 with P prompt and C continuation targets: in the first document of P + C tokens, starting
    at s, prefill inputs s .. s+P-1; the prefill's last logits score target s+P-1 (the token x[s+P]); then
    inputs s+P .. s+P+C-2 are teacher-forced, scoring targets s+P .. s+P+C-2. C targets; the cache ends
    at P + C - 1 tokens (the model's context here is exactly P + C - 1)."""
    from looplm.data import build_datasets
    from looplm.eval.cached import _document_with_room, cached_perplexity

    assert _document_with_room(torch.tensor([0, 0, 1, 1, 1, 2]), 3) == 2
    assert _document_with_room(torch.tensor([0, 0, 1, 1, 1, 2]), 4) is None
    tok = ByteTokenizer()
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(4):
        (docs / f"{i}.txt").write_text("to be or not to be, that is the question. " * 3)
    _, val = build_datasets(str(docs), tok, seq_len=48, holdout=0.5, cache_dir=tmp_path / "cache")
    P, C = 16, 8
    m = _tiny(tok.vocab_size, P + C - 1)
    total, count = 0.0, 0
    for i in range(2):
        b = val.get_batch([i])
        doc = b.doc_ids[0].tolist()
        s = next(
            a for a in range(len(doc)) if (a == 0 or doc[a] != doc[a - 1]) and doc[a : a + P + C] == [doc[a]] * (P + C)
        )
        with torch.no_grad():  # no cache: the prompt and the C - 1 fed continuation tokens in one forward
            logits = m(b.inputs[:, s : s + P + C - 1], 2, init="seeded", example_ids=b.example_ids).logits
        t = b.targets[:, s + P - 1 : s + P + C - 1]
        total += F.cross_entropy(
            logits[:, P - 1 :].flatten(0, 1), t.flatten(), ignore_index=-100, reduction="sum"
        ).item()
        count += int((t != -100).sum())
    assert count == 2 * C
    for stepwise in (True, False):
        got = cached_perplexity(m, val, 2, "full", max_sequences=2, stepwise=stepwise, span=(P, C))
        assert got["tokens"] == count and math.isclose(got["ppl"], math.exp(total / count), rel_tol=1e-5)
    term = cached_perplexity(m, val, 2, "terminal", max_sequences=2, stepwise=True, span=(P, C))
    assert term["tokens"] == count and term["mean_decode_depth"] == 2.0


def test_a_span_no_document_holds_is_named(tmp_path):
    # short documents: no row holds P + C tokens of one document. The error blamed "no supervised targets".
    from looplm.data import build_datasets
    from looplm.eval.cached import cached_perplexity

    tok = ByteTokenizer()
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(40):
        (docs / f"{i}.txt").write_text(f"short {i}.")
    _, val = build_datasets(str(docs), tok, seq_len=48, holdout=0.5, cache_dir=tmp_path / "cache")
    m = _tiny(tok.vocab_size, 48)
    with pytest.raises(ValueError, match=r"cacheeval span 10 10: no held-out document has 20 tokens \(the longest has"):
        cached_perplexity(m, val, 2, "full", max_sequences=2, span=(10, 10))


def test_cached_perplexity_runs_in_the_model_dtype(monkeypatch):
    """A bf16 model gets bf16 caches: finite results close to the fp32 model's, on the same targets."""
    import copy

    from looplm.eval import cached
    from looplm.eval.cached import cached_perplexity

    made = []

    def spy(*args, **kwargs):  # the caches the protocol allocates, and their banks' dtype
        cache = make_cache(*args, **kwargs)
        made.append({bank.k.dtype for bank in cache.banks()})
        return cache

    monkeypatch.setattr(cached, "make_cache", spy)
    m, data = _tiny(), _Packed(_ROWS)
    m16 = copy.deepcopy(m).to(torch.bfloat16)
    for mode, stepwise, span in (("terminal", True, None), ("full", False, (5, 3))):
        ref = cached_perplexity(m, data, 3, mode, stepwise=stepwise, span=span)
        made.clear()
        got = cached_perplexity(m16, data, 3, mode, stepwise=stepwise, span=span)
        assert made and all(dtypes == {torch.bfloat16} for dtypes in made), made
        assert got["tokens"] == ref["tokens"]
        assert math.isfinite(got["loss"]) and abs(got["loss"] - ref["loss"]) < 0.05


def test_depth_samples_fit_the_context():
    """The train report's samples (200 tokens by default) from a model with a short context: each
    sample is cut to what the context leaves after the prompt, and it is the seeded continuation
    `generate` gives for that length."""
    from looplm.eval.report import EvalConfig, depth_samples
    from looplm.infer.generate import DepthRule, SamplingConfig, generate

    tok = ByteTokenizer()
    m = LoopedLM(
        ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=24)
    ).eval()
    cfg = EvalConfig(sample_depths=(1, 3), sample_tokens=200, sample_prompt="KING.\n")
    room = 24 - len(tok.encode(cfg.sample_prompt)) + 1
    got = depth_samples(m, tok, cfg, "cpu")
    assert got["tokens"] == room < 200
    want = generate(
        m,
        tok,
        [cfg.sample_prompt],
        DepthRule(3),
        sampling=SamplingConfig(max_new_tokens=room, temperature=cfg.sample_temperature, seed=cfg.task_seed),
    )[0]
    assert got["by_depth"][3] == want
    short = depth_samples(m, tok, EvalConfig(sample_depths=(1,), sample_tokens=5), "cpu")
    assert short["tokens"] == 5


@pytest.mark.parametrize(("tau", "low"), [(0.1, 1), (0.2, 5)])
def test_stepwise_adaptive_exit_against_a_decode_by_hand(tau, low):
    """`stepwise=True` with `exit_tau`/`min_depth`: every fed input decoded with adaptive exit, as
    `_reference.NaiveDecoder` does it by hand (each second-half document from its start, the part before
    the midpoint prefilled at full depth): the loss over the scored targets and the mean recurrences
    over every decoded input."""
    from _reference import NaiveDecoder

    from looplm.eval.cached import cached_perplexity, document_segments

    m, data, depth = _tiny(), _Packed(_ROWS), 6
    total, count, used = 0.0, 0, []
    for i in range(len(data)):
        b = data.get_batch([i])
        for s, e in document_segments(b.doc_ids[0]):
            if e <= 8:
                continue
            first = max(s, 8)
            ref = NaiveDecoder(m, "terminal", example_id=i)
            if first > s:
                ref.chunk(b.inputs[0, s:first].tolist(), depth)
            for t in range(first, e):
                logits, u = ref.step(int(b.inputs[0, t]), depth, exit_tau=tau, min_depth=low)
                used.append(u)
                if b.targets[0, t] != -100:
                    total += F.cross_entropy(logits, b.targets[0, t]).item()
                    count += 1
    assert count == len(_SCORED) and low <= min(used) < depth  # tokens exit early, never below min_depth
    got = cached_perplexity(m, data, depth, "terminal", stepwise=True, exit_tau=tau, min_depth=low)
    assert got["tokens"] == count
    assert math.isclose(got["loss"], total / count, rel_tol=1e-5)
    assert math.isclose(got["mean_decode_depth"], sum(used) / len(used), rel_tol=1e-9)


def test_sharing_table_with_a_span_scores_the_cacheeval_targets():
    """`sharing_table(span=(P, C))`: every column under the CacheEval protocol. In the first document of
    P + C tokens of each row (row 0 has none: skipped), the full cache equals the native forward over the
    prompt and the fed continuation; the decode column equals a prefill at R and C - 1 steps by hand."""
    from _reference import NaiveDecoder

    from looplm.eval.cached import sharing_table

    m, data, (P, C), R = _tiny(), _Packed(_ROWS), (5, 3), 3
    full = decode = 0.0
    count = 0
    for i, s in ((1, 0), (2, 0)):  # rows 1 and 2 start with a document of >= 8 tokens; row 0 has none
        b = data.get_batch([i])
        t = b.targets[0, s + P - 1 : s + P + C - 1]
        with torch.no_grad():
            logits = m(b.inputs[:, s : s + P + C - 1], R, init="seeded", example_ids=b.example_ids).logits[0, P - 1 :]
        full += F.cross_entropy(logits, t, reduction="sum").item()
        ref = NaiveDecoder(m, "terminal", example_id=i)
        steps = [ref.chunk(b.inputs[0, s : s + P].tolist(), R)[0][-1]]
        steps += [ref.step(int(x), R)[0] for x in b.inputs[0, s + P : s + P + C - 1]]
        decode += F.cross_entropy(torch.stack(steps), t, reduction="sum").item()
        count += len(t)
    row = sharing_table(m, data, [R], span=(P, C))[R]
    assert row["span"] == (P, C) and row["tokens"] == count == 2 * C
    assert math.isclose(row["full_ppl"], math.exp(full / count), rel_tol=1e-5)
    assert math.isclose(row["cacheeval_terminal_ppl"], math.exp(decode / count), rel_tol=1e-5)


def test_odd_rows_and_one_token_prompts_against_the_native_forward():
    """Row halves on rows of odd length (the midpoint is L // 2: of 15 positions, targets 7..14) and a
    document with a single token before the midpoint (prefilled alone): the full cache, chunk and decode,
    equals the document-masked native forward on the targets t >= L // 2; at a fixed depth every decoded
    token reports that depth."""
    from looplm.eval.cached import cached_perplexity

    m, data = _tiny(), _Packed([((6, 9), (), False), ((7, 9), (), False)])
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(data)):
            b = data.get_batch([i])
            L = b.inputs.shape[1]
            logits = m(
                b.inputs, 3, doc_ids=b.doc_ids, positions=b.positions, init="seeded", example_ids=b.example_ids
            ).logits[0]
            for t in range(L // 2, L):
                if b.targets[0, t] != -100:
                    total += F.cross_entropy(logits[t], b.targets[0, t]).item()
                    count += 1
    assert count == 7 + 7  # row 0: 7..13 (14 ends its document); row 1: 8..14
    for stepwise in (False, True):
        got = cached_perplexity(m, data, 3, "full", stepwise=stepwise)
        assert got["tokens"] == count
        assert math.isclose(got["loss"], total / count, rel_tol=1e-5)
        assert got["mean_decode_depth"] == 3.0


def test_cacheeval_max_sequences_counts_spans_not_rows():
    """With spans, `max_sequences` counts the spans scored, not the rows read: row 0 of `_ROWS` holds no
    document of P + C tokens, so max_sequences=1 scores row 1's span (read past row 0), and only it."""
    from looplm.eval.cached import cached_perplexity

    m, data, (P, C) = _tiny(), _Packed(_ROWS), (5, 3)
    b = data.get_batch([1])
    with torch.no_grad():
        logits = m(b.inputs[:, : P + C - 1], 2, init="seeded", example_ids=b.example_ids).logits[0, P - 1 :]
    want = F.cross_entropy(logits, b.targets[0, P - 1 : P + C - 1]).item()
    for stepwise in (False, True):
        got = cached_perplexity(m, data, 2, "full", max_sequences=1, stepwise=stepwise, span=(P, C))
        assert got["tokens"] == C
        assert math.isclose(got["loss"], want, rel_tol=1e-5)
