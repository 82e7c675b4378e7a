"""Trainer: exact resume, token-weighted gradient accumulation, resume guards, metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _jobs import losses, read_metrics, shared_cache, step_records, tiny_job

from looplm import checkpoint as ckpt
from looplm.data import IGNORE_INDEX, Batch
from looplm.depth import DepthConfig, LearnedPriorConfig, build_sampler
from looplm.errors import UserError
from looplm.model import LoopedLM
from looplm.train.layout import BatchLayout
from looplm.train.flops import flops_per_token
from looplm.train.noise import initial_state_noise
from looplm.train.optim import param_groups
from looplm.train.trainer import StepResult, Trainer

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread


@pytest.fixture
def cache(tmp_path_factory):
    return shared_cache(tmp_path_factory)


def job(tmp_path, cache, name="run", **overrides):
    return tiny_job(tmp_path, name, cache=cache, **overrides)


def final_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return ckpt.load_tensors(trainer.latest_checkpoint(), "model.safetensors")


# -- resume reproduces an uninterrupted run -----------------------------------------------------
def test_resume_reproduces_uninterrupted_run(tmp_path, cache):
    full = Trainer(job(tmp_path, cache, "full", train__checkpoint_every=2))
    summary = full.fit()
    assert summary["step"] == 8
    reference = losses(full.out_dir)
    assert sorted(reference) == list(range(1, 9))

    first = Trainer(job(tmp_path, cache, "split", train__checkpoint_every=100, train__stop_after=4))
    assert first.fit()["step"] == 4
    assert first.latest_checkpoint().name == "step_0000004"  # stop_after always checkpoints
    assert sorted(losses(first.out_dir)) == [1, 2, 3, 4]

    second = Trainer(job(tmp_path, cache, "split", train__checkpoint_every=100, train__resume=True))
    assert second.step == 4
    assert second.sampler.counter == first.sampler.counter
    second.fit()

    resumed = losses(second.out_dir)
    assert resumed == reference  # exact: same data, depths, noise and optimizer state
    depths = {s: r["depths"] for s, r in step_records(second.out_dir).items()}
    assert depths == {s: r["depths"] for s, r in step_records(full.out_dir).items()}
    a, b = final_weights(full), final_weights(second)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # bookkeeping survives the restart
    assert second.tokens_seen == full.tokens_seen
    # keep_checkpoints=2: the full run wrote steps 2, 4, 6, 8 and kept the last two
    kept = sorted(p.name for p in full.ckpt_root.glob("step_*"))
    assert kept == ["step_0000006", "step_0000008"]
    assert (full.ckpt_root / "latest").read_text().strip() == "step_0000008"


def test_the_log_holds_each_step_once_after_a_restart_without_checkpoint_and_a_torn_line(tmp_path, cache):
    """A run stopped before its first checkpoint leaves metrics.jsonl behind; started again (here with
    --train.resume, as the interrupt message says, which finds nothing to resume) it must not append to
    it. A process killed while writing a record leaves a torn last line, which a resume drops instead of
    failing on it. Either way the log is an uninterrupted run's: steps 1..N once each."""
    first = Trainer(job(tmp_path, cache, "run", train__steps=4, train__checkpoint_every=100))
    first.step = 2
    first.logger.log({"loss": 9.0}, 1)
    first.logger.log({"loss": 9.0}, 2)  # what the stopped attempt logged, with no checkpoint written
    again = Trainer(job(tmp_path, cache, "run", train__steps=4, train__checkpoint_every=2, train__resume=True))
    again.fit()
    records = [json.loads(line) for line in (again.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert all(r["loss"] != 9.0 for r in records)
    with open(again.out_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 5.5')  # torn: the process died mid-write
    resumed = Trainer(job(tmp_path, cache, "run", train__steps=6, train__checkpoint_every=2, train__resume=True))
    assert resumed.step == 4
    resumed.fit()
    steps = [json.loads(line)["step"] for line in (resumed.out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s for s in steps if s > 4] and steps == sorted(steps)
    assert sorted(losses(resumed.out_dir)) == [1, 2, 3, 4, 5, 6]


def test_a_resume_over_data_that_no_longer_splits_as_it_did_is_refused(tmp_path):
    """The held-out draw depends on the number of documents: a file added to the source folder between the
    two halves of a run would put former held-out documents into training (and `looplm eval` would score
    documents the model trained on). The checkpoint records how its data split; the resume checks it."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"doc{i:02d}.txt").write_text(f"document {i}: " + "the quick brown fox jumps. " * (20 + i))
    kw = dict(data__source=str(corpus), data__cache_dir=tmp_path / "cache", train__checkpoint_every=100)
    first = Trainer(tiny_job(tmp_path, "run", train__stop_after=2, **kw))
    first.fit()
    Trainer(tiny_job(tmp_path, "run", train__resume=True, **kw))  # the same data: resumes
    (corpus / "doc99.txt").write_text("a document added since. " * 30)
    with pytest.raises(UserError, match="no longer splits as it did when this run started"):
        Trainer(tiny_job(tmp_path, "run", train__resume=True, **kw))


def test_resume_reproduces_the_learned_prior_trajectory(tmp_path, cache):
    """A learned prior whose logits move every step resumes onto the same trajectory (logits, Adam
    state, baselines, draw counter), so the depths and losses match an uninterrupted run."""
    prior = dict(
        depth__sampler="learned",
        depth__learned__warmup_updates=1,
        depth__learned__lr=0.3,
        depth__learned__entropy_weight=0.01,
    )
    full = Trainer(job(tmp_path, cache, "full", train__checkpoint_every=100, **prior))
    full.fit()
    Trainer(job(tmp_path, cache, "split", train__checkpoint_every=100, train__stop_after=3, **prior)).fit()
    second = Trainer(job(tmp_path, cache, "split", train__checkpoint_every=100, train__resume=True, **prior))
    assert second.step == 3 and second.sampler.n == 3
    second.fit()
    assert second.sampler.state_dict() == full.sampler.state_dict()
    assert losses(second.out_dir) == losses(full.out_dir)
    records = [r for r in read_metrics(full.out_dir) if "depth/pmf" in r]
    assert len(records) == 8 and records[-1]["depth/updates"] == 8
    assert records[0]["depth/pmf"] != records[-1]["depth/pmf"]
    assert (full.out_dir / "depth_prior.png").stat().st_size > 10_000
    # the frozen arm can start from this run's learned shape
    frozen = build_sampler(
        DepthConfig(sampler="learned", learned=LearnedPriorConfig(init_from=full.out_dir, frozen=True))
    )
    np.testing.assert_allclose(frozen.pmf(), full.sampler.pmf(), rtol=1e-12)
    pln = Trainer(job(tmp_path, cache, "pln", train__stop_after=1))
    pln.fit()
    with pytest.raises(ValueError, match="not trained with a learned depth prior"):
        build_sampler(DepthConfig(sampler="learned", learned=LearnedPriorConfig(init_from=pln.out_dir)))


def test_a_prior_from_another_run_keeps_its_cap_and_resumes_without_that_run(tmp_path, cache):
    import shutil

    prior = dict(depth__sampler="learned", depth__learned__warmup_updates=1, depth__learned__lr=0.3)
    source = Trainer(job(tmp_path, cache, "source", train__stop_after=1, **prior))
    source.fit()
    n = len(source.sampler.pmf())  # 64: the tiny job's cap
    # a cap other than the source prior's is refused before any work (it used to train with
    # depths past the cap, up to a failure at the first draw past the model's max depth)
    with pytest.raises(UserError, match=f"set --depth.cap {n}"):
        Trainer(job(tmp_path, cache, "short", depth__cap=8, depth__learned__init_from=source.out_dir, **prior))
    follow = dict(depth__learned__init_from=source.out_dir, train__checkpoint_every=100, **prior)
    first = Trainer(job(tmp_path, cache, "follow", train__stop_after=2, **follow))
    first.fit()
    shutil.rmtree(source.out_dir)  # the source run is gone: the resumed run has its own prior
    second = Trainer(job(tmp_path, cache, "follow", train__resume=True, **follow))
    assert second.step == 2 and second.sampler.state_dict() == first.sampler.state_dict()


def test_resume_restores_optimizer_state(tmp_path, cache):
    """The optimizer state goes through flatten -> safetensors/JSON -> unflatten unchanged."""
    a = Trainer(job(tmp_path, cache, train__stop_after=2))
    a.fit()
    b = Trainer(job(tmp_path, cache, train__resume=True))
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["state"].keys() == sb["state"].keys() and len(sa["state"]) == len(list(a.model.parameters()))
    for pid, st in sa["state"].items():
        assert st.keys() == sb["state"][pid].keys()
        for name, value in st.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb["state"][pid][name])), (pid, name)

    def hyper(groups):  # JSON normalises tuples (betas) to lists, as the checkpoint does
        return json.loads(json.dumps([{k: v for k, v in g.items() if k != "params"} for g in groups]))

    assert hyper(sa["param_groups"]) == hyper(sb["param_groups"])
    for (na, pa), (nb, pb) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na


# -- gradient accumulation is a token mean over the global batch --------------------------------
def keep_first_targets(t: Trainer, micro: int, keep: int) -> None:
    """Make microbatch `micro` of every step supervise only its first `keep` targets (the rest
    ignored), so the step's microbatches hold different numbers of targets by construction."""
    host_batch = t._host_batch

    def patched(data, step, i, n_micro, seed):
        forwards = host_batch(data, step, i, n_micro, seed)
        if i == micro:
            left = keep
            for _, b in forwards:
                flat = b.targets.flatten().clone()
                supervised = (flat != IGNORE_INDEX).nonzero().flatten()
                flat[supervised[left:]] = IGNORE_INDEX
                left = max(0, left - len(supervised))
                b.targets = flat.view_as(b.targets)
        return forwards

    t._host_batch = patched


@pytest.mark.parametrize("max_rows", [4, 3, 1])
def test_accumulated_gradient_is_token_mean_of_global_batch(tmp_path, cache, max_rows):
    """Also when each microbatch of 4 sequences runs as several forwards (max_rows 3: 2 + 2, 1: four),
    as a run resumed on fewer ranks does."""
    t = Trainer(
        job(
            tmp_path,
            cache,
            depth__sampler="fixed",
            depth__depth=3,
            depth__bptt_window=None,
            train__grad_clip=0.0,
            train__grad_accum=2,
        )
    )
    t.layout = BatchLayout(global_rows=4, grad_accum=2, max_rows=max_rows)
    assert len(t.layout.forwards()) == {4: 1, 3: 2, 1: 4}[max_rows]
    keep_first_targets(t, micro=1, keep=5)  # 5 targets against ~100: per-microbatch means would differ
    init = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    captured = {}

    def capture_then_step(*args, **kwargs):  # grads as accumulated, before the update
        captured.update({n: p.grad.detach().clone() for n, p in t.model.named_parameters() if p.grad is not None})
        return original_step(*args, **kwargs)

    original_step = t.optimizer.step
    t.optimizer.step = capture_then_step
    seen = []  # the initial states each forward was given, in order
    original_loss = t._loss

    def record_noise(batch, depth, bptt_window, state0):
        seen.append(state0.detach().clone())
        return original_loss(batch, depth, bptt_window, state0)

    t._loss = record_noise
    res = t.train_step()
    assert res.depths == [3, 3]
    assert len(captured) == len(list(t.model.parameters()))

    # The noise, checked without the trainer's seed function: one [4, L, d] block per microbatch (its
    # forwards' rows in order), N(0, 1/d), every row its own draw and the two microbatches independent
    # (a step that gave each microbatch the same noise, or each forward the same rows, fails here).
    seed, L, d = t.job.train.seed, t.job.data.seq_len, t.job.model.d_model
    per_micro = len(seen) // 2
    noise = [torch.cat(seen[i * per_micro : (i + 1) * per_micro]) for i in range(2)]
    assert all(z.shape == (4, L, d) for z in noise)
    flat = torch.cat(noise).flatten(1)  # [8 rows, L * d]
    assert abs(float(flat.std()) * math.sqrt(d) - 1) < 0.05 and abs(float(flat.mean())) * math.sqrt(d) < 0.05
    corr = torch.corrcoef(flat)
    assert (corr - torch.eye(8)).abs().max() < 0.15, corr  # no row repeats another (7 sd of 2048 values)
    # ... and it is the documented draw of each global row, however the rows are split into forwards
    for i, z in enumerate(noise):
        assert torch.equal(z, initial_state_noise(seed, 0, i, range(4), L, d, torch.device("cpu")))

    # Reference: one forward over the concatenated global batch, same inputs and noise.
    batches = [
        Batch(
            *(
                torch.cat(parts)
                for parts in zip(*(vars(b).values() for _, b in t._host_batch(t.train_data, 0, i, 2, seed)))
            )
        )
        for i in range(2)
    ]
    n = [b.n_targets for b in batches]
    assert n[1] == 5 and n[0] > 5 * n[1]
    assert res.n_targets == sum(n)
    ref = LoopedLM(t.job.model)
    ref.load_state_dict(init)

    def cat(name):
        return torch.cat([getattr(b, name) for b in batches])

    out = ref(
        cat("inputs"), 3, bptt_window=None, doc_ids=cat("doc_ids"), positions=cat("positions"), state0=torch.cat(noise)
    )
    loss = F.cross_entropy(out.logits.flatten(0, 1), cat("targets").flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    assert res.loss == pytest.approx(loss.item(), rel=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(captured[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)

    # The check is sensitive to the weighting: a mean of per-microbatch means differs, since the
    # microbatches hold different numbers of supervised targets (asserted above).
    ref.zero_grad()
    per_micro = []
    for b, z in zip(batches, noise):
        o = ref(b.inputs, 3, doc_ids=b.doc_ids, positions=b.positions, state0=z)
        per_micro.append(F.cross_entropy(o.logits.flatten(0, 1), b.targets.flatten(), ignore_index=IGNORE_INDEX))
    (sum(per_micro) / 2).backward()
    assert any(not torch.allclose(captured[k], p.grad, rtol=1e-4, atol=1e-7) for k, p in ref.named_parameters())


# -- the backprop window (design §3) ------------------------------------------------------------------
def captured_step_grads(t: Trainer) -> tuple[dict, dict, StepResult]:
    """(initial weights, gradients of one train_step as they reach the optimizer, the step's result)."""
    init = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    captured = {}
    original_step = t.optimizer.step

    def capture_then_step(*args, **kwargs):
        captured.update({n: p.grad.detach().clone() for n, p in t.model.named_parameters()})
        return original_step(*args, **kwargs)

    t.optimizer.step = capture_then_step
    return init, captured, t.train_step()


@pytest.mark.parametrize(("depth", "window", "other"), [(12, None, 10), (4, 1, None)], ids=["full", "truncated"])
def test_the_trainers_gradient_follows_its_backprop_window(tmp_path, cache, depth, window, other):
    """The gradient of one training step equals autograd through the last `window` recurrences, and
    differs from the one through `other` (so the check bites):
    - `full`: --depth.sampler fixed --depth.depth 12 without a window trains with full BPTT (the paper's
      fixed-depth baseline), not with the sampled priors' b = 10 (the first 2 recurrences contribute);
    - `truncated`: an explicit window of 1 reaches the model (it was once passed as None: full BPTT)."""
    overrides = {} if window is None else {"depth__bptt_window": window}
    t = Trainer(
        job(
            tmp_path,
            cache,
            depth__sampler="fixed",
            depth__depth=depth,
            train__grad_clip=0.0,
            train__grad_accum=1,
            **overrides,
        )
    )
    assert t.job.depth.bptt_window == window
    init, captured, _ = captured_step_grads(t)
    ((rows, batch),) = t._host_batch(t.train_data, 0, 0, 1, t.job.train.seed)
    state0 = t._noise(0, 0, rows, t.job.data.seq_len)

    def reference(b):
        ref = LoopedLM(t.job.model)
        ref.load_state_dict(init)
        out = ref(batch.inputs, depth, bptt_window=b, doc_ids=batch.doc_ids, positions=batch.positions, state0=state0)
        F.cross_entropy(out.logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX).backward()
        return torch.cat([p.grad.flatten() for _, p in sorted(ref.named_parameters())])

    got = torch.cat([g.flatten() for _, g in sorted(captured.items())])
    want, contrast = reference(window), reference(other)
    gap = (want - contrast).norm()
    assert gap > 0
    assert (got - want).norm() <= 0.01 * gap


@pytest.mark.parametrize(
    ("overrides", "line", "recorded"),
    [
        (
            {"depth__sampler": "fixed", "depth__depth": 16},
            "depth: fixed R = 16, backprop window b = R (full BPTT)",
            None,
        ),
        ({}, "depth: pln mean 5, backprop window b = 10 (truncated)", 10),
        (
            {"depth__sampler": "learned"},
            "depth: learned prior (init pln, target mean 5), backprop window b = 10 (truncated)",
            10,
        ),
        (
            {"depth__sampler": "fixed", "depth__depth": 16, "depth__bptt_window": 4},
            "depth: fixed R = 16, backprop window b = 4 (truncated)",
            4,
        ),
        (
            {"depth__sampler": "uniform", "depth__low": 2, "depth__high": 6},
            "depth: uniform 2..6, backprop window b = 10 (full BPTT: no depth above 6 is drawn)",
            10,
        ),
    ],
)
def test_start_line_and_config_record_the_resolved_window(tmp_path, cache, capsys, overrides, line, recorded):
    """The start-up line names the window the run trains with, and config.json records it resolved
    (None = full BPTT), so a checkpoint says what was trained."""
    t = Trainer(job(tmp_path, cache, train__steps=2, **overrides))
    t.fit()
    assert [x for x in capsys.readouterr().out.splitlines() if x.startswith("depth:")] == [line]
    config = ckpt.read_json(t.latest_checkpoint(), "config.json")
    assert config["depth"]["bptt_window"] == recorded


def test_expected_flops_follow_the_learned_pmf(tmp_path, cache):
    """With a learned prior the logged expected FLOPs/token is the expectation over that step's pmf
    (design §5), not over the initial one."""
    from looplm.train.flops import flops_per_token

    t = Trainer(
        job(
            tmp_path,
            cache,
            train__steps=4,
            depth__sampler="learned",
            depth__learned__warmup_updates=0,
            depth__learned__lr=0.5,
        )
    )
    t.fit()
    records = [r for r in read_metrics(t.out_dir) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    pmfs = [np.array(r["depth/pmf"]) for r in records]
    initial = build_sampler(t.job.depth).pmf()
    assert not np.allclose(pmfs[0], initial, rtol=0, atol=1e-6)  # the prior moved from the first update
    assert not np.allclose(pmfs[0], pmfs[-1], rtol=0, atol=1e-6)
    L, b = t.job.data.seq_len, 10  # the learned prior's window (paper App. B.3)
    per_depth = np.array([flops_per_token(t.job.model, L, r, b) for r in range(1, 65)])
    logged = [r["expected_flops_per_token"] for r in records]
    for got, p in zip(logged, pmfs):
        assert got == pytest.approx(float(p @ per_depth), rel=1e-12)
    assert logged[0] != pytest.approx(float(initial @ per_depth), rel=1e-9)


# -- the initial state of training is the model's own rule (design §2, §14) ------------------------
def test_a_model_that_starts_from_its_input_trains_from_its_input(tmp_path, cache):
    # state_init "input" (Ouro; what injection "none" needs): s0 = the prelude output, with its
    # gradient. The reference starts the recurrence from e through the forward's `initial` hook.
    t = Trainer(job(tmp_path, cache, model__injection="none", model__state_init="input"))
    rows, batch = t._host_batch(t.train_data, 0, 0, t.job.train.grad_accum, t.job.train.seed)[0]
    got = t._loss(batch, 2, None, t._noise(0, 0, rows, batch.inputs.shape[1]))
    got.backward()
    assert t.model.embed.weight.grad is not None and float(t.model.embed.weight.grad.abs().sum()) > 0
    out = t.model(batch.inputs, 2, doc_ids=batch.doc_ids, positions=batch.positions, initial=lambda e, *a, **k: e)
    want = F.cross_entropy(
        out.logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    assert torch.allclose(got, want, rtol=1e-6), (float(got), float(want))


def test_training_noise_has_the_models_std_and_truncation(tmp_path, cache):
    # Huginn's state: N(0, std^2) truncated at +-3 std. The std of a standard normal cut at +-3 is
    # sqrt(1 - 6 phi(3) / (1 - 2 Phi(-3))) = 0.98658.
    t = Trainer(job(tmp_path, cache, model__state_init="trunc-normal", model__state_std=0.5))
    z = t._noise(0, 0, range(4), 64)
    assert float(z.abs().max()) <= 1.5 + 1e-6
    assert abs(float(z.std()) - 0.5 * 0.98658) < 0.01, float(z.std())
    t = Trainer(job(tmp_path, cache, "plain", model__state_std=0.25))
    assert abs(float(t._noise(0, 0, range(4), 64).std()) - 0.25) < 0.01


def test_train_step_is_deterministic_in_seed(tmp_path, cache):
    """Same seed, same job: identical loss; another seed: another loss."""
    a = Trainer(job(tmp_path, cache, "a", train__steps=2)).train_step()
    b = Trainer(job(tmp_path, cache, "b", train__steps=2)).train_step()
    assert (a.loss, a.depths, a.n_targets) == (b.loss, b.depths, b.n_targets)
    c = Trainer(job(tmp_path, cache, "c", train__steps=2, depth__seed=7, train__seed=1)).train_step()
    assert c.loss != a.loss


# -- resume guards ------------------------------------------------------------------------------
@pytest.fixture
def stopped_run(tmp_path, cache):
    """A run stopped (with a checkpoint) at step 2 of 4."""
    Trainer(job(tmp_path, cache, train__steps=4, train__stop_after=2)).fit()
    return tmp_path


def test_fresh_run_refuses_to_overwrite_checkpoints(stopped_run, cache):
    before = sorted(p.name for p in (stopped_run / "run" / "checkpoints").iterdir())
    with pytest.raises(ValueError, match="already holds checkpoints.*--train.resume"):
        Trainer(job(stopped_run, cache, train__steps=4))
    assert sorted(p.name for p in (stopped_run / "run" / "checkpoints").iterdir()) == before


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("train__lr", 1e-3, "train.lr"),
        ("model__d_model", 64, "model.d_model"),
        ("depth__depth", 3.0, "depth.depth"),
        ("data__seq_len", 32, "data.seq_len"),
    ],
)
def test_resume_into_different_config_is_refused(stopped_run, cache, field, value, named):
    with pytest.raises(ckpt.CheckpointError, match="cannot resume into a different config") as err:
        Trainer(job(stopped_run, cache, train__steps=4, train__resume=True, **{field: value}))
    assert named in str(err.value)


def test_resume_allows_run_settings_to_change(stopped_run, cache):
    t = Trainer(
        job(
            stopped_run,
            cache,
            train__steps=4,
            train__resume=True,
            train__progress=False,
            train__log_every=2,
            train__checkpoint_every=1,
            train__eval_every=2,
            eval__depths=(3,),
            eval__task_examples=5,
        )
    )
    assert t.step == 2
    t.fit()
    records = step_records(stopped_run / "run")
    assert sorted(records) == [1, 2, 4]  # steps 1-2 logged every step before, then every 2nd
    assert t.latest_checkpoint().name == "step_0000004"


def test_resume_extends_the_run_and_recomputes_the_schedule(tmp_path, cache, capsys):
    """A 4-step run stopped at step 2 and resumed with 6 steps trains to step 6 on the 6-step
    schedule: decay_frac 0.5 gives D = 3 decayed updates, step indices 3-5, so the lr of step index 3
    is 0.1 + 0.45 (1 + cos(pi / 3)) = 0.775 of the peak and index 5, the last, trains at 0.1 (the
    4-step schedule would be at 0.1 by index 3)."""
    sched = dict(train__decay_frac=0.5, train__warmup_frac=0.0, train__lr=1e-3)
    Trainer(job(tmp_path, cache, train__steps=4, train__stop_after=2, **sched)).fit()
    capsys.readouterr()
    t = Trainer(job(tmp_path, cache, train__steps=6, train__resume=True, **sched))
    assert t.step == 2
    assert (
        "extending the run from 4 to 6 steps: the learning-rate schedule is recomputed for 6 steps"
        in capsys.readouterr().out
    )
    assert t.fit()["step"] == 6
    lrs = {s: r["lr"] for s, r in step_records(t.out_dir).items()}
    # record of step k: the lr of step index k - 1; no warmup (fraction 0), D = 3
    want = {
        3: 1e-3,
        4: 1e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi / 3))),
        5: 1e-3 * (0.1 + 0.45 * (1 + math.cos(2 * math.pi / 3))),
        6: 1e-3 * 0.1,
    }
    for s, lr in want.items():
        assert lrs[s] == pytest.approx(lr, rel=1e-12), s
    assert t.latest_checkpoint().name == "step_0000006"
    assert ckpt.read_json(t.latest_checkpoint(), "config.json")["train"]["steps"] == 6


def test_a_log_resumed_off_its_grid_equals_an_uninterrupted_runs(tmp_path, cache):
    """A session stopped at step 3 (off the logging and evaluation grid of 4) logs its last step; once
    resumed, the log holds the records an uninterrupted run writes, step by step, not those extra ones,
    and the first record after it averages the depths of its whole window (the checkpoint keeps them)."""
    grid = dict(train__log_every=4, train__eval_every=4, train__checkpoint_every=100)
    full = Trainer(job(tmp_path, cache, "full", **grid))
    full.fit()
    first = Trainer(job(tmp_path, cache, "split", train__stop_after=3, **grid))
    first.fit()
    assert 3 in step_records(first.out_dir)  # the stopped session shows where it stopped
    Trainer(job(tmp_path, cache, "split", train__resume=True, **grid)).fit()

    def kinds(out_dir):
        return [(r["step"], "val_loss" in r) for r in read_metrics(out_dir)]

    assert kinds(tmp_path / "split") == kinds(full.out_dir) == [(4, False), (4, True), (8, False), (8, True)]
    assert losses(tmp_path / "split") == losses(full.out_dir)
    # the first record after the resume covers the whole window, steps 1-4, not only step 4
    window = {s: r["mean_depth_window"] for s, r in step_records(tmp_path / "split").items()}
    assert window == {s: r["mean_depth_window"] for s, r in step_records(full.out_dir).items()}


def test_resume_with_fewer_steps_than_trained_is_refused(stopped_run, cache):
    from looplm.errors import UserError

    with pytest.raises(UserError, match=r"train.steps 1 is below the checkpoint's step 2"):
        Trainer(job(stopped_run, cache, train__steps=1, train__resume=True))


def test_resume_keeps_the_global_batch_when_micro_batch_changes(stopped_run, cache):
    """micro_batch bounds one forward on resume; the checkpoint's global batch (4 sequences per
    microbatch) stays, run as 4 forwards of 1: same data, depths and noise, so the losses follow
    the uninterrupted run up to float summation order."""
    full = Trainer(job(stopped_run, cache, "full", train__steps=4))
    full.fit()
    t = Trainer(job(stopped_run, cache, train__steps=4, train__resume=True, train__micro_batch=1))
    assert (t.layout.global_rows, len(t.layout.forwards())) == (4, 4)
    t.fit()
    got, ref = step_records(stopped_run / "run"), step_records(full.out_dir)
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
    for s in (3, 4):
        assert got[s]["depths"] == ref[s]["depths"] and got[s]["tokens"] == ref[s]["tokens"]
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-6), s  # measured 2e-8; wrong noise rows: 1e-5
    assert ckpt.read_json(t.latest_checkpoint(), "trainer_state.json")["global_micro_batch"] == 4


def test_resume_on_ranks_that_do_not_divide_the_global_batch_is_refused(stopped_run, cache):
    from looplm.train.distributed import DistEnv

    with pytest.raises(ValueError, match="microbatch of 4 sequences.*does not split evenly over 3 ranks"):
        Trainer(job(stopped_run, cache, train__steps=4, train__resume=True), env=DistEnv(world_size=3))


def test_resume_without_checkpoint_starts_fresh(tmp_path, cache):
    t = Trainer(job(tmp_path, cache, train__resume=True, train__steps=2))
    assert t.step == 0
    t.fit()
    assert sorted(losses(t.out_dir)) == [1, 2]


# -- validation and metrics ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"data__seq_len": 128}, "seq_len 128 exceeds"),
        ({"train__micro_batch": 0}, "micro_batch must be >= 1"),
        ({"model__injection": "foo"}, "unknown injection"),
        ({"depth__sampler": "fixed", "depth__depth": 0}, "fixed depth must be in 1..64"),
        ({"depth__sampler": "fixed", "depth__depth": 65}, "fixed depth must be in 1..64"),
        ({"depth__cap": 65, "depth__sampler": "fixed", "depth__depth": 5}, "exceeds the model's max_depth"),
        ({"depth__bptt_window": 0}, "bptt_window must be >= 1"),
        ({"eval__depths": (1, 65)}, r"eval.depths: depth must be in 1..64, got 65"),
        ({"train__flex_kernel_options": ("BLOCK_M",)}, "flex kernel option 'BLOCK_M' is not KEY=VALUE"),
        # each of these used to pass, then fail after the first step (% 0) or log a made-up val loss
        ({"train__checkpoint_every": 0}, "checkpoint_every must be >= 1, got 0"),
        ({"train__log_every": 0}, "log_every must be >= 1, got 0"),
        ({"train__eval_batches": 0}, "eval_batches must be >= 1, got 0"),
        # choices the command line restricts, in a job built in Python (they trained in fp32, uncompiled)
        ({"train__precision": "fp16"}, "unknown train.precision 'fp16'; choose one of auto, fp32, bf16"),
        ({"train__compile": "yes"}, "unknown train.compile 'yes'"),
        ({"model__n_kv_heads": 0}, "n_kv_heads must be >= 1, got 0"),
        ({"model__exit_gate": True}, "no exit objective"),  # untrained, and DDP failed on it at step 2
        ({"model__norm_eps": -1.0}, "norm_eps must be > 0, got -1"),
        ({"depth__sampler": "learned", "depth__learned__beta1": 1.5}, r"beta1 must be in \[0, 1\), got 1.5"),
    ],
)
def test_invalid_jobs_fail_before_building_data(tmp_path, overrides, match):
    fresh = tmp_path / "fresh-cache"
    with pytest.raises(ValueError, match=match):
        Trainer(job(tmp_path, fresh, **overrides))
    assert not fresh.exists()  # rejected up front, not after tokenizing the corpus
    assert not (tmp_path / "run").exists()


def test_metrics_records(tmp_path, cache):
    t = Trainer(job(tmp_path, cache, train__steps=4, train__log_every=2, train__eval_every=2, train__eval_batches=1))
    summary = t.fit()
    assert summary["tokens"] == 4 * 4 * 2 * 64
    records = step_records(t.out_dir)
    assert sorted(records) == [2, 4]
    for r in records.values():
        for key in (
            "loss",
            "lr",
            "grad_norm",
            "depths",
            "tokens_per_s",
            "model_tflops_per_s",
            "flops",
            "expected_flops_per_token",
            "elapsed_s",
            "tokens",
        ):
            assert key in r, key
        assert len(r["depths"]) == 2 and all(1 <= d <= 64 for d in r["depths"])
        assert r["tokens_per_s"] > 0 and r["model_tflops_per_s"] > 0 and math.isfinite(r["loss"])
    val = [r for r in read_metrics(t.out_dir) if "val_loss" in r]
    assert [r["step"] for r in val] == [2, 4]
    assert all(r["val_ppl"] == pytest.approx(math.exp(r["val_loss"])) for r in val)


def test_metrics_logger_feeds_tensorboard_and_wandb_the_finite_scalars_at_their_step(tmp_path, monkeypatch):
    """JSONL gets every record; TensorBoard and W&B (stand-ins here) get the finite numbers only, without
    the step itself, each at the record's step."""
    import sys
    import types

    from looplm.train.metrics import MetricsLogger

    tb_calls, wb_calls = [], []

    class SummaryWriter:
        def __init__(self, log_dir, purge_step=None):
            self.log_dir = log_dir
            tb_calls.append(("purge_step", purge_step))

        def add_scalar(self, *args):
            tb_calls.append(args)

        def close(self):
            tb_calls.append("closed")

    class Run:
        def log(self, scalars, **kw):
            wb_calls.append((scalars, kw))

        def finish(self):
            wb_calls.append("finished")

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: Run()))
    log = MetricsLogger(tmp_path, enabled=True, tensorboard=True, wandb=True)
    log.log({"loss": 2.5, "n": 3, "val_loss": float("nan"), "grad_norm": float("inf"), "depths": [1, 2]}, 7)
    log.close()
    assert tb_calls == [("purge_step", None), ("loss", 2.5, 7), ("n", 3, 7), "closed"]
    assert wb_calls == [({"loss": 2.5, "n": 3}, {"step": 7}), "finished"]
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert line.startswith('{"step": 7, "loss": 2.5') and json.loads(line)["depths"] == [1, 2]
    # a run that starts at a step hides an earlier attempt's TensorBoard events from the next step on, as
    # truncate_after drops its records: TensorBoard's purge_step (every event on a fresh start)
    for start, purge in ((6, 7), (None, 0)):
        tb_calls.clear()
        log = MetricsLogger(tmp_path, enabled=True, tensorboard=True, wandb=False)
        log.truncate_after(start)
        log.log({"loss": 1.0}, 8)
        assert tb_calls == [("purge_step", purge), ("loss", 1.0, 8)]


