"""looplm.hf beyond export/generate: PEFT LoRA, lm-eval's `hf` backend, exported folders in looplm's
own commands, and the adaptive-exit depth that `generate()` reports."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from _jobs import write_choice_task as write_jobs_choice_task  # noqa: E402
from _jobs import error_line, run_main, shared_cache, tiny_job  # noqa: E402
from _models import decisive_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from looplm import checkpoint as ckpt  # noqa: E402
from looplm.config import ModelConfig  # noqa: E402
from looplm.data import BPETokenizer, ByteTokenizer  # noqa: E402
from looplm.hf import LoopedLMForCausalLM, export  # noqa: E402
from looplm.infer.generate import DepthRule, SamplingConfig, generate  # noqa: E402
from looplm.model import LoopedLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread

TOK = ByteTokenizer()
PROMPTS = ["x", "a longer prompt", "mid size"]
CHOICE_ROWS = [
    {"context": "+1,2=", "choices": ["3", "4"], "gold": 0},
    {"context": "+2,2=", "choices": ["4", "5", "6"], "gold": 0},
    {"context": "+1,1=", "choices": ["2", "7"], "gold": 0},
    {"context": "ab", "choices": ["c", "d"], "gold": 1},
]


def tiny_model(vocab_size=258, **fields) -> LoopedLM:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=vocab_size, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64, max_depth=16, **fields
    )
    return LoopedLM(cfg).eval()


def write_checkpoint(path, model: LoopedLM, tokenizer, job: dict | None = None) -> None:
    """A looplm checkpoint folder as load_model reads it; `job` is the rest of its config.json."""

    def populate(tmp):
        ckpt.save_tensors(tmp, "model.safetensors", model.state_dict())
        ckpt.write_json(tmp, "config.json", {**(job or {}), "model": model.cfg.to_dict()})
        tokenizer.save(tmp)

    ckpt.write_atomic(path, populate)


def padded_batch(prompts):
    enc = [TOK.encode(p) for p in prompts]
    L = max(map(len, enc))
    ids = torch.tensor([[TOK.pad_id] * (L - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (L - len(e)) + [1] * len(e) for e in enc])
    return ids, mask


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(looplm model, checkpoint folder, exported folder); the export defaults to 3 steps, full cache."""
    root = tmp_path_factory.mktemp("hf_extras")
    model = tiny_model()
    write_checkpoint(root / "ckpt", model, TOK)
    export(root / "ckpt", root / "hf", num_steps=3, cache_kind="full")
    return model, root / "ckpt", root / "hf"


# -- 1. PEFT LoRA ----------------------------------------------------------------------------------------
CORE_ATTN = [f"model.core.0.attn.{name}" for name in ("wq", "wk", "wv", "wo")]


def test_lora_on_a_core_block_trains_and_merges(exported):
    peft = pytest.importorskip("peft")
    hf = AutoModelForCausalLM.from_pretrained(exported[2])
    names = dict(hf.named_modules())
    assert all(isinstance(names[n], torch.nn.Linear) for n in CORE_ATTN)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=CORE_ATTN)
    model = peft.get_peft_model(hf, config)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and ".core.0.attn." in n for n in trainable)
    assert len(trainable) == 2 * len(CORE_ATTN)  # lora_A and lora_B of each projection

    ids = torch.tensor([TOK.encode("the looped cat sat on"), TOK.encode("a mat with a looped hat")[:21]])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    model.train()
    losses = []
    for _ in range(8):
        loss = model(input_ids=ids, labels=ids, num_steps=2).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    frozen = hf.model.core[1].attn.wq.weight
    assert frozen.grad is None  # only the adapters learn

    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids, num_steps=2).logits
    merged = model.merge_and_unload()
    assert isinstance(merged, LoopedLMForCausalLM)
    assert isinstance(merged.model.core[0].attn.wq, torch.nn.Linear)
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        plain = merged(input_ids=ids, num_steps=2).logits
    assert (plain - adapted).abs().max() <= 1e-5
    # and the merged model is still the looplm model: its generate runs on the cache
    out = merged.generate(ids[:, :5], max_new_tokens=3, do_sample=False, num_steps=2, cache_kind="terminal")
    assert out.shape == (2, 8)


# -- 2. lm-eval's hf backend -------------------------------------------------------------------------------
def write_choice_task(folder):
    """The local multiple-choice YAML task of tests/test_eval_harness.py, over CHOICE_ROWS."""
    return write_jobs_choice_task(folder, CHOICE_ROWS)


