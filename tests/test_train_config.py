"""Training presets: what `looplm train tiny|S|M|L` runs on and in which precision."""

from __future__ import annotations

import pytest
import torch

from looplm.cli import main
from looplm.errors import UserError
from looplm.train.config import DataConfig, TrainJob, job_preset
from looplm.train.trainer import Trainer, resolve_dtype

PAPER = ["S", "M", "L"]


@pytest.mark.parametrize("preset", PAPER)
def test_paper_presets_do_not_default_to_the_task_generator(tmp_path, capsys, preset):
    """`looplm train S` without --data.source stops with a one-line error naming the option (it trained on
    the synthetic addition task before); the Python API refuses the same job."""
    assert main(["train", preset, "--train.out-dir", str(tmp_path / "run")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(err) == 1 and "--data.source" in err[0], err
    assert not (tmp_path / "run").exists()
    with pytest.raises(UserError, match="data.source is required"):
        Trainer(job_preset(preset))


def test_a_job_without_a_preset_defaults_to_text():
    assert DataConfig().source == TrainJob().data.source == job_preset("tiny").data.source == "shakespeare"


@pytest.mark.parametrize("preset", ["tiny", *PAPER])
def test_presets_train_in_bf16_on_cuda_and_fp32_on_cpu(preset):
    """Every preset leaves the precision to `auto`: bf16 autocast on CUDA, fp32 on any CPU."""
    precision = job_preset(preset).train.precision
    assert resolve_dtype(precision, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype(precision, torch.device("cpu")) == torch.float32
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16  # asked for explicitly
    assert resolve_dtype("fp32", torch.device("cuda")) == torch.float32


# the optimisation defaults and the paper's peak learning rate (design §6)
def test_optimisation_defaults_follow_the_design():
    from looplm.train.config import TrainConfig

    t = TrainConfig()
    assert (t.beta1, t.beta2, t.weight_decay, t.grad_clip) == (0.9, 0.98, 0.1, 1.0)
    assert (t.warmup_frac, t.decay_frac) == (1 / 20, 1 / 10)  # W = T/20, D = T/10
    assert job_preset("S").train.lr == 1.5e-3  # paper peak at S (fixed depth, PLN)
    assert all(job_preset(p).train.warmup_frac == 1 / 20 for p in ("tiny", *PAPER))


# config.py `grad_accum: int = 1` -> 2 (the tiny preset trained twice the batch the README states)
def test_the_tiny_preset_trains_400_steps_of_16_x_256_tokens():
    t, d = job_preset("tiny").train, job_preset("tiny").data
    assert (t.steps, t.micro_batch, t.grad_accum, d.seq_len) == (400, 16, 1, 256)  # README: Quick start