def test_the_metrics_log_keeps_the_whole_records_up_to_the_step_it_starts_from(tmp_path):
    """Records past the step a run resumes at are dropped (a step-0 record, e.g. RL's first evaluation, is
    kept), all of them on a fresh start, and a torn last line (a process killed mid-write) is dropped
    instead of failing the resume."""
    from looplm.train.metrics import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    records = '{"step": 0, "val_loss": 3.0}\n{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "lo'
    log = MetricsLogger(tmp_path, enabled=True, tensorboard=False, wandb=False)
    path.write_text(records)
    log.truncate_after(2)
    assert path.read_text() == '{"step": 0, "val_loss": 3.0}\n{"step": 1}\n{"step": 2}\n'
    path.write_text(records)
    log.truncate_after(0)
    assert path.read_text() == '{"step": 0, "val_loss": 3.0}\n'
    path.write_text(records)
    log.truncate_after(None)
    assert path.read_text() == ""


def test_a_disabled_metrics_logger_neither_writes_nor_truncates(tmp_path):
    """Ranks other than the main one log through a disabled logger: it leaves the main rank's file alone."""
    from looplm.train.metrics import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')
    log = MetricsLogger(tmp_path, enabled=False, tensorboard=False, wandb=False)
    log.log({"loss": 1.0}, 3)
    log.truncate_after(1)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


