"""`looplm convert --from xllm-loop`: the paper's reference release (ifm-ai/xllm-loop) -> looplm.

Each test builds a tiny random checkpoint in the release's artifact layout (BF16 tensors keyed as the
release model's state dict, two shards with model.safetensors.index.json, config.json with the model
and tokenizer sections, tokenizer/, artifact_manifest.json with SHA-256 of every file and its own
digest). The logits of the converted model are compared with a reference forward written here from
the release's equations (interleaved RoPE, RMSNorm gains stored as offsets from 1, its injections),
not with looplm's code.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from looplm.checkpoint import CheckpointError, load_model
from looplm.cli import main
from looplm.convert import convert_xllm_loop
from looplm.data import build_tokenizer, load_tokenizer
from looplm.train.config import job_from_dict

D, HEADS, KV, FFN = 32, 4, 2, 48
EOS, PAD = "<|endoftext|>", "<|pad|>"

VARIANTS = {  # recipe overrides of the release (xllm/paper_part2/recipes.py INJECTION_VARIANTS)
    "diagonal": {},
    "parcae": {"huginn_diagonal_dt_init": 0.5 * math.log(5), "huginn_prelude_norm": "rms"},
    "ortho": {"huginn_diagonal_dt_init": 0.5 * math.log(5), "huginn_prelude_orthogonal": True},
    "linear": {"huginn_input_injection": "linear", "huginn_recurrent_exit_norm": "parameterless_rms"},
}
LOOPLM_SCHEME = {"diagonal": "parcae-nonorm", "parcae": "parcae-decay", "ortho": "ortho", "linear": "huginn-linear"}


# -- a release folder ------------------------------------------------------------------------------
def _hf_tokenizer() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOS, PAD, "<|bos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the looped model thinks again and again"] * 20, trainer=trainer)
    return tok


def _fields(vocab: int, variant: str, **overrides) -> dict:
    fields = {  # the shape of huginn_model_fields, scaled down
        "arch": "huginn",
        "huginn_depth_control": True,
        "num_layers": 4,
        "model_dim": D,
        "num_heads": HEADS,
        "num_kv_heads": KV,
        "head_dim": D // HEADS,
        "ffn_hidden_dim": FFN,
        "vocab_size": vocab,
        "swiglu": True,
        "apply_bias_term": True,
        "apply_rmsnorm": True,
        "rmsnorm_eps": 1e-6,
        "attn_gate_func": "silu",
        "rope_base": 10_000.0,
        "rope_head_dim": D // HEADS,
        "chunk_size": 1024,
        "causal_attn_backend": "flash",
        "fused_block": False,
        "init_mode": "gaussian",
        "init_std": 0.02,
        "loop_times": 5,
        "loop_start_layer": 1,
        "loop_end_layers": 3,
        "huginn_prelude_layers": 1,
        "huginn_recurrent_layers": 2,
        "huginn_coda_layers": 1,
        "huginn_state_init": "normal",
        "huginn_input_injection": "diagonal",
        "huginn_sampling_scheme": "fixed",
        "huginn_backprop_depth": 5,
    }
    fields.update(VARIANTS[variant])
    fields.update(overrides)
    return fields


def _release_state(fields: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d, hd, f, v = fields["model_dim"], fields["head_dim"], fields["ffn_hidden_dim"], fields["vocab_size"]

    def rnd(*shape, std=0.2):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    state = {"embed.weight": rnd(v, d, std=1.0), "output.final_norm.weight": rnd(d), "output.output.weight": rnd(v, d)}
    for i in range(fields["num_layers"]):
        p = f"layers.{i}."
        state.update(
            {
                p + "attention.norm.weight": rnd(d),
                p + "attention.wq.weight": rnd(HEADS * hd, d),
                p + "attention.wk.weight": rnd(KV * hd, d),
                p + "attention.wv.weight": rnd(KV * hd, d),
                p + "attention.wo.weight": rnd(d, HEADS * hd),
                p + "nffn.norm.weight": rnd(d),
                p + "nffn.fc1.weight": rnd(f, d),
                p + "nffn.fc3.weight": rnd(f, d),
                p + "nffn.fc2.weight": rnd(d, f),
            }
        )
    if fields["huginn_input_injection"] == "none":
        pass  # Part I dense-middle: no injection module
    elif fields["huginn_input_injection"] == "linear":
        state["input_injection.adapter.weight"] = rnd(d, 2 * d, std=0.15)
        state["input_injection.adapter.bias"] = rnd(d)
    else:
        state["input_injection.input_adapter.weight"] = (torch.eye(d) + torch.randn(d, d, generator=g) * 0.1).bfloat16()
        state["input_injection.A_log"] = rnd(d, std=0.5)
        state["input_injection.dt_bias"] = rnd(d, std=0.5)
    if fields.get("huginn_prelude_norm") == "rms":
        state["huginn_prelude_norm_module.weight"] = rnd(d)
    return state


def _json_bytes(value) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def write_manifest(root: Path) -> None:
    files = [
        {
            "path": p.relative_to(root).as_posix(),
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            "size_bytes": p.stat().st_size,
        }
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "artifact_manifest.json"
    ]
    manifest = {
        "schema_version": 1,
        "release": "paper-part2",
        "format": "xllm-native-bf16-safetensors",
        "source": {"checkpoint_id": "test"},
        "files": files,
        "model": {"dtype": "bfloat16", "index": "model.safetensors.index.json"},
    }
    manifest["manifest_sha256"] = hashlib.sha256(
        json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()
    (root / "artifact_manifest.json").write_bytes(_json_bytes(manifest))


def make_release(
    root: Path,
    variant: str = "diagonal",
    *,
    mutate=None,
    manifest: bool = True,
    model_fields: dict | None = None,
    **overrides,
) -> Path:
    """A release folder; `overrides` change config.json only (the weights keep the variant's shapes),
    `model_fields` change both (another model: Part I fields, a padded vocabulary)."""
    root.mkdir(parents=True)
    tok = _hf_tokenizer()
    (root / "tokenizer").mkdir()
    tok.save(str(root / "tokenizer" / "tokenizer.json"))
    (root / "tokenizer" / "special_tokens_map.json").write_bytes(
        _json_bytes({"eos_token": {"content": EOS, "lstrip": False}, "pad_token": PAD, "bos_token": "<|bos|>"})
    )
    (root / "tokenizer" / "tokenizer_config.json").write_bytes(_json_bytes({"model_max_length": 8192}))
    fields = _fields(tok.get_vocab_size(), variant, **{**(model_fields or {}), **overrides})
    state = _release_state(_fields(tok.get_vocab_size(), variant, **(model_fields or {})))
    if mutate:
        mutate(state)
    keys = sorted(state)
    shards = [keys[: len(keys) // 2], keys[len(keys) // 2 :]]
    weight_map = {}
    for i, part in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: state[k] for k in part}, str(root / name))
        weight_map.update(dict.fromkeys(part, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (root / "model.safetensors.index.json").write_bytes(
        _json_bytes({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (root / "config.json").write_bytes(
        _json_bytes({"model": fields, "tokenizer": {"type": "huggingface", "path": "tokenizer"}})
    )
    (root / "README.md").write_text("# test artifact\n")
    if manifest:
        write_manifest(root)
    return root


# -- the release's forward, from its equations -----------------------------------------------------
def _norm(x, offset_weight, eps=1e-6):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if offset_weight is None else y * (1.0 + offset_weight)


def _rope_interleaved(x, base):  # x [B, H, L, hd]: rotate channel pairs (2j, 2j+1) by position * base^(-2j/hd)
    hd, L = x.shape[-1], x.shape[-2]
    freqs = 1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.arange(L, dtype=torch.float64)[:, None] * freqs
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], hd // 2, 2).contiguous())
    return torch.view_as_real(xc * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


def _layer(x, w, i, base):
    p = f"layers.{i}."
    B, L, _ = x.shape
    hd = D // HEADS
    h = _norm(x, w[p + "attention.norm.weight"])
    q = (h @ w[p + "attention.wq.weight"].T).view(B, L, HEADS, hd).transpose(1, 2)
    k = (h @ w[p + "attention.wk.weight"].T).view(B, L, KV, hd).transpose(1, 2)
    v = (h @ w[p + "attention.wv.weight"].T).view(B, L, KV, hd).transpose(1, 2)
    q, k = _rope_interleaved(q, base), _rope_interleaved(k, base)
    k, v = k.repeat_interleave(HEADS // KV, dim=1), v.repeat_interleave(HEADS // KV, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, HEADS * hd)
    x = x + att @ w[p + "attention.wo.weight"].T
    h = _norm(x, w[p + "nffn.norm.weight"])
    return x + (F.silu(h @ w[p + "nffn.fc1.weight"].T) * (h @ w[p + "nffn.fc3.weight"].T)) @ w[p + "nffn.fc2.weight"].T


def reference_logits(root: Path, tokens, depth, state0):
    fields = json.loads((root / "config.json").read_text())["model"]
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    w = {}
    for shard in set(index.values()):
        w.update({k: t.double() for k, t in load_file(str(root / shard)).items()})
    base = fields["rope_base"]
    x = w["embed.weight"][tokens]
    x = _layer(x, w, 0, base)  # prelude
    e = _norm(x, w["huginn_prelude_norm_module.weight"]) if fields.get("huginn_prelude_norm") == "rms" else x
    s = e if fields.get("huginn_state_init") == "input" else state0.double()  # input: s0 = the prelude output
    for _ in range(depth):
        if fields["huginn_input_injection"] == "none":
            pass  # no injection: the input entered as s0
        elif fields["huginn_input_injection"] == "linear":
            s = torch.cat([s, e], -1) @ w["input_injection.adapter.weight"].T + w["input_injection.adapter.bias"]
        else:
            dt = F.softplus(w["input_injection.dt_bias"])
            retained = s * torch.exp(-dt * torch.exp(w["input_injection.A_log"]))
            injected = dt * (e @ w["input_injection.input_adapter.weight"].T)
            if fields.get("huginn_prelude_orthogonal"):
                c = (retained * injected).sum(-1, keepdim=True) / (injected.square().sum(-1, keepdim=True) + 1e-6)
                retained = retained - c * injected
            s = retained + injected
        s = _layer(_layer(s, w, 1, base), w, 2, base)  # the core
        if fields.get("huginn_recurrent_exit_norm") == "parameterless_rms":
            s = _norm(s, None)
    s = _layer(s, w, 3, base)  # coda
    return _norm(s, w["output.final_norm.weight"]) @ w["output.output.weight"].T


# -- conversion matches the release ------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_the_release_equations(tmp_path, variant):
    src = make_release(tmp_path / "release", variant)
    out = convert_xllm_loop(src, tmp_path / "converted", dtype="fp32")
    model, tok, job = load_model(out)
    assert model.cfg.injection == LOOPLM_SCHEME[variant]
    assert (model.cfg.n_prelude, model.cfg.n_core, model.cfg.n_coda) == (1, 2, 1)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=g)
    state0 = torch.randn(2, 12, D, generator=g) / math.sqrt(D)
    for depth in (1, 3, 8):
        with torch.no_grad():
            got = model(tokens, depth, state0=state0).logits
        want = reference_logits(src, tokens, depth, state0)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert job["model"]["injection"] == LOOPLM_SCHEME[variant]
    assert job["depth"]["sampler"] == "fixed" and job["depth"]["depth"] == 5.0 and job["depth"]["bptt_window"] == 5


def test_zero_state_and_converted_tokenizer(tmp_path):
    src = make_release(tmp_path / "release", "parcae")
    out = convert_xllm_loop(src, tmp_path / "converted")  # default dtype: fp32
    model, tok, _ = load_model(out)
    hf = HFTokenizer.from_file(str(src / "tokenizer" / "tokenizer.json"))
    assert (tok.eos_id, tok.pad_id) == (hf.token_to_id(EOS), hf.token_to_id(PAD))
    assert tok.vocab_size == model.cfg.vocab_size == hf.get_vocab_size()
    again = load_tokenizer(out)
    assert (again.eos_id, again.pad_id, again.fingerprint()) == (tok.eos_id, tok.pad_id, tok.fingerprint())
    ids = tok.encode("the looped model")
    assert tok.decode(ids) == "the looped model"
    tokens = torch.tensor([ids])
    zero = torch.zeros(1, len(ids), D)
    with torch.no_grad():
        got = model(tokens, 4, init="zero").logits
    torch.testing.assert_close(got.double(), reference_logits(src, tokens, 4, zero), atol=1e-5, rtol=1e-5)
    provenance = json.loads((out / "conversion.json").read_text())
    assert provenance["manifest_verified"] and provenance["from"] == "xllm-loop"
    job = job_from_dict(json.loads((out / "config.json").read_text()))  # as a resumed or fine-tuning run reads it
    assert build_tokenizer(job.data.tokenizer, None, 0).eos_id == tok.eos_id


@pytest.mark.parametrize(
    "overrides, sampler, window",
    [
        ({"huginn_sampling_scheme": "poisson-lognormal-capped", "huginn_backprop_depth": 10}, "pln", 10),
        (
            {
                "huginn_sampling_scheme": "poisson-lognormal-capped",
                "huginn_backprop_depth": 10,
                "huginn_depth_prior": "learned",
                "huginn_depth_prior_entropy": 0.01,
            },
            "learned",
            10,
        ),
        ({"huginn_backprop_depth": None}, "fixed", None),
    ],
)
def test_job_records_the_release_depth_recipe(tmp_path, overrides, sampler, window):
    src = make_release(tmp_path / "release", **overrides)
    out = convert_xllm_loop(src, tmp_path / "converted")
    depth = json.loads((out / "config.json").read_text())["depth"]
    assert (depth["sampler"], depth["bptt_window"]) == (sampler, window)
    if sampler == "learned":
        assert depth["learned"]["entropy_weight"] == 0.01


def test_bf16_output_and_no_manifest(tmp_path):
    src = make_release(tmp_path / "release", manifest=False)
    out = convert_xllm_loop(src, tmp_path / "converted", dtype="bf16")
    weights = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    model, _, _ = load_model(out)
    tokens = torch.arange(8)[None] % model.cfg.vocab_size
    state0 = torch.zeros(1, 8, D)
    with torch.no_grad():
        got = model(tokens, 3, state0=state0).logits.double()
    want = reference_logits(src, tokens, 3, state0)
    assert (got - want).abs().max() < 0.1 * want.abs().max()  # bf16-rounded norm gains: close, not exact
    assert not json.loads((out / "conversion.json").read_text())["manifest_verified"]


# Part I's plain Huginn (no depth control): the diagonal injection without norms, or none at all, and
# the state started from the prelude output (`LoopedLM-P1-dense-middle-*`).
PART_ONE = {
    "prelude-injection": ({"huginn_depth_control": False, "huginn_state_init": "input"}, "parcae-nonorm"),
    "dense-middle": (
        {"huginn_depth_control": False, "huginn_state_init": "input", "huginn_input_injection": "none"},
        "none",
    ),
}


@pytest.mark.parametrize("name", list(PART_ONE))
def test_part_one_plain_huginn_matches_the_release_equations(tmp_path, name):
    fields, injection = PART_ONE[name]
    src = make_release(tmp_path / "release", model_fields=fields)
    model, _, _ = load_model(convert_xllm_loop(src, tmp_path / "converted"))
    assert (model.cfg.injection, model.cfg.state_init) == (injection, "input")
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    for depth in (1, 3, 8):
        with torch.no_grad():
            got = model(tokens, depth).logits  # no state to choose: s0 is the prelude output
        torch.testing.assert_close(got.double(), reference_logits(src, tokens, depth, None), atol=1e-5, rtol=1e-5)


def test_a_padded_vocabulary_converts(tmp_path):
    """The release's embedding and head may have more rows than its tokenizer has tokens."""
    src = make_release(tmp_path / "release", model_fields={"vocab_size": 320})
    tokenizer_size = HFTokenizer.from_file(str(src / "tokenizer" / "tokenizer.json")).get_vocab_size()
    assert tokenizer_size < 320
    model, tok, _ = load_model(convert_xllm_loop(src, tmp_path / "converted"))
    assert (model.cfg.vocab_size, tok.vocab_size) == (320, tokenizer_size)
    tokens = torch.tensor([tok.encode("the looped model thinks")])
    state0 = torch.randn(1, tokens.shape[1], D, generator=torch.Generator().manual_seed(3)) / math.sqrt(D)
    with torch.no_grad():
        got = model(tokens, 4, state0=state0).logits
    torch.testing.assert_close(got.double(), reference_logits(src, tokens, 4, state0), atol=1e-5, rtol=1e-5)


# -- refusals ----------------------------------------------------------------------------------------
def _extra(state):
    state["layers.0.attention.wr.weight"] = torch.zeros(D, D, dtype=torch.bfloat16)


def _drop(state):
    del state["input_injection.A_log"]


def _reshape(state):
    state["layers.2.nffn.fc1.weight"] = state["layers.2.nffn.fc1.weight"][:-1]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (_extra, "unknown tensor layers.0.attention.wr.weight"),
        (_drop, "missing tensor input_injection.A_log"),
        (_reshape, r"layers.2.nffn.fc1.weight has shape \(47, 32\), config.json implies \(48, 32\)"),
    ],
)
def test_refuses_bad_tensors(tmp_path, mutate, match):
    src = make_release(tmp_path / "release", mutate=mutate)
    with pytest.raises(CheckpointError, match=match):
        convert_xllm_loop(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"ffn_hidden_dim": 40}, "has shape .* config.json implies"),
        ({"qknorm": True}, "qknorm"),
        ({"huginn_input_injection": "none"}, "the input would never enter the recurrence"),  # state_init normal
        ({"huginn_hierarchical_state": "split_hl"}, "huginn_hierarchical_state"),
        ({"num_layers": 5}, "num_layers 5"),
        # the release starts from zeros by default; this converted to a noise start (0.41 logits off)
        ({"huginn_state_init": "zero"}, "huginn_state_init 'zero': a zero initial state"),
    ],
)
def test_refuses_configs_it_cannot_convert_exactly(tmp_path, overrides, match):
    src = make_release(tmp_path / "release", **overrides)
    with pytest.raises(CheckpointError, match=match):
        convert_xllm_loop(src, tmp_path / "out")