@pytest.mark.slow
def test_lm_eval_hf_backend_matches_the_looplm_adapter(exported, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("accelerate")
    import looplm.eval.harness as harness
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    write_choice_task(tmp_path)
    _, checkpoint, folder = exported
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)  # indexing the built-in tasks: ~10 s
    # looplm's adapter seeds each item's initial state by a hash of its context; HF's forward seeds
    # by batch row (0 at batch_size=1). With the same seed (and the full cache at prefill depth =
    # depth: the same computation as the parallel forward) they agree.
    monkeypatch.setattr(harness, "stable_id", lambda context: 0)
    for depth, extra in ((3, ""), (2, ",num_steps=2")):  # the export's num_steps, then a model_args override
        args = f"pretrained={folder},backend=causal,device=cpu,batch_size=1,dtype=float32{extra}"
        res = lm_eval.simple_evaluate(model="hf", model_args=args, tasks=["looplm_choice"], task_manager=tasks)
        hf_acc = res["results"]["looplm_choice"]["acc,none"]
        own = harness.LoopLMHarness(checkpoint=str(checkpoint), depth=depth, cache="full")
        res = lm_eval.simple_evaluate(model=own, tasks=["looplm_choice"], task_manager=tasks)
        assert math.isclose(hf_acc, res["results"]["looplm_choice"]["acc,none"]), depth

    class Req:
        def __init__(self, *args):
            self.args = args

    hflm = HFLM(pretrained=str(folder), backend="causal", device="cpu", batch_size=1)  # num_steps 3
    own = harness.LoopLMHarness(checkpoint=str(checkpoint), depth=3, cache="full")
    assert hflm.max_length == 64  # config.max_position_embeddings -> max_seq_len
    requests = [Req(r["context"], c) for r in CHOICE_ROWS for c in r["choices"]] + [Req("", "abc")]
    for (a, greedy_a), (b, greedy_b) in zip(hflm.loglikelihood(requests), own.loglikelihood(requests), strict=True):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5) and greedy_a == greedy_b


# -- 3. exported folders in looplm's commands --------------------------------------------------------------
def looplm(capsys, *args) -> SimpleNamespace:
    """`looplm ARGS` in this process (the console script itself is tests/test_cli.py's): returncode,
    stdout, stderr."""
    rc, out, err = run_main(args, capsys)
    return SimpleNamespace(returncode=rc, stdout=out, stderr=err)


@pytest.fixture(scope="module")
def trained_like(tmp_path_factory):
    """(checkpoint, exported folder) of a tiny model with a full job config (the tiny test job's
    data: the task generator), as `looplm train` writes it."""
    root = tmp_path_factory.mktemp("hf_job")
    job = tiny_job(root, cache=shared_cache(tmp_path_factory)).to_dict()
    model_cfg = ModelConfig.from_dict({**job["model"], "vocab_size": TOK.vocab_size})
    torch.manual_seed(0)
    model = LoopedLM(model_cfg).eval()
    write_checkpoint(root / "ckpt", model, TOK, job)
    export(root / "ckpt", root / "hf")
    return root / "ckpt", root / "hf"


def test_load_model_reads_an_exported_folder(exported, trained_like, tmp_path):
    model, checkpoint, folder = exported
    assert ckpt.is_hf_folder(folder) and not ckpt.is_hf_folder(checkpoint)
    loaded, tokenizer, job = ckpt.load_model(folder)
    assert isinstance(tokenizer, ByteTokenizer) and loaded.cfg == model.cfg
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    assert job["model"] == model.cfg.to_dict()
    with pytest.raises(ckpt.CheckpointError, match="does not record the training job"):
        job["data"]
    # with the job: the checkpoint's own
    _, _, job = ckpt.load_model(trained_like[1])
    assert job == ckpt.load_model(trained_like[0])[2]
    # a folder saved by transformers alone (no looplm extras): the tokenizer is rebuilt from its files
    hf = AutoModelForCausalLM.from_pretrained(folder)
    hf.save_pretrained(tmp_path / "bare")
    AutoTokenizer.from_pretrained(folder).save_pretrained(tmp_path / "bare")
    assert not (tmp_path / "bare" / ckpt.HF_EXPORT_INFO).exists()
    again, tokenizer, job = ckpt.load_model(tmp_path / "bare")
    assert isinstance(tokenizer, ByteTokenizer) and set(job) == {"model"}
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


