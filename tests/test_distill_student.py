"""Distilled prefill (design §9): the student, its prefill path, its loss and its checkpoints."""

import math

import pytest
import torch
import torch.nn.functional as F

from looplm.checkpoint import CheckpointError
from looplm.config import INJECTIONS, ModelConfig
from looplm.distill import EndpointStudent, load_student, save_student, teacher_hash
from looplm.distill.trainer import Targets, distill_loss, relative_error
from looplm.errors import UserError
from looplm.infer import TerminalCache, extend
from looplm.infer.generate import DepthRule, SamplingConfig, generate
from looplm.infer.prefill import Prefill, student_prefill
from looplm.model import LoopedLM
from looplm.model.blocks import rope_tables
from looplm.data import ByteTokenizer


def _teacher(injection="parcae-nonorm", seed=0, **kw):
    torch.manual_seed(seed)
    shape = dict(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
    cfg = ModelConfig(injection=injection, **{**shape, **kw})
    return LoopedLM(cfg).eval()


def _rope(model, B, L):
    return rope_tables(torch.arange(L).expand(B, L), model.cfg.head_dim, model.cfg.rope_base)


class OracleStudent(torch.nn.Module):
    """Returns the teacher's exact depth-R endpoint of fixed tokens (seeded state), whatever e is."""

    def __init__(self, endpoint):
        super().__init__()
        self.endpoint, self.n_blocks = endpoint, 2

    def forward(self, e, rope, mask):
        return self.endpoint


@pytest.mark.parametrize("injection", INJECTIONS)
def test_oracle_student_prefill_equals_teacher_prefill_plus_one_recurrence(injection, single_thread):
    m, R = _teacher(injection), 4
    x = torch.randint(0, 50, (2, 20))
    ids = torch.tensor([3, 7])
    with torch.no_grad():
        z_R = m(x, R, init="seeded", example_ids=ids).endpoint
        native_next = m(x, R + 1, init="seeded", example_ids=ids).logits  # independent: the native forward
    ref_cache = TerminalCache(m.cfg, 2, 32)
    ref = extend(m, x, ref_cache, R + 1, example_ids=ids).logits  # teacher prefill at R, then one more recurrence
    cache = TerminalCache(m.cfg, 2, 32)
    got = student_prefill(m, OracleStudent(z_R), x, cache, example_ids=ids)
    assert cache.length == ref_cache.length == 20
    assert (got - native_next).abs().max() <= 1e-5
    assert (got - ref).abs().max() <= 1e-5
    for a, b in zip(cache.banks(), ref_cache.banks(), strict=True):  # prelude, both core layers, coda
        assert (a.k - b.k).abs().max() <= 1e-5 and (a.v - b.v).abs().max() <= 1e-5
    # decoding is unchanged: the next token reads the same terminal banks either way
    nxt = torch.randint(0, 50, (2, 1))
    assert (
        extend(m, nxt, cache, R, example_ids=ids).logits - extend(m, nxt, ref_cache, R, example_ids=ids).logits
    ).abs().max() <= 1e-5


@pytest.mark.parametrize("injection", ["parcae-nonorm", "parcae-decay", "ortho", "additive"])
def test_teacher_init_outputs_one_recurrence_from_zero_state(injection, single_thread):
    m = _teacher(injection)
    with torch.no_grad():  # train the injection away from its init so diag(dt) W is not trivial
        for p in m.injection.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randint(0, 50, (2, 16))
    rope = _rope(m, 2, 16)
    student = EndpointStudent.from_teacher(m, init="teacher")
    with torch.no_grad():
        e = m.run_prelude(x, rope, None)
        ref = m(x, 1, init="zero").endpoint
        got = student(e, rope, None)
        rand = EndpointStudent.from_teacher(m, init="random")(e, rope, None)
    assert (got - ref).abs().max() <= 1e-5
    assert (rand - ref).abs().max() > 1e-2  # the random-init ablation is not the teacher


def test_teacher_init_refuses_nonlinear_injections_and_copies_blocks_cyclically():
    with pytest.raises(ValueError, match="random init"):
        EndpointStudent.from_teacher(_teacher("huginn-linear"))
    m = _teacher()
    s = EndpointStudent.from_teacher(m, n_blocks=3)
    assert torch.equal(s.blocks[2].ffn.w1.weight, m.core[0].ffn.w1.weight)
    EndpointStudent.from_teacher(_teacher("deq-qkv"), init="random")  # random init works for any teacher
    # a recurrence that ends in an exit norm is not F(0; e) of the student's blocks (2.4 off before)
    for norm in ("rms", "rms-gain"):
        with pytest.raises(ValueError, match="exit norm"):
            EndpointStudent.from_teacher(_teacher("parcae-nonorm", exit_norm=norm))
        EndpointStudent.from_teacher(_teacher("parcae-nonorm", exit_norm=norm), init="random")


def test_student_prefill_of_a_padded_batch_equals_each_row_alone(single_thread):
    tok = ByteTokenizer()
    m_byte = _teacher(vocab_size=tok.vocab_size)
    student = EndpointStudent.from_teacher(m_byte, init="teacher").eval()
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))  # a student that is not the teacher's one recurrence
    arm = Prefill("student", student)
    prompts = ["+12,345=", "+7,8=", "+100,99="]
    sampling = SamplingConfig(max_new_tokens=12)
    batched = generate(m_byte, tok, prompts, DepthRule(3), prefill=arm, example_ids=[0, 1, 2], sampling=sampling)
    alone = [
        generate(m_byte, tok, [p], DepthRule(3), prefill=arm, example_ids=[i], sampling=sampling)[0]
        for i, p in enumerate(prompts)
    ]
    assert batched == alone and any(batched)
    # the prefill logits themselves: left-padded rows against each row alone
    enc = [tok.encode(p) for p in prompts]
    L = max(map(len, enc))
    x = torch.tensor([[tok.pad_id] * (L - len(ids)) + ids for ids in enc])
    pad = torch.tensor([L - len(ids) for ids in enc])
    got = arm(m_byte, x, TerminalCache(m_byte.cfg, 3, L), 3, pad=pad, example_ids=torch.arange(3))[:, -1]
    for i, ids in enumerate(enc):
        one = arm(m_byte, torch.tensor([ids]), TerminalCache(m_byte.cfg, 1, L), 3, example_ids=torch.tensor([i]))
        assert (got[i] - one[0, -1]).abs().max() <= 1e-5
    # and the arm matters: this student's prefill is not the teacher's
    cache_a, cache_b = TerminalCache(m_byte.cfg, 1, 32), TerminalCache(m_byte.cfg, 1, 32)
    x = torch.tensor([tok.encode(prompts[0])])
    assert (arm(m_byte, x, cache_a, 3) - Prefill("teacher")(m_byte, x, cache_b, 3)).abs().max() > 1e-4