def test_refuses_a_file_that_does_not_match_the_manifest(tmp_path):
    src = make_release(tmp_path / "release")
    shard = src / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors does not match artifact_manifest.json"):
        convert_xllm_loop(src, tmp_path / "out")


def test_refuses_an_edited_manifest_and_unlisted_files(tmp_path):
    src = make_release(tmp_path / "release")
    manifest = json.loads((src / "artifact_manifest.json").read_text())
    manifest["files"] = [r for r in manifest["files"] if r["path"] != "config.json"]
    (src / "artifact_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest_sha256 mismatch"):
        convert_xllm_loop(src, tmp_path / "out")
    del manifest["manifest_sha256"]  # a manifest without its own digest: files it omits are refused
    (src / "artifact_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="config.json is read but not listed"):
        convert_xllm_loop(src, tmp_path / "out")


def test_refuses_pickles_without_unpickling(tmp_path, monkeypatch):
    src = make_release(tmp_path / "release")
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04 never unpickled")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    with pytest.raises(CheckpointError, match="pytorch_model.bin is a pickle file"):
        convert_xllm_loop(src, tmp_path / "out")


def test_refuses_a_shard_that_disagrees_with_the_index(tmp_path):
    src = make_release(tmp_path / "release", manifest=False)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    key = next(k for k, v in index["weight_map"].items() if v.startswith("model-00001"))
    index["weight_map"][key] = "model-00002-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="does not hold the tensors"):
        convert_xllm_loop(src, tmp_path / "out")


def test_refuses_a_non_empty_output_and_a_missing_folder(tmp_path):
    src = make_release(tmp_path / "release")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty"):
        convert_xllm_loop(src, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    with pytest.raises(CheckpointError, match="no release folder"):
        convert_xllm_loop(tmp_path / "absent", tmp_path / "out2")


# -- CLI ---------------------------------------------------------------------------------------------
def test_cli_converts_and_reports_bad_folders_in_one_line(tmp_path, capsys):
    src = make_release(tmp_path / "release", "ortho")
    assert main(["convert", str(src), str(tmp_path / "out"), "--from", "xllm-loop", "--dtype", "fp32"]) == 0
    assert "wrote" in capsys.readouterr().out
    model, _, _ = load_model(tmp_path / "out")
    assert model.cfg.injection == "ortho"

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    assert main(["convert", str(bad), str(tmp_path / "out2"), "--from", "xllm-loop"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "config.json is not valid JSON" in err
    assert main(["convert", str(src), str(tmp_path / "out3")]) == 2  # --from is required
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "--from" in err


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            {"huginn_prelude_orthogonal": True, "huginn_prelude_norm": "rms"},
            "OrthoInj with a prelude norm has no looplm equivalent",
        ),
        ({"huginn_recurrent_exit_norm": "parameterless_rms"}, "a recurrent exit norm with the diagonal injection"),
        ({"huginn_input_injection": "linear"}, "huginn-linear injection has the parameter-free exit norm"),
    ],
)
def test_refuses_injection_and_norm_combinations_looplm_lacks(tmp_path, overrides, match):
    """Each combination is refused by
    name (not converted into another model, nor failing later on the weights)."""
    src = make_release(tmp_path / "release", **overrides)
    with pytest.raises(CheckpointError, match=match):
        convert_xllm_loop(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_vocab_size_minus_one_means_the_tokenizers(tmp_path):
    """The release's vocab_size -1 (its default) takes the tokenizer's size."""
    src = make_release(tmp_path / "release", vocab_size=-1)
    model, tok, _ = load_model(convert_xllm_loop(src, tmp_path / "converted"))
    assert (
        model.cfg.vocab_size
        == tok.vocab_size
        == HFTokenizer.from_file(str(src / "tokenizer/tokenizer.json")).get_vocab_size()
    )


def test_depth_cap_and_pln_recipe_come_from_the_release(tmp_path):
    """Max_depth = max(64, loop_times, PLN cap), and the recipe's mean, sigma and cap."""
    fields = {
        "huginn_sampling_scheme": "poisson-lognormal-capped",
        "huginn_poisson_lognormal_target_mean": 7.0,
        "huginn_poisson_lognormal_sigma": 0.4,
        "huginn_poisson_lognormal_max": 100,
    }
    out = convert_xllm_loop(make_release(tmp_path / "release", **fields), tmp_path / "converted")
    job = json.loads((out / "config.json").read_text())
    assert job["model"]["max_depth"] == 100
    assert (job["depth"]["sampler"], job["depth"]["depth"], job["depth"]["sigma"], job["depth"]["cap"]) == (
        "pln",
        7.0,
        0.4,
        100,
    )
    out = convert_xllm_loop(make_release(tmp_path / "r2", loop_times=80), tmp_path / "c2")
    assert json.loads((out / "config.json").read_text())["model"]["max_depth"] == 80


def test_a_tokenizer_path_of_the_training_machine_reads_the_artifacts_tokenizer(tmp_path):
    """An absolute tokenizer path in config.json (where training ran) is not read;
    the artifact's tokenizer/ folder is."""
    src = make_release(tmp_path / "release", manifest=False)
    config = json.loads((src / "config.json").read_text())
    config["tokenizer"]["path"] = str(tmp_path / "elsewhere" / "tokenizer")
    (src / "config.json").write_text(json.dumps(config))
    write_manifest(src)
    _, tok, _ = load_model(convert_xllm_loop(src, tmp_path / "converted"))
    assert tok.eos_id == HFTokenizer.from_file(str(src / "tokenizer" / "tokenizer.json")).token_to_id(EOS)


def test_a_teacher_for_a_model_artifact_is_refused(tmp_path):
    """--teacher belongs to a distilled student; given with a model artifact it
    is refused rather than ignored."""
    src = make_release(tmp_path / "release")
    with pytest.raises(CheckpointError, match="--teacher is for a distilled student artifact"):
        convert_xllm_loop(src, tmp_path / "out", teacher=tmp_path / "teacher")
    assert not (tmp_path / "out").exists()


# -- the release format shared with the student converter: defaults, required fields, the manifest ---------
def _edit_release(src: Path, edit) -> None:
    """Change config.json's model section with `edit` and write the manifest again (a consistent artifact)."""
    config = json.loads((src / "config.json").read_text())
    edit(config["model"])
    (src / "config.json").write_bytes(_json_bytes(config))
    write_manifest(src)


def _rewrite_manifest(src: Path, edit, digest: bool = True) -> None:
    """Change artifact_manifest.json with `edit`; its manifest_sha256 recomputed (`digest`) or dropped."""
    path = src / "artifact_manifest.json"
    manifest = json.loads(path.read_text())
    manifest.pop("manifest_sha256")
    edit(manifest)
    if digest:
        manifest["manifest_sha256"] = hashlib.sha256(
            json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest()
    path.write_bytes(_json_bytes(manifest))


def test_fields_config_json_omits_take_xllms_modelconf_defaults(tmp_path):
    """A field that config.json omits has xllm's ModelConf default (xllm/config.py): rmsnorm_eps 1e-6, rope_base 100000,
    PLN sigma 0.5 and cap 64."""
    src = make_release(tmp_path / "release", huginn_sampling_scheme="poisson-lognormal-capped")

    def omit(model):
        for name in ("rmsnorm_eps", "rope_base", "huginn_poisson_lognormal_sigma", "huginn_poisson_lognormal_max"):
            model.pop(name, None)

    _edit_release(src, omit)
    out = convert_xllm_loop(src, tmp_path / "converted")
    model, _, _ = load_model(out)
    assert (model.cfg.norm_eps, model.cfg.rope_base) == (1e-6, 100000.0)
    depth = json.loads((out / "config.json").read_text())["depth"]
    assert (depth["sampler"], depth["sigma"], depth["cap"]) == ("pln", 0.5, 64)


def test_a_field_set_to_a_false_value_is_not_its_default(tmp_path):
    """A release without affine norm gains (norm_affine false, whose default is true) is refused, not converted as if
    its norms had gains."""
    src = make_release(tmp_path / "release", norm_affine=False)
    with pytest.raises(CheckpointError, match="model.norm_affine = False: looplm converts only norm_affine = True"):
        convert_xllm_loop(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_manifest_size_that_disagrees_is_refused(tmp_path):
    """A file whose size differs from the manifest's size_bytes is refused even where its SHA-256 matches (a manifest
    without its own digest, edited)."""
    src = make_release(tmp_path / "release")

    def wrong_size(manifest):
        record = next(r for r in manifest["files"] if r["path"] == "config.json")
        record["size_bytes"] += 1

    _rewrite_manifest(src, wrong_size, digest=False)
    with pytest.raises(CheckpointError, match="config.json has the wrong size"):
        convert_xllm_loop(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_manifest_path_outside_the_folder_is_refused(tmp_path):
    """A manifest record naming a file outside the artifact is refused by name, even when that file exists and matches
    its SHA-256."""
    src = make_release(tmp_path / "release")
    outside = tmp_path / "outside.txt"
    outside.write_text("not in the artifact\n")

    def add(manifest):
        digest = hashlib.sha256(outside.read_bytes()).hexdigest()
        manifest["files"].append({"path": "../outside.txt", "sha256": digest, "size_bytes": outside.stat().st_size})

    _rewrite_manifest(src, add)
    with pytest.raises(CheckpointError, match=r"file name '\.\./outside\.txt' points outside the folder"):
        convert_xllm_loop(src, tmp_path / "out")


def test_the_manifest_digest_does_not_depend_on_its_key_order(tmp_path):
    """manifest_sha256 is over the canonical JSON (sorted keys, compact), so a manifest written with its keys in another
    order verifies."""
    src = make_release(tmp_path / "release")
    path = src / "artifact_manifest.json"
    manifest = json.loads(path.read_text())
    reordered = {k: manifest[k] for k in reversed(list(manifest))}
    reordered["files"] = [{k: r[k] for k in reversed(list(r))} for r in manifest["files"]]
    assert list(reordered) != sorted(reordered)
    path.write_text(json.dumps(reordered, indent=1))
    out = convert_xllm_loop(src, tmp_path / "converted")
    provenance = json.loads((out / "conversion.json").read_text())
    assert provenance["manifest_verified"] and provenance["manifest_sha256"] == manifest["manifest_sha256"]
