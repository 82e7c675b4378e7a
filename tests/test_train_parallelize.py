"""What wraps the model for training: torch.compile without recompiles across drawn depths,
FlexAttention document masks equal to the boolean-mask SDPA path, and activation checkpointing
that keeps the gradients and sheds the activations."""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess

import pytest
import torch
from _jobs import shared_cache, step_records, tiny_job

from looplm.train.config import TrainConfig
from looplm.errors import UserError
from looplm.model import LoopedLM
from looplm.model.blocks import causal_document_mask, document_block_mask
from looplm.train.parallelize import apply_activation_checkpointing, apply_compile, compiled_graphs
from looplm.train.trainer import Trainer, attention_kernel

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return shared_cache(tmp_path_factory)


def packed_rows(vocab: int, B: int = 3, L: int = 40):
    """Tokens, document ids and per-document positions of packed rows with uneven documents."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (B, L), generator=g)
    doc = torch.zeros(B, L, dtype=torch.long)
    for b, cuts in enumerate(([7, 19, 33], [1], [])):
        for c in cuts:
            doc[b, c:] += 1
    starts = torch.cat([torch.ones(B, 1, dtype=torch.bool), doc[:, 1:] != doc[:, :-1]], 1)
    idx = torch.arange(L).expand(B, L)
    positions = idx - torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), 1).values
    return tokens, doc, positions


# -- FlexAttention ------------------------------------------------------------------------------
def test_block_mask_is_the_causal_document_mask():
    _, doc, _ = packed_rows(10, L=150)
    bm = document_block_mask(doc)
    dense = causal_document_mask(doc)[:, 0]
    B, L = doc.shape
    q, kv = torch.arange(L)[:, None], torch.arange(L)[None, :]
    by_hand = (q >= kv) & (doc[:, :, None] == doc[:, None, :])  # causal, same document
    assert torch.equal(dense, by_hand)
    mod = bm.mask_mod
    from_block_mask = torch.stack([mod(torch.tensor(b), torch.tensor(0), q, kv) for b in range(B)])
    assert torch.equal(from_block_mask, by_hand)


@pytest.mark.parametrize("injection", ["parcae-nonorm", "deq-qkv"])
def test_flex_attention_logits_equal_sdpa(tiny_model_config, injection):
    """fp32 on CPU, forward only (torch's FlexAttention has no CPU backward; training uses it on CUDA)."""
    cfg = tiny_model_config(injection=injection, max_seq_len=64)
    model = LoopedLM(cfg)
    tokens, doc, positions = packed_rows(cfg.vocab_size)
    with torch.no_grad():
        outs = {
            kernel: model(tokens, 4, doc_ids=doc, positions=positions, init="seeded", attention=kernel).logits
            for kernel in ("sdpa", "flex")
        }
        plain = model(tokens, 4, positions=positions, init="seeded").logits
    torch.testing.assert_close(outs["flex"], outs["sdpa"], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, outs["sdpa"], atol=1e-3)  # the masks matter


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention backward needs CUDA")
def test_flex_attention_gradients_equal_sdpa_on_cuda(tiny_model_config):
    cfg = tiny_model_config(max_seq_len=64, d_model=64, ffn_dim=128)  # head_dim 16: the fused kernel's least
    model = LoopedLM(cfg).cuda()
    tokens, doc, positions = (t.cuda() for t in packed_rows(cfg.vocab_size))
    grads = {}
    for kernel in ("sdpa", "flex"):
        model.zero_grad()
        model(tokens, 4, doc_ids=doc, positions=positions, init="seeded", attention=kernel).logits.logsumexp(
            -1
        ).mean().backward()
        grads[kernel] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for n in grads["sdpa"]:
        torch.testing.assert_close(grads["flex"][n], grads["sdpa"][n], rtol=1e-3, atol=1e-5, msg=n)


def test_auto_attention_picks_flex_on_cuda_only_where_its_kernel_takes_the_heads():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # a device object needs no GPU
    auto, flex = TrainConfig(attention="auto"), TrainConfig(attention="flex")
    assert attention_kernel(auto, cuda, 16) == "flex"
    assert attention_kernel(auto, cuda, 8) == "sdpa"  # inductor's flex kernel refuses head_dim < 16
    assert attention_kernel(auto, cpu, 64) == "sdpa"
    assert attention_kernel(flex, cuda, 64) == "flex"
    with pytest.raises(UserError, match="head_dim >= 16, the model has 8"):
        attention_kernel(flex, cuda, 8)


def test_explicit_flex_with_too_small_heads_is_refused_before_the_data_build(tmp_path, cache, monkeypatch):
    import looplm.train.trainer as trainer_module

    monkeypatch.setattr(trainer_module.D, "resolve_device", lambda _: torch.device("cuda"))  # as on a GPU
    monkeypatch.setattr(Trainer, "_build_data", lambda self: pytest.fail("validation came after the data build"))
    job = tiny_job(tmp_path, "flex8", cache=cache, train__attention="flex", model__d_model=32, model__n_heads=4)
    with pytest.raises(UserError, match="head_dim >= 16, the model has 8"):
        Trainer(job)


def test_trainer_attention_kernel(tmp_path, cache):
    assert Trainer(tiny_job(tmp_path, "auto", cache=cache)).attention == "sdpa"  # auto on CPU
    with pytest.raises(ValueError, match="FlexAttention has no backward on CPU"):
        Trainer(tiny_job(tmp_path, "flex", cache=cache, train__attention="flex"))


# -- activation checkpointing -------------------------------------------------------------------
def peak_activation_bytes(model, tokens, depth) -> int:
    """Peak bytes of activations alive during forward + backward, tracked per tensor by torch's
    MemTracker (a dispatch mode: every op output is counted until it is freed)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(model)
    with mt:
        model(tokens, depth).logits.logsumexp(-1).mean().backward()
    peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]
    return next(v for k, v in peak.items() if "ACT" in str(k))


def test_block_checkpointing_keeps_gradients_and_sheds_activations(tiny_model_config):
    cfg = tiny_model_config(max_seq_len=64, d_model=64, ffn_dim=256)
    plain = LoopedLM(cfg)
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, "block")
    assert list(wrapped.state_dict()) == list(plain.state_dict())  # checkpoints stay loadable
    tokens, doc, positions = packed_rows(cfg.vocab_size, L=64)
    grads = []
    for m in (plain, wrapped):
        out = m(tokens, 6, doc_ids=doc, positions=positions, init="seeded", bptt_window=None)
        out.logits.logsumexp(-1).mean().backward()
        grads.append({n: p.grad for n, p in zip(m.state_dict(), m.parameters())})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7, msg=n)
    # full BPTT: activations grow with R; checkpointing keeps each block's input only
    tokens = tokens[:, :48]
    a4, a16 = (peak_activation_bytes(plain, tokens, r) for r in (4, 16))
    c4, c16 = (peak_activation_bytes(wrapped, tokens, r) for r in (4, 16))
    assert a16 > 3 * a4  # the measurement sees depth
    assert c16 < a16 / 4, (c16, a16)


# -- torch.compile ------------------------------------------------------------------------------
@pytest.mark.slow
def test_compiled_training_matches_eager_without_recompiles(tmp_path, cache, monkeypatch):
    """20 steps with PLN-drawn depths and a backprop window of 2 (so the no-grad prefix runs on
    most microbatches): same losses and depths as eager, and no graph compiled after warm-up. The
    trainer's blocks go through aot_eager, not inductor: Dynamo's graphs, guards and recompiles and
    AOT autograd's forward/backward split are the trainer's; inductor's CPU code is not what a GPU
    trains with (Triton), and its cold compile of these graphs took ~45 s of the suite."""
    import looplm.train.parallelize as P

    compile_blocks = P.apply_compile
    monkeypatch.setattr(P, "apply_compile", lambda model: compile_blocks(model, backend="aot_eager"))
    common = dict(cache=cache, train__steps=20, depth__bptt_window=2, depth__depth=3.0)
    eager = Trainer(tiny_job(tmp_path, "eager", train__compile="off", **common))
    eager.fit()
    compiled = Trainer(tiny_job(tmp_path, "compiled", train__compile="on", **common))
    assert compiled.compiled and not eager.compiled
    compiled.fit()
    ref, got = step_records(eager.out_dir), step_records(compiled.out_dir)
    assert sorted(got) == sorted(ref) == list(range(1, 21))
    drawn = [r for s in ref for r in ref[s]["depths"]]
    assert min(drawn) <= 2 < max(drawn) and len(set(drawn)) >= 4, drawn  # with and without a prefix
    for s in ref:
        assert got[s]["depths"] == ref[s]["depths"]
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=2e-4, abs=1e-5), s
        assert got[s]["compile_recompiles"] == 0, s
        assert "compile_recompiles" not in ref[s]
    # the counter sees a recompile: a new sequence length compiles the blocks again
    before = compiled_graphs()
    with torch.no_grad():
        compiled.model(torch.zeros(1, 17, dtype=torch.long), 2)
    assert compiled_graphs() > before


def test_compile_wraps_blocks_in_place(tiny_model_config):
    model = LoopedLM(tiny_model_config())
    names = list(model.state_dict())
    apply_compile(model)
    assert list(model.state_dict()) == names
    assert all(b._compiled_call_impl is not None for b in (*model.prelude, *model.core, *model.coda))


def test_trainer_with_checkpointing_matches_and_saves_plain_keys(tmp_path, cache):
    """Block checkpointing changes memory, not the run: same losses, and checkpoints that load
    into a plain model (and a resumed run may switch it off)."""
    from looplm.checkpoint import load_model, load_tensors

    runs = {}
    for mode in ("none", "block"):
        trainer = Trainer(
            tiny_job(
                tmp_path,
                mode,
                cache=cache,
                train__steps=3,
                depth__bptt_window=None,
                train__activation_checkpointing=mode,
            )
        )
        trainer.fit()
        runs[mode] = trainer
    ref, got = step_records(runs["none"].out_dir), step_records(runs["block"].out_dir)
    for s in ref:
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-5)
    plain = load_tensors(runs["none"].latest_checkpoint(), "model.safetensors")
    wrapped = load_tensors(runs["block"].latest_checkpoint(), "model.safetensors")
    assert wrapped.keys() == plain.keys()
    load_model(runs["block"].latest_checkpoint(), "cpu")  # loads into an unwrapped LoopedLM
    resumed = Trainer(
        tiny_job(
            tmp_path,
            "block",
            cache=cache,
            train__steps=3,
            depth__bptt_window=None,
            train__activation_checkpointing="none",
            train__resume=True,
        )
    )
    assert resumed.step == 3


# trainer.py `apply_activation_checkpointing(self.model, t.activation_checkpointing)` -> `(..., "none")`
# (the setting was accepted and recorded, and every block kept its activations)
def test_the_trainer_wraps_its_blocks_as_train_activation_checkpointing_says(tmp_path, cache):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    for mode in ("none", "block"):
        model = Trainer(tiny_job(tmp_path, mode, cache=cache, train__activation_checkpointing=mode)).model
        blocks = [*model.prelude, *model.core, *model.coda]
        assert [isinstance(b, CheckpointWrapper) for b in blocks] == [mode == "block"] * len(blocks), mode


@pytest.mark.slow
def test_compiled_blocks_with_block_masks_do_not_recompile_per_batch(tiny_model_config):
    """The GPU training path (compiled blocks + FlexAttention), forward only on CPU: every batch
    brings a new document layout (a new block mask and mask_mod closure) and reuses the graphs."""
    cfg = tiny_model_config(max_seq_len=128)
    model, ref = LoopedLM(cfg), LoopedLM(cfg)
    ref.load_state_dict(model.state_dict())
    apply_compile(model)
    counts = []
    for i in range(3):
        tokens, doc, positions = packed_rows(cfg.vocab_size, L=128)
        doc = torch.roll(doc, shifts=17 * i, dims=1)  # another layout per batch
        with torch.no_grad():
            got = model(tokens, 3, doc_ids=doc, positions=positions, init="seeded", attention="flex").logits
            want = ref(tokens, 3, doc_ids=doc, positions=positions, init="seeded", attention="sdpa").logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        counts.append(compiled_graphs())
    assert counts[0] > 0 and counts[1] == counts[2] == counts[0], counts


def graphs_for_one_step(model, tokens, depth, **kw) -> int:
    before = compiled_graphs()
    model(tokens, depth, **kw).logits.logsumexp(-1).mean().backward()
    return compiled_graphs() - before


def test_blocks_share_one_graph_with_and_without_checkpointing(tiny_model_config):
    """Prelude, every core visit and the coda call a block with one signature, so a compiled block traces
    one graph for all of them, and checkpoint wrappers do not add any (torch's 'eager' backend: dynamo
    traces and counts graphs as for inductor, without code generation)."""
    cfg = tiny_model_config()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    counts = {}
    for mode in ("none", "block"):
        torch._dynamo.reset()
        model = LoopedLM(cfg)
        apply_activation_checkpointing(model, mode)
        apply_compile(model, backend="eager")
        counts[mode] = graphs_for_one_step(model, tokens, 3)
    # one block graph; the injection traces twice (s^0 carries no gradient, later states do)
    assert counts == {"none": 3, "block": 3}, counts
    torch._dynamo.reset()


def test_recompile_limit_covers_grad_modes_masks_and_shapes(tiny_model_config):
    """2 grad modes x (causal, boolean mask) + a no-grad FlexAttention mask, at 2 lengths: 10 graphs of the
    same block code, past dynamo's default limit of 8 (a hard error under fullgraph=True)."""
    torch._dynamo.reset()
    cfg = tiny_model_config()
    model = LoopedLM(cfg)
    apply_compile(model, backend="eager")
    before = compiled_graphs()
    for L in (8, 16):
        tokens, doc, positions = packed_rows(cfg.vocab_size, L=L)
        for grad in (True, False):
            for doc_ids in (None, doc):
                with torch.set_grad_enabled(grad):
                    model(tokens, 2, doc_ids=doc_ids, positions=positions, init="seeded")
        with torch.no_grad():
            model(tokens, 2, doc_ids=doc, positions=positions, init="seeded", attention="flex")
    assert compiled_graphs() - before >= 10
    torch._dynamo.reset()


def test_flex_masks_carry_kernel_options(tiny_model_config):
    """document_mask(flex) carries the configured options and never ROWS_GUARANTEED_SAFE, whose real
    condition (a key the row attends to in the first key block its query block runs) packed rows break:
    checked here on the mask itself. On the CPU the options are not passed and the logits stay SDPA's."""
    from looplm.model.blocks import FlexMask, document_mask

    _, doc, _ = packed_rows(10, L=40)
    mask = document_mask(doc, "flex", {"fwd_BLOCK_M": 64})
    assert isinstance(mask, FlexMask)
    assert mask.kernel_options == {"fwd_BLOCK_M": 64}
    dense = causal_document_mask(doc)[:, 0]  # [B, L, L]
    assert bool(dense.any(-1).all())  # every row attends somewhere: the documented, too weak, condition
    blk = 8  # key and query blocks of 8: a row whose block's first live key block holds none of its keys
    B, L = doc.shape
    live = dense.reshape(B, L // blk, blk, L // blk, blk).any(-1).any(2)  # [B, query block, key block]
    first = live.float().argmax(-1)  # the first key block each query block runs
    rows = torch.arange(L) // blk
    starts = first.gather(1, rows.expand(B, L))  # per row: its query block's first key block
    in_first = (dense.reshape(B, L, L // blk, blk).any(-1)).gather(2, starts[..., None])[..., 0]
    assert not bool(in_first.all())  # packed rows break the real one: the option would give NaN
    cfg = tiny_model_config(max_seq_len=64)
    model = LoopedLM(cfg)
    tokens, doc, positions = packed_rows(cfg.vocab_size)
    with torch.no_grad():
        flex = model(
            tokens,
            3,
            doc_ids=doc,
            positions=positions,
            init="seeded",
            attention="flex",
            flex_options={"fwd_BLOCK_M": 64},
        ).logits
        sdpa = model(tokens, 3, doc_ids=doc, positions=positions, init="seeded").logits
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


def test_fsdp_bf16_carries_the_state_in_the_dtype_ddp_does(tiny_model_config):
    """DDP trains fp32 parameters under bf16 autocast: the embedding rows, the residual stream and the
    recurrent state are fp32. FSDP2 with bf16 parameters (here: the parameters cast to bf16, as FSDP
    gathers them) carries the same dtypes once keep_stream_fp32 is applied; without it, bf16."""
    from looplm.train.parallelize import keep_stream_fp32

    cfg = tiny_model_config()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    ddp = LoopedLM(cfg)
    fsdp = copy.deepcopy(ddp).to(torch.bfloat16)
    plain_bf16 = copy.deepcopy(fsdp)
    keep_stream_fp32(fsdp)

    def dtypes(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(tokens, 3, init="seeded", return_states=True)
        return [s.dtype for s in out.states] + [out.endpoint.dtype]

    assert dtypes(ddp) == [torch.float32] * 4
    assert dtypes(fsdp) == dtypes(ddp)
    assert dtypes(plain_bf16) == [torch.bfloat16] * 4  # what FSDP2 bf16 carried before


@pytest.mark.parametrize("injection", ["parcae-nonorm", "deq-qkv", "huginn-linear"])
def test_fsdp_bf16_trains_an_injection_with_parameters(tiny_model_config, injection):
    """FSDP2 with bf16 parameters, run for real on a one-rank gloo group: the injection is its own fp32
    unit, and the model calls its `prepare`, `qkv_offsets` and `exit` directly (not its forward), so
    those calls must gather its parameters too. The loss and the injection's gradients equal those of
    the same model trained as DDP trains it (fp32 parameters under bf16 autocast) to bf16 accuracy."""
    import torch.distributed as dist

    from looplm.train.distributed import DistEnv
    from looplm.train.parallelize import wrap_model

    cfg = tiny_model_config(injection=injection)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    ddp = LoopedLM(cfg)
    names = [n for n, _ in ddp.injection.named_parameters()]
    assert names, "an injection with parameters"

    def step(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens, 3, init="seeded").logits.float().logsumexp(-1).mean()
        loss.backward()
        grads = dict(model.injection.named_parameters())
        return loss.item(), {
            n: grads[n].grad.full_tensor() if hasattr(grads[n].grad, "full_tensor") else grads[n].grad for n in names
        }

    fsdp = copy.deepcopy(ddp)
    ref_loss, ref_grads = step(ddp)
    dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wrap_model(fsdp, DistEnv(world_size=1, joined=True), "fsdp", param_dtype=torch.bfloat16)
        loss, grads = step(fsdp)
    finally:
        dist.destroy_process_group()
    assert loss == pytest.approx(ref_loss, rel=2e-2)
    for n in names:
        torch.testing.assert_close(grads[n].float(), ref_grads[n], rtol=0.1, atol=0.1 * ref_grads[n].abs().max().item())


GATHER_COUNT_SCRIPT = """
import json, sys

import torch
import torch.distributed as dist

from looplm.config import ModelConfig
from looplm.model import LoopedLM
from looplm.train.distributed import DistEnv
from looplm.train.parallelize import wrap_model

dist.init_process_group("gloo")
rank = dist.get_rank()
gathers = []
for op in ("all_gather_into_tensor", "all_gather_single"):
    if hasattr(dist, op):
        real = getattr(dist, op)
        setattr(dist, op, lambda *a, _real=real, **k: (gathers.append(1), _real(*a, **k))[1])
torch.manual_seed(0)
cfg = ModelConfig(**json.loads(sys.argv[2]))
ref = LoopedLM(cfg)
model = LoopedLM(cfg)
model.load_state_dict(ref.state_dict())
wrap_model(model, DistEnv(rank=rank, world_size=2, local_world_size=2, joined=True), sys.argv[3])
tokens = torch.randint(0, cfg.vocab_size, (2, 16))
report = {}
for depth in (2, 5):
    gathers.clear()
    out = model(tokens, depth, init="seeded")
    forward = len(gathers)
    out.logits.logsumexp(-1).mean().backward()
    expect = ref(tokens, depth, init="seeded")
    expect.logits.logsumexp(-1).mean().backward()
    grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for n, p in model.named_parameters()}
    report[depth] = {
        "forward_gathers": forward,
        "logits": (out.logits - expect.logits).abs().max().item(),
        "grads": max(((grads[n] - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)).item()
                     for n, q in ref.named_parameters()),
    }
    model.zero_grad()
    ref.zero_grad()
with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["fsdp", "hsdp"])
def test_fsdp_gathers_the_core_blocks_once_per_forward_whatever_the_depth(tmp_path, parallel):
    """The core blocks run at every recurrence; resharded after each run (FSDP2's default) they were all-gathered
    R times per forward: 1 + n_prelude + n_coda + R x n_core gathers (+1 for an injection with parameters). Kept
    gathered from their first run, a forward gathers each unit once at any depth. Two gloo ranks, fp32: the
    logits and gradients equal the unwrapped model's."""
    import dataclasses

    from _jobs import subprocess_env, torchrun_cmd

    from looplm.config import ModelConfig

    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_heads=2, n_kv_heads=2, ffn_dim=64, n_prelude=1, n_core=2, n_coda=1, max_seq_len=32
    )
    units = 1 + cfg.n_prelude + cfg.n_core + cfg.n_coda  # the injection (parcae) shares the root's unit
    (tmp_path / "rank.py").write_text(GATHER_COUNT_SCRIPT)
    args = [tmp_path, json.dumps(dataclasses.asdict(cfg)), parallel]
    proc = subprocess.run(
        torchrun_cmd(2, tmp_path / "rank.py", *args), env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert [report[d]["forward_gathers"] for d in ("2", "5")] == [units, units], report
        assert all(report[d]["logits"] == 0 and report[d]["grads"] <= 1e-6 for d in ("2", "5")), report


def test_ddp_trains_a_model_whose_prelude_enters_only_through_its_initial_state(tiny_model_config):
    """Injection `none` with s0 = e (state_init input): the prelude output enters the recurrence only
    through s0, so a step whose depth exceeds the backprop window (the first R - b recurrences run
    without autograd) gives the prelude and embedding no gradient. DDP, run for real on a one-rank gloo
    group, must take such steps (it failed on the next one: unused parameters) and give every parameter
    the gradient the unwrapped model gets (autograd's: none for the prelude)."""
    import torch.distributed as dist

    from looplm.train.distributed import DistEnv
    from looplm.train.parallelize import wrap_model

    cfg = tiny_model_config(injection="none", state_init="input")
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    plain = LoopedLM(cfg)
    model = copy.deepcopy(plain)

    def step(m):
        m.zero_grad(set_to_none=True)
        m(tokens, 4, bptt_window=2).logits.logsumexp(-1).mean().backward()
        inner = getattr(m, "module", m)
        return {n: None if p.grad is None else p.grad.clone() for n, p in inner.named_parameters()}

    dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = wrap_model(model, DistEnv(world_size=1, joined=True), "ddp")
        for _ in range(2):  # the second step is where an unfinished reduction fails
            got, want = step(ddp), step(plain)
    finally:
        dist.destroy_process_group()
    assert want["embed.weight"] is None or not want["embed.weight"].any()  # the case at hand
    for name, grad in want.items():
        if grad is None or not grad.any():
            assert got[name] is None or not got[name].any(), name
        else:
            torch.testing.assert_close(got[name], grad, msg=name)


class SyncRecorder(torch.nn.Module):
    """Stands in for a DDP / FSDP2 module: records the gradient-sync switches it is given."""

    def __init__(self):
        super().__init__()
        self.events = []

    def set_requires_gradient_sync(self, sync):
        self.events.append(("fsdp", sync))

    @contextlib.contextmanager
    def no_sync(self):
        self.events.append(("ddp", "no_sync"))
        yield
        self.events.append(("ddp", "sync again"))


@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "hsdp"])
def test_gradient_sync_skips_accumulation_micro_steps(parallel):
    from looplm.train.distributed import DistEnv
    from looplm.train.parallelize import gradient_sync

    model, env = SyncRecorder(), DistEnv(world_size=2, joined=True)
    seen = []
    for i in range(3):  # grad_accum 3: only the last microbatch reduces
        with gradient_sync(model, env, parallel, sync=i == 2):
            seen.append(list(model.events))
    if parallel == "ddp":
        assert model.events == [("ddp", "no_sync"), ("ddp", "sync again")] * 2
    else:
        assert [e for e in seen[0]] == [("fsdp", False)]  # micro-step 1 ran without sync
        assert model.events == [
            ("fsdp", False),
            ("fsdp", True),
            ("fsdp", False),
            ("fsdp", True),
            ("fsdp", True),
            ("fsdp", True),
        ]
    with gradient_sync(model, DistEnv(), parallel, sync=False):  # one process: nothing to switch
        pass
    assert len(model.events) == (4 if parallel == "ddp" else 6)


def test_fsdp_gets_bf16_compute_with_fp32_gradient_reduction(monkeypatch, tiny_model_config):
    """The wiring of FSDP2's mixed precision, fully_shard recorded instead of run (the policies it is given;
    test_fsdp_bf16_trains_an_injection_with_parameters runs it for real): every block, then the root."""
    import torch.distributed.fsdp as fsdp

    from looplm.train.distributed import DistEnv
    from looplm.train.parallelize import wrap_model

    calls = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: calls.append((module, kw)))
    model = LoopedLM(tiny_model_config())
    env = DistEnv(world_size=2, joined=True)
    assert wrap_model(model, env, "fsdp", param_dtype=torch.bfloat16) is model
    assert [m for m, _ in calls] == [*model.prelude, *model.core, *model.coda, model.injection, model]
    injection = calls.pop(-2)[1]["mp_policy"]  # elementwise on the state each recurrence: fp32, as under DDP
    assert injection.param_dtype is None and injection.reduce_dtype == torch.float32
    policies = {kw["mp_policy"] for _, kw in calls}
    assert len(policies) == 1
    policy = policies.pop()
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert policy.cast_forward_inputs is False  # the stream enters blocks in fp32, as under DDP
    assert model.embed(torch.zeros(1, 2, dtype=torch.long).to(torch.long)).dtype == torch.float32
    with torch.no_grad():
        assert model.to(torch.bfloat16).embed(torch.zeros(1, 2, dtype=torch.long)).dtype == torch.float32
    model.float()
    calls.clear()
    wrap_model(model, env, "fsdp")  # fp32 training: no casts
    assert calls[0][1]["mp_policy"].param_dtype is None and calls[0][1]["mp_policy"].reduce_dtype is None
    with pytest.raises(ValueError, match="choose ddp, fsdp or hsdp"):
        wrap_model(model, env, "zero3")


def test_hsdp_shards_within_a_node_and_replicates_across_nodes(monkeypatch, tiny_model_config):
    """HSDP over 3 nodes of 2 ranks: a (replicate 3, shard 2) mesh handed to every fully_shard call;
    a world that is not whole nodes is refused before any mesh is built. A model whose injection has
    no parameters (additive) gets no fp32 injection group."""
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.fsdp as fsdp

    from looplm.train.distributed import DistEnv
    from looplm.train.parallelize import wrap_model

    meshes, calls = [], []

    def init_device_mesh(device_type, shape, *, mesh_dim_names):
        meshes.append((device_type, shape, mesh_dim_names))
        return "mesh"

    monkeypatch.setattr(device_mesh, "init_device_mesh", init_device_mesh)
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: calls.append((module, kw)))
    model = LoopedLM(tiny_model_config(injection="additive"))
    assert not list(model.injection.parameters())
    wrap_model(model, DistEnv(world_size=6, local_world_size=2, joined=True), "hsdp", param_dtype=torch.bfloat16)
    assert meshes == [("cpu", (3, 2), ("replicate", "shard"))]
    assert [m for m, _ in calls] == [*model.prelude, *model.core, *model.coda, model]  # no injection group
    assert all(kw["mesh"] == "mesh" for _, kw in calls)
    meshes.clear()
    with pytest.raises(UserError, match="hsdp: world size 6 is not a multiple of the ranks per node 4"):
        wrap_model(LoopedLM(tiny_model_config()), DistEnv(world_size=6, local_world_size=4, joined=True), "hsdp")
    assert meshes == []


def test_unknown_activation_checkpointing_is_refused(tiny_model_config):
    model = LoopedLM(tiny_model_config())
    for mode in ("blocks", "full"):
        with pytest.raises(UserError, match=f"unknown activation checkpointing '{mode}'; choose none or block"):
            apply_activation_checkpointing(model, mode)
    assert type(model.core[0]).__name__ == "Block"  # nothing was wrapped


def test_prefetched_batches_are_the_batches(tmp_path, cache):
    """The background thread assembles the same batches in the same order: identical runs."""
    runs = {}
    for prefetch in (True, False):
        trainer = Trainer(
            tiny_job(tmp_path, f"prefetch-{prefetch}", cache=cache, train__steps=4, train__prefetch=prefetch)
        )
        assert (trainer._prefetcher is not None) == prefetch
        trainer.fit()
        runs[prefetch] = step_records(trainer.out_dir)
    assert [r["loss"] for r in runs[True].values()] == [r["loss"] for r in runs[False].values()]
    assert [r["depths"] for r in runs[True].values()] == [r["depths"] for r in runs[False].values()]


# trainer.py `self._prefetched = (step + 1, ...)` keyed the next step's batches under another step: each
# step assembled its batches again on the training thread, the prefetched ones thrown away
def test_prefetched_steps_are_not_assembled_again_on_the_training_thread(tmp_path, cache):
    import threading

    trainer = Trainer(tiny_job(tmp_path, "run", cache=cache, train__steps=4, train__prefetch=True))
    built = []
    real = trainer._host_step_batches

    def recording(step):
        built.append((step, threading.current_thread() is threading.main_thread()))
        return real(step)

    trainer._host_step_batches = recording
    trainer.fit()
    # step 0 on the training thread, each later step (and one past the end) once, ahead, on the prefetch thread
    assert sorted(built) == [(0, True), (1, False), (2, False), (3, False), (4, False)]