# -- the vocabulary size of a run ---------------------------------------------------------------
def test_vocab_size_is_the_tokenizers_unless_the_job_pads_it(tmp_path, cache):
    """`--model.vocab-size` is honoured (a padded embedding and head: more rows than the tokenizer has
    tokens) or refused (fewer), never silently replaced; 0, the presets' value, means the tokenizer's."""
    from looplm.errors import UserError

    default = Trainer(job(tmp_path, cache, "default"))
    assert tiny_job(tmp_path).model.vocab_size == 0
    assert default.model.cfg.vocab_size == default.tokenizer.vocab_size == 258
    padded = Trainer(job(tmp_path, cache, "padded", model__vocab_size=320, train__steps=1))
    assert padded.model.embed.weight.shape[0] == padded.model.head.weight.shape[0] == 320
    padded.fit()
    model, tokenizer, config = ckpt.load_model(padded.out_dir)  # a padded vocabulary loads
    assert (model.cfg.vocab_size, tokenizer.vocab_size, config["model"]["vocab_size"]) == (320, 258, 320)
    resumed = Trainer(job(tmp_path, cache, "padded", model__vocab_size=320, train__steps=1, train__resume=True))
    assert resumed.model.cfg.vocab_size == 320
    with pytest.raises(UserError, match="model.vocab_size 100 is smaller than the tokenizer's 258 tokens"):
        Trainer(job(tmp_path, cache, "short", model__vocab_size=100))