def test_load_model_rebuilds_a_bpe_tokenizer(tmp_path):
    bpe = BPETokenizer.train(["the cat sat on the mat", "the dog ate the log"] * 20, vocab_size=300)
    write_checkpoint(tmp_path / "ckpt", tiny_model(vocab_size=bpe.vocab_size), bpe)
    export(tmp_path / "ckpt", tmp_path / "hf")
    _, tokenizer, _ = ckpt.load_model(tmp_path / "hf")
    assert tokenizer.fingerprint() == bpe.fingerprint()  # looplm's own copy
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "bare")
    AutoTokenizer.from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "bare")
    _, tokenizer, _ = ckpt.load_model(tmp_path / "bare")  # rebuilt from transformers' files
    assert isinstance(tokenizer, BPETokenizer) and (tokenizer.eos_id, tokenizer.pad_id) == (bpe.eos_id, bpe.pad_id)
    for text in ["the cat ate the mat", "unseen wörds <eos>"]:
        assert tokenizer.encode(text) == bpe.encode(text)


def test_checkpoint_module_does_not_import_transformers():
    code = (
        "import sys; from looplm import checkpoint; assert 'transformers' not in sys.modules; "
        "import ast, pathlib; tree = ast.parse(pathlib.Path(checkpoint.__file__).read_text()); "
        "names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names] + "
        "[n.module or '' for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]; "
        "assert not [m for m in names if m.startswith(('transformers', 'looplm.hf'))], names"
    )
    done = subprocess.run([__import__("sys").executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_cli_generate_and_eval_on_an_exported_folder(trained_like, exported, tmp_path, capsys):
    checkpoint, folder = trained_like
    data = write_choice_task(tmp_path)
    common = (
        "--depths",
        1,
        2,
        "--choice-tasks",
        data,
        "--max-sequences",
        4,
        "--task-examples",
        0,
        "--sharing-sequences",
        0,
    )
    calls = [
        ("generate", src, "--prompt", "+1,2=", "ab", "--depth", 2, "--max-new-tokens", 4)
        for src in (folder, checkpoint)
    ]
    calls += [
        ("eval", src, *common, "--output", tmp_path / f"{name}.json")
        for src, name in ((folder, "hf"), (checkpoint, "ckpt"))
    ]
    res, from_ckpt, evaluated, ref = (looplm(capsys, *args) for args in calls)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout == from_ckpt.stdout and res.stdout.startswith("--- prompt 1 of 2 ---\n+1,2=")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert "Traceback" not in evaluated.stderr
    assert ref.returncode == 0, ref.stderr[-3000:]
    got, want = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("hf", "ckpt"))
    assert sorted(got["choice"]) == ["1", "2"] and got["choice"] == want["choice"]
    assert got["perplexity"] == want["perplexity"]
    # without --output the report lands in the exported folder itself, not two levels above it
    res = looplm(
        capsys, "eval", folder, "--depths", 1, "--max-sequences", 2, "--task-examples", 0, "--sharing-sequences", 0
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert (Path(folder) / "eval.json").is_file() and not (Path(folder).parent.parent / "eval.json").exists()

    # a folder that does not record the training job: generate works, eval is a one-line error
    bare = exported[2]
    res = looplm(capsys, "generate", bare, "--prompt", "hi", "--depth", 2, "--max-new-tokens", 3)
    assert res.returncode == 0, res.stderr[-3000:]
    stripped = tmp_path / "stripped"
    stripped.mkdir()
    for f in bare.iterdir():
        if f.is_file() and f.name != ckpt.HF_EXPORT_INFO:
            (stripped / f.name).write_bytes(f.read_bytes())
    res = looplm(capsys, "eval", stripped, *common, "--output", tmp_path / "none.json")
    assert res.returncode == 2  # one error line after eval's progress bar:
    assert "does not record the training job" in error_line(res.stderr)


# -- 4. adaptive exit --------------------------------------------------------------------------------------
def test_adaptive_exit_reports_looplms_mean_depth(exported):
    model = exported[0]
    hf = LoopedLMForCausalLM.from_looplm(model, TOK, num_steps=8)
    ids, mask = padded_batch(PROMPTS)
    for tau, low in ((0.05, 2), (0.3, 1), (None, 1)):
        stats: dict = {}
        sampling = SamplingConfig(max_new_tokens=8)
        texts = generate(
            model,
            TOK,
            PROMPTS,
            DepthRule(8, exit_tau=tau, min_depth=low),
            cache="terminal",
            sampling=sampling,
            stats=stats,
            example_ids=[0] * len(PROMPTS),  # every row as if alone, as the wrapper seeds them
        )
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=8,
            do_sample=False,
            cache_kind="terminal",
            exit_tau=tau,
            min_depth=low,
            return_dict_in_generate=True,
        )
        new = out.sequences[:, ids.shape[1] :]
        assert not any(TOK.eos_id in row for row in new.tolist())  # no row stops early (rows ending: below)
        assert [TOK.decode(row) for row in new.tolist()] == texts
        got = hf.last_generate_stats
        assert got == {"mean_decode_depth": stats["mean_decode_depth"], "decode_steps": 7}
        assert out.cache.mean_decode_depth == stats["mean_decode_depth"]
        if tau is None:
            assert got["mean_decode_depth"] == 8.0
        elif tau == 0.05:
            assert low <= got["mean_decode_depth"] < 8  # it really exits early
    hf.generate(ids, attention_mask=mask, max_new_tokens=3, use_cache=False)
    assert hf.last_generate_stats is None


@pytest.mark.parametrize("own_cache", [False, True], ids=["generates-cache", "users-cache"])
def test_mean_depth_counts_only_rows_still_generating(own_cache):
    """A row that ended (EOS) is fed padding by transformers until the batch ends; looplm's `generate`
    takes it out of the batch. The wrapper's mean depth averaged over those padded steps too (4.2286
    against looplm's 4.2222 in the review's case); it now counts what looplm counts, also with a
    `LoopedCache` of the user's own (which learns generate's end-of-sequence ids too)."""
    import copy

    from looplm.hf import LoopedCache

    prompts = ["x", "a longer prompt", "mid size", "the end", "hello"]
    ids, mask = padded_batch(prompts)
    base = decisive_model(TOK.vocab_size, max_seq_len=48)  # its exits vary from row to row
    rule = dict(exit_tau=0.05, min_depth=2)
    first = LoopedLMForCausalLM.from_looplm(base, TOK, num_steps=8).eval()
    plain = first.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **rule)[:, ids.shape[1] :]
    for cand in sorted({t for row in plain.tolist() for t in row[:5]}):  # make EOS win where `cand` would
        model = copy.deepcopy(base)
        with torch.no_grad():
            model.head.weight[TOK.eos_id] = model.head.weight[cand] * 1.5
        hf = LoopedLMForCausalLM.from_looplm(model, TOK, num_steps=8).eval()
        own = {"cache": LoopedCache()} if own_cache else {}
        new = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **rule, **own)
        new = new[:, ids.shape[1] :]
        ended = [TOK.eos_id in row[:6] for row in new.tolist()]
        if any(ended) and not all(ended):
            break
    else:
        raise AssertionError("no token of the greedy text makes some rows (not all) end early: the test needs one")
    stats: dict = {}
    sampling = SamplingConfig(max_new_tokens=8)
    texts = generate(
        model, TOK, prompts, DepthRule(8, **rule), cache="terminal", sampling=sampling, stats=stats,
        example_ids=[0] * len(prompts),
    )  # fmt: skip
    rows = [row[: row.index(TOK.eos_id)] if TOK.eos_id in row else row for row in new.tolist()]
    assert [TOK.decode(row) for row in rows] == texts
    assert hf.last_generate_stats["mean_decode_depth"] == pytest.approx(stats["mean_decode_depth"], abs=1e-9)