def test_prefill_arms_validate_and_count_block_passes():
    m = _teacher()
    s = EndpointStudent.from_teacher(m)
    assert Prefill("teacher").block_passes(m.cfg, 5) == 12  # design §9: 1 + 10 + 1
    assert Prefill("student", s).block_passes(m.cfg, 5) == 6  # 1 + 2 + 2 + 1
    assert Prefill("r1").block_passes(m.cfg, 5) == 4 and Prefill("r2").block_passes(m.cfg, 5) == 6
    with pytest.raises(ValueError, match="--student"):
        Prefill("student")
    with pytest.raises(ValueError, match="unknown prefill arm"):
        Prefill("r3")
    from looplm.infer import FullCache

    with pytest.raises(ValueError, match="terminal"):
        student_prefill(m, s, torch.zeros(1, 4, dtype=torch.long), FullCache(m.cfg, 1, 8, depth=2))
    cache = TerminalCache(m.cfg, 1, 16)
    extend(m, torch.zeros(1, 4, dtype=torch.long), cache, 2)
    with pytest.raises(ValueError, match="empty cache"):
        student_prefill(m, s, torch.zeros(1, 4, dtype=torch.long), cache)


def test_distill_loss_matches_a_direct_computation_and_trains_only_the_student(single_thread):
    m = _teacher()
    m.requires_grad_(False)
    x = torch.randint(0, 50, (2, 12))
    rope = _rope(m, 2, 12)
    with torch.no_grad():
        out = m(x, 3, init="seeded")
        e = m.run_prelude(x, rope, None)
    student = EndpointStudent.from_teacher(m, init="random")
    z_hat = student(e, rope, None)
    t = Targets(e, out.endpoint, out.logits, rope, None, None)
    energy = 0.37
    loss, mse, kl = distill_loss(m, z_hat, t, energy, kl_weight=0.5)
    # direct, in fp64: per-element MSE over E; KL(p_T || p_S) summed over the vocabulary, averaged over tokens
    ref_mse = ((z_hat.double() - out.endpoint.double()) ** 2).sum() / z_hat.numel() / energy
    log_p_s = torch.log_softmax(m.run_coda(z_hat, rope, None).double(), -1)
    log_p_t = torch.log_softmax(out.logits.double(), -1)
    ref_kl = (log_p_t.exp() * (log_p_t - log_p_s)).sum(-1).mean()
    assert math.isclose(mse.item(), ref_mse.item(), rel_tol=1e-5)
    assert math.isclose(kl.item(), ref_kl.item(), rel_tol=1e-4, abs_tol=1e-7)
    assert math.isclose(loss.item(), ref_mse.item() + 0.5 * ref_kl.item(), rel_tol=1e-4)
    loss.backward()
    assert all(p.grad is None for p in m.parameters())  # the teacher is frozen
    assert student.in_proj.weight.grad is not None and student.in_proj.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in student.blocks.parameters())
    # relative error helper against its definition
    a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    assert torch.allclose(relative_error(a, b), (a - b).norm(dim=-1) / b.norm(dim=-1))