# -- torchrun and start-up tokenization --------------------------------------------------------------
@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus"
    path.mkdir()
    for i in range(40):
        (path / f"{i:02d}.txt").write_text(f"document {i} of a small corpus, long enough to pack. " * 8)
    return path


@pytest.mark.parametrize("tokenizer", ["bpe", "byte"])
def test_torchrun_on_raw_text_asks_for_looplm_tokenize(tmp_path, cache, corpus, tokenizer):
    """Rank 0 would train the tokenizer / tokenize the corpus while the other ranks wait in a timed
    collective: refused before any of it, naming the `looplm tokenize` command that does it once."""
    from looplm.train.distributed import DistEnv

    fresh = tmp_path / "fresh-cache"
    j = job(tmp_path, fresh, data__source=str(corpus), data__tokenizer=tokenizer, data__bpe_vocab_size=300)
    with pytest.raises(UserError) as err:
        Trainer(j, env=DistEnv(world_size=2))
    msg = str(err.value)
    assert "\n" not in msg and "2 ranks" in msg
    out = f"{corpus}-tokenized"
    vocab = " --bpe-vocab-size 300" if tokenizer == "bpe" else ""
    assert f"`looplm tokenize {corpus} {out} --tokenizer {tokenizer}{vocab} --holdout 0.05 --seed 0`" in msg, msg
    assert f"--data.source {out}" in msg
    assert not fresh.exists() and not (tmp_path / "run").exists()


def test_torchrun_reads_a_built_cache_and_the_cheap_sources(tmp_path, cache, corpus):
    """A token cache that one process already built, the task generator and the built-in corpus
    need no long pass on rank 0, so more ranks may start on them."""
    from looplm.data.tokenizer import ByteTokenizer
    from looplm.train.config import DataConfig
    from looplm.train.distributed import DistEnv
    from looplm.train.trainer import refuse_rank0_preparation

    Trainer(job(tmp_path, cache, "one", data__source=str(corpus)))  # builds the byte-level cache
    t = Trainer(job(tmp_path, cache, "two", data__source=str(corpus)), env=DistEnv(world_size=2))
    assert len(t.train_data) > 0
    for source in ("tasks", "shakespeare"):
        refuse_rank0_preparation(4, DataConfig(source=source, tokenizer="bpe"), seed=0, tokenizer=None)
    refuse_rank0_preparation(1, DataConfig(source=str(corpus), tokenizer="bpe"), seed=0, tokenizer=None)
    with pytest.raises(UserError, match="looplm tokenize"):
        refuse_rank0_preparation(
            2, DataConfig(source=str(corpus), cache_dir=tmp_path / "none"), seed=0, tokenizer=ByteTokenizer()
        )
    with pytest.raises(UserError, match="resume once on one process to build it, or point --data.cache-dir"):
        refuse_rank0_preparation(
            2,
            DataConfig(source=str(corpus), cache_dir=tmp_path / "none"),
            seed=0,
            tokenizer=ByteTokenizer(),
            resumed=True,
        )