def test_generate_of_one_token_reports_num_steps_not_the_prefill_depth():
    """Kills H08 (modeling.py `cache.decode_depth = rule.depth` -> `rule.deepest` after the prefill): a
    generation with no decode step reports the decode depth, as looplm's `generate` does, never the prefill's."""
    model = decisive_model(TOK.vocab_size, max_seq_len=48)
    hf = LoopedLMForCausalLM.from_looplm(model, TOK, num_steps=3).eval()
    stats: dict = {}
    generate(
        model, TOK, ["a longer prompt"], DepthRule(3, 6), cache="terminal",
        sampling=SamplingConfig(max_new_tokens=1), stats=stats, example_ids=[0],
    )  # fmt: skip
    ids = torch.tensor([TOK.encode("a longer prompt")])
    out = hf.generate(ids, max_new_tokens=1, do_sample=False, prefill_steps=6, return_dict_in_generate=True)
    assert stats["mean_decode_depth"] == 3.0
    assert hf.last_generate_stats == {"mean_decode_depth": stats["mean_decode_depth"], "decode_steps": 0}
    assert out.cache.mean_decode_depth == 3.0


def test_min_depth_keyword_bounds_the_adaptive_exit():
    """Kills C01 (configuration.py `depth_rule` ignoring its `min_depth` argument): generate(min_depth=4)
    equals looplm's generate under DepthRule(8, exit_tau, min_depth=4) (texts and mean depth), and differs
    from min_depth=1 (the config's), so the keyword is seen."""
    model = decisive_model(TOK.vocab_size, max_seq_len=48)
    hf = LoopedLMForCausalLM.from_looplm(model, TOK, num_steps=8).eval()
    ids, mask = padded_batch(PROMPTS)
    got = {}
    for low in (1, 4):
        stats: dict = {}
        texts = generate(
            model, TOK, PROMPTS, DepthRule(8, exit_tau=0.3, min_depth=low), cache="terminal",
            sampling=SamplingConfig(max_new_tokens=8), stats=stats, example_ids=[0] * len(PROMPTS),
        )  # fmt: skip
        new = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, exit_tau=0.3, min_depth=low)
        rows = [r[: r.index(TOK.eos_id)] if TOK.eos_id in r else r for r in new[:, ids.shape[1] :].tolist()]
        assert [TOK.decode(r) for r in rows] == texts
        assert hf.last_generate_stats["mean_decode_depth"] == pytest.approx(stats["mean_decode_depth"], abs=1e-9)
        got[low] = stats["mean_decode_depth"]
    assert got[4] >= 4 > got[1]  # the test can fail: min_depth changes the depth


