"""`looplm convert --from xllm-loop STUDENT OUT --teacher CONVERTED_TEACHER`: a distilled prefill student of the
paper's reference release (ifm-ai/xllm-loop, xllm/paper_part2/distill.py `Student`) -> a looplm student checkpoint.

Each test builds a tiny random teacher artifact (test_convert_xllm_loop.make_release) and a student artifact in
the release layout: config.json with the teacher's fields but huginn_*/loop_* (arch "transformer", num_layers 2)
and a `student` section pinning the teacher artifact's manifest SHA-256, BF16 `in_proj.weight` and
`layers.{0,1}.*` TransformerBlock tensors in two shards with an index, artifact_manifest.json. The converted
student is compared with a reference forward written here from the release's equations:
z_hat = layers(in_proj(e)) on the raw prelude output e, interleaved RoPE, norm gains stored as offsets from 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_convert_xllm_loop import D, FFN, HEADS, KV, _json_bytes, _layer, make_release, reference_logits
from test_convert_xllm_loop import write_manifest

from looplm.checkpoint import CheckpointError, load_model
from looplm.cli import main
from looplm.convert import convert_xllm_loop
from looplm.distill import load_student
from looplm.infer import TerminalCache
from looplm.infer.prefill import student_prefill
from looplm.model.blocks import rope_tables

LEARNED = {
    "huginn_sampling_scheme": "poisson-lognormal-capped",
    "huginn_backprop_depth": 10,
    "huginn_depth_prior": "learned",
    "huginn_depth_prior_entropy": 0.01,
}  # the students' teacher recipe


def make_student(
    root: Path,
    teacher: Path,
    *,
    d: int = D,
    n_layers: int = 2,
    mutate=None,
    pin: str | None = None,
    manifest: bool = True,
    fields: dict | None = None,
) -> Path:
    """A release student artifact for the teacher artifact `teacher` (distill.py student_config + Student)."""
    root.mkdir(parents=True)
    teacher_fields = json.loads((teacher / "config.json").read_text())["model"]
    overrides, fields = (
        fields or {},
        {k: v for k, v in teacher_fields.items() if not k.startswith(("huginn_", "loop_"))},
    )
    fields.update(arch="transformer", num_layers=n_layers, model_dim=d, head_dim=d // HEADS, rope_head_dim=d // HEADS)
    fields.update(overrides)
    g = torch.Generator().manual_seed(7)

    def rnd(*shape, std=0.2):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    hd = d // HEADS
    state = {"in_proj.weight": (torch.eye(d) * 0.7 + torch.randn(d, d, generator=g) * 0.1).bfloat16()}
    for j in range(n_layers):
        p = f"layers.{j}."
        state.update(
            {
                p + "attention.norm.weight": rnd(d),
                p + "attention.wq.weight": rnd(HEADS * hd, d),
                p + "attention.wk.weight": rnd(KV * hd, d),
                p + "attention.wv.weight": rnd(KV * hd, d),
                p + "attention.wo.weight": rnd(d, HEADS * hd),
                p + "nffn.norm.weight": rnd(d),
                p + "nffn.fc1.weight": rnd(FFN, d),
                p + "nffn.fc3.weight": rnd(FFN, d),
                p + "nffn.fc2.weight": rnd(d, FFN),
            }
        )
    if mutate:
        mutate(state)
    keys = sorted(state)
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2 :]), start=1):
        name = f"model-{i:05d}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, str(root / name))
        weight_map.update(dict.fromkeys(part, name))
    (root / "model.safetensors.index.json").write_bytes(_json_bytes({"metadata": {}, "weight_map": weight_map}))
    pinned = pin or json.loads((teacher / "artifact_manifest.json").read_text())["manifest_sha256"]
    (root / "config.json").write_bytes(
        _json_bytes(
            {"model": fields, "student": {"teacher": "huginn-s-learned-entropy0p01", "teacher_manifest_sha256": pinned}}
        )
    )
    for doc in ("README.md", "LICENSE", "NOTICE"):
        (root / doc).write_text(f"test {doc}\n")
    if manifest:
        write_manifest(root)
    return root


def reference_student(src: Path, e: torch.Tensor, base: float) -> torch.Tensor:
    """The release Student's forward in float64: layers(in_proj(e)), no input or final norm."""
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    w = {}
    for shard in set(index.values()):
        w.update({k: t.double() for k, t in load_file(str(src / shard)).items()})
    x = e.double() @ w["in_proj.weight"].T
    n_layers = json.loads((src / "config.json").read_text())["model"]["num_layers"]
    for j in range(n_layers):
        x = _layer(x, w, j, base)
    return x


