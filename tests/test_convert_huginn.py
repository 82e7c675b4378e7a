"""`looplm convert --from huginn`: Huginn-0125 (seal-rg/recurrent-pretraining) -> looplm.

Each test builds a tiny random checkpoint in the release's Hugging Face layout (bf16 tensors named as
RavenForCausalLM's state dict: fused Wqkv, qk_bias [2, 1, heads, head_dim], sandwich norms norm_1..4,
the adapter [d, 2d], ln_f, tied embeddings with no lm_head.weight, the persistent freqs_cis buffer; two
shards with model.safetensors.index.json; config.json with the RavenConfig fields; tokenizer.json at
the root). The converted model's logits are compared with a reference forward written here from the
source's equations (interleaved RoPE, sqrt(d) embedding scale, ln_f after the loop and before the
head), not with looplm's code.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from _jobs import write_hf_weights
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from looplm.checkpoint import CheckpointError, load_model
from looplm.cli import main
from looplm.convert import convert_huginn

D, HEADS, FFN, BLOCK = 32, 4, 48, 64
HD = D // HEADS
EOS, PAD, BOS = "<|end_text|>", "<|pad|>", "<|begin_text|>"


def hf_tokenizer(specials=(BOS, EOS, PAD)) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["the recurrent model thinks deeper and deeper"] * 20, trainer=trainer)
    return tok


def raven_config(vocab: int, **overrides) -> dict:
    config = {  # the RavenConfig fields of huginn-0125's config.json, scaled down
        "architectures": ["RavenForCausalLM"],
        "model_type": "huginn_raven",
        "bias": False,
        "block_class_name": "SandwichBlock",
        "block_size": BLOCK,
        "effective_expected_depth": 12,
        "head_dim": HD,
        "init_orthogonal": False,
        "init_strategy": "takase",
        "init_values": {
            "embed_scale": math.sqrt(D),
            "embedding": math.sqrt(2 / (5 * D)),
            "out_proj": 0.001,
            "std": math.sqrt(2 / (5 * D)),
        },
        "injection_type": "linear",
        "intermediate_size": FFN,
        "mean_backprop_depth": 8,
        "mean_recurrence": 32,
        "mlp_class_name": "GatedMLP",
        "n_embd": D,
        "n_heads": HEADS,
        "n_layers": 4,
        "n_layers_in_coda": 1,
        "n_layers_in_prelude": 1,
        "n_layers_in_recurrent_block": 2,
        "nonlin_name": "SiLU",
        "norm_class_name": "RMSNorm_llama",
        "norm_eps": 1e-6,
        "num_key_value_heads": HEADS,
        "padded_vocab_size": vocab,
        "padding_multiple": 64,
        "qk_bias": True,
        "rope_base": 50000,
        "sampling_scheme": "poisson-lognormal-filling",
        "state_init": "like-init",
        "tie_embeddings": True,
        "test_time_noise": 0,
        "test_time_noise_type": "fixed",
        "torch_dtype": "bfloat16",
        "vocab_size": vocab,
    }
    config.update(overrides)
    return config


def raven_state(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d, f, v = config["n_embd"], config["intermediate_size"], config["padded_vocab_size"]

    def rnd(*shape, std=0.2, mean=0.0):
        return (mean + torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    state = {
        "transformer.wte.weight": rnd(v, d, std=0.5),
        "transformer.ln_f.weight": rnd(d, mean=1.0),
        "transformer.adapter.weight": rnd(d, 2 * d, std=0.15),
    }
    if config["bias"]:
        state["transformer.adapter.bias"] = rnd(d)
    for stack, key in (
        ("prelude", "n_layers_in_prelude"),
        ("core_block", "n_layers_in_recurrent_block"),
        ("coda", "n_layers_in_coda"),
    ):
        for i in range(config[key]):
            p = f"transformer.{stack}.{i}."
            state.update({p + f"norm_{k}.weight": rnd(d, mean=1.0) for k in (1, 2, 3, 4)})
            state.update(
                {
                    p + "attn.Wqkv.weight": rnd(3 * d, d),
                    p + "attn.proj.weight": rnd(d, d),
                    p + "mlp.fc.weight": rnd(2 * f, d),
                    p + "mlp.proj.weight": rnd(d, f),
                }
            )
            if config["qk_bias"]:
                state[p + "attn.qk_bias"] = rnd(2, 1, HEADS, HD, std=0.5)
    # the persistent RoPE buffer: [1, block, 1, hd/2, (cos, sin)], stored in bf16 like the rest
    inv = 1.0 / (config["rope_base"] ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD))
    ang = torch.outer(torch.arange(BLOCK, dtype=torch.float32), inv)
    state["freqs_cis"] = torch.stack([ang.cos(), ang.sin()], -1)[None, :, None].to(torch.bfloat16)
    return state


def make_huginn(root: Path, *, mutate=None, shards: int = 2, **overrides) -> Path:
    root.mkdir(parents=True)
    tok = hf_tokenizer()
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}))
    config = raven_config(tok.get_vocab_size(), **overrides)
    state = raven_state(raven_config(tok.get_vocab_size()))
    if mutate:
        mutate(state)
    write_hf_weights(root, state, shards)
    (root / "config.json").write_text(json.dumps(config))
    return root


# -- the source's forward, from its equations ---------------------------------------------------
def _norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_interleaved(x, base):  # x [B, L, H, hd]: pairs (2j, 2j+1) rotated by position * base^(-2j/hd)
    L, hd = x.shape[1], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(L, dtype=torch.float64)[:, None] * inv  # [L, hd/2]
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    pairs = x.reshape(*x.shape[:-1], hd // 2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)


def _attention(q, k, v):  # [B, L, H, hd] each; causal, one query at a time
    B, L, H, hd = q.shape
    out = torch.zeros_like(q)
    for t in range(L):
        scores = torch.einsum("bhd,bshd->bhs", q[:, t], k[:, : t + 1]) / math.sqrt(hd)
        out[:, t] = torch.einsum("bhs,bshd->bhd", scores.softmax(-1), v[:, : t + 1])
    return out


def _sandwich(x, w, p, base, qk_bias, kv=HEADS):
    B, L, _ = x.shape
    qkv = _norm(x, w[p + "norm_1.weight"]) @ w[p + "attn.Wqkv.weight"].T
    q, k, v = qkv.split([D, kv * HD, kv * HD], -1)
    q = q.reshape(B, L, HEADS, HD)  # grouped-query: query head h reads key/value head h // (HEADS / kv)
    k, v = (t.reshape(B, L, kv, HD).repeat_interleave(HEADS // kv, 2) for t in (k, v))
    if qk_bias:
        q, k = q + w[p + "attn.qk_bias"][0], k + w[p + "attn.qk_bias"][1]
    att = _attention(_rope_interleaved(q, base), _rope_interleaved(k, base), v).reshape(B, L, D)
    x = _norm(x + att @ w[p + "attn.proj.weight"].T, w[p + "norm_2.weight"])
    gate, up = (_norm(x, w[p + "norm_3.weight"]) @ w[p + "mlp.fc.weight"].T).chunk(2, -1)
    return _norm(x + (F.silu(gate) * up) @ w[p + "mlp.proj.weight"].T, w[p + "norm_4.weight"])


def load_source(root: Path) -> tuple[dict, dict]:
    config = json.loads((root / "config.json").read_text())
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    w = {}
    for shard in set(index.values()):
        w.update({k: t.double() for k, t in load_file(str(root / shard)).items()})
    return config, w


def reference_logits(root: Path, tokens, depth, state0):
    config, w = load_source(root)
    base, qkb, kv = config["rope_base"], config["qk_bias"], config.get("num_key_value_heads", config["n_heads"])
    e = w["transformer.wte.weight"][tokens] * math.sqrt(config["n_embd"])  # emb_scale: _init_func(n_embd)
    for i in range(config["n_layers_in_prelude"]):
        e = _sandwich(e, w, f"transformer.prelude.{i}.", base, qkb, kv)
    s = state0.double()
    for _ in range(depth):
        s = torch.cat([s, e], -1) @ w["transformer.adapter.weight"].T
        if "transformer.adapter.bias" in w:
            s = s + w["transformer.adapter.bias"]
        for i in range(config["n_layers_in_recurrent_block"]):
            s = _sandwich(s, w, f"transformer.core_block.{i}.", base, qkb, kv)
    s = _norm(s, w["transformer.ln_f.weight"])  # once after the loop
    for i in range(config["n_layers_in_coda"]):
        s = _sandwich(s, w, f"transformer.coda.{i}.", base, qkb, kv)
    head = w.get("lm_head.weight", w["transformer.wte.weight"])
    return _norm(s, w["transformer.ln_f.weight"]) @ head.T


# -- conversion matches the source ----------------------------------------------------------------
MAX_DELTA: dict[str, float] = {}


@pytest.mark.parametrize(
    "overrides", [{}, {"bias": True, "tie_embeddings": False, "qk_bias": False}], ids=["release", "untied-bias"]
)
def test_logits_match_the_source_equations(tmp_path, overrides):
    def add_untied(state):
        if overrides:
            state["lm_head.weight"] = (torch.randn(*state["transformer.wte.weight"].shape) * 0.3).bfloat16()
            state["transformer.adapter.bias"] = (torch.randn(D) * 0.2).bfloat16()
            for k in [k for k in state if k.endswith("qk_bias")]:
                del state[k]

    src = make_huginn(tmp_path / "huginn", mutate=add_untied, **overrides)
    out = convert_huginn(src, tmp_path / "converted", dtype="fp32")
    model, tok, job = load_model(out)
    c = model.cfg
    assert (c.block_norm, c.injection, c.exit_norm, c.post_loop_norm, c.state_init) == (
        "sandwich",
        "huginn-linear",
        "none",
        True,
        "trunc-normal",
    )
    assert c.tie_embeddings == (not overrides) and c.qk_bias == (not overrides)
    assert c.embed_scale == pytest.approx(math.sqrt(D)) and c.state_std == pytest.approx(math.sqrt(2 / 5))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, c.vocab_size, (2, 10), generator=g)
    state0 = torch.randn(2, 10, D, generator=g) * 0.6
    worst = 0.0
    for depth in (1, 2, 4):
        with torch.no_grad():
            got = model(tokens, depth, state0=state0).logits
        want = reference_logits(src, tokens, depth, state0)
        assert got.dtype == torch.float32
        worst = max(worst, (got.double() - want).abs().max().item())
    MAX_DELTA["huginn"] = worst
    print(f"huginn max |delta logit| = {worst:.2e}")
    assert worst <= 1e-4
    assert job["depth"]["depth"] == 32.0


def test_grouped_query_heads_and_the_release_init_values(tmp_path):
    """Guards against: Wqkv split as [kv, q, kv] rows or its shape taken as 3 * heads (grouped-query heads, allowed
    without qk_bias); the state std read from init_values.embedding instead of init_values.std, or not scaled by
    sqrt(n_embd) as the source's initialize_state does (emb_scale, which is _init_func(n_embd)["embed_scale"], not the
    config's value); max_depth not 2 * mean_recurrence. Each value here differs from its default, so only the config's
    own numbers give the source's logits."""
    KV = 2
    init = {"embed_scale": math.sqrt(D), "embedding": 0.05, "out_proj": 0.001, "std": 0.1}

    def gqa(state):
        g = torch.Generator().manual_seed(5)
        for k in [k for k in state if k.endswith("attn.Wqkv.weight")]:
            state[k] = (torch.randn((HEADS + 2 * KV) * HD, D, generator=g) * 0.2).bfloat16()
        for k in [k for k in state if k.endswith("qk_bias")]:
            del state[k]

    src = make_huginn(
        tmp_path / "huginn", mutate=gqa, num_key_value_heads=KV, qk_bias=False, init_values=init, mean_recurrence=40
    )
    model, _, job = load_model(convert_huginn(src, tmp_path / "converted", dtype="fp32"))
    c = model.cfg
    assert (c.n_heads, c.n_kv_heads, c.embed_scale, c.max_depth) == (HEADS, KV, math.sqrt(D), 80)
    assert c.state_std == pytest.approx(0.1 * math.sqrt(D))
    assert job["depth"]["depth"] == 40.0
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, c.vocab_size, (2, 9), generator=g)
    state0 = torch.randn(2, 9, D, generator=g) * 0.3
    for depth in (1, 3):
        with torch.no_grad():
            got = model(tokens, depth, state0=state0).logits.double()
        assert (got - reference_logits(src, tokens, depth, state0)).abs().max() <= 1e-4