# -- what a run says at start-up (issue 33 item 3) ---------------------------------------------------
def test_start_up_model_line(tmp_path, cache, capsys):
    """One line on the model and where it trains comes before the depth line and the first step."""
    t = Trainer(job(tmp_path, cache, train__steps=1, data__seq_len=32))
    t.fit()
    n = sum(p.numel() for p in t.model.parameters())
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        f"model: {n / 1e6:.2f} M params, vocab 258 (byte), context 64 (rows of 32), device cpu, fp32",
        "depth: pln mean 5, backprop window b = 10 (truncated)",
    ]


def test_start_up_line_of_a_padded_vocabulary(tmp_path, cache, capsys):
    Trainer(job(tmp_path, cache, train__steps=1, model__vocab_size=320)).fit()
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("model:")]
    assert ", vocab 320 (byte, 258 used), context 64, device cpu, fp32" in line


def test_paper_preset_on_a_cpu_warns_before_any_work(tmp_path, capsys):
    """`train S` on a CPU says what it is in for (steps, parameters, FLOPs, days) before the tokenizer
    or data are built: here the source does not exist, and the warning still came first."""
    from looplm.train.config import job_preset

    j = job_preset("S")
    j.data.source = str(tmp_path / "nowhere.txt")
    j.train.device, j.train.out_dir, j.train.progress = "cpu", tmp_path / "run", False
    with pytest.raises(Exception, match="nowhere"):
        Trainer(j)
    warnings = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning: preset S on a CPU")]
    assert len(warnings) == 1, warnings
    line = warnings[0]
    assert (
        "20,000 steps of a 303.58 M-parameter model (65,536 tokens a step, 4.4e+18 FLOPs) take about 51 days "
        "even at 1 TFLOP/s; use a GPU (--train.device cuda) or the tiny preset" in line
    ), line


def test_tiny_and_gpu_runs_get_no_cpu_warning():
    from looplm.config import model_preset
    from looplm.train.startup import cpu_warning

    assert cpu_warning(model_preset("tiny"), 870_000, 400, 4096, 1e7, "cpu") is None
    assert cpu_warning(model_preset("S"), 3e8, 20_000, 65536, 3e9, "cuda") is None
    assert cpu_warning(model_preset("M"), 8e8, 10, 65536, 3e9, "cpu").startswith("warning: preset M on a CPU: 10 steps")


@pytest.mark.parametrize(
    ("tokenizer", "bpe_vocab", "asked"),
    [
        ("byte", 4096, "byte, vocabulary 258"),
        ("bpe", 64256, "bpe, vocabulary 64,256"),  # the paper presets' tokenizer
    ],
)
def test_a_tokenized_folder_that_overrides_the_tokenizer_is_named(tmp_path, cache, capsys, tokenizer, bpe_vocab, asked):
    from looplm.data.pretokenized import pretokenized_info, tokenize_corpus

    src = tmp_path / "text"
    src.mkdir()
    for i in range(20):
        (src / f"{i}.txt").write_text(f"document {i} of a small corpus, long enough to pack. " * 8)
    folder = tokenize_corpus(str(src), tmp_path / "tok", tokenizer="bpe", bpe_vocab_size=300)
    vocab = pretokenized_info(folder)["vocab_size"]
    capsys.readouterr()
    Trainer(
        job(
            tmp_path,
            cache,
            train__steps=1,
            data__source=str(folder),
            data__tokenizer=tokenizer,
            data__bpe_vocab_size=bpe_vocab,
        )
    )
    err = capsys.readouterr().err
    assert (
        f"warning: data.source {folder} is a `looplm tokenize` folder: the run uses its tokenizer "
        f"(bpe, vocabulary {vocab}), not data.tokenizer's ({asked})"
    ) in err.splitlines(), err


def test_a_tokenized_folder_of_the_same_tokenizer_gives_no_warning(tmp_path, cache, capsys):
    from looplm.data.pretokenized import tokenize_corpus

    src = tmp_path / "text"
    src.mkdir()
    for i in range(20):
        (src / f"{i}.txt").write_text(f"document {i} of a small corpus, long enough to pack. " * 8)
    folder = tokenize_corpus(str(src), tmp_path / "tok", tokenizer="byte")
    capsys.readouterr()
    Trainer(job(tmp_path, cache, train__steps=1, data__source=str(folder)))
    assert "warning" not in capsys.readouterr().err


def test_resume_says_where_it_resumes(stopped_run, cache, capsys):
    capsys.readouterr()
    t = Trainer(job(stopped_run, cache, train__steps=4, train__resume=True))
    assert f"resuming {stopped_run / 'run'} from step 2 (of 4)" in capsys.readouterr().out.splitlines()
    assert t.fit()["start_step"] == 2


# -- resume from another working folder (issue 28 item 7) --------------------------------------------
def test_resume_from_another_folder_reads_the_runs_relative_source(tmp_path, cache, monkeypatch):
    """A run started on a relative source (and cache folder) resumes from another working folder, on
    the same relative text (which means what it meant where the run started) or on a path that names
    the same folder; the data is the run's, and the new checkpoint's data record still names it
    absolutely."""
    first, other = tmp_path / "first", tmp_path / "other"
    (first / "corpus").mkdir(parents=True)
    other.mkdir()
    for i in range(30):
        (first / "corpus" / f"{i:02d}.txt").write_text(f"document {i} of a small corpus, long enough to pack. " * 8)
    monkeypatch.chdir(first)
    run = first / "run"
    kw = dict(data__source="corpus", data__cache_dir=Path(".cache"), train__out_dir=Path("run"))
    started = Trainer(job(tmp_path, cache, train__steps=2, **kw))
    n_rows = len(started.train_data)
    started.fit()
    monkeypatch.chdir(other)
    t = Trainer(job(tmp_path, cache, **{**kw, "train__out_dir": run}, train__steps=4, train__resume=True))
    assert t.step == 2 and len(t.train_data) == n_rows
    assert t.fit()["step"] == 4
    assert not (other / ".cache").exists()  # the run's token cache was read, not rebuilt here
    record = ckpt.read_json(t.latest_checkpoint(), "data.json")
    assert record["source"] == str(first / "corpus") and record["cache_dir"] == str(first / ".cache")
    assert ckpt.read_json(t.latest_checkpoint(), "config.json")["data"]["source"] == "corpus"
    t = Trainer(
        job(
            tmp_path,
            cache,
            **{**kw, "train__out_dir": run, "data__source": "../first/corpus"},
            train__steps=6,
            train__resume=True,
        )
    )
    assert t.fit()["step"] == 6
    (other / "corpus").mkdir()  # another folder is not the run's, however it is named
    with pytest.raises(ckpt.CheckpointError, match="data.source"):
        Trainer(
            job(
                tmp_path,
                cache,
                **{**kw, "train__out_dir": run, "data__source": str(other / "corpus")},
                train__steps=8,
                train__resume=True,
            )
        )


# -- what the trainer reports about its own steps -------------------------------------------------------
def test_progress_lines_carry_their_own_steps_loss(tmp_path, cache, capsys, monkeypatch):
    """Off a terminal the trainer updated the bar before setting its values, so each printed line
    carried the previous step's loss (and the first none)."""
    import re

    from looplm.train import progress

    real = progress.LineProgress.__init__
    monkeypatch.setattr(  # a line every step
        progress.LineProgress, "__init__", lambda self, *a, **kw: real(self, *a, **{**kw, "every_s": 0.0})
    )
    trainer = Trainer(job(tmp_path, cache, train__steps=3, train__log_every=1, train__progress=True))
    trainer.fit()
    printed = {
        int(m[1]): float(m[2])
        for m in re.finditer(r"train: step (\d+)/3 \(\d+%\), loss=([\d.]+)", capsys.readouterr().err)
    }
    assert printed == {s: round(v, 3) for s, v in losses(trainer.out_dir).items()}


def test_the_token_rate_leaves_out_evaluation_and_checkpoints(tmp_path, cache, monkeypatch):
    """Evaluation and checkpoint time fell into the next window's tokens/s (a 2 s evaluation: 127
    against 26,895 tokens/s measured from the steps). The rate of a window is now its tokens over its
    steps' time only, so an evaluation made 50 s long changes no rate by much."""
    import time as time_mod

    clock = {"now": 0.0}
    monkeypatch.setattr(time_mod, "perf_counter", lambda: clock["now"])
    real_step, real_eval = Trainer.train_step, Trainer.evaluate

    def step(self):  # every step takes 1 s of the fake clock
        clock["now"] += 1.0
        return real_step(self)

    def evaluate(self):
        clock["now"] += 50.0
        return real_eval(self)

    monkeypatch.setattr(Trainer, "train_step", step)
    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    trainer = Trainer(job(tmp_path, cache, train__steps=4, train__log_every=1, train__eval_every=2))
    trainer.fit()
    per_step = trainer.layout.global_batch * trainer.job.data.seq_len
    rates = [r["tokens_per_s"] for r in step_records(trainer.out_dir).values()]
    assert rates == [pytest.approx(per_step)] * 4


@pytest.mark.parametrize(("field", "value"), [("stop_after", -3), ("stop_after", 0), ("keep_checkpoints", 0)])
def test_run_lengths_and_kept_checkpoints_below_one_are_refused(tmp_path, cache, field, value):
    # stop_after -3 trained nothing and returned "checkpoint": "None"; keep_checkpoints -1 kept one
    with pytest.raises(UserError, match=f"train.{field} must be >= 1"):
        Trainer(job(tmp_path, cache, **{f"train__{field}": value}))


