"""The GPU benchmark's CPU dry run (`benchmarks/gpu_train.py --tiny`) in CI, so the prepared GPU run cannot
break unseen: the FlexAttention check, every timing row, and every one-rank torchrun job (train with its
depth report, distill, RL) on a gloo group exit cleanly, with tyro hidden as on the GPU machine, and
every row reaches the output folder's JSONL as well as its JSON."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _jobs import subprocess_env

ROOT = Path(__file__).resolve().parents[1]

# Imported first by every Python process that has this folder on its path (the benchmark, torchrun,
# its worker): `import tyro` fails there, as on the GPU machine, which has torch but not tyro.
HIDE_TYRO = """
import sys


class HideTyro:
    def find_spec(self, name, path=None, target=None):
        if name == "tyro" or name.startswith("tyro."):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the dry-run test)", name=name)
        return None


sys.meta_path.insert(0, HideTyro())
"""


@pytest.mark.slow
def test_gpu_train_dry_run_without_tyro(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE_TYRO)
    path = os.pathsep.join(p for p in (str(site), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)
    env = subprocess_env(PYTHONPATH=path)
    hidden = subprocess.run([sys.executable, "-c", "import tyro"], env=env, capture_output=True, text=True)
    assert hidden.returncode != 0 and "hidden by the dry-run test" in hidden.stderr
    out = tmp_path / "out"
    # backend 'eager': dynamo traces every compiled block and the baseline as inductor would (graphs,
    # fullgraph, recompiles) without generating code, which keeps the dry run to a minute
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_train.py"),
        "--tiny",
        "--out",
        str(out),
        "--compile-backend",
        "eager",
        "--runs-dir",
        str(tmp_path / "runs"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    res = json.loads((out / "gpu_train_tiny.json").read_text())
    assert res["finished"] and res["modules"]["tyro"].startswith("not importable")
    assert [c["check"] for c in res["checks"]] == ["flex_vs_sdpa", "chunked_ce_vs_full"]
    assert all(c["ok"] for c in res["checks"]), res["checks"]
    assert res["peak"]["best"] >= res["peak"]["median"] > 0
    rows = res["rows"]
    assert len(rows) == 13
    for r in rows:
        assert "error" not in r and "skipped" not in r, r
        assert r["tokens_per_s"] > 0 and r["graphs_compiled_in_timed_steps"] == 0, r
        assert r["losses_finite"] and len(r["losses"]) == 2, r  # the timed steps' losses, read after timing
        assert all(abs(v - math.log(512)) < 1.0 for v in r["losses"]), r  # random data, vocab 512: about ln V
    first = {}
    for r in rows:
        first.setdefault((r["seq"], r["arm"]), r)
    for (seq, arm), r in first.items():  # compiled arms compiled graphs of their own; eager ones none
        assert (r["graphs_compiled"] > 0) == (arm != "eager-sdpa"), r
    packed = [r for r in rows if r["mask"] == "packed"]
    assert all(r["mfu_pairs"] < r["mfu"] for r in packed)  # a document mask runs fewer pairs than causal rows
    jobs = res["torchrun_one_rank"]
    assert [j["job"] for j in jobs] == ["train", "distill", "rl"]
    for j in jobs:
        assert j["rc"] == 0, j["tail"]
        assert j["process_group"].startswith("process group: gloo, 1 rank(s)"), j
    report = json.loads((tmp_path / "runs" / "train" / "eval.json").read_text())
    assert report["samples"]["tokens"] < 200 and set(report["samples"]["by_depth"]) == {"1", "5"}
    # every row also went to the JSONL and the log as it was measured
    decode = res[
        "decode"
    ]  # eager, compiled, compiled-unroll-R, compiled+speculate at batch 1; the first two at batch 16
    assert [(r["arm"], r["batch"]) for r in decode] == [
        ("eager", 1),
        ("compiled", 1),
        ("compiled-unroll-R", 1),
        ("compiled+speculate", 1),
        ("eager", 16),
        ("compiled", 16),
    ]
    for r in decode:
        assert "error" not in r and r["tokens_per_s"] > 0, r
    assert 0 <= decode[3]["acceptance_rate"] <= 1 and decode[3]["tokens_per_verify"] >= 1
    lines = [json.loads(line) for line in (out / "gpu_train_tiny.jsonl").read_text().splitlines()]
    assert [x for x in lines if x.pop("section") == "rows"] == rows
    assert len(lines) == 2 + 13 + 6 + 3
    log = (out / "gpu_train_tiny.log").read_text()
    assert log.count("rows: ") == 13 and "torchrun_one_rank: " in log
    assert (out / "gpu_train_tiny_torchrun_train.log").read_text().count("process group: gloo") == 1