def test_config_fields_are_read_with_the_ravenconfig_defaults(tmp_path):
    """Guards against: rope_base or norm_eps not read from config.json (the test release sets 10000 and 1e-5, not the
    defaults), num_key_value_heads defaulting to anything but n_heads, vocab_size read before padded_vocab_size (the
    embedding has padded_vocab_size rows) and tie_embeddings defaulting to False when config.json names neither tie
    key (RavenConfig ties by default)."""
    vocab = hf_tokenizer().get_vocab_size()
    src = make_huginn(tmp_path / "huginn", rope_base=10000, norm_eps=1e-5, vocab_size=vocab - 5)
    config = json.loads((src / "config.json").read_text())
    for key in ("num_key_value_heads", "tie_embeddings"):
        del config[key]
    (src / "config.json").write_text(json.dumps(config))
    model, _, _ = load_model(convert_huginn(src, tmp_path / "converted", dtype="fp32"))
    c = model.cfg
    assert (c.n_kv_heads, c.vocab_size, c.tie_embeddings, c.rope_base, c.norm_eps) == (HEADS, vocab, True, 1e4, 1e-5)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (1, 12), generator=g)
    state0 = torch.randn(1, 12, D, generator=g) * 0.6
    with torch.no_grad():
        got = model(tokens, 2, state0=state0).logits.double()
    assert (got - reference_logits(src, tokens, 2, state0)).abs().max() <= 1e-3  # eps 1e-5 vs the reference's 1e-6