# -- found by mutating the trainer: what the other tests let through ---------------------------------
def ce_sum(model, batch, depth, **kw):
    out = model(batch.inputs, depth, doc_ids=batch.doc_ids, positions=batch.positions, **kw)
    return F.cross_entropy(
        out.logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


# trainer.py `self._noise(self.step, i, ...)` -> `self._noise(0, i, ...)` (every step reuses step 0's noise)
def test_every_step_draws_its_own_initial_state_noise(tmp_path, cache):
    t = Trainer(job(tmp_path, cache, depth__sampler="fixed", depth__depth=1, train__steps=4))
    seen = []
    original = t._loss

    def record(batch, depth, bptt_window, state0):
        seen.append((t.step, state0.detach().clone()))
        return original(batch, depth, bptt_window, state0)

    t._loss = record
    t.train_step()
    t.train_step()
    L, d, seed = t.job.data.seq_len, t.job.model.d_model, t.job.train.seed
    by_step = {s: [z for k, z in seen if k == s] for s in (0, 1)}
    assert [len(v) for v in by_step.values()] == [2, 2]  # grad_accum 2, one forward per microbatch
    for s, zs in by_step.items():
        for i, z in enumerate(zs):
            assert torch.equal(z, initial_state_noise(seed, s, i, range(4), L, d, torch.device("cpu"))), (s, i)
    # independent of the seed function: the 4 microbatches of the two steps are mutually uncorrelated
    flat = torch.cat([torch.cat(by_step[0]), torch.cat(by_step[1])]).flatten(1)  # 16 rows of L * d
    corr = torch.corrcoef(flat)
    assert (corr - torch.eye(len(flat))).abs().max() < 0.15


# trainer.py `zip(depths, stats.tolist())` -> `zip(depths[::-1], stats.tolist())` (feedback paired
# with another microbatch's depth)
def test_prior_feedback_pairs_each_microbatch_with_its_own_depth(tmp_path, cache):
    t = Trainer(
        job(
            tmp_path,
            cache,
            depth__sampler="learned",
            depth__depth=2.5,
            depth__learned__init="restricted",
            depth__low=1,
            depth__high=4,
            train__grad_accum=4,
        )
    )
    init = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    observed = []
    original = t.sampler.observe
    t.sampler.observe = lambda depth, loss_sum, n: (observed.append((depth, loss_sum, n)), original(depth, loss_sum, n))
    res = t.train_step()
    assert len(set(res.depths)) > 1, res.depths  # the check needs microbatches of different depths
    ref = LoopedLM(t.job.model)
    ref.load_state_dict(init)
    L, d, seed = t.job.data.seq_len, t.job.model.d_model, t.job.train.seed
    want = []
    with torch.no_grad():
        for i, depth in enumerate(res.depths):
            ((rows, batch),) = t._host_batch(t.train_data, 0, i, 4, seed)
            z = initial_state_noise(seed, 0, i, rows, L, d, torch.device("cpu"))
            want.append((depth, float(ce_sum(ref, batch, depth, state0=z)), batch.n_targets))
    assert [(r, n) for r, _, n in observed] == [(r, n) for r, _, n in want]
    for (_, got, _), (_, ref_sum, _) in zip(observed, want):
        assert got == pytest.approx(ref_sum, rel=1e-5)


# checkpointing.py drops `torch.set_rng_state(torch.tensor(state["torch_rng"], ...))` in `load`
def test_resume_restores_the_global_torch_rng(tmp_path, cache):
    a = Trainer(job(tmp_path, cache, train__steps=4))
    a.train_step()
    torch.manual_seed(1234)
    want = torch.get_rng_state().clone()
    a.save()
    torch.manual_seed(99)
    Trainer(job(tmp_path, cache, train__steps=4, train__resume=True))
    assert torch.equal(torch.get_rng_state(), want)


# trainer.py `mean_flops_per_token(..., res.depths, self.job.depth.bptt_window)` -> `(..., res.depths, None)`
def test_flops_seen_count_only_the_backprop_window(tmp_path, cache):
    t = Trainer(job(tmp_path, cache, depth__sampler="fixed", depth__depth=3, depth__bptt_window=1, train__steps=2))
    t.fit()
    L = t.job.data.seq_len
    tokens_per_step = 4 * 2 * L  # micro_batch x grad_accum x seq_len
    m = t.job.model
    # design §5 by hand: 6 (static + 1 recurrence) + 2 (2 no-grad recurrences); the full-BPTT count is larger
    per_token = flops_per_token(m, L, 3, 1)
    assert per_token < flops_per_token(m, L, 3, None)
    assert t.flops_seen == pytest.approx(2 * tokens_per_step * per_token, rel=1e-12)
    last = [r for r in read_metrics(t.out_dir) if "flops" in r][-1]
    assert last["flops"] == pytest.approx(2 * tokens_per_step * per_token, rel=1e-12)


# trainer.py `max(1, round(self.sampler.mean()))` -> `max(1, int(self.sampler.mean()))`
def test_evaluate_defaults_to_the_rounded_prior_mean(tmp_path, cache):
    t = Trainer(job(tmp_path, cache, depth__sampler="uniform", depth__low=2, depth__high=5, train__eval_batches=1))
    assert t.sampler.mean() == pytest.approx(3.5)  # rounds to 4 (int() would give 3)
    got = t.evaluate()
    assert got == t.evaluate(depth=4)
    assert got != t.evaluate(depth=3)


# trainer.py evaluate drops `init="seeded",` (the model's default gaussian init from the global RNG);
# loss.py full path drops `positions=batch.positions` (the seeded state is keyed by (example, position))
def test_evaluate_is_the_seeded_token_mean_of_the_validation_batches(tmp_path, cache):
    t = Trainer(job(tmp_path, cache, depth__sampler="fixed", depth__depth=2, train__eval_batches=2))
    ref = LoopedLM(t.job.model)
    ref.load_state_dict(t.model.state_dict())
    total, n = 0.0, 0
    restarts = False
    with torch.no_grad():
        for i in range(2):
            for _, batch in t._host_batch(t.val_data, 0, i, 2, seed=1):
                restarts |= bool((batch.positions[:, 1:] == 0).any())
                total += float(ce_sum(ref, batch, 2, init="seeded", example_ids=batch.example_ids))
                n += batch.n_targets
    assert restarts  # rows pack several documents, so their positions differ from 0..L-1
    torch.manual_seed(5)
    first = t.evaluate()
    torch.manual_seed(6)
    assert t.evaluate() == first  # no draw from the global RNG
    assert first == pytest.approx(total / n, rel=1e-6)


# optim.py `p.ndim >= 2 and not name.startswith("injection.")` -> `p.ndim >= 2`
@pytest.mark.parametrize("injection", ["parcae-decay", "huginn-linear"])
def test_weight_decay_spares_the_injection_matrices(tiny_model_config, injection):
    model = LoopedLM(tiny_model_config(injection=injection))
    groups = param_groups(model, 0.1)
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    injection_matrices = {n for n, p in model.named_parameters() if n.startswith("injection.") and p.ndim >= 2}
    assert injection_matrices  # W (parcae) or A_state/A_input (huginn): the check is not vacuous
    # design §12: matrices of the blocks, embedding and head; no norm gains, no injection parameters
    assert names == {n for n, p in model.named_parameters() if p.ndim >= 2} - injection_matrices
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


# -- run lengths, resume state, records, refusals ---------------------------------------------------------
# trainer.py fit `end = min(t.steps, t.stop_after)` -> `end = t.stop_after` (trained past the schedule)
def test_stop_after_past_the_schedule_ends_at_its_last_step(tmp_path, cache):
    t = Trainer(job(tmp_path, cache, train__steps=3, train__stop_after=10))
    summary = t.fit()
    assert summary["step"] == 3 and sorted(losses(t.out_dir)) == [1, 2, 3]
    assert t.latest_checkpoint().name == "step_0000003"


# trainer.py _warn_cpu `end - done` -> `end` (a resumed run was warned about the whole schedule)
def test_the_cpu_warning_of_a_resumed_run_counts_the_steps_left(capsys):
    from types import SimpleNamespace

    from looplm.train.config import job_preset
    from looplm.train.distributed import DistEnv

    j = job_preset("S").resolved()
    j.data.source = "corpus.txt"
    resumed = SimpleNamespace(  # what `_warn_cpu` reads of a trainer resuming at step 19,000 of 20,000
        job=j,
        data=j.data,
        env=DistEnv(),
        _saved={"step": 19_000},
        sampler=build_sampler(j.depth),
        layout=BatchLayout(global_rows=1, grad_accum=8),
    )
    Trainer._warn_cpu(resumed, SimpleNamespace(vocab_size=64256))  # the tokenizer the checkpoint brings
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning: preset S")]
    # a fresh run's warning says 20,000 steps and 4.4e+18 FLOPs (test above): 1/20 of that is left
    assert "preset S on a CPU: 1,000 steps of a 303.58 M-parameter model (65,536 tokens a step, 2.2e+17 FLOPs)" in line


# trainer.py `self.step % t.log_every == 0 or self.step == end` (and eval's) lost `or self.step == end`
def test_the_last_step_is_logged_and_evaluated_off_the_cadence(tmp_path, cache):
    t = Trainer(job(tmp_path, cache, train__steps=3, train__log_every=2, train__eval_every=2, train__eval_batches=1))
    t.fit()
    assert sorted(step_records(t.out_dir)) == [2, 3]
    assert [r["step"] for r in read_metrics(t.out_dir) if "val_loss" in r] == [2, 3]


# trainer.py the log window's depths were not reset after a record
def test_mean_depth_window_averages_the_depths_since_the_last_record(tmp_path, cache):
    t = Trainer(job(tmp_path, cache, train__steps=6, train__log_every=3))
    drawn = []
    step = t.train_step

    def recording():
        res = step()
        drawn.append(res.depths)
        return res

    t.train_step = recording
    t.fit()
    records = step_records(t.out_dir)
    assert sorted(records) == [3, 6]
    for s in (3, 6):
        window = [d for ds in drawn[s - 3 : s] for d in ds]
        assert records[s]["mean_depth_window"] == pytest.approx(sum(window) / len(window), rel=1e-12), s
    first, second = (sum(sum(ds) for ds in drawn[a : a + 3]) for a in (0, 3))
    assert first != second  # the windows' means differ, so a window that kept step 1-3's depths shows


# trainer.py `_load` dropped the restore of flops_seen (or elapsed_s)
def test_resume_restores_the_flops_and_time_counters(tmp_path, cache):
    first = Trainer(job(tmp_path, cache, train__steps=4, train__stop_after=2))
    first.fit()
    assert first.flops_seen > 0 and first.elapsed > 0
    second = Trainer(job(tmp_path, cache, train__steps=4, train__resume=True))
    assert (second.flops_seen, second.elapsed, second.tokens_seen) == (
        first.flops_seen,
        first.elapsed,
        first.tokens_seen,
    )
    summary = second.fit()
    last = step_records(second.out_dir)[4]
    assert last["flops"] == pytest.approx(second.flops_seen) and second.flops_seen > first.flops_seen
    assert summary["elapsed_s"] > first.elapsed
    assert summary["tokens"] == 4 * 4 * 2 * 64 and summary["session_tokens"] == 2 * 4 * 2 * 64


# RESUMABLE_CHANGES lost "train.keep_checkpoints" / "data.cache_dir"; Checkpointer.save passed
# keep=2 instead of train.keep_checkpoints
def test_resume_may_change_kept_checkpoints_cache_folder_and_eval_batches(stopped_run, cache):
    t = Trainer(
        job(
            stopped_run,
            cache,
            train__steps=4,
            train__resume=True,
            train__keep_checkpoints=3,
            train__checkpoint_every=1,
            train__eval_batches=2,
            train__prefetch=False,
            data__cache_dir=cache / "elsewhere" / "..",  # the same folder, spelt otherwise
        )
    )
    assert t.step == 2
    t.fit()
    kept = sorted(p.name for p in t.ckpt_root.glob("step_*"))
    assert kept == ["step_0000002", "step_0000003", "step_0000004"]  # keep 3, not the default 2


# `_check_steps` refused steps == done; fit's summary named no checkpoint when nothing was left to train
def test_resuming_a_finished_run_trains_nothing_and_names_its_checkpoint(stopped_run, cache):
    t = Trainer(job(stopped_run, cache, train__steps=2, train__resume=True))
    assert t.step == 2
    summary = t.fit()
    assert summary["step"] == summary["start_step"] == 2 and summary["session_tokens"] == 0
    assert summary["checkpoint"] == str(stopped_run / "run" / "checkpoints" / "step_0000002")


# `_plan_layout` read an old checkpoint's global batch off this run's micro_batch
def test_a_checkpoint_without_its_global_batch_keeps_the_runs_micro_batch(stopped_run, cache):
    path = stopped_run / "run" / "checkpoints" / "step_0000002"
    state = ckpt.read_json(path, "trainer_state.json")
    del state["global_micro_batch"]  # written before the field existed: micro_batch x world_size then
    ckpt.write_json(path, "trainer_state.json", state)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    manifest["sha256"]["trainer_state.json"] = ckpt.file_sha256(path / "trainer_state.json")
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    t = Trainer(job(stopped_run, cache, train__steps=4, train__resume=True, train__micro_batch=2))
    assert (t.layout.global_rows, [len(f) for f in t.layout.forwards()]) == (4, [2, 2])


# depth_summary `b >= deepest` -> `b > deepest`
def test_a_window_equal_to_the_deepest_draw_is_full_bptt(tmp_path, cache):
    t = Trainer(job(tmp_path, cache, depth__sampler="fixed", depth__depth=4, depth__bptt_window=4))
    assert t.depth_summary() == "depth: fixed R = 4, backprop window b = 4 (full BPTT: no depth above 4 is drawn)"


# the optimisation settings' bounds (<= 1 for the sum, > 0, [0, 1), >= 0)
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"train__lr": 0.0}, "train.lr must be > 0, got 0"),
        # and a negative clip, warm-up or decay fraction, a zero accumulation, a negative eval period
        ({"train__grad_clip": -1.0}, r"train.grad_clip must be >= 0 \(0 disables\), got -1"),
        ({"train__warmup_frac": -0.1}, r"train.warmup_frac must be in \[0, 1\], got -0.1"),
        ({"train__decay_frac": -0.1}, r"train.decay_frac must be in \[0, 1\], got -0.1"),
        ({"train__grad_accum": 0}, "train.grad_accum must be >= 1, got 0"),
        ({"train__eval_every": -1}, r"train.eval_every must be >= 0 \(0 disables\), got -1"),
        ({"train__beta2": 1.0}, r"train.beta2 must be in \[0, 1\), got 1"),
        ({"train__beta1": 1.0}, r"train.beta1 must be in \[0, 1\), got 1"),
        ({"train__weight_decay": -0.1}, "train.weight_decay must be >= 0, got -0.1"),
        ({"train__warmup_frac": 0.6, "train__decay_frac": 0.5}, r"warmup_frac \+ decay_frac must be <= 1, got 1.1"),
    ],
)
def test_optimisation_settings_out_of_range_are_refused(tmp_path, overrides, match):
    with pytest.raises(UserError, match=match):
        Trainer(job(tmp_path, tmp_path / "fresh-cache", **overrides))
    assert not (tmp_path / "fresh-cache").exists()