# -- the exit gate's threshold exit (Ouro's rule) --------------------------------------------------------
def gated_model() -> LoopedLM:
    """A decisive model with an exit gate whose exit distribution spreads over the recurrences, so a
    threshold picks different recurrences for different tokens."""
    model = decisive_model(TOK.vocab_size, max_seq_len=48, exit_gate=True)
    with torch.no_grad():
        torch.manual_seed(1)
        for p in model.exit_gate.parameters():
            p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("compile_decode", [False, True])
def test_generate_with_exit_gate_threshold_decodes_as_looplm_does(compile_decode):
    """`exit_gate_threshold` (a generate keyword or config field) decodes as looplm's `generate` under
    DepthRule(depth, exit_gate=q): the gate's recurrence feeds the coda. The wrapper used to ignore the
    gate and decode at num_steps; the texts differ here, so the test sees it. With compile_decode the
    one-token steps (the compiled step has no gate) run the model's forward."""
    model = gated_model()
    hf = LoopedLMForCausalLM.from_looplm(model, TOK, num_steps=6).eval()
    ids, mask = padded_batch(PROMPTS)
    texts = {}
    for q in (None, 0.5):
        texts[q] = generate(
            model, TOK, PROMPTS, DepthRule(6, exit_gate=q), cache="terminal",
            sampling=SamplingConfig(max_new_tokens=8), example_ids=[0] * len(PROMPTS),
        )  # fmt: skip
    assert texts[0.5] != texts[None]  # the threshold changes the text: the test can tell
    new = hf.generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, exit_gate_threshold=0.5,
        compile_decode=compile_decode,
    )  # fmt: skip
    rows = [r[: r.index(TOK.eos_id)] if TOK.eos_id in r else r for r in new[:, ids.shape[1] :].tolist()]
    assert [TOK.decode(r) for r in rows] == texts[0.5]
    by_config = LoopedLMForCausalLM.from_looplm(model, TOK, num_steps=6, exit_gate_threshold=0.5).eval()
    assert torch.equal(by_config.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False), new)


def test_forward_without_a_cache_reads_the_gates_recurrence():
    """A forward without a cache at exit_gate_threshold q is the native forward under
    DepthPlan(num_steps, exit_gate=q), and not the last recurrence's logits."""
    from looplm.model.exits import DepthPlan

    model = gated_model()
    hf = LoopedLMForCausalLM.from_looplm(model, TOK, num_steps=6).eval()
    ids = torch.tensor([TOK.encode("a longer prompt")])
    seeded = dict(init="seeded", example_ids=torch.zeros(1, dtype=torch.long))
    with torch.no_grad():
        want = model(ids, DepthPlan(6, exit_gate=0.5), **seeded).logits
        last = model(ids, 6, **seeded).logits
        got = hf(ids, exit_gate_threshold=0.5).logits
    assert not torch.allclose(want, last)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"exit_gate_threshold": 1.5}, "exit_gate_threshold must be a probability in"),
        ({"exit_gate_threshold": 0.5, "exit_tau": 0.1}, "choose one exit rule: exit_gate_threshold"),
    ],
)
def test_exit_gate_threshold_is_refused_by_its_config_name(fields, message):
    model = gated_model()
    with pytest.raises(ValueError, match=message):
        LoopedLMForCausalLM.from_looplm(model, TOK, **fields)


