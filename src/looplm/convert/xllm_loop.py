"""Convert a checkpoint of the paper's reference release (github ifm-ai/xllm-loop; the Part II
artifacts `IFM/LoopedLM-P2-huginn-*`) into a looplm checkpoint that `looplm.checkpoint.load_model` reads.

The source is a local folder in the release's artifact layout (xllm/paper_part2/artifacts.py):

  config.json                     {"model": <ModelConf fields>,
                                   "tokenizer": {"type": "huggingface", "path": "tokenizer"}}
  model.safetensors.index.json    {"metadata": {...}, "weight_map": {tensor name: shard file}}
  model-0000i-of-0000N.safetensors  the release model's state dict in BF16
  artifact_manifest.json          size and SHA-256 of every file, and manifest_sha256 of the manifest itself
  tokenizer/                      tokenizer.json, tokenizer_config.json, special_tokens_map.json

The model is the release's `DepthControlledHuginn` (arch 'huginn', xllm/models/looped.py): physical layers
0..P-1 are the prelude, P..P+C-1 the recurrent core and the rest the coda; every recurrence applies the
input injection and then the core layers; the prelude output is optionally RMS-normalised (Parcae-Decay)
and the state optionally passes a parameter-free RMSNorm after each recurrence (Huginn-Linear). Part I's
plain Huginn (huginn_depth_control false) has the diagonal injection without norms, or no injection at all
(huginn_input_injection 'none', the dense-middle models); huginn_state_init 'input' starts the state from
the prelude output (looplm's state_init="input"), which is how the input enters a model without injection.

Its blocks come from the upstream xllm library (ifm-ai/xllm, xllm/modules): pre-norm attention and
SwiGLU FFN (silu(fc1 x) * fc3 x -> fc2) with plain residuals, scale 1/sqrt(head_dim), query head h
reading kv head h // (heads / kv_heads), no biases.

Tensor transforms (release -> looplm):
- RMSNorm weights are stored as offsets from 1 (GroupRMSNorm: zero init, gain = weight + 1; `norm_offset`);
- RoPE rotates interleaved channel pairs (2j, 2j+1) of each head (complex multiply on x.reshape(..., -1, 2)),
  looplm the half-split pairs
  (j, j + hd/2): the rows of wq and wk are permuted per head so that both give the same scores;
- the diagonal injection's `dt_bias` and `A_log` have looplm's meaning (dt = softplus(dt_bias),
  a = exp(A_log)) and are copied unchanged; the linear injection's W [d, 2d] acting on [s; e] is
  split into looplm's A_state (columns :d) and A_input (columns d:, with the bias).

Nothing is downloaded and nothing is unpickled: a folder holding pickle weights (.bin, .pt, ...)
is refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from looplm.checkpoint import CheckpointError, save_tensors, write_atomic
from looplm.config import ModelConfig
from looplm.convert.common import (
    DTYPES,
    INDEX,
    check_family,
    check_folders,
    check_vocab,
    read_checked,
    read_json,
    release_job,
    write_release_files,
)
from looplm.convert.common import refuse_pickles as _refuse_pickles
from looplm.convert.common import shard_map as _shard_map
from looplm.convert.xllm_release import REQUIRED, block_shapes, check_covered, field, map_block, refuse, verify_manifest

TOKENIZER_DIR = "tokenizer"
RELEASE_MAX_SEQ_LEN = 8192  # the release trains and evaluates at 8,192 tokens


# -- config ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Release:
    """What the conversion needs from the release's model fields."""

    cfg: ModelConfig
    n_layers: int
    scheme: str  # diagonal | linear | none
    prelude_norm: bool
    linear_bias: bool
    state_init: str
    fields: dict


