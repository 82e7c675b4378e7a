"""Convert a distilled prefill student of the paper's reference release (github ifm-ai/xllm-loop; the Part II
artifacts `IFM/LoopedLM-P2-distilled-{s,m}-{random,teacher}-init`) into a looplm student checkpoint
(`looplm.distill.checkpoint`) for the teacher converted from the student's release teacher.

The release's student (xllm/paper_part2/distill.py, `Student`) is a bias-free `d x d` `in_proj` followed by
`num_layers` (two) of the teacher's TransformerBlocks, applied to the teacher's raw prelude output with
the teacher's RoPE: z_hat = layers(in_proj(e)), no input norm, no final norm. That is looplm's
`EndpointStudent(cfg, n_blocks, input_norm=False)`. Its artifact (xllm/paper_part2/artifacts.py) has the
release layout without the tokenizer:

  config.json                     {"model": <the teacher's ModelConf fields but huginn_*/loop_*, with
                                    arch "transformer" and num_layers 2>,
                                   "student": {"teacher_manifest_sha256": <the teacher artifact's>, ...}}
  model.safetensors.index.json    shards of `in_proj.weight` and `layers.{j}.{attention,nffn}.*` in BF16
  artifact_manifest.json          size and SHA-256 of every file, and manifest_sha256
  README.md, LICENSE, NOTICE

The release loads a student only with the teacher artifact whose manifest SHA-256 the student's config
pins; here the teacher is a looplm checkpoint converted from that artifact, whose conversion.json records it.
The block tensors take the teacher conversion's transforms (norm gains = stored + 1, wq/wk rows permuted
from interleaved to half-split RoPE pairs).
"""

from __future__ import annotations

from pathlib import Path

from looplm import checkpoint as ckpt
from looplm.checkpoint import CheckpointError
from looplm.convert.common import DTYPES, INDEX, check_folders, read_checked, read_json, refuse_pickles
from looplm.convert.common import shard_map as _shard_map
from looplm.convert.xllm_release import (
    MANIFEST,
    REQUIRED,
    block_shapes,
    check_covered,
    field,
    map_block,
    verify_manifest,
)

STUDENT_SECTION = "student"


def _refuse(message: str) -> CheckpointError:
    return CheckpointError(message)


def is_student(config: dict, weight_names) -> bool:
    """A release student artifact: a config with a `student` section, or a dense model holding `in_proj`."""
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    return isinstance(config.get(STUDENT_SECTION), dict) or (
        model.get("arch") == "transformer" and "in_proj.weight" in weight_names
    )


def _teacher(teacher: Path):
    """(model, conversion.json) of a looplm checkpoint converted by `looplm convert --from xllm-loop`."""
    path = ckpt.resolve(Path(teacher))
    if not path.is_dir():
        raise _refuse(f"no teacher checkpoint at {teacher}")
    model, _, _ = ckpt.load_model(path)
    try:
        provenance = ckpt.read_json(path, "conversion.json")
    except FileNotFoundError:
        provenance = {}
    if provenance.get("from") != "xllm-loop":
        raise _refuse(
            f"{path} is not a checkpoint converted by `looplm convert --from xllm-loop`; convert the "
            "student's release teacher first and pass that as --teacher"
        )
    return model, provenance