def test_optimisation_settings_on_their_bounds_are_accepted(tmp_path, cache):
    t = Trainer(
        job(
            tmp_path,
            cache,
            train__warmup_frac=0.5,
            train__decay_frac=0.5,
            train__weight_decay=0.0,
            train__grad_clip=0.0,
            train__beta1=0.0,
            train__beta2=0.0,
        )
    )
    assert all(g["weight_decay"] == 0.0 for g in t.optimizer.param_groups)


# the `looplm tokenize` command named for a .jsonl (--text-field) and an hf:<name>:<split> source
@pytest.mark.parametrize(
    ("source", "out"),
    [("data/x.jsonl", "data/x-tokenized"), ("hf:org/name:train", "org-name-train-tokenized")],
)
def test_torchrun_on_records_names_their_text_field_and_output(source, out):
    from looplm.train.config import DataConfig
    from looplm.train.trainer import refuse_rank0_preparation

    d = DataConfig(source=source, tokenizer="bpe", text_field="body")
    with pytest.raises(UserError) as err:
        refuse_rank0_preparation(2, d, seed=3, tokenizer=None)
    cmd = f"looplm tokenize {source} {out} --tokenizer bpe --bpe-vocab-size 4096 --holdout 0.05 --text-field body --seed 3"
    assert f"`{cmd}`" in str(err.value) and str(err.value).endswith(f"--data.source {out}")


# the optimizer took (beta2, beta1)
def test_the_optimizer_is_adamw_with_the_jobs_settings(tmp_path, cache):
    t = Trainer(job(tmp_path, cache, train__beta1=0.8, train__beta2=0.95, train__lr=2e-3))
    assert isinstance(t.optimizer, torch.optim.AdamW)
    for g in t.optimizer.param_groups:
        assert (tuple(g["betas"]), g["eps"], g["lr"]) == ((0.8, 0.95), 1e-8, 2e-3)  # design §6: eps 1e-8


# the non-finite loss check dropped (the run went on, logging and checkpointing NaN weights)
def test_a_non_finite_loss_stops_the_run(tmp_path, cache):
    t = Trainer(job(tmp_path, cache, train__steps=3, train__checkpoint_every=1))
    step = t.train_step

    def diverging():
        res = step()
        if t.step == 2:
            res.loss = float("nan")
        return res

    t.train_step = diverging
    with pytest.raises(FloatingPointError, match="non-finite loss at step 2; lower --train.lr"):
        t.fit()
    assert t.latest_checkpoint().name == "step_0000001"


# config.py vocab_size_for `job_vocab < tokenizer_vocab` -> `<=` (a vocabulary equal to the tokenizer's refused)
def test_a_vocabulary_equal_to_the_tokenizers_is_accepted():
    from looplm.train.config import vocab_size_for

    assert vocab_size_for(258, 258) == 258 and vocab_size_for(0, 258) == 258 and vocab_size_for(300, 258) == 300
    with pytest.raises(UserError, match="257 is smaller than the tokenizer's 258"):
        vocab_size_for(257, 258)


# startup.py `steps <= 0` -> `steps < 0` (a warning for nothing left to train); `days >= 2` -> `days >= 1`
def test_the_cpu_warning_has_nothing_to_say_of_no_steps_and_says_hours_below_two_days():
    from looplm.config import model_preset
    from looplm.train.startup import cpu_warning

    s = model_preset("S")
    assert cpu_warning(s, 3e8, 0, 1000, 1.296e9, "cpu") is None
    # 1.296e17 FLOPs at 1e12 FLOP/s: 129,600 s = 1.5 days, said in hours
    line = cpu_warning(s, 3e8, 100_000, 1000, 1.296e9, "cpu")
    assert "take about 36 hours even at 1 TFLOP/s" in line, line
    assert "take about 3 days" in cpu_warning(s, 3e8, 200_000, 1000, 1.296e9, "cpu")  # 3.0 days