@pytest.fixture
def converted(tmp_path):
    teacher_src = make_release(tmp_path / "teacher", **LEARNED)
    teacher = convert_xllm_loop(teacher_src, tmp_path / "teacher-ckpt")
    return teacher_src, teacher


@pytest.mark.parametrize("variant", ["diagonal", "parcae"])
def test_student_matches_the_release_equations(tmp_path, variant):
    teacher_src = make_release(tmp_path / "teacher", variant, **LEARNED)
    teacher = convert_xllm_loop(teacher_src, tmp_path / "teacher-ckpt")
    src = make_student(tmp_path / "student", teacher_src)
    out = convert_xllm_loop(src, tmp_path / "student-ckpt", teacher=teacher)
    model, _, _ = load_model(teacher)
    student, meta = load_student(out, model)
    assert (student.n_blocks, student.input_norm) == (2, None)
    assert meta["conversion"]["from"] == "xllm-loop" and meta["conversion"]["manifest_verified"]
    assert (
        meta["conversion"]["teacher_manifest_sha256"]
        == json.loads((teacher_src / "artifact_manifest.json").read_text())["manifest_sha256"]
    )

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=g)
    rope = rope_tables(torch.arange(12).expand(2, 12), model.cfg.head_dim, model.cfg.rope_base)
    with torch.no_grad():
        e = model.run_prelude(tokens, rope, None)
        got = student(e, rope, None)
    want = reference_student(src, e, model.cfg.rope_base)
    delta = (got.double() - want).abs().max().item()
    assert delta <= 1e-4, delta

    # the distilled prefill: student, one teacher recurrence (injection + core) and the coda, as the release's
    # prefill_banks; its logits equal the release teacher's one recurrence from the state z_hat
    cache = TerminalCache(model.cfg, 2, 16)
    logits = student_prefill(model, student, tokens, cache)
    ref = reference_logits(teacher_src, tokens, 1, want)
    assert (logits.double() - ref).abs().max().item() <= 1e-4


def test_cli_converts_a_student_and_generates_with_it(tmp_path, capsys, converted):
    teacher_src, teacher = converted
    src = make_student(tmp_path / "student", teacher_src)
    out = tmp_path / "student-ckpt"
    assert main(["convert", str(src), str(out), "--from", "xllm-loop", "--teacher", str(teacher)]) == 0
    assert "--prefill student" in capsys.readouterr().out
    assert (
        main(
            [
                "generate",
                str(teacher),
                "--prompt",
                "the looped",
                "--prefill",
                "student",
                "--student",
                str(out),
                "--max-new-tokens",
                "3",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("the looped")


def test_bf16_student_loads(tmp_path, converted):
    teacher_src, teacher = converted
    out = convert_xllm_loop(make_student(tmp_path / "student", teacher_src), tmp_path / "s", "bf16", teacher=teacher)
    assert {t.dtype for t in load_file(str(out / "student.safetensors")).values()} == {torch.bfloat16}
    student, _ = load_student(out, load_model(teacher)[0])
    assert student.in_proj.weight.dtype == torch.float32


# -- refusals ----------------------------------------------------------------------------------------
def _drop(state):
    del state["layers.1.nffn.fc2.weight"]


def _extra(state):
    state["norm.weight"] = torch.zeros(D, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"d": 48}, "the student's model_dim 48 contradicts the teacher's 32"),
        ({"mutate": _drop}, "missing tensor layers.1.nffn.fc2.weight"),
        ({"mutate": _extra}, "unknown tensor norm.weight"),
        ({"pin": "0" * 64}, "was distilled from the teacher artifact with manifest 000000000000"),
        # fields that would give blocks of another shape or forward than the teacher's
        ({"fields": {"num_kv_heads": HEADS}}, f"the student's num_kv_heads {HEADS} contradicts the teacher's {KV}"),
        ({"fields": {"rope_head_dim": 4}}, "the student's rope_head_dim 4 != head_dim 8"),
        ({"fields": {"residual_func": "gated"}}, "residual_func = 'gated'"),
        ({"fields": {"swiglu": False}}, "model.swiglu = False"),
    ],
)
def test_refuses_students_that_do_not_fit_the_teacher(tmp_path, converted, kwargs, match):
    teacher_src, teacher = converted
    src = make_student(tmp_path / "student", teacher_src, **kwargs)
    with pytest.raises(CheckpointError, match=match):
        convert_xllm_loop(src, tmp_path / "out", teacher=teacher)
    assert not (tmp_path / "out").exists()