def _scheme(model: dict) -> tuple[str, str, bool, bool]:
    """(looplm injection, release injection kind, prelude norm, exit norm) of the release fields."""
    kind = field(model, "huginn_input_injection")
    if kind not in ("diagonal", "linear", "none"):
        raise refuse(f"unknown huginn_input_injection {kind!r}")
    controlled = bool(field(model, "huginn_depth_control"))
    if kind == "none":  # Part I dense-middle: no injection, the input enters only as the initial state s0 = e
        if field(model, "huginn_state_init") != "input":
            raise refuse(
                "huginn_input_injection 'none' with huginn_state_init "
                f"{field(model, 'huginn_state_init')!r}: the input would never enter the recurrence"
            )
        if controlled and (
            field(model, "huginn_prelude_norm") != "none"
            or field(model, "huginn_recurrent_exit_norm") != "none"
            or field(model, "huginn_prelude_orthogonal")
        ):
            raise refuse(
                "huginn_input_injection 'none' with a prelude or exit norm or OrthoInj has no looplm equivalent"
            )
        return "none", kind, False, False
    # Plain Huginn (no depth control) always builds the diagonal injection and neither norm.
    prelude_norm = controlled and field(model, "huginn_prelude_norm") == "rms"
    exit_norm = controlled and field(model, "huginn_recurrent_exit_norm") == "parameterless_rms"
    ortho = controlled and bool(field(model, "huginn_prelude_orthogonal"))
    if controlled and field(model, "huginn_prelude_norm") not in ("none", "rms"):
        raise refuse(f"unknown huginn_prelude_norm {field(model, 'huginn_prelude_norm')!r}")
    if controlled and field(model, "huginn_recurrent_exit_norm") not in ("none", "parameterless_rms"):
        raise refuse(f"unknown huginn_recurrent_exit_norm {field(model, 'huginn_recurrent_exit_norm')!r}")
    if not controlled or kind == "diagonal":
        kind = "diagonal"
    if kind == "linear":
        if prelude_norm or not exit_norm:
            raise refuse(
                "looplm's huginn-linear injection has the parameter-free exit norm and no prelude norm; "
                "this linear-injection config differs"
            )
        return "huginn-linear", kind, False, True
    if exit_norm:
        raise refuse("a recurrent exit norm with the diagonal injection has no looplm equivalent")
    if ortho and prelude_norm:
        raise refuse("OrthoInj with a prelude norm has no looplm equivalent")
    if ortho:
        return "ortho", kind, False, False
    return ("parcae-decay" if prelude_norm else "parcae-nonorm"), kind, prelude_norm, False


