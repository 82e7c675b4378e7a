"""The chunked head + cross-entropy (model/cross_entropy.py, train/loss.py) against the full path as an
independent reference: [N, V] fp32 logits from the head, then F.cross_entropy; same sums and
gradients within fp32 rounding, with ignored targets and uneven last chunks."""

from __future__ import annotations

import contextlib
import copy
import math
import types

import pytest
import torch
import torch.nn.functional as F
from _jobs import read_metrics, shared_cache, tiny_job

from looplm.data import Batch
from looplm.model import LoopedLM
from looplm.model.cross_entropy import linear_cross_entropy
from looplm.train.loss import cross_entropy_sum, loss_kind, microbatch_loss, parse_kernel_options
from looplm.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("single_thread")


def rows(N=37, d=16, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, d, generator=g, requires_grad=True)
    w = (torch.randn(V, d, generator=g) / 4).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    t[[3, 10, 11]] = -100  # unsupervised positions
    return h, w, t


@pytest.mark.parametrize("chunk", [1, 5, 36, 37, 100])
def test_linear_cross_entropy_equals_full_logits(chunk):
    h, w, t = rows()
    want = F.cross_entropy((h @ w.t()).float(), t, ignore_index=-100, reduction="sum")
    want_gh, want_gw = torch.autograd.grad(0.37 * want, (h, w))
    got = linear_cross_entropy(h, w, t, chunk_rows=chunk)
    gh, gw = torch.autograd.grad(0.37 * got, (h, w))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(gh, want_gh, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, want_gw, rtol=1e-5, atol=1e-6)
    assert gh[[3, 10, 11]].abs().max() == 0  # ignored rows get no gradient


def test_linear_cross_entropy_without_gradient_and_under_bf16_autocast():
    h, w, t = rows(N=64)
    with torch.no_grad():
        torch.testing.assert_close(
            linear_cross_entropy(h, w, t, chunk_rows=16),
            F.cross_entropy(h @ w.t(), t, reduction="sum"),
            rtol=1e-6,
            atol=1e-5,
        )
    # bf16 autocast: the head matmul in bf16 as nn.Linear under autocast does it, then fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.cross_entropy(F.linear(h, w).float(), t, reduction="sum")
        got = linear_cross_entropy(h, w, t, chunk_rows=16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)
    want_g = torch.autograd.grad(want, (h, w))
    got_g = torch.autograd.grad(got, (h, w))
    assert got_g[0].dtype == torch.float32 and got_g[1].dtype == torch.float32
    for a, b in zip(got_g, want_g):  # bf16 matmuls: compare at bf16 resolution
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


@pytest.mark.parametrize("tied", [False, True])
def test_model_targets_give_the_ce_of_its_logits(tiny_model_config, tied):
    """forward(targets=...) vs the model's own logits + F.cross_entropy: same sum, same gradient for every
    parameter (truncated backprop, packed documents, tied or separate head)."""
    cfg = tiny_model_config(tie_embeddings=tied)
    model = LoopedLM(cfg)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (3, 20), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (3, 20), generator=g)
    targets[0, :5] = -100
    doc = (torch.arange(20) >= 8).long().expand(3, 20)
    kw = dict(bptt_window=2, doc_ids=doc, init="seeded")
    logits = ref(tokens, 4, **kw).logits
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    want.backward()
    out = model(tokens, 4, targets=targets, ce_chunk_rows=7, **kw)
    assert out.logits is None
    torch.testing.assert_close(out.ce_sum, want, rtol=1e-6, atol=1e-5)
    out.ce_sum.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_loss_kind_and_kernel_options():
    from looplm.train.config import TrainConfig

    assert loss_kind(TrainConfig(), torch.device("cpu")) == "full"  # CPU runs keep their recorded losses
    assert loss_kind(TrainConfig(), torch.device("cuda")) == "chunked"
    assert loss_kind(TrainConfig(cross_entropy="chunked"), torch.device("cpu")) == "chunked"
    assert parse_kernel_options(("fwd_BLOCK_M=128", "PRESCALE_QK=false", "bwd_BLOCK_N1 = 64")) == {
        "fwd_BLOCK_M": 128,
        "PRESCALE_QK": False,
        "bwd_BLOCK_N1": 64,
    }
    for bad in ("BLOCK_M", "BLOCK_M=big", "=4"):
        with pytest.raises(ValueError, match="flex kernel option"):
            parse_kernel_options((bad,))
    with pytest.raises(ValueError, match="unknown cross_entropy 'fused'"):  # not silently the full path
        loss_kind(TrainConfig(cross_entropy="fused"), torch.device("cpu"))


def packed_batch(vocab: int, B: int = 3, L: int = 24) -> Batch:
    """Rows of several documents: positions restart at each document, targets partly ignored."""
    g = torch.Generator().manual_seed(4)
    inputs, targets = torch.randint(0, vocab, (2, B, L), generator=g)
    targets[0, :3] = -100
    doc = torch.zeros(B, L, dtype=torch.long)
    for b, cuts in enumerate(([5, 14], [9], [])):
        for c in cuts:
            doc[b, c:] += 1
    positions = torch.stack([torch.cat([torch.arange(int(n)) for n in row.bincount()]) for row in doc])
    return Batch(inputs, targets, doc, positions, torch.arange(7, 7 + B))