def test_cli_refusals_are_one_line_and_write_nothing(tmp_path, capsys, converted):
    teacher_src, teacher = converted
    src = make_student(tmp_path / "student", teacher_src)
    cases = [
        (["--from", "xllm-loop"], "is a distilled prefill student; convert its teacher artifact first"),
        (["--from", "xllm-loop", "--teacher", str(tmp_path / "student")], "not a looplm checkpoint"),
        (["--from", "huginn", "--teacher", str(teacher)], "--teacher applies to --from xllm-loop"),
    ]
    for flags, match in cases:
        assert main(["convert", str(src), str(tmp_path / "out"), *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err
        assert any(m in err for m in match.split("|")), err
        assert not (tmp_path / "out").exists()
    # --teacher with a model artifact, and a student whose manifest was edited
    assert (
        main(["convert", str(teacher_src), str(tmp_path / "out"), "--from", "xllm-loop", "--teacher", str(teacher)])
        == 2
    )
    assert "is for a distilled student artifact" in capsys.readouterr().err
    shard = src / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))
    assert main(["convert", str(src), str(tmp_path / "out"), "--from", "xllm-loop", "--teacher", str(teacher)]) == 2
    assert "does not match artifact_manifest.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_refuses_a_teacher_converted_without_a_manifest(tmp_path):
    teacher_src = make_release(tmp_path / "teacher", manifest=False, **LEARNED)
    teacher = convert_xllm_loop(teacher_src, tmp_path / "teacher-ckpt")
    src = make_student(tmp_path / "student", teacher_src, pin="a" * 64)
    with pytest.raises(CheckpointError, match="cannot be confirmed"):
        convert_xllm_loop(src, tmp_path / "out", teacher=teacher)
    assert not (tmp_path / "out").exists()


def test_refuses_a_teacher_not_converted_from_xllm_loop(tmp_path, converted):
    """Guards against: the teacher's provenance check dropped. A looplm checkpoint converted from another family is
    refused as such (not later, as a teacher whose manifest cannot be confirmed)."""
    from test_convert_huginn import make_huginn

    from looplm.convert import convert_huginn

    teacher_src, _ = converted
    other = convert_huginn(make_huginn(tmp_path / "huginn"), tmp_path / "other-ckpt")
    src = make_student(tmp_path / "student", teacher_src)
    with pytest.raises(CheckpointError, match="is not a checkpoint converted by `looplm convert --from xllm-loop`"):
        convert_xllm_loop(src, tmp_path / "out", teacher=other)
    assert not (tmp_path / "out").exists()


def test_norm_offset_is_added_to_every_block_norm_gain(tmp_path, converted):
    """Guards against: one norm gain given a fixed + 1 instead of `norm_offset`. With norm_offset 0 the student's norm
    gains are the stored tensors themselves; every other tensor is the same either way."""
    teacher_src, teacher = converted
    src = make_student(tmp_path / "student", teacher_src)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    stored = {}
    for shard in set(index.values()):
        stored.update({k: t.float() for k, t in load_file(str(src / shard)).items()})
    model, _, _ = load_model(teacher)
    plain, _ = load_student(convert_xllm_loop(src, tmp_path / "s0", "fp32", teacher=teacher, norm_offset=0.0), model)
    offset, _ = load_student(convert_xllm_loop(src, tmp_path / "s1", "fp32", teacher=teacher), model)
    for j in range(2):
        for looplm_name, release_name in (("attn_norm", "attention.norm"), ("ffn_norm", "nffn.norm")):
            want = stored[f"layers.{j}.{release_name}.weight"]
            torch.testing.assert_close(getattr(plain.blocks[j], looplm_name).weight, want, rtol=0, atol=0)
            torch.testing.assert_close(getattr(offset.blocks[j], looplm_name).weight, want + 1, rtol=0, atol=0)
    torch.testing.assert_close(plain.in_proj.weight, stored["in_proj.weight"], rtol=0, atol=0)