# -- schedule groups, clipping, records, resume ------------------------------------------------------------
# trainer.py `for g in self.optimizer.param_groups` -> `param_groups[:1]` (the no-decay group kept the peak lr)
def test_every_param_group_follows_the_schedule(tmp_path, cache):
    t = Trainer(job(tmp_path, cache, train__steps=8, train__warmup_frac=0.5, train__lr=1e-3))
    assert len(t.optimizer.param_groups) == 2  # decayed matrices and the rest
    for k in range(3):
        t.train_step()
        want = 1e-3 * (1e-4 + (1 - 1e-4) * k / 4)  # linear warmup over W = 8 * 0.5 = 4 steps, at step index k
        assert [g["lr"] for g in t.optimizer.param_groups] == [pytest.approx(want, rel=1e-12)] * 2, k


# trainer.py `clip_grad_norm_(..., t.grad_clip if t.grad_clip > 0 else inf)` -> `inf` (never clipped);
# StepResult reported the clipped norm instead of the norm before clipping
def test_gradients_are_clipped_to_grad_clip_and_the_norm_before_clipping_is_reported(tmp_path, cache):
    clip = 0.05
    t = Trainer(
        job(
            tmp_path,
            cache,
            depth__sampler="fixed",
            depth__depth=2,
            depth__bptt_window=None,
            train__grad_accum=1,
            train__grad_clip=clip,
        )
    )
    init, captured, res = captured_step_grads(t)
    # reference: the unclipped token-mean gradient of the same batch and noise, by plain autograd
    seed, L, d = t.job.train.seed, t.job.data.seq_len, t.job.model.d_model
    ((rows, batch),) = t._host_batch(t.train_data, 0, 0, 1, seed)
    ref = LoopedLM(t.job.model)
    ref.load_state_dict(init)
    z = initial_state_noise(seed, 0, 0, rows, L, d, torch.device("cpu"))
    out = ref(batch.inputs, 2, doc_ids=batch.doc_ids, positions=batch.positions, state0=z)
    F.cross_entropy(out.logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX).backward()
    norm = float(torch.cat([p.grad.flatten() for p in ref.parameters()]).norm())
    assert norm > 4 * clip  # clipping engages
    assert res.grad_norm == pytest.approx(norm, rel=1e-4)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(captured[name], p.grad * (clip / norm), rtol=1e-3, atol=1e-8, msg=name)


# trainer.py `model_tflops_per_s` took the last step's depths (or full BPTT) instead of the log window's
def test_model_tflops_rate_counts_the_windows_depths_and_backprop_window(tmp_path, cache, monkeypatch):
    import time as time_mod

    clock = {"now": 0.0}
    monkeypatch.setattr(time_mod, "perf_counter", lambda: clock["now"])
    real_step = Trainer.train_step
    drawn = []

    def step(self):  # every step takes 1 s of the fake clock
        clock["now"] += 1.0
        res = real_step(self)
        drawn.append(res.depths)
        return res

    monkeypatch.setattr(Trainer, "train_step", step)
    t = Trainer(job(tmp_path, cache, train__steps=4, train__log_every=2, depth__depth=3.0, depth__bptt_window=1))
    t.fit()
    records = step_records(t.out_dir)
    assert sorted(records) == [2, 4]
    m, L = t.job.model, t.job.data.seq_len
    per_step = t.layout.global_batch * L
    for s in (2, 4):
        window = [r for ds in drawn[s - 2 : s] for r in ds]
        assert sum(drawn[s - 1]) * 2 != sum(window)  # the last step's mean is not the window's
        assert max(window) > 1  # the window of 1 leaves a no-grad prefix
        # 6 (static + last recurrence) + 2 per no-grad recurrence, per token (design §5), averaged by hand
        flops = sum(flops_per_token(m, L, r, 1) for r in window) / len(window)
        assert records[s]["tokens_per_s"] == pytest.approx(per_step)
        assert records[s]["model_tflops_per_s"] == pytest.approx(per_step * flops / 1e12, rel=1e-12), s


# RESUMABLE_CHANGES lost a run setting (progress, tensorboard, wandb, device, cross_entropy, attention,
# compile, parallel): a resume that changed it was refused as "a different config"
def test_resume_may_change_how_the_run_is_executed(stopped_run, cache, monkeypatch):
    import sys
    import types

    class Sink:  # TensorBoard and W&B stand-ins: the test needs neither installed nor a network
        def __init__(self, *a, **kw):
            pass

        def __getattr__(self, name):
            return lambda *a, **kw: None

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=Sink))
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kw: Sink()))
    changed = dict(
        train__progress=True,
        train__tensorboard=True,
        train__wandb=True,
        train__device="auto",
        train__cross_entropy="full",
        train__attention="sdpa",
        train__compile="off",
        train__parallel="fsdp",
    )
    before = tiny_job(stopped_run, "run").train
    assert all(getattr(before, k.removeprefix("train__")) != v for k, v in changed.items())  # each one changes
    t = Trainer(job(stopped_run, cache, train__steps=4, train__resume=True, **changed))
    assert t.step == 2


# trainer.py `_check_steps` `steps != saved_steps` -> `steps > saved_steps` (a shortened run said nothing)
def test_resume_with_fewer_steps_says_the_schedule_is_recomputed(stopped_run, cache, capsys):
    capsys.readouterr()
    t = Trainer(job(stopped_run, cache, train__steps=3, train__resume=True))
    assert (
        "shortening the run from 4 to 3 steps: the learning-rate schedule is recomputed for 3 steps"
        in capsys.readouterr().out.splitlines()
    )
    assert t.fit()["step"] == 3


# trainer.py `torch.manual_seed(t.seed)` before building the model -> `torch.manual_seed(0)`
def test_the_model_init_follows_train_seed(tmp_path, cache):
    for seed in (0, 3):
        t = Trainer(job(tmp_path, cache, f"seed{seed}", train__seed=seed))
        torch.manual_seed(seed)
        ref = LoopedLM(t.job.model)
        for (name, p), q in zip(t.model.named_parameters(), ref.parameters()):
            assert torch.equal(p, q), (seed, name)


# trainer.py `resumed=resume_from is not None` -> `resumed=False` (a resume on more ranks was told to run
# `looplm tokenize` into another source, which the resume then refuses as a different config)
def test_a_resume_on_ranks_without_its_token_cache_is_told_where_the_cache_is(tmp_path, cache):
    from looplm.train.distributed import DistEnv

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(30):
        (corpus / f"{i:02d}.txt").write_text(f"document {i} of a small corpus, long enough to pack. " * 8)
    Trainer(job(tmp_path, cache, data__source=str(corpus), train__steps=4, train__stop_after=2)).fit()
    fresh = tmp_path / "fresh-cache"
    with pytest.raises(UserError, match="resume once on one process to build it"):
        Trainer(
            job(tmp_path, fresh, data__source=str(corpus), train__steps=4, train__resume=True),
            env=DistEnv(world_size=2),
        )


# trainer.py `progress_bar(end, self.step, "train")` -> `progress_bar(end, 0, "train")` (a resumed run's
# bar counted from 0)
def test_a_resumed_runs_progress_counts_from_its_checkpoint(stopped_run, cache, capsys, monkeypatch):
    import re

    from looplm.train import progress

    real = progress.LineProgress.__init__
    monkeypatch.setattr(
        progress.LineProgress, "__init__", lambda self, *a, **kw: real(self, *a, **{**kw, "every_s": 0.0})
    )
    capsys.readouterr()
    Trainer(job(stopped_run, cache, train__steps=4, train__resume=True, train__progress=True)).fit()
    assert re.findall(r"train: step (\d+)/4", capsys.readouterr().err) == ["3", "4"]


# startup.py tokenizer_warning compared the tokenizers' names, not their fingerprints (another BPE file
# than the folder's went unmentioned); model_line dropped " x N ranks"
def test_a_tokenized_folder_with_another_bpe_than_the_requested_file_is_named(tmp_path):
    from looplm.data.tokenizer import BPETokenizer
    from looplm.train.startup import tokenizer_warning

    texts = [f"document {i} of a small corpus, long enough to train a tokenizer. " * 4 for i in range(30)]
    folder_tok, file_tok = BPETokenizer.train(texts, 300), BPETokenizer.train(texts, 280)
    assert folder_tok.name == file_tok.name == "bpe" and folder_tok.vocab_size != file_tok.vocab_size
    line = tokenizer_warning("tok", folder_tok, "my/tokenizer.json", 4096, file_tok)
    assert line is not None and line.endswith(
        f"(bpe, vocabulary {folder_tok.vocab_size}), not data.tokenizer's (my/tokenizer.json, vocabulary "
        f"{file_tok.vocab_size})"
    ), line
    assert tokenizer_warning("tok", folder_tok, "my/tokenizer.json", 4096, folder_tok) is None


def test_a_tokenized_folder_whose_bpe_came_out_smaller_than_asked_is_not_warned_of(tmp_path):
    """`looplm tokenize --bpe-vocab-size 60000` on a small corpus trains fewer ids than asked; a job that asks
    for the same (data.tokenizer bpe, the same bpe_vocab_size) gets the folder's tokenizer as it asked, so no
    warning; one that asks for another size is told."""
    from looplm.data.tokenizer import BPETokenizer
    from looplm.train.startup import tokenizer_warning

    texts = [f"document {i} of a small corpus, long enough to train a tokenizer. " * 4 for i in range(30)]
    folder_tok = BPETokenizer.train(texts, 60000)
    assert folder_tok.vocab_size < 60000
    assert tokenizer_warning("tok", folder_tok, "bpe", 60000, trained_as="bpe-60000") is None
    line = tokenizer_warning("tok", folder_tok, "bpe", 4096, trained_as="bpe-60000")
    assert line is not None and line.endswith("not data.tokenizer's (bpe, vocabulary 4,096)"), line


def test_the_model_line_names_the_ranks():
    from looplm.data import ByteTokenizer
    from looplm.train.startup import model_line

    args = (870_000, 258, ByteTokenizer(), 256, "cuda:0", "bf16 autocast")
    assert model_line(*args, world_size=4).endswith(", device cuda:0 x 4 ranks, bf16 autocast")
    assert model_line(*args).endswith(", device cuda:0, bf16 autocast")