@pytest.mark.parametrize("kind", ["full", "chunked"])
def test_cross_entropy_sum_passes_the_batchs_documents_and_positions(tiny_model_config, kind):
    """Both loss kinds give F.cross_entropy (sum, ignored targets left out) of the logits of a forward
    that sees the batch's document ids and restarted positions: the seeded initial state of evaluation
    depends on the positions (and attention on the documents), so a path that drops either differs."""
    cfg = tiny_model_config()
    model = LoopedLM(cfg)
    batch = packed_batch(cfg.vocab_size)
    kw = dict(init="seeded", example_ids=batch.example_ids, bptt_window=2)
    with torch.no_grad():
        logits = model(batch.inputs, 3, doc_ids=batch.doc_ids, positions=batch.positions, **kw).logits
        want = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), ignore_index=-100, reduction="sum")
        no_pos = model(batch.inputs, 3, doc_ids=batch.doc_ids, **kw).logits
        got = cross_entropy_sum(model, batch, 3, contextlib.nullcontext(), loss=kind, **kw)
    assert not torch.allclose(no_pos, logits, atol=1e-3)  # the positions matter here
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


class ForwardRecorder(torch.nn.Module):
    """Stands in for the model: records the keyword arguments of its forward and returns a fixed
    CE sum (chunked) or fixed logits (full)."""

    def __init__(self, vocab: int = 5):
        super().__init__()
        self.vocab, self.calls = vocab, []

    def forward(self, inputs, depth, **kw):
        self.calls.append((depth, kw))
        if kw.get("targets") is not None:
            return types.SimpleNamespace(logits=None, ce_sum=torch.tensor(1.5))
        return types.SimpleNamespace(logits=torch.zeros(*inputs.shape, self.vocab), ce_sum=None)


@pytest.mark.parametrize("kind", ["full", "chunked"])
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_microbatch_loss_hands_the_model_its_kind_window_state_and_kernel(kind, attention):
    """The trainer's loss reaches the model as asked: the chunked kind as targets (the model's chunked
    head + CE, never the [B, L, V] logits), the window, the initial state, the attention kernel, and the
    flex kernel options only with flex."""
    model, state0 = ForwardRecorder(), torch.ones(2, 4, 3)
    batch = Batch(*(torch.zeros(2, 4, dtype=torch.long) for _ in range(4)), torch.arange(2))
    opts = {"fwd_BLOCK_M": 64}
    loss = microbatch_loss(
        model, batch, 6, 2, state0, contextlib.nullcontext(), attention, loss=kind, flex_options=opts
    )
    ((depth, kw),) = model.calls
    assert depth == 6 and kw["bptt_window"] == 2 and kw["state0"] is state0 and kw["attention"] == attention
    assert kw.get("flex_options") == (opts if attention == "flex" else None)
    assert ("targets" in kw) == (kind == "chunked")
    assert float(loss) == pytest.approx(1.5 if kind == "chunked" else 8 * math.log(5))  # uniform logits


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return shared_cache(tmp_path_factory)


def test_trainer_chunked_loss_trains_like_the_full_one(tmp_path, cache):
    """Three steps with grad accumulation and validation: the chunked loss gives the losses, gradient
    norms and validation loss of full logits within fp32 rounding."""
    runs = {}
    for kind in ("full", "chunked"):
        trainer = Trainer(
            tiny_job(
                tmp_path,
                kind,
                cache=cache,
                train__steps=3,
                train__cross_entropy=kind,
                train__eval_every=3,
                train__eval_batches=2,
            )
        )
        assert trainer.loss_kind == kind
        trainer.fit()
        runs[kind] = read_metrics(trainer.out_dir)
    assert [sorted(r) for r in runs["chunked"]] == [sorted(r) for r in runs["full"]]
    assert any("val_loss" in r for r in runs["full"])
    for ref, got in zip(runs["full"], runs["chunked"]):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in ref:
                assert got[key] == pytest.approx(ref[key], rel=1e-5), (ref["step"], key)


def test_chunk_ce_traces_whole_for_cuda_compile():
    """On CUDA the chunk's elementwise work runs compiled (fullgraph): it must trace without a graph break,
    and its loss and logit gradient are softmax - onehot against F.cross_entropy's autograd."""
    from looplm.model.cross_entropy import chunk_ce

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 30, generator=g, requires_grad=True)
    t = torch.randint(0, 30, (9,), generator=g)
    t[4] = -100
    want = F.cross_entropy(logits, t, ignore_index=-100, reduction="sum")
    (want_g,) = torch.autograd.grad(want, logits)
    compiled = torch.compile(chunk_ce, dynamic=False, fullgraph=True, backend="aot_eager")
    for fn in (chunk_ce, compiled):
        loss, grad = fn(logits.detach(), t, -100, torch.float32)
        torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, want_g, rtol=1e-6, atol=1e-7)
    assert fn(logits.detach(), t, -100, None)[1] is None


@pytest.mark.parametrize("chunk", [100, 5])
def test_linear_cross_entropy_honours_its_ignore_index(chunk):
    """A non-default `ignore_index` (-1 here) is skipped on both paths: one chunk without a gradient
    (F.cross_entropy directly) and several chunks (the autograd function)."""
    h, w, t = rows()
    t[[3, 10, 11]] = -1
    want = F.cross_entropy((h @ w.t()).float(), t.clamp(min=0), reduction="none")[t != -1].sum()
    with torch.no_grad():
        got = linear_cross_entropy(h, w, t, ignore_index=-1, chunk_rows=chunk)
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-5)


def test_linear_cross_entropy_gradient_of_the_weight_alone():
    """Only the head weight requires a gradient (a frozen trunk, h detached): the chunked loss still
    gives the weight its gradient, that of the full logits."""
    h, w, t = rows()
    h = h.detach()
    want = F.cross_entropy((h @ w.t()).float(), t, ignore_index=-100, reduction="sum")
    (want_gw,) = torch.autograd.grad(want, w)
    got = linear_cross_entropy(h, w, t, chunk_rows=5)
    assert got.requires_grad
    (gw,) = torch.autograd.grad(got, w)
    torch.testing.assert_close(gw, want_gw, rtol=1e-5, atol=1e-6)
