"""Dependencies point one way: model <- infer <- eval / analyze / distill / rl / serve <- cli;
converters map into looplm's config and checkpoint format only.

Scans every import statement (top-level and inside functions) of the lower packages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "looplm"

# package -> the looplm packages/modules it may import
ALLOWED = {
    "model": {"config", "model"},
    "infer": {"config", "model", "infer", "data"},
    "eval": {"config", "model", "infer", "data", "eval", "checkpoint"},
    "analyze": {"config", "model", "infer", "data", "eval", "analyze", "checkpoint"},
    "data": {"data"},
    "serve": {"config", "model", "infer", "data", "serve"},
    "convert": {"config", "model", "data", "checkpoint", "convert", "train", "depth", "distill"},  # job, student format
    "vllm_plugin": {"config", "model", "hf", "vllm_plugin"},
}
BASE = {"errors"}  # the user-error type (stdlib only), importable from every layer
ALLOWED = {package: allowed | BASE for package, allowed in ALLOWED.items()}


def looplm_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("looplm."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out |= {a.name.split(".")[1] for a in node.names if a.name.startswith("looplm.")}
    return out


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_lower_layers_do_not_reach_up(package):
    bad = {f"{p.relative_to(SRC)} -> looplm.{m}" for p in (SRC / package).rglob("*.py")
           for m in looplm_imports(p) - ALLOWED[package]}
    assert not bad, sorted(bad)


def test_scanner_sees_function_level_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from looplm.distill.evaluate import x\n    import looplm.rl.trainer\n")
    assert looplm_imports(f) == {"distill", "rl"}


def test_only_the_vllm_plugin_imports_vllm():
    """vLLM is an optional environment of its own: nothing outside looplm.vllm_plugin imports it."""
    def imports_vllm(path: Path) -> bool:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
                return True
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in node.names):
                return True
        return False

    users = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if imports_vllm(p)}
    assert users and all(u.startswith("vllm_plugin/") for u in users), sorted(users)