def test_tied_embeddings_stay_tied_and_the_tokenizer_keeps_its_specials(tmp_path):
    src = make_huginn(tmp_path / "huginn")
    out = convert_huginn(src, tmp_path / "converted")
    weights = load_file(str(out / "model.safetensors"))
    assert "head.weight" not in weights and "embed.weight" in weights  # one matrix, stored once
    model, tok, _ = load_model(out)
    assert model.head.weight is model.embed.weight
    hf = HFTokenizer.from_file(str(src / "tokenizer.json"))
    assert (tok.eos_id, tok.pad_id) == (hf.token_to_id(EOS), hf.token_to_id(PAD))
    provenance = json.loads((out / "conversion.json").read_text())
    assert provenance["from"] == "huginn" and provenance["eos_id"] == tok.eos_id
    # through the transformers wrapper's save_pretrained / from_pretrained: still tied, same logits
    pytest.importorskip("transformers")
    from looplm.hf import LoopedLMForCausalLM

    LoopedLMForCausalLM.from_looplm(model, tok).save_pretrained(tmp_path / "hf")
    assert "model.head.weight" not in load_file(str(tmp_path / "hf" / "model.safetensors"))
    again = LoopedLMForCausalLM.from_pretrained(tmp_path / "hf").model.eval()
    assert again.cfg.tie_embeddings and again.head.weight is again.embed.weight
    tokens = torch.arange(6)[None] + 5
    s0 = torch.zeros(1, 6, D)
    with torch.no_grad():
        torch.testing.assert_close(again(tokens, 3, state0=s0).logits, model(tokens, 3, state0=s0).logits)