def _check_fields(model: dict, cfg, src: Path) -> int:
    """The student's block count, after checking that its fields give blocks of the teacher's shape."""
    if field(model, "arch") != "transformer":
        raise _refuse(f"{src}: config.json model.arch = {field(model, 'arch')!r}; a release student is 'transformer'")
    for name, want in REQUIRED:
        if name != "arch" and field(model, name) != want:
            raise _refuse(
                f"{src}: config.json model.{name} = {field(model, name)!r}: looplm converts only {name} = {want!r}"
            )
    if field(model, "residual_func") not in ("base", "add"):
        raise _refuse(
            f"{src}: config.json model.residual_func = {field(model, 'residual_func')!r}: looplm "
            "converts only the plain residual (base)"
        )
    d, heads = int(field(model, "model_dim")), int(field(model, "num_heads"))
    have = {
        "model_dim": d,
        "num_heads": heads,
        "num_kv_heads": int(field(model, "num_kv_heads") or heads),
        "head_dim": int(field(model, "head_dim") or d // heads),
        "ffn_hidden_dim": int(field(model, "ffn_hidden_dim")),
        "rmsnorm_eps": float(field(model, "rmsnorm_eps")),
    }
    want = {
        "model_dim": cfg.d_model,
        "num_heads": cfg.n_heads,
        "num_kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "ffn_hidden_dim": cfg.ffn_dim,
        "rmsnorm_eps": cfg.norm_eps,
    }
    for name in have:
        if have[name] != want[name]:
            raise _refuse(f"{src}: the student's {name} {have[name]} contradicts the teacher's {want[name]}")
    for name in ("v_head_dim", "rope_head_dim"):
        if field(model, name) not in (None, cfg.head_dim):
            raise _refuse(f"{src}: the student's {name} {field(model, name)} != head_dim {cfg.head_dim}")
    n_blocks = int(field(model, "num_layers"))
    if n_blocks < 1:
        raise _refuse(f"{src}: the student has num_layers {n_blocks}; it needs at least one block")
    return n_blocks


def convert_xllm_student(
    src: Path, out: Path, teacher: Path, dtype: str | None = None, *, norm_offset: float = 1.0
) -> Path:
    """Convert the release student artifact `src` into the looplm student checkpoint `out` (new or empty) for
    `teacher`, the looplm checkpoint converted from the student's release teacher. Raises CheckpointError with
    a one-line reason, before anything is written, for anything it cannot convert exactly."""
    from looplm.distill.checkpoint import save_student
    from looplm.distill.student import EndpointStudent

    src, out, teacher = Path(src), Path(out), Path(teacher)
    check_folders(src, out, dtype)
    if out.resolve() == teacher.resolve():
        raise _refuse("the output folder must differ from the student and teacher folders")
    refuse_pickles(src)
    manifest = verify_manifest(src)
    config = read_json(src / "config.json", "an xllm-loop release folder")
    model_fields = config.get("model")
    if not isinstance(model_fields, dict):
        raise _refuse(f"{src}: config.json has no 'model' section")
    pinned = (config.get(STUDENT_SECTION) or {}).get("teacher_manifest_sha256")
    if not isinstance(pinned, str) or not pinned:
        raise _refuse(
            f"{src}: config.json names no student.teacher_manifest_sha256; the release ties a student "
            "to its teacher artifact by it"
        )
    weight_map = _shard_map(src)
    check_covered(
        src, manifest, ["config.json", *([INDEX] if (src / INDEX).is_file() else []), *sorted(set(weight_map.values()))]
    )

    teacher_model, provenance = _teacher(teacher)
    if provenance.get("manifest_sha256") is None:
        raise _refuse(
            f"{teacher} was converted from a folder without {MANIFEST}; the student's teacher "
            f"(manifest {pinned[:12]}) cannot be confirmed"
        )
    if provenance["manifest_sha256"] != pinned:
        raise _refuse(
            f"{src} was distilled from the teacher artifact with manifest {pinned[:12]}, "
            f"{teacher} was converted from {str(provenance['manifest_sha256'])[:12]}"
        )
    cfg = teacher_model.cfg
    n_blocks = _check_fields(model_fields, cfg, src)

    expected = {"in_proj.weight": (cfg.d_model, cfg.d_model)}
    for j in range(n_blocks):
        expected.update(block_shapes(f"layers.{j}.", cfg))
    state = read_checked(src, expected, family="release student")
    mapped = {"in_proj.weight": state["in_proj.weight"]}
    for j in range(n_blocks):
        mapped.update(map_block(state, f"layers.{j}.", f"blocks.{j}", cfg, norm_offset))

    student = EndpointStudent(cfg, n_blocks=n_blocks, input_norm=False)
    ckpt.check_model_shapes(student.state_dict(), mapped, src)
    student.load_state_dict(mapped)
    target = DTYPES[dtype]
    conversion = {
        "from": "xllm-loop",
        "source": str(src.resolve()),
        "manifest_sha256": manifest.get("manifest_sha256") if manifest else None,
        "manifest_verified": manifest is not None,
        "teacher_manifest_sha256": pinned,
        "release_student": config.get(STUDENT_SECTION),
        "dtype": str(target).removeprefix("torch."),
        "norm_offset": norm_offset,
        "rope": "interleaved pairs permuted to half-split",
    }
    if out.is_dir():
        out.rmdir()  # empty (checked above): write_atomic renames the finished folder into place
    return save_student(
        out, student.to(target), teacher_model, teacher_path=str(ckpt.resolve(teacher).resolve()), conversion=conversion
    )