def _release(config: dict, tokenizer_vocab: int) -> _Release:
    model = config.get("model")
    if not isinstance(model, dict):
        raise refuse("config.json has no 'model' section")
    for name, want in REQUIRED:
        if field(model, name) != want:
            raise refuse(f"config.json model.{name} = {field(model, name)!r}: looplm converts only {name} = {want!r}")
    if field(model, "residual_func") not in ("base", "add"):  # both: out = h + residual
        raise refuse(
            f"config.json model.residual_func = {field(model, 'residual_func')!r}: looplm converts "
            "only the plain residual (base)"
        )
    d, heads = int(field(model, "model_dim")), int(field(model, "num_heads"))
    kv = int(field(model, "num_kv_heads") or heads)
    head_dim = int(field(model, "head_dim") or d // heads)
    if head_dim * heads != d:
        raise refuse(f"head_dim {head_dim} x num_heads {heads} != model_dim {d}: looplm derives head_dim = d / heads")
    if field(model, "v_head_dim") not in (None, head_dim):
        raise refuse(f"v_head_dim {field(model, 'v_head_dim')} != head_dim {head_dim} has no looplm equivalent")
    if field(model, "rope_head_dim") not in (None, head_dim):
        raise refuse(
            f"rope_head_dim {field(model, 'rope_head_dim')} != head_dim {head_dim}: looplm rotates whole heads"
        )
    vocab = int(field(model, "vocab_size"))
    vocab = tokenizer_vocab if vocab == -1 else vocab
    if field(model, "output_size") not in (-1, vocab):
        raise refuse(f"output_size {field(model, 'output_size')} != vocab_size {vocab} has no looplm equivalent")
    n_layers = int(field(model, "num_layers"))
    n_prelude, n_coda = int(field(model, "huginn_prelude_layers")), int(field(model, "huginn_coda_layers"))
    n_core = field(model, "huginn_recurrent_layers")
    n_core = n_layers - n_prelude - n_coda if n_core is None else int(n_core)
    if n_prelude + n_core + n_coda != n_layers or n_core < 1:
        raise refuse(f"prelude {n_prelude} + core {n_core} + coda {n_coda} layers != num_layers {n_layers}")
    injection, kind, prelude_norm, _ = _scheme(model)
    state_init = field(model, "huginn_state_init")
    if state_init not in ("normal", "input"):  # the release's default is 'zero'
        raise refuse(
            f"huginn_state_init {state_init!r}: a zero initial state has no looplm state_init (it would "
            "start from noise); only 'normal' and 'input' releases convert"
        )
    if state_init == "input" and prelude_norm:
        raise refuse(
            "huginn_state_init 'input' with a prelude norm: which prelude output starts the state is not mapped"
        )
    max_depth = max(64, int(field(model, "loop_times")), int(field(model, "huginn_poisson_lognormal_max")))
    cfg = ModelConfig(
        vocab_size=vocab,
        d_model=d,
        n_heads=heads,
        n_kv_heads=kv,
        ffn_dim=int(field(model, "ffn_hidden_dim")),
        n_prelude=n_prelude,
        n_core=n_core,
        n_coda=n_coda,
        max_seq_len=RELEASE_MAX_SEQ_LEN,
        injection=injection,
        rope_base=float(field(model, "rope_base")),
        norm_eps=float(field(model, "rmsnorm_eps")),
        ortho_eps=float(field(model, "huginn_ortho_projection_eps")),
        max_depth=max_depth,
        state_init=state_init,  # input: s0 = the prelude output e
    )
    try:
        cfg.validate()
    except ValueError as err:
        raise refuse(f"config.json model section gives an invalid looplm shape: {err}") from None
    return _Release(
        cfg,
        n_layers,
        kind,
        prelude_norm,
        bool(field(model, "apply_bias_term")),
        str(field(model, "huginn_state_init")),
        model,
    )


def _expected_shapes(rel: _Release) -> dict[str, tuple[int, ...]]:
    """The release model's state-dict names and shapes for these fields."""
    c = rel.cfg
    d = c.d_model
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (c.vocab_size, d),
        "output.final_norm.weight": (d,),
        "output.output.weight": (c.vocab_size, d),
    }
    for i in range(rel.n_layers):
        shapes.update(block_shapes(f"layers.{i}.", c))
    if rel.scheme == "none":
        pass  # no injection module
    elif rel.scheme == "linear":
        shapes["input_injection.adapter.weight"] = (d, 2 * d)
        if rel.linear_bias:
            shapes["input_injection.adapter.bias"] = (d,)
    else:
        shapes.update(
            {
                "input_injection.input_adapter.weight": (d, d),
                "input_injection.A_log": (d,),
                "input_injection.dt_bias": (d,),
            }
        )
    if rel.prelude_norm:
        shapes["huginn_prelude_norm_module.weight"] = (d,)
    return shapes


# -- tensors -----------------------------------------------------------------------------------------
def _map_state(state: dict[str, torch.Tensor], rel: _Release, norm_offset: float) -> dict[str, torch.Tensor]:
    """Release state dict (float32) -> looplm LoopedLM state dict (float32)."""
    c = rel.cfg
    out = {
        "embed.weight": state["embed.weight"],
        "norm.weight": state["output.final_norm.weight"] + norm_offset,
        "head.weight": state["output.output.weight"],
    }
    blocks = (
        [f"prelude.{i}" for i in range(c.n_prelude)]
        + [f"core.{i}" for i in range(c.n_core)]
        + [f"coda.{i}" for i in range(c.n_coda)]
    )
    for i, name in enumerate(blocks):  # physical layer order: prelude, core, coda
        out.update(map_block(state, f"layers.{i}.", name, c, norm_offset))
    d = c.d_model
    if rel.scheme == "none":
        return out
    if rel.scheme == "linear":  # W [s; e] + b  ->  A_state s + (A_input e + b)
        w = state["input_injection.adapter.weight"]
        out["injection.A_state.weight"] = w[:, :d]
        out["injection.A_input.weight"] = w[:, d:]
        out["injection.A_input.bias"] = state.get("input_injection.adapter.bias", torch.zeros(d))
    else:  # same parametrisation: dt = softplus(dt_bias) = softplus(dt_raw), a = exp(A_log)
        out["injection.W.weight"] = state["input_injection.input_adapter.weight"]
        out["injection.dt_raw"] = state["input_injection.dt_bias"]
        out["injection.A_log"] = state["input_injection.A_log"]
        if rel.prelude_norm:
            out["injection.prelude_norm.weight"] = state["huginn_prelude_norm_module.weight"] + norm_offset
    return out


