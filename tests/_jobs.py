"""Small training-job factories shared by the trainer, checkpoint, distributed and CLI tests.

Everything is shrunk from the `tiny` preset so that a few optimizer steps take well under a
second on a CPU: a 32-wide model, 64-token sequences, 2000 generator examples, fp32.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch

from looplm.train.config import TrainJob, job_preset

# Overrides applied to the `tiny` preset, as (config path, value). The same list drives the
# in-process jobs (`tiny_job`) and the command-line flags (`tiny_flags`), so CLI runs and
# Trainer runs train the very same model on the very same data.
TINY = (
    ("model.d_model", 32),
    ("model.n_heads", 2),
    ("model.n_kv_heads", 1),
    ("model.ffn_dim", 64),
    ("model.max_seq_len", 64),
    ("data.seq_len", 64),
    ("data.source", "tasks"),  # the preset reads Shakespeare; tests use the faster task generator
    ("data.n_task_examples", 2000),
    ("train.steps", 8),
    ("train.micro_batch", 4),
    ("train.grad_accum", 2),
    ("train.eval_every", 0),
    ("train.log_every", 1),
    ("train.progress", False),
    ("train.tensorboard", False),
    ("train.precision", "fp32"),
    ("train.device", "cpu"),
    ("eval.depths", (1, 2)),
    ("eval.task_examples", 20),
    ("eval.max_sequences", 8),
    ("eval.batch_size", 16),
    ("eval.sample_tokens", 8),
)


def _set(job: TrainJob, dotted: str, value) -> None:
    *path, name = dotted.split(".")
    obj = job
    for part in path:
        obj = getattr(obj, part)
    if not hasattr(obj, name):
        raise AttributeError(f"no config field {dotted}")
    setattr(obj, name, value)


def tiny_job(tmp_path: Path, name: str = "run", *, cache: Path | None = None, **overrides) -> TrainJob:
    """The shrunken tiny job writing to tmp_path/name; `overrides` use '__' for '.', e.g.
    `train__steps=4`, `depth__sampler="fixed"`."""
    job = job_preset("tiny")
    for key, value in TINY:
        _set(job, key, value)
    job.data.cache_dir = Path(cache) if cache is not None else Path(tmp_path) / "cache"
    job.train.out_dir = Path(tmp_path) / name
    for key, value in overrides.items():
        _set(job, key.replace("__", "."), value)
    return job


def _flag(dotted: str) -> str:
    return "--" + dotted.replace("_", "-")


def tiny_flags(tmp_path: Path, name: str = "run", *, cache: Path | None = None, **overrides) -> list[str]:
    """Command-line flags for `looplm train tiny` equivalent to `tiny_job(...)`."""
    values = dict(TINY)
    values["data.cache_dir"] = Path(cache) if cache is not None else Path(tmp_path) / "cache"
    values["train.out_dir"] = Path(tmp_path) / name
    values.update({k.replace("__", "."): v for k, v in overrides.items()})
    argv: list[str] = []
    for key, value in values.items():
        if isinstance(value, bool):  # tyro: --section.flag / --section.no-flag
            section, name = key.rsplit(".", 1)
            argv.append(_flag(key) if value else _flag(f"{section}.no_{name}"))
        elif isinstance(value, (tuple, list)):
            argv += [_flag(key), *map(str, value)]
        elif value is None:
            argv += [_flag(key), "None"]
        else:
            argv += [_flag(key), str(value)]
    return argv


def read_metrics(out_dir: Path) -> list[dict]:
    """The records of out_dir/metrics.jsonl."""
    path = Path(out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def step_records(out_dir: Path) -> dict[int, dict]:
    """{step: record} of the training records (those with a loss) of a run."""
    return {r["step"]: r for r in read_metrics(out_dir) if "loss" in r}


def losses(out_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in step_records(out_dir).items()}


def torchrun_cmd(nproc: int, script, *args) -> list[str]:
    """`torch.distributed.run` with `nproc` local ranks. `--standalone` binds its rendezvous store
    and the ranks' store to port 0 and hands the chosen port to the ranks, so no port is picked
    ahead (picking a free port and passing it on races with other processes binding it). Its logs
    go beside `script` (a test's own folder), not to a `torchelastic_*` folder in /tmp per launch."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "--local-addr",
        "127.0.0.1",
        "--log-dir",
        str(Path(script).parent / "torchrun-logs"),
        str(script),
        *map(str, args),
    ]


def error_line(stderr: str) -> str:
    """The one `error: ...` line a failing looplm command writes, checked to be its last line and
    to come without a traceback. Other lines (warnings of libraries whose versions are not pinned)
    are not the test's business."""
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == errors[0], stderr[-3000:]
    assert len(errors[0]) < 400, errors[0]
    return errors[0]


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: one thread each, no CUDA, unbuffered output."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        CUDA_VISIBLE_DEVICES="",
        TOKENIZERS_PARALLELISM="false",
    )
    env.update(extra)
    return env