def test_default_initial_state_is_the_truncated_normal_of_the_source(tmp_path):
    model, _, _ = load_model(convert_huginn(make_huginn(tmp_path / "huginn"), tmp_path / "converted"))
    e = torch.zeros(4, 64, D)
    for init in ("gaussian", "seeded"):
        s = model.initial_state(e, init, generator=torch.Generator().manual_seed(0))
        std = model.cfg.state_std
        assert s.abs().max() <= 3 * std + 1e-6
        assert s.std().item() == pytest.approx(std * 0.9866, rel=0.06)  # truncation at 3 sigma shrinks std


def test_bf16_output_is_close(tmp_path):
    src = make_huginn(tmp_path / "huginn")
    out = convert_huginn(src, tmp_path / "converted", dtype="bf16")
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    model, _, _ = load_model(out)
    tokens = torch.arange(8)[None] + 3
    state0 = torch.zeros(1, 8, D)
    with torch.no_grad():
        got = model.float()(tokens, 2, state0=state0).logits.double()
    want = reference_logits(src, tokens, 2, state0)
    assert (got - want).abs().max() < 1e-4  # the source's tensors are bf16 already: fp32 math on them is exact


# -- refusals ---------------------------------------------------------------------------------------
def _extra(state):
    state["transformer.core_block.0.attn.Wr.weight"] = torch.zeros(D, D, dtype=torch.bfloat16)