def test_exit_gate_threshold_needs_a_model_with_a_gate():
    with pytest.raises(ValueError, match="exit_gate_threshold needs a model with an exit gate"):
        LoopedLMForCausalLM.from_looplm(decisive_model(TOK.vocab_size), TOK, exit_gate_threshold=0.5)
    hf = LoopedLMForCausalLM.from_looplm(decisive_model(TOK.vocab_size), TOK).eval()
    with pytest.raises(ValueError, match="exit_gate_threshold needs a model with an exit gate"):
        hf(torch.tensor([[1, 2]]), exit_gate_threshold=0.5)


@pytest.mark.parametrize("q", [0.0, 1.0])
def test_exit_gate_thresholds_at_the_ends_of_0_1_are_accepted(q):
    """A threshold is a probability: 0 (every token reads the first recurrence) and 1 are allowed, as
    looplm's DepthRule allows them, in the config and as a forward keyword; the forward is the native
    forward under DepthPlan(num_steps, exit_gate=q)."""
    from looplm.model.exits import DepthPlan

    model = gated_model()
    hf = LoopedLMForCausalLM.from_looplm(model, TOK, num_steps=6, exit_gate_threshold=q).eval()
    assert hf.config.exit_gate_threshold == q
    ids = torch.tensor([TOK.encode("a longer prompt")])
    seeded = dict(init="seeded", example_ids=torch.zeros(1, dtype=torch.long))
    with torch.no_grad():
        want = model(ids, DepthPlan(6, exit_gate=q), **seeded).logits
        got = hf(ids, exit_gate_threshold=q).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_an_export_keeps_the_checkpoints_own_data_record(tmp_path):
    """The exported folder's held-out data is the checkpoint's data record (data.json), not one rebuilt from the job,
    which it may differ from (a converted model's evaluation text, its origin)."""
    import dataclasses

    from looplm.data.record import DataRecord

    model = tiny_model()
    job = {**tiny_job(tmp_path).to_dict(), "model": model.cfg.to_dict()}
    record = dataclasses.replace(DataRecord.from_job(job), source="shakespeare", seq_len=48, origin="converted")
    assert record != DataRecord.from_job(job)

    def populate(tmp):
        ckpt.save_tensors(tmp, "model.safetensors", model.state_dict())
        ckpt.write_json(tmp, "config.json", job)
        ckpt.write_data_record(tmp, record)
        TOK.save(tmp)

    ckpt.write_atomic(tmp_path / "ckpt", populate)
    assert ckpt.load_data(tmp_path / "ckpt") == record
    export(tmp_path / "ckpt", tmp_path / "hf")
    assert ckpt.load_data(tmp_path / "hf") == record


# -- the config's adaptive exit ------------------------------------------------------------------------------
def test_the_configs_exit_tau_and_min_depth_drive_generate():
    """Q32, Q33: a config's exit_tau and min_depth (no keyword) decode as looplm's generate under DepthRule(8, exit_tau,
    min_depth): the same texts and mean depth, within [min_depth, 8)."""
    model = decisive_model(TOK.vocab_size, max_seq_len=48)
    ids, mask = padded_batch(PROMPTS)
    for low in (1, 4):
        hf = LoopedLMForCausalLM.from_looplm(model, TOK, num_steps=8, exit_tau=0.3, min_depth=low).eval()
        stats: dict = {}
        texts = generate(
            model, TOK, PROMPTS, DepthRule(8, exit_tau=0.3, min_depth=low), cache="terminal",
            sampling=SamplingConfig(max_new_tokens=8), stats=stats, example_ids=[0] * len(PROMPTS),
        )  # fmt: skip
        new = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        rows = [r[: r.index(TOK.eos_id)] if TOK.eos_id in r else r for r in new[:, ids.shape[1] :].tolist()]
        assert [TOK.decode(r) for r in rows] == texts
        got = hf.last_generate_stats["mean_decode_depth"]
        assert got == pytest.approx(stats["mean_decode_depth"], abs=1e-9) and low <= got < 8