def looplm_cmd(*args: str) -> list[str]:
    """The `looplm` console script next to this interpreter (the venv's), else `python -m looplm.cli`."""
    script = Path(sys.executable).parent / "looplm"
    if script.is_file():
        return [str(script), *args]
    return [sys.executable, "-m", "looplm.cli", *args]


def shared_cache(tmp_path_factory) -> Path:
    """A token-cache folder shared by every test of the session (caches are content-keyed, so
    runs with the same data reuse one build; concurrent builders are handled by looplm)."""
    return tmp_path_factory.getbasetemp() / "looplm-token-cache"


@contextlib.contextmanager
def one_thread():
    """One intra-op thread for module-scoped fixtures (tests use conftest's `single_thread`):
    tiny models gain nothing from more, and on a loaded 2-core machine OpenMP spin-waiting
    makes them 10-50x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


CHOICE_TASK_YAML = """task: looplm_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""


def write_choice_task(folder: Path, rows: list[dict]) -> Path:
    """A local lm-eval multiple-choice task `looplm_choice` (folder/looplm_choice.yaml) over `rows`
    ({"context", "choices", "gold"}) stored in folder/choice.jsonl; returns the JSONL path."""
    data = folder / "choice.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "looplm_choice.yaml").write_text(CHOICE_TASK_YAML.format(data=data))
    return data


def write_random_run(root: Path, **overrides) -> Path:
    """A run folder `root` holding one checkpoint (step 1) of a random tiny byte-level model, as
    `looplm train` writes it; `overrides` as in `tiny_job` (e.g. data__source="shakespeare")."""
    from looplm import checkpoint as ckpt
    from looplm.data import ByteTokenizer
    from looplm.model import LoopedLM

    job = tiny_job(root.parent, root.name, **overrides)
    job.model.vocab_size = ByteTokenizer().vocab_size
    torch.manual_seed(0)
    ckpt.save_model(root, LoopedLM(job.model), job.to_dict(), ByteTokenizer())
    return root


def write_hf_weights(root: Path, state: dict, shards: int = 1) -> None:
    """`state` as an HF-style weights folder: model.safetensors, or `shards` files round-robin by
    sorted name plus model.safetensors.index.json (the layout the converters read)."""
    from safetensors.torch import save_file

    if shards <= 1:
        save_file(state, str(root / "model.safetensors"), metadata={"format": "pt"})
        return
    keys = sorted(state)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: state[k] for k in part}, str(root / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def read_hf_weights(root: Path) -> dict:
    """Every tensor of an HF-style weights folder (single file or sharded), as float64."""
    from safetensors.torch import load_file

    index = root / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    return {k: t.double() for name in files for k, t in load_file(str(root / name)).items()}


def assert_full_cache_decodes_like_the_forward(model, prompt: torch.Tensor, depth: int, n_new: int, **forward) -> None:
    """Greedy decoding of `prompt` [1, L] with a full cache at `depth`: every step's logits equal the
    whole forward recomputed (keyword arguments `forward`, e.g. init="seeded") to 1e-4, and the
    tokens equal greedy decoding without a cache (the converter tests' check of each family)."""
    from looplm.infer.cache import make_cache
    from looplm.infer.extend import extend

    cache = make_cache("full", model.cfg, 1, prompt.shape[1] + n_new, depth)
    logits = extend(model, prompt, cache, depth).logits[:, -1]
    cached, seq = [], prompt
    for _ in range(n_new):
        nxt = logits.argmax(-1)
        cached.append(int(nxt))
        with torch.no_grad():
            full = model(seq, depth, **forward).logits[:, -1]  # recompute the whole forward
        torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4)
        seq = torch.cat([seq, nxt[:, None]], 1)
        logits = extend(model, nxt[:, None], cache, depth).logits[:, -1]
    uncached, seq = [], prompt
    for _ in range(n_new):
        with torch.no_grad():
            nxt = model(seq, depth, **forward).logits[:, -1].argmax(-1)
        uncached.append(int(nxt))
        seq = torch.cat([seq, nxt[:, None]], 1)
    assert cached == uncached


def run_main(argv, capsys):
    """looplm.cli.main in-process: (exit status, stdout, stderr). Any exception escaping main
    would be a traceback for the user, so it fails the test."""
    from looplm.cli import main

    grad_mode = torch.is_grad_enabled()
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exit_:  # tyro's parse errors
        rc = exit_.code
    finally:
        leaked = torch.is_grad_enabled() != grad_mode
        torch.set_grad_enabled(grad_mode)
    assert not leaked, "looplm.cli.main changed the global autograd mode"
    out, err = capsys.readouterr()
    return rc, out, err
