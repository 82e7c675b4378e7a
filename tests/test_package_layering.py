"""Dependencies point one way: model <- infer <- eval / analyze / distill / rl / serve / hf <- cli;
converters map into looplm's config and checkpoint format only.

Scans every import statement (top level and inside functions) of every package and top-level
module, in every form: `import looplm.x`, `from looplm.x import y`, `from looplm import x`,
relative imports (`from . import x`, `from ..x import y`) and `importlib.import_module("looplm.x")`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "looplm"

# package or top-level module -> the looplm packages/modules it may import (cli: anything)
ALLOWED = {
    "errors": {"errors"},
    "config": {"config"},
    "data": {"data"},
    "model": {"config", "model"},
    "checkpoint": {"config", "data", "model", "checkpoint"},
    "infer": {"config", "model", "infer", "data"},
    "depth": {"config", "data", "model", "checkpoint", "depth"},
    "eval": {"config", "model", "infer", "data", "eval", "checkpoint"},
    "analyze": {"config", "model", "infer", "data", "eval", "analyze", "checkpoint"},
    "serve": {"config", "model", "infer", "data", "serve"},
    "hf": {"config", "model", "infer", "data", "checkpoint", "hf"},
    "train": {"config", "model", "data", "depth", "checkpoint", "eval", "train"},
    "distill": {"config", "model", "infer", "data", "eval", "checkpoint", "train", "distill"},
    "rl": {"config", "model", "infer", "data", "eval", "checkpoint", "train", "rl"},
    "convert": {"config", "model", "data", "checkpoint", "convert", "train", "depth", "distill"},  # job, student format
    "vllm_plugin": {"config", "model", "infer", "hf", "vllm_plugin"},  # infer: the DepthRule it checks
}
BASE = {"errors"}  # the user-error type (stdlib only), importable from every layer
ALLOWED = {package: allowed | BASE for package, allowed in ALLOWED.items()}


def _top(dotted: str, root: Path) -> str | None:
    """The looplm package or top-level module a dotted module name lies in (None outside looplm).
    A name the package root itself defines (`from looplm import ModelConfig`) counts as looplm.config,
    the only module the root imports (checked below)."""
    parts = dotted.split(".")
    if parts[0] != "looplm":
        return None
    if len(parts) == 1:
        return "config"
    return parts[1] if (root / parts[1]).is_dir() or (root / f"{parts[1]}.py").is_file() else "config"


def looplm_imports(path: Path, root: Path = SRC) -> set[str]:
    """The looplm packages/modules `path` (a file under `root`, the looplm package folder) imports."""
    package = ["looplm", *path.relative_to(root).parent.parts]  # the file's own package
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: level 1 is the file's package, 2 its parent, ...
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [module] if module != "looplm" else [f"looplm.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and "import_module" in (
            getattr(node.func, "attr", None),
            getattr(node.func, "id", None),
        ):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        out |= {t for t in (_top(n, root) for n in names) if t is not None}
    return out


def upward_imports(root: Path, name: str) -> set[str]:
    """'file -> looplm.x' for each import of package or module `name` that ALLOWED does not permit."""
    files = [root / f"{name}.py"] if (root / f"{name}.py").is_file() else sorted((root / name).rglob("*.py"))
    return {f"{p.relative_to(root)} -> looplm.{m}" for p in files for m in looplm_imports(p, root) - ALLOWED[name]}


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_lower_layers_do_not_reach_up(name):
    assert (SRC / name).is_dir() or (SRC / f"{name}.py").is_file(), name
    bad = upward_imports(SRC, name)
    assert not bad, sorted(bad)


def test_every_package_is_covered_and_the_layers_form_no_cycle():
    tops = {p.name.removesuffix(".py") for p in SRC.iterdir() if p.suffix == ".py" or any(p.glob("*.py"))}
    assert tops - {"__init__", "cli"} == set(ALLOWED)
    seen: dict[str, int] = {}  # depth-first search: 1 on the stack, 2 done

    def visit(name: str) -> None:
        assert seen.get(name) != 1, f"the allowed imports have a cycle through {name}"
        if name not in seen:
            seen[name] = 1
            for other in ALLOWED[name] - {name}:
                visit(other)
            seen[name] = 2

    for name in ALLOWED:
        visit(name)
    assert looplm_imports(SRC / "__init__.py") == {"config"}  # root names are config's


def test_the_scanner_sees_every_import_form(tmp_path):
    """A fake looplm tree whose model package imports upward in each form; each is reported."""
    root = tmp_path / "looplm"
    for folder in ("model", "model/sub", "serve", "rl", "infer", "hf", "distill", "eval", "train"):
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "__init__.py").write_text("")
    (root / "config.py").write_text("")
    forms = {
        "absolute.py": ("import looplm.serve.engine\n", "serve"),
        "from_module.py": ("from looplm.rl.trainer import x\n", "rl"),
        "from_root.py": ("from looplm import infer\n", "infer"),
        "relative.py": ("from .. import hf\n", "hf"),
        "relative_module.py": ("from ..distill.student import EndpointStudent\n", "distill"),
        "sub/deeper.py": ("def f():\n    from ...eval import harness\n", "eval"),
        "dynamic.py": ("import importlib\nimportlib.import_module('looplm.train')\n", "train"),
    }
    for name, (code, _) in forms.items():
        (root / "model" / name).write_text(code)
    fine = (
        "from . import sub\nfrom .sub import deeper\nimport torch\n"
        "from looplm import ModelConfig\nfrom looplm.config import X\n"
    )
    (root / "model" / "fine.py").write_text(fine)
    for name, (_, target) in forms.items():
        assert looplm_imports(root / "model" / name, root) == {target}, name
    assert looplm_imports(root / "model" / "fine.py", root) == {"model", "config"}
    assert upward_imports(root, "model") == {f"model/{name} -> looplm.{target}" for name, (_, target) in forms.items()}


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


def private_imports(root: Path = SRC) -> set[str]:
    """'file: module.name' for each private name (leading underscore) one looplm module imports from another."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("looplm"):
                found |= {
                    f"{path.relative_to(root)}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                }
    return found


def test_no_private_name_is_imported_across_modules(tmp_path):
    assert not private_imports(), sorted(private_imports())
    planted = tmp_path / "looplm" / "serve"
    planted.mkdir(parents=True)
    (planted / "m.py").write_text("from looplm.infer.generate import _cut_at_stop\nfrom looplm.x import y as _y\n")
    assert private_imports(tmp_path / "looplm") == {"serve/m.py: looplm.infer.generate._cut_at_stop"}


def block_walks(root: Path = SRC) -> set[str]:
    """'file:line' of each loop outside `model/` over a model's prelude, core or coda blocks
    (`for ... in x.core`, `zip(x.prelude, ...)`): only `LoopedLM` runs its blocks (design §16).
    Loops over a cache's banks (`cache.core`) are not block walks."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in ("model", "vllm_plugin") or rel == Path("infer/cache.py"):
            continue  # the model itself; the vLLM model's own vLLM blocks; the caches' banks of those names
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.For, ast.comprehension)):
                continue
            for sub in ast.walk(node.iter):
                if (
                    isinstance(sub, ast.Attribute)
                    and sub.attr in ("prelude", "core", "coda")
                    and not (isinstance(sub.value, ast.Name) and "cache" in sub.value.id)
                    and not (isinstance(sub.value, ast.Attribute) and "cache" in sub.value.attr)
                ):
                    found.add(f"{rel}:{node.lineno if hasattr(node, 'lineno') else node.iter.lineno}")
    return found


def test_only_the_model_walks_its_blocks(tmp_path):
    # train/parallelize lists the blocks to wrap them (FSDP, checkpointing, compile), it does not run them
    assert {w for w in block_walks() if not w.startswith("train/parallelize.py")} == set()
    planted = tmp_path / "looplm" / "infer"
    planted.mkdir(parents=True)
    (planted / "m.py").write_text(
        "def f(model, cache, x):\n    for b in cache.core:\n        pass\n    for b in model.core:\n        x = b(x)\n"
    )
    assert block_walks(tmp_path / "looplm") == {"infer/m.py:4"}