def test_student_checkpoint_refuses_another_teacher(tmp_path):
    teacher, other = _teacher(seed=0), _teacher(seed=1)
    student = EndpointStudent.from_teacher(teacher)
    with torch.no_grad():
        student.in_proj.weight.mul_(1.5)
    save_student(tmp_path / "s", student, teacher, depth=5)
    loaded, meta = load_student(tmp_path / "s", teacher)
    assert meta["depth"] == 5 and meta["teacher_sha256"] == teacher_hash(teacher)
    for (k, a), (_, b) in zip(student.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    with pytest.raises(CheckpointError, match="another teacher"):
        load_student(tmp_path / "s", other)
    with torch.no_grad():  # one changed weight is another teacher
        teacher.coda[0].ffn.w2.weight[0, 0] += 1e-3
    with pytest.raises(CheckpointError, match="another teacher"):
        load_student(tmp_path / "s", teacher)


def test_teacher_hash_depends_on_every_weight_and_not_on_the_object():
    a, b = _teacher(seed=0), _teacher(seed=0)
    assert teacher_hash(a) == teacher_hash(b)
    with torch.no_grad():
        b.injection.A_log[3] += 1e-6
    assert teacher_hash(a) != teacher_hash(b)


class OneRow:
    """A held-out set of one 20-token row, as a PackedDataset gives it: one document, or two whose
    boundary falls at position 4 of the first half."""

    def __init__(self, boundary: int | None = None):
        self.x = torch.randint(0, 50, (1, 20))
        self.doc = torch.zeros_like(self.x)
        self.positions = torch.arange(20)[None]
        if boundary is not None:
            self.doc[:, boundary:] = 1
            self.positions[:, boundary:] -= boundary

    def __len__(self):
        return 1

    def get_batch(self, idx):
        from looplm.data import Batch

        return Batch(self.x, self.x, self.doc, self.positions, torch.tensor([0]))


def test_bank_error_against_a_direct_computation(single_thread):
    from looplm.eval.prefill_arms import bank_error

    m, rows = _teacher(), OneRow()
    assert bank_error(m, rows, Prefill("teacher"), 4) == 0.0
    x, ids = rows.x[:, :10], torch.tensor([0])
    ref, r1 = TerminalCache(m.cfg, 1, 10), TerminalCache(m.cfg, 1, 10)
    extend(m, x, ref, 4, example_ids=ids)
    extend(m, x, r1, 1, example_ids=ids)
    banks = list(zip(ref.banks()[1:], r1.banks()[1:]))  # core and coda banks; the prelude's are equal
    num = sum((b.k - a.k).pow(2).sum() + (b.v - a.v).pow(2).sum() for a, b in banks)
    den = sum(a.k.pow(2).sum() + a.v.pow(2).sum() for a, _ in banks)
    want = math.sqrt(num / den)
    assert want > 0.01 and abs(bank_error(m, rows, Prefill("r1"), 4) - want) < 1e-5


def test_bank_error_of_a_bf16_model(single_thread):
    """The banks were fp32 whatever the model's dtype: a bf16 model's attention then refused them (query
    BFloat16, key float). Now they hold the model's dtype, and the error is the fp32 model's to bf16 accuracy."""
    from looplm.eval.prefill_arms import bank_error

    m, rows = _teacher(), OneRow()
    want = bank_error(m, rows, Prefill("r1"), 4)
    got = bank_error(m.to(torch.bfloat16), rows, Prefill("r1"), 4)
    assert abs(got - want) < 0.05 * want + 0.02


def test_bank_error_prefills_each_document_from_its_own_start(single_thread):
    # the first half [0, 10) holds documents [0, 4) and [4, 10): each is its own prompt (its own
    # cache), as in real use; the whole half as one sequence let the second attend to the first
    from looplm.eval.prefill_arms import bank_error

    m, rows = _teacher(), OneRow(boundary=4)
    ids, num, den = torch.tensor([0]), 0.0, 0.0
    for start, end in ((0, 4), (4, 10)):
        x = rows.x[:, start:end]
        ref, r1 = TerminalCache(m.cfg, 1, end - start), TerminalCache(m.cfg, 1, end - start)
        extend(m, x, ref, 4, example_ids=ids)
        extend(m, x, r1, 1, example_ids=ids)
        for a, b in zip(ref.banks()[1:], r1.banks()[1:]):
            num += float((b.k - a.k).pow(2).sum() + (b.v - a.v).pow(2).sum())
            den += float(a.k.pow(2).sum() + a.v.pow(2).sum())
    assert abs(bank_error(m, rows, Prefill("r1"), 4) - math.sqrt(num / den)) < 1e-5


def test_teacher_targets_equal_the_native_forward_of_packed_documents(single_thread):
    """The targets of a packed row (two documents, positions restarting at the boundary) are the
    teacher's native forward with the same document mask, positions and seeded initial state."""
    from looplm.distill.trainer import teacher_targets

    m, rows = _teacher(), OneRow(boundary=7)
    b = rows.get_batch([0])
    t = teacher_targets(m, b, 3)
    with torch.no_grad():
        out = m(b.inputs, 3, init="seeded", example_ids=b.example_ids, doc_ids=b.doc_ids, positions=b.positions)
    torch.testing.assert_close(t.endpoint, out.endpoint, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(t.logits, out.logits, rtol=1e-5, atol=1e-5)


def test_student_blocks_default_to_the_teachers_core_and_read_its_value_embeddings_cyclically():
    """A 3-block core with value embeddings on odd layers: the default student has 3 blocks; a 5-block
    student's block i is core block i mod 3 and reads core layer (i mod 3)'s value embeddings (a naive
    loop over the teacher's own blocks)."""
    m = _teacher("parcae-nonorm", n_core=3, value_embeds="odd")
    assert EndpointStudent.from_teacher(m).n_blocks == 3
    with pytest.raises(UserError, match="at least one block, got 0"):  # 0 is no block, not the default
        EndpointStudent.from_teacher(m, n_blocks=0)
    s = EndpointStudent.from_teacher(m, n_blocks=5)
    x = torch.randint(0, 50, (2, 10))
    rope = _rope(m, 2, 10)
    with torch.no_grad():
        e = m.run_prelude(x, rope, None)
        values = m.context(e, rope, None, x).core_values
        got = s(e, rope, None, values=values)
        want = s.in_proj(e)
        for i in range(5):
            v = values[i % 3]
            want = m.core[i % 3](want, rope, None, **({} if v is None else {"value_embed": v}))
    assert values[1] is not None and values[0] is None
    assert (got - want).abs().max() <= 1e-6


def test_a_student_with_an_input_norm_survives_its_checkpoint(tmp_path):
    """A parcae-decay teacher's student normalises its input: the norm is part of its arch, so the
    loaded student computes exactly what the saved one did."""
    teacher = _teacher("parcae-decay")
    student = EndpointStudent.from_teacher(teacher).eval()
    assert student.input_norm is not None
    with torch.no_grad():
        student.input_norm.weight.mul_(1.3)
    save_student(tmp_path / "s", student, teacher, depth=3)
    loaded, _ = load_student(tmp_path / "s", teacher)
    assert loaded.input_norm is not None
    e, rope = torch.randn(1, 6, 32), _rope(teacher, 1, 6)
    with torch.no_grad():
        assert torch.equal(loaded(e, rope, None), student(e, rope, None))


class Rows(OneRow):
    """A held-out set of `n` 20-token one-document rows."""

    def __init__(self, n: int):
        super().__init__()
        self.xs = [torch.randint(0, 50, (1, 20)) for _ in range(n)]

    def __len__(self):
        return len(self.xs)

    def get_batch(self, idx):
        from looplm.data import Batch

        (i,) = idx
        return Batch(self.xs[i], self.xs[i], self.doc, self.positions, torch.tensor([i]))


def test_bank_error_is_the_mean_of_the_per_row_errors(single_thread):
    from looplm.eval.prefill_arms import bank_error

    m, rows = _teacher(), Rows(3)
    per_row = []
    for i in range(3):
        x, ids = rows.xs[i][:, :10], torch.tensor([i])
        ref, r1 = TerminalCache(m.cfg, 1, 10), TerminalCache(m.cfg, 1, 10)
        extend(m, x, ref, 4, example_ids=ids)
        extend(m, x, r1, 1, example_ids=ids)
        banks = list(zip(ref.banks()[1:], r1.banks()[1:]))
        num = sum(float((b.k - a.k).pow(2).sum() + (b.v - a.v).pow(2).sum()) for a, b in banks)
        den = sum(float(a.k.pow(2).sum() + a.v.pow(2).sum()) for a, _ in banks)
        per_row.append(math.sqrt(num / den))
    assert max(per_row) - min(per_row) > 1e-4  # rows that differ: a max or a sum would not pass
    assert abs(bank_error(m, rows, Prefill("r1"), 4, rows=3) - sum(per_row) / 3) < 1e-6
    assert abs(bank_error(m, rows, Prefill("r1"), 4, rows=2) - sum(per_row[:2]) / 2) < 1e-6


def test_prefill_table_format():
    from looplm.eval.prefill_arms import format_prefill_table

    row = dict(continuation_ppl=3.25, tokens=10, acc=0.5, n=8, bank_rel_err=0.125, block_passes=6)
    text = format_prefill_table({"teacher": {2: row}, "r1": {2: dict(row, acc=None, continuation_ppl=None)}})
    lines = text.splitlines()
    assert lines[2].split() == ["2", "teacher", "6", "0.1250", "3.2500", "50.0%", "8"]
    assert lines[3].split() == ["2", "r1", "6", "0.1250", "-", "-", "8"]


def test_a_loaded_student_is_in_eval_mode(tmp_path):
    """load_student hands back the student in eval mode (its docstring's promise), every submodule too."""
    teacher = _teacher()
    student = EndpointStudent.from_teacher(teacher).train()
    save_student(tmp_path / "s", student, teacher, depth=2)
    loaded, _ = load_student(tmp_path / "s", teacher)
    assert not any(mod.training for mod in loaded.modules())


def test_teacher_hash_covers_each_entrys_name_shape_and_dtype():
    """The same bytes under another name, in another shape or of another dtype are another teacher."""

    def holder(**tensors):
        mod = torch.nn.Module()
        for name, t in tensors.items():
            mod.register_buffer(name, t)
        return mod

    x = torch.arange(6, dtype=torch.float32)
    base = teacher_hash(holder(a=x.view(2, 3)))
    assert teacher_hash(holder(a=x.view(2, 3).clone())) == base
    assert teacher_hash(holder(b=x.view(2, 3))) != base
    assert teacher_hash(holder(a=x.view(3, 2))) != base
    assert teacher_hash(holder(a=x.view(torch.int32).view(2, 3))) != base  # same bytes, another dtype


def test_save_student_records_the_given_teachers_hash_over_a_stale_one_in_meta(tmp_path):
    """Re-saving with the meta of another student.json (which carries its own teacher_sha256) still ties
    the checkpoint to the teacher passed in."""
    teacher, other = _teacher(seed=0), _teacher(seed=1)
    student = EndpointStudent.from_teacher(teacher)
    save_student(tmp_path / "s", student, teacher, teacher_sha256=teacher_hash(other), depth=2)
    _, meta = load_student(tmp_path / "s", teacher)
    assert meta["teacher_sha256"] == teacher_hash(teacher)
    with pytest.raises(CheckpointError, match="another teacher"):
        load_student(tmp_path / "s", other)


def test_block_passes_count_each_stack_of_an_uneven_shape():
    """Design §9's cost count at 2/3/2 blocks and a 4-block student, R = 4: prelude + student blocks +
    teacher recurrences x core + coda (the student's own block count, not the core's)."""
    m = _teacher(n_prelude=2, n_core=3, n_coda=2)
    s = EndpointStudent.from_teacher(m, n_blocks=4)
    assert Prefill("teacher").block_passes(m.cfg, 4) == 2 + 4 * 3 + 2
    assert Prefill("student", s).block_passes(m.cfg, 4) == 2 + 4 + 1 * 3 + 2
    assert Prefill("r1").block_passes(m.cfg, 4) == 2 + 3 + 2
    assert Prefill("r2").block_passes(m.cfg, 4) == 2 + 2 * 3 + 2


def test_student_prefill_refuses_a_cache_holding_one_token():
    """The student sees only its chunk: even one cached token is a prefix it cannot read."""
    m = _teacher()
    s = EndpointStudent.from_teacher(m)
    cache = TerminalCache(m.cfg, 1, 16)
    extend(m, torch.zeros(1, 1, dtype=torch.long), cache, 2)
    with pytest.raises(ValueError, match="empty cache"):
        student_prefill(m, s, torch.zeros(1, 4, dtype=torch.long), cache)


def test_student_prefill_of_a_value_embedding_teacher_against_a_hand_run(single_thread):
    """A teacher with value embeddings: the student reads the core's value embeddings, then one teacher
    recurrence and the coda (the model's pieces run by hand, no cache)."""
    m = _teacher(n_core=3, value_embeds="odd")
    student = EndpointStudent.from_teacher(m).eval()
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x = torch.randint(0, 50, (2, 10))
    got = student_prefill(m, student, x, TerminalCache(m.cfg, 2, 16))
    rope = _rope(m, 2, 10)
    with torch.no_grad():
        e = m.run_prelude(x, rope, None)
        ctx = m.context(e, rope, None, x)
        want = m.run_coda(m.recurrence(student(e, rope, None, values=ctx.core_values), ctx), rope, None, ctx)
    assert (got - want).abs().max() <= 1e-5


def test_prefill_table_scores_the_second_half_after_each_arms_prefill(single_thread):
    """continuation_ppl of an arm: its prefill of each row's first half, then the second half scored at R
    as one chunk (extend by hand), over the first `rows` rows; a document that starts past the midpoint
    is left out (it has no prefilled part)."""
    from looplm.eval.prefill_arms import prefill_table

    m, rows = _teacher(), Rows(3)
    table = prefill_table(m, None, rows, [], [Prefill("teacher"), Prefill("r1")], (3,), rows=2)
    ppls = {}
    for arm, pre in (("teacher", 3), ("r1", 1)):
        nll = 0.0
        for i in range(2):
            x, ids = rows.xs[i], torch.tensor([i])
            cache = TerminalCache(m.cfg, 1, 20)
            extend(m, x[:, :10], cache, pre, example_ids=ids)
            logits = extend(m, x[:, 10:], cache, 3, example_ids=ids).logits
            nll += float(F.cross_entropy(logits[0], x[0, 10:], reduction="sum"))
        v = table[arm][3]
        assert v["tokens"] == 20 and v["acc"] is None and v["n"] == 0
        assert math.isclose(v["continuation_ppl"], math.exp(nll / 20), rel_tol=1e-5)
        ppls[arm] = v["continuation_ppl"]
    assert abs(ppls["teacher"] - ppls["r1"]) > 1e-4  # the arm is what differs
    # documents [0, 12) and [12, 20): only targets 10 and 11 have a prefilled part
    late = prefill_table(m, None, OneRow(boundary=12), [], [Prefill("r1")], (3,), rows=1)
    assert late["r1"][3]["tokens"] == 2


def test_prefill_table_without_rows_or_examples_still_counts_block_passes_per_depth():
    """rows = 0 and no examples: no perplexity, no bank error, no accuracy; block passes at each depth."""
    from looplm.eval.prefill_arms import prefill_table

    m = _teacher()
    table = prefill_table(m, None, Rows(1), [], [Prefill("teacher"), Prefill("r2")], (2, 4), rows=0)
    for arm, passes in (("teacher", {2: 6, 4: 10}), ("r2", {2: 6, 4: 6})):
        for r in (2, 4):
            v = table[arm][r]
            assert v["block_passes"] == passes[r], (arm, r)
            assert v["continuation_ppl"] is None and v["bank_rel_err"] is None and v["acc"] is None
            assert v["tokens"] == 0 and v["n"] == 0


def test_prefill_table_decodes_the_generator_tasks_after_each_arms_prefill(monkeypatch):
    """Each arm's exact match is taken with that arm's prefill at the table's depth."""
    from looplm.eval import prefill_arms

    calls = []

    def fake(model, tokenizer, examples, *, depth, prefill=None, batch_size=16):
        calls.append((prefill.arm if prefill is not None else None, depth, batch_size))
        return {"acc": 0.25, "n": len(examples)}

    monkeypatch.setattr(prefill_arms, "exact_match_generator_tasks", fake)
    m = _teacher()
    arms = [Prefill("teacher"), Prefill("r1")]
    table = prefill_arms.prefill_table(m, None, Rows(1), ["a", "b"], arms, (2, 3), rows=0, batch_size=5)
    assert calls == [("teacher", 2, 5), ("teacher", 3, 5), ("r1", 2, 5), ("r1", 3, 5)]
    assert table["r1"][3]["acc"] == 0.25 and table["r1"][3]["n"] == 2
