"""Every looplm command runs on a converted checkpoint: a tiny Huginn, Ouro and Parcae are converted
through `looplm convert --data TEXT` (the held-out text the checkpoint's job records), then `looplm
eval` (native perplexity, terminal/full sharing), `looplm generate` (terminal and full cache) and
`looplm analyze` run on them through the CLI's `main`.
"""

from __future__ import annotations

import json

import pytest
from test_convert_huginn import make_huginn
from test_convert_ouro import make_ouro
from test_convert_parcae import make_parcae

from looplm.cli import main

TEXT = ("The recurrent model thinks deeper and deeper. " * 8 + "\n") * 6
FAST_ANALYZE = [
    "--horizon",
    "4",
    "--sequences",
    "2",
    "--batch-size",
    "2",
    "--kv-depths",
    "1",
    "2",
    "--kv-span",
    "1",
    "--solve-spans",
    "1",
    "--solve-length",
    "8",
    "--solve.max-depth",
    "40",
    "--sharing-depths",
    "1",
    "2",
    "--sharing-sequences",
    "2",
    "--no-plots",
]


@pytest.mark.parametrize("family, make", [("huginn", make_huginn), ("ouro", make_ouro), ("parcae", make_parcae)])
def test_eval_generate_analyze_on_a_converted_checkpoint(tmp_path, capsys, family, make):
    src = make(tmp_path / "src")
    text = tmp_path / "texts"  # a folder: one document per file
    text.mkdir()
    for i in range(4):
        (text / f"doc{i}.txt").write_text(TEXT)
    ckpt = tmp_path / "converted"
    assert main(["convert", str(src), str(ckpt), "--from", family, "--data", str(text)]) == 0
    assert json.loads((ckpt / "config.json").read_text())["data"]["source"] == str(text)
    capsys.readouterr()

    report = tmp_path / "eval.json"
    assert (
        main(
            [
                "eval",
                str(ckpt),
                "--depths",
                "1",
                "2",
                "--max-sequences",
                "2",
                "--task-examples",
                "0",
                "--batch-size",
                "2",
                "--sharing-sequences",
                "2",
                "--output",
                str(report),
            ]
        )
        == 0
    )
    result = json.loads(report.read_text())
    assert set(result["perplexity"]) == {"1", "2"} and set(result["sharing"]) == {"1", "2"}
    assert "val ppl" in capsys.readouterr().out

    for cache in ("terminal", "full"):
        assert (
            main(
                [
                    "generate",
                    str(ckpt),
                    "--prompt",
                    "The recurrent",
                    "--depth",
                    "2",
                    "--cache",
                    cache,
                    "--max-new-tokens",
                    "4",
                    "--temperature",
                    "0",
                ]
            )
            == 0
        )
    if family == "ouro":  # its own exit gate, next to looplm's state-change exit
        for rule in (["--exit-gate", "0.5"], ["--exit-tau", "0.01", "--min-depth", "1"]):
            assert (
                main(
                    [
                        "generate",
                        str(ckpt),
                        "--prompt",
                        "The recurrent",
                        "--depth",
                        "3",
                        "--max-new-tokens",
                        "4",
                        "--temperature",
                        "0",
                        *rule,
                    ]
                )
                == 0
            )
    capsys.readouterr()

    out = tmp_path / "analyze"
    assert main(["analyze", str(ckpt), *FAST_ANALYZE, "--output", str(out)]) == 0
    assert {"convergence", "kv_settling", "sharing"} <= set(json.loads((out / "report.json").read_text()))

    # distillation reads the teacher's own initial state (Ouro: the embedding; Huginn: its noise)
    student = tmp_path / "student"
    assert (
        main(
            [
                "distill",
                str(ckpt),
                "--out-dir",
                str(student),
                "--depth",
                "2",
                "--steps",
                "2",
                "--micro-batch",
                "2",
                "--calibration-rows",
                "2",
                "--val-rows",
                "2",
                "--val-every",
                "2",
                "--log-every",
                "1",
                "--checkpoint-every",
                "100",
                "--init",
                "random",
                "--warmup",
                "1",
                "--no-progress",
                "--device",
                "cpu",
                "--report-rows",
                "0",
                "--report-examples",
                "0",
            ]
        )
        == 0
    )
    assert (student / "checkpoints" / "latest").is_file()


@pytest.mark.parametrize("family, make", [("huginn", make_huginn), ("ouro", make_ouro), ("parcae", make_parcae)])
def test_export_of_a_converted_checkpoint_keeps_its_logits(tmp_path, family, make):
    """The release tokenizer (its own end-of-text/padding names) and the switches survive `looplm export`."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import looplm.hf  # noqa: F401  (registers the model type)
    from looplm.checkpoint import load_model

    ckpt = tmp_path / "converted"
    assert main(["convert", str(make(tmp_path / "src")), str(ckpt), "--from", family]) == 0
    assert main(["export", str(ckpt), str(tmp_path / "hf"), "--num-steps", "3"]) == 0
    model, tok, _ = load_model(ckpt)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "The recurrent model"
    assert hf_tok(text)["input_ids"] == tok.encode(text) and hf_tok.eos_token_id == tok.eos_id
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        want = model(ids, 3, init="seeded").logits
        got = hf(ids, num_steps=3).logits
    assert (got - want).abs().max() <= 1e-5