# -- tokenizer ---------------------------------------------------------------------------------------
def _special_name(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _tokenizer(src: Path, config: dict):
    """The release tokenizer as a looplm BPETokenizer with the release's eos/pad names and BOS policy
    (`looplm.data.tokenizer.bos_policy`). Returns (tokenizer, files read, note)."""
    from tokenizers import Tokenizer as HFTokenizer

    from looplm.data.tokenizer import BPETokenizer, bos_policy

    section = config.get("tokenizer")
    if not isinstance(section, dict) or section.get("type") != "huggingface":
        raise refuse("config.json has no huggingface 'tokenizer' section; looplm checkpoints need the tokenizer")
    folder = str(section.get("path") or TOKENIZER_DIR)
    if Path(folder).is_absolute() or ".." in Path(folder).parts:
        folder = TOKENIZER_DIR  # a path on the training machine: the artifact holds it under tokenizer/
    tok_dir = src / folder
    read = [f"{folder}/tokenizer.json"]
    if not (tok_dir / "tokenizer.json").is_file():
        raise refuse(f"{src}: no {folder}/tokenizer.json")
    names: dict[str, str | None] = {"eos_token": None, "pad_token": None}
    files: dict[str, dict] = {}
    for fname in ("special_tokens_map.json", "tokenizer_config.json"):
        files[fname] = {}
        if (tok_dir / fname).is_file():
            read.append(f"{folder}/{fname}")
            files[fname] = read_json(tok_dir / fname, "an xllm-loop release folder")
            for key in names:
                names[key] = names[key] or _special_name(files[fname].get(key))
    if names["eos_token"] is None:
        raise refuse(f"{tok_dir}: no eos_token in special_tokens_map.json or tokenizer_config.json")
    note = None
    if names["pad_token"] is None:
        names["pad_token"], note = names["eos_token"], "no pad_token in the release tokenizer: padding uses eos"
    try:
        backend = HFTokenizer.from_file(str(tok_dir / "tokenizer.json"))
        bos = bos_policy(backend, files["tokenizer_config.json"], files["special_tokens_map.json"])
        tok = BPETokenizer.from_file(tok_dir / "tokenizer.json", names["eos_token"], names["pad_token"], bos)
    except ValueError as err:
        raise refuse(str(err)) from None
    except Exception as err:  # tokenizers raises its own error types
        raise refuse(f"{tok_dir}: cannot read tokenizer.json ({err})") from None
    return tok, read, note


# -- job dict ----------------------------------------------------------------------------------------
def _job_dict(cfg: ModelConfig, model: dict, tokenizer_path: str, data: str | None = None) -> dict:
    """config.json as a looplm training run of this model would write it (TrainJob.resolved().to_dict())."""
    from looplm.depth.config import DepthConfig, LearnedPriorConfig

    scheme = field(model, "huginn_sampling_scheme")
    window = field(model, "huginn_backprop_depth")
    window = None if window is None else int(window)
    if field(model, "huginn_depth_prior") == "learned":
        depth = DepthConfig(
            sampler="learned",
            depth=float(field(model, "huginn_poisson_lognormal_target_mean")),
            sigma=float(field(model, "huginn_poisson_lognormal_sigma")),
            cap=int(field(model, "huginn_poisson_lognormal_max")),
            bptt_window=window,
            learned=LearnedPriorConfig(entropy_weight=float(field(model, "huginn_depth_prior_entropy"))),
        )
    elif scheme == "poisson-lognormal-capped":
        depth = DepthConfig(
            sampler="pln",
            depth=float(field(model, "huginn_poisson_lognormal_target_mean")),
            sigma=float(field(model, "huginn_poisson_lognormal_sigma")),
            cap=int(field(model, "huginn_poisson_lognormal_max")),
            bptt_window=window,
        )
    else:
        depth = DepthConfig(sampler="fixed", depth=float(field(model, "loop_times")), bptt_window=window)
    return release_job(cfg, depth, tokenizer_path, data)


# -- entry point -------------------------------------------------------------------------------------
def _student_artifact(src: Path) -> bool:
    """Whether `src` is a release student artifact (config.json with a `student` section, or a dense model
    holding `in_proj`); config and weights are verified later, by whichever converter reads them."""
    from looplm.convert.xllm_student import is_student

    config = read_json(src / "config.json", "an xllm-loop release folder")
    model = config.get("model")
    if isinstance(config.get("student"), dict):
        return True
    if not (isinstance(model, dict) and model.get("arch") == "transformer"):
        return False
    try:
        names = set(_shard_map(src))
    except CheckpointError:
        return False
    return is_student(config, names)


def convert_xllm_loop(
    src: Path,
    out: Path,
    dtype: str | None = None,
    *,
    norm_offset: float = 1.0,
    data: str | None = None,
    teacher: Path | None = None,
) -> Path:
    """Convert the xllm-loop release folder `src` into the looplm checkpoint folder `out` (new or empty).

    `dtype` of the written weights: 'fp32' (default, exact: every BF16 value and BF16 + 1 is an FP32
    value) or 'bf16' (the norm gains weight + 1 are then rounded). `norm_offset` is added to the
    stored RMSNorm weights (the release stores gain - 1). `data`: the held-out text source recorded in
    the job (what `looplm eval` reads; default the built-in text corpus). Raises CheckpointError (a ValueError) with
    a one-line reason for anything it cannot convert exactly.

    A distilled prefill student artifact (`IFM/LoopedLM-P2-distilled-*`) converts into a looplm student
    checkpoint instead (`looplm.convert.xllm_student`); it needs `teacher`, the looplm checkpoint converted
    from the release teacher the student pins.
    """
    src, out = Path(src), Path(out)
    check_family(src, "xllm-loop")
    check_folders(src, out, dtype)
    _refuse_pickles(src)
    if _student_artifact(src):
        from looplm.convert.xllm_student import convert_xllm_student

        if teacher is None:
            raise refuse(
                f"{src} is a distilled prefill student; convert its teacher artifact first and pass "
                "that checkpoint with --teacher"
            )
        if data is not None:
            raise refuse("--data applies to model checkpoints, not to a distilled student")
        return convert_xllm_student(src, out, teacher, dtype, norm_offset=norm_offset)
    if teacher is not None:
        raise refuse(f"--teacher is for a distilled student artifact; {src} is not one")
    manifest = verify_manifest(src)
    config = read_json(src / "config.json", "an xllm-loop release folder")
    tokenizer, tok_files, tok_note = _tokenizer(src, config)
    rel = _release(config, tokenizer.vocab_size)
    check_vocab(tokenizer, rel.cfg)
    weight_map = _shard_map(src)
    check_covered(
        src,
        manifest,
        ["config.json", *([INDEX] if (src / INDEX).is_file() else []), *sorted(set(weight_map.values())), *tok_files],
    )

    expected = _expected_shapes(rel)
    state = read_checked(src, expected, family=f"{rel.cfg.injection} looped")
    mapped = _map_state(state, rel, norm_offset)
    target = DTYPES[dtype]
    mapped = {k: v.to(target).contiguous() for k, v in mapped.items()}
    job = _job_dict(rel.cfg, rel.fields, str(out.resolve()), data)  # the checkpoint folder holds the tokenizer
    provenance = {
        "from": "xllm-loop",
        "source": str(src.resolve()),
        "manifest_sha256": manifest.get("manifest_sha256") if manifest else None,
        "manifest_verified": manifest is not None,
        "dtype": str(target).removeprefix("torch."),
        "norm_offset": norm_offset,
        "rope": "interleaved pairs permuted to half-split",
        "release_state_init": rel.state_init,
        "release_loop_times": int(field(rel.fields, "loop_times")),
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
        "notes": [n for n in (tok_note,) if n]
        + [
            "evaluation state: the release seeds s0 with its own hash (identity_recurrent_state); looplm's "
            "init='seeded' draws a different N(0, 1/d) state, so seeded evaluations match only in distribution"
        ],
    }

    def populate(tmp: Path) -> None:
        save_tensors(tmp, "model.safetensors", mapped)
        write_release_files(tmp, job, provenance, tokenizer)

    if out.is_dir():
        out.rmdir()  # empty (checked above): write_atomic renames the finished folder into place
    return write_atomic(out, populate)