def _drop(state):
    del state["transformer.adapter.weight"]


def _untie(state):
    state["lm_head.weight"] = torch.ones_like(state["transformer.wte.weight"])


@pytest.mark.parametrize(
    "mutate, overrides, match",
    [
        (_extra, {}, "unknown tensor transformer.core_block.0.attn.Wr.weight"),
        (_drop, {}, "missing tensor transformer.adapter.weight"),
        (None, {"intermediate_size": 40}, r"mlp\.(fc|proj)\.weight has shape \(\d+, \d+\), config.json implies"),
        (None, {"n_layers_in_recurrent_block": 3, "n_layers": 5}, "missing tensor transformer.core_block.2"),
        (None, {"n_layers": 7}, "!= n_layers 7"),
        (None, {"num_key_value_heads": 2}, "qk_bias with 2 key/value heads"),
        (None, {"test_time_noise": 0.1}, "test_time_noise"),
        (_untie, {}, "lm_head.weight differs"),
        (None, {"qk_norm": True}, r"qk_norm = True: looplm converts only qk_norm in \[False\]"),
        (None, {"init_values": {"embed_scale": math.sqrt(D), "std": 0.0}}, r"init_values.std <= 0"),
        # the source (since c1fbabc) scales by sqrt(n_embd) whatever the config says; older code read the value
        (None, {"init_values": {"embed_scale": 3.0, "std": 0.1}}, r"embed_scale = 3 differs from sqrt\(n_embd\)"),
        (None, {"block_size": None}, r"config.json block_size = None is not an integer"),
        (None, {"rope_base": "fast"}, r"config.json rope_base = 'fast' is not a number"),
        (None, {"mean_recurrence": 0}, r"config.json mean_recurrence = 0 must be > 0"),
    ],
)
def test_refuses_folders_it_cannot_map(tmp_path, mutate, overrides, match):
    src = make_huginn(tmp_path / "huginn", mutate=mutate, **overrides)
    with pytest.raises(CheckpointError, match=match) as err:
        convert_huginn(src, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_refuses_a_missing_shard_and_pickle_only_weights(tmp_path, monkeypatch):
    src = make_huginn(tmp_path / "huginn")
    (src / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors named in .* is missing"):
        convert_huginn(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (pickled / name).write_bytes((src / name).read_bytes())
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04 never unpickled")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    with pytest.raises(CheckpointError, match="pytorch_model.bin is a pickle file"):
        convert_huginn(pickled, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_converts_and_refuses_an_unknown_format_in_one_line(tmp_path, capsys):
    src = make_huginn(tmp_path / "huginn")
    assert main(["convert", str(src), str(tmp_path / "out"), "--from", "huginn"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["convert", str(src), str(tmp_path / "out2"), "--from", "raven"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "raven" in err
    assert not (tmp_path / "out2").exists()
