"""The xllm-loop release's artifact format, shared by its model and student converters
(`looplm.convert.xllm_loop`, `looplm.convert.xllm_student`): the integrity manifest, the recipe
fields and their defaults, and one release TransformerBlock's tensors mapped onto a looplm `Block`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from looplm.checkpoint import CheckpointError, file_sha256
from looplm.config import ModelConfig
from looplm.convert.common import inside, interleaved_to_half_split, read_json

MANIFEST = "artifact_manifest.json"

# ModelConf defaults (xllm/config.py) of the fields the conversion reads: config.json holds a recipe's
# fields, and a field it omits has its default.
DEFAULTS: dict = {
    "arch": "transformer",
    "num_layers": 8,
    "model_dim": 1024,
    "num_heads": 1,
    "num_kv_heads": None,
    "head_dim": None,
    "v_head_dim": None,
    "qknorm": False,
    "attn_act_func": "softmax",
    "apply_attn_gate": False,
    "apply_bias_term": False,
    "ffn_hidden_dim": 2048,
    "num_values": 0,
    "num_experts": 0,
    "vocab_size": -1,
    "output_size": -1,
    "layernorm_num_groups": 1,
    "norm_affine": True,
    "rmsnorm_eps": 1e-6,
    "apply_rmsnorm": False,
    "residual_func": "base",
    "rope_base": 100000.0,
    "rope_head_dim": None,
    "swiglu": False,
    "scale_emb": False,
    "loop_times": 1,
    "huginn_prelude_layers": 1,
    "huginn_recurrent_layers": None,
    "huginn_coda_layers": 1,
    "huginn_state_init": "zero",
    "huginn_input_injection": "diagonal",
    "huginn_hierarchical_state": "none",
    "huginn_depth_control": False,
    "huginn_sampling_scheme": "fixed",
    "huginn_poisson_lognormal_target_mean": 5.0,
    "huginn_poisson_lognormal_sigma": 0.5,
    "huginn_poisson_lognormal_max": 64,
    "huginn_backprop_depth": None,
    "huginn_depth_prior": "none",
    "huginn_depth_prior_entropy": 0.0,
    "huginn_prelude_norm": "none",
    "huginn_recurrent_exit_norm": "none",
    "huginn_prelude_orthogonal": False,
    "huginn_ortho_projection_eps": 1e-6,
}
# Fields whose other values change the forward in ways looplm's model does not have: (field, required value).
REQUIRED = (
    ("arch", "huginn"),
    ("apply_rmsnorm", True),
    ("swiglu", True),
    ("qknorm", False),
    ("apply_attn_gate", False),
    ("attn_act_func", "softmax"),
    ("scale_emb", False),
    ("num_experts", 0),
    ("num_values", 0),
    ("layernorm_num_groups", 1),
    ("norm_affine", True),
    ("huginn_hierarchical_state", "none"),
)


def refuse(message: str) -> CheckpointError:
    return CheckpointError(message)


def verify_manifest(src: Path) -> dict | None:
    """Check artifact_manifest.json when present: its own digest and every listed file's size and
    SHA-256. Returns the manifest (None without one)."""
    path = src / MANIFEST
    if not path.is_file():
        return None
    manifest = read_json(path, "an xllm-loop release folder")
    records = manifest.get("files")
    if not isinstance(records, list):
        raise refuse(f"{path}: no 'files' list")
    if "manifest_sha256" in manifest:
        payload = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        if digest != manifest["manifest_sha256"]:
            raise refuse(f"{path}: manifest_sha256 mismatch (the manifest was edited or damaged)")
    for record in records:
        if not isinstance(record, dict) or "path" not in record or "sha256" not in record:
            raise refuse(f"{path}: a file record lacks 'path' or 'sha256'")
        f = inside(src, record["path"])
        if not f.is_file():
            raise refuse(f"{src}: {record['path']} is listed in {MANIFEST} but missing")
        if "size_bytes" in record and f.stat().st_size != record["size_bytes"]:
            raise refuse(f"{src}: {record['path']} has the wrong size (manifest: {record['size_bytes']} bytes)")
        if file_sha256(f) != record["sha256"]:
            raise refuse(f"{src}: {record['path']} does not match {MANIFEST} (SHA-256 mismatch)")
    return manifest


def check_covered(src: Path, manifest: dict | None, names: list[str]) -> None:
    """With a manifest, every file the conversion reads must be one it verified."""
    if manifest is None:
        return
    listed = {r["path"] for r in manifest["files"]}
    unlisted = [n for n in names if n not in listed]
    if unlisted:
        raise refuse(f"{src}: {unlisted[0]} is read but not listed in {MANIFEST}")


def field(model: dict, name: str):
    return model.get(name, DEFAULTS[name])


def block_shapes(prefix: str, c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of one release TransformerBlock (xllm's pre-norm attention + SwiGLU FFN) under `prefix`."""
    d, hd, f = c.d_model, c.head_dim, c.ffn_dim
    return {
        prefix + "attention.norm.weight": (d,),
        prefix + "attention.wq.weight": (c.n_heads * hd, d),
        prefix + "attention.wk.weight": (c.n_kv_heads * hd, d),
        prefix + "attention.wv.weight": (c.n_kv_heads * hd, d),
        prefix + "attention.wo.weight": (d, c.n_heads * hd),
        prefix + "nffn.norm.weight": (d,),
        prefix + "nffn.fc1.weight": (f, d),
        prefix + "nffn.fc3.weight": (f, d),
        prefix + "nffn.fc2.weight": (d, f),
    }


def map_block(
    state: dict[str, torch.Tensor], src: str, dst: str, c: ModelConfig, norm_offset: float
) -> dict[str, torch.Tensor]:
    """One release block's tensors under prefix `src` -> looplm `Block` tensors under module name `dst`:
    norm gains = stored + norm_offset, wq/wk rows permuted from interleaved to half-split RoPE pairs."""
    hd = c.head_dim
    return {
        f"{dst}.attn_norm.weight": state[src + "attention.norm.weight"] + norm_offset,
        f"{dst}.attn.wq.weight": interleaved_to_half_split(state[src + "attention.wq.weight"], c.n_heads, hd),
        f"{dst}.attn.wk.weight": interleaved_to_half_split(state[src + "attention.wk.weight"], c.n_kv_heads, hd),
        f"{dst}.attn.wv.weight": state[src + "attention.wv.weight"],
        f"{dst}.attn.wo.weight": state[src + "attention.wo.weight"],
        f"{dst}.ffn_norm.weight": state[src + "nffn.norm.weight"] + norm_offset,
        f"{dst}.ffn.w1.weight": state[src + "nffn.fc1.weight"],  # SwiGLU gate: silu(fc1 x) * fc3 x
        f"{dst}.ffn.w3.weight": state[src + "nffn.fc3.weight"],
        f"{dst}.ffn.w2.weight": state[src + "nffn.fc2.weight"],
    }