# -- the student's fields, its conversion record, residuals, the manifest's coverage -------------------
@pytest.mark.parametrize(
    "fields, match",
    [
        # the student's head_dim field ignored (d // heads assumed)
        ({"head_dim": 4}, "the student's head_dim 4 contradicts the teacher's 8"),
        # the student's rmsnorm_eps not compared with the teacher's norm_eps
        ({"rmsnorm_eps": 1e-5}, "the student's rmsnorm_eps 1e-05 contradicts the teacher's 1e-06"),
        # the arch check dropped (a student section over a Huginn model's fields)
        ({"arch": "huginn"}, "model.arch = 'huginn'; a release student is 'transformer'"),
        # `n_blocks < 0`; zero blocks is refused here, in the converter's one-line form
        ({"num_layers": 0}, "the student has num_layers 0; it needs at least one block"),
    ],
)
def test_refuses_student_fields_its_weights_would_not_show(tmp_path, converted, fields, match):
    """Fields that differ from the teacher's while the tensors keep the teacher's shapes: refused by the field,
    before anything is written (the shape check alone would accept them)."""
    teacher_src, teacher = converted
    n_layers = fields.get("num_layers", 2)
    src = make_student(tmp_path / "student", teacher_src, n_layers=n_layers, fields=fields)
    with pytest.raises(CheckpointError, match=match):
        convert_xllm_loop(src, tmp_path / "out", teacher=teacher)
    assert not (tmp_path / "out").exists()


def test_a_student_without_a_student_section_is_still_a_student(tmp_path, converted):
    """A dense artifact holding `in_proj` is a student even when config.json lacks the section (then refused for naming
    no teacher manifest), not read as a model artifact."""
    teacher_src, teacher = converted
    src = make_student(tmp_path / "student", teacher_src, manifest=False)
    config = json.loads((src / "config.json").read_text())
    del config["student"]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="is a distilled prefill student; convert its teacher artifact first"):
        convert_xllm_loop(src, tmp_path / "out")
    with pytest.raises(CheckpointError, match="names no student.teacher_manifest_sha256"):
        convert_xllm_loop(src, tmp_path / "out", teacher=teacher)
    assert not (tmp_path / "out").exists()


def test_the_conversion_record_says_what_was_verified_and_written(tmp_path, converted):
    """student.json's conversion section describes this conversion."""
    teacher_src, teacher = converted
    model = load_model(teacher)[0]
    src = make_student(tmp_path / "student", teacher_src, manifest=False)
    _, meta = load_student(convert_xllm_loop(src, tmp_path / "s", teacher=teacher, norm_offset=0.5), model)
    conversion = meta["conversion"]
    assert (conversion["manifest_verified"], conversion["manifest_sha256"]) == (False, None)
    assert (conversion["norm_offset"], conversion["dtype"]) == (0.5, "float32")
    _, meta = load_student(convert_xllm_loop(src, tmp_path / "s16", "bf16", teacher=teacher), model)
    assert (meta["conversion"]["norm_offset"], meta["conversion"]["dtype"]) == (1.0, "bfloat16")


def test_the_add_residual_converts_as_the_base_one(tmp_path, converted):
    """xllm's 'add' residual is the plain one (out = h + residual), so a student recorded with it converts to the very
    tensors of its 'base' twin."""
    teacher_src, teacher = converted
    model = load_model(teacher)[0]
    base = make_student(tmp_path / "base", teacher_src)
    add = make_student(tmp_path / "add", teacher_src, fields={"residual_func": "add"})
    want, _ = load_student(convert_xllm_loop(base, tmp_path / "s-base", teacher=teacher), model)
    got, _ = load_student(convert_xllm_loop(add, tmp_path / "s-add", teacher=teacher), model)
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), want.state_dict().values()))


def test_an_index_the_manifest_does_not_list_is_refused(tmp_path, converted):
    """Every file the conversion reads, model.safetensors.index.json included, must be listed in
    artifact_manifest.json."""
    teacher_src, teacher = converted
    src = make_student(tmp_path / "student", teacher_src)
    path = src / "artifact_manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["manifest_sha256"]
    manifest["files"] = [r for r in manifest["files"] if r["path"] != "model.safetensors.index.json"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is read but not listed"):
        convert_xllm_loop(src, tmp_path / "out", teacher=teacher)
    assert not (tmp_path / "out").exists()
