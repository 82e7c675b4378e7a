"""`looplm convert --from ouro`: Ouro (ByteDance's looped LMs; modeling_ouro.py) -> looplm.

Each test builds a tiny random checkpoint in the release's Hugging Face layout (bf16 tensors named
as OuroForCausalLM's state dict: model.layers.i.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj,
input_layernorm(_2), post_attention_layernorm(_2)}, model.norm, model.early_exit_gate, untied
lm_head; model.safetensors or shards with an index; config.json with the OuroConfig fields and the
special-token ids; tokenizer.json). The converted model's logits, exit distribution and exit rules
are compared with a reference forward written here from the source's equations, not with looplm's
code; decoding with looplm's full cache is compared with recomputing the whole forward.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _jobs import assert_full_cache_decodes_like_the_forward, read_hf_weights, write_hf_weights
from test_convert_huginn import hf_tokenizer

from looplm.checkpoint import CheckpointError, load_model
from looplm.convert import convert_ouro
from looplm.infer.cache import make_cache
from looplm.infer.extend import extend
from looplm.infer.generate import DepthRule, SamplingConfig, generate
from looplm.model.exit_gate import exit_distribution, expected_logits, select_depth, threshold_exit

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread

D, HEADS, KV, FFN, LAYERS, STEPS = 32, 4, 2, 48, 2, 4
HD = D // HEADS
EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"


def ouro_config(vocab: int, eos_id: int, **overrides) -> dict:
    config = {  # the OuroConfig fields of Ouro-1.4B's config.json, scaled down
        "architectures": ["OuroForCausalLM"],
        "model_type": "ouro",
        "attention_dropout": 0.0,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "hidden_act": "silu",
        "hidden_size": D,
        "initializer_range": 0.02,
        "intermediate_size": FFN,
        "layer_types": ["full_attention"] * LAYERS,
        "max_position_embeddings": 64,
        "max_window_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "total_ut_steps": STEPS,
        "early_exit_threshold": 1.0,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab,
    }
    config.update(overrides)
    return config


def ouro_state(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]

    def rnd(*shape, std=0.2, mean=0.0):
        return (mean + torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    state = {
        "model.embed_tokens.weight": rnd(v, d, std=1.0),
        "model.norm.weight": rnd(d, mean=1.0),
        "model.early_exit_gate.weight": rnd(1, d, std=0.5),
        "model.early_exit_gate.bias": rnd(1, std=0.5),
        "lm_head.weight": rnd(v, d, std=0.3),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state.update(
            {
                p + n + ".weight": rnd(d, mean=1.0, std=0.1)
                for n in (
                    "input_layernorm",
                    "input_layernorm_2",
                    "post_attention_layernorm",
                    "post_attention_layernorm_2",
                )
            }
        )
        state.update(
            {
                p + "self_attn.q_proj.weight": rnd(HEADS * HD, d),
                p + "self_attn.k_proj.weight": rnd(KV * HD, d),
                p + "self_attn.v_proj.weight": rnd(KV * HD, d),
                p + "self_attn.o_proj.weight": rnd(d, HEADS * HD),
                p + "mlp.gate_proj.weight": rnd(f, d),
                p + "mlp.up_proj.weight": rnd(f, d),
                p + "mlp.down_proj.weight": rnd(d, f),
            }
        )
    return state


def make_ouro(root: Path, *, mutate=None, sharded: bool = False, **overrides) -> Path:
    root.mkdir(parents=True)
    tok = hf_tokenizer((EOS, IM_START, IM_END))
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))  # names no specials
    eos_id = tok.token_to_id(EOS)
    config = ouro_config(tok.get_vocab_size(), eos_id, **overrides)
    state = ouro_state(ouro_config(tok.get_vocab_size(), eos_id))
    if mutate:
        mutate(state)
    write_hf_weights(root, state, 2 if sharded else 1)
    (root / "config.json").write_text(json.dumps(config))
    return root


# -- the source's forward, from its equations ---------------------------------------------------
def _norm(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_rotate_half(x, base, start=0):  # x [B, H, L, hd] at positions start..: x*cos + rotate_half(x)*sin
    L, hd = x.shape[-2], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    emb = torch.cat([torch.arange(start, start + L, dtype=torch.float64)[:, None] * inv] * 2, -1)
    rotated = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return x * emb.cos() + rotated * emb.sin()


def _layer(h, w, i, base, past=None):
    """Layer i over the chunk h [B, L, D]; `past` = (K, V) [B, KV, P, HD] of P earlier tokens (K after
    RoPE) that the chunk, at positions P.., also attends to. Returns (output, (K, V) of past and chunk)."""
    p = f"model.layers.{i}."
    B, L, _ = h.shape
    start = 0 if past is None else past[0].shape[2]
    x = _norm(h, w[p + "input_layernorm.weight"])
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(B, L, HEADS, HD).transpose(1, 2)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(B, L, KV, HD).transpose(1, 2)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(B, L, KV, HD).transpose(1, 2)
    q, k = _rope_rotate_half(q, base, start), _rope_rotate_half(k, base, start)
    if past is not None:
        k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
    kv = (k, v)
    k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
    scores = (q @ k.transpose(-1, -2)) * HD**-0.5
    scores = scores + torch.full((L, start + L), float("-inf"), dtype=scores.dtype).triu(start + 1)
    att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, D) @ w[p + "self_attn.o_proj.weight"].T
    h = h + _norm(att, w[p + "input_layernorm_2.weight"])
    x = _norm(h, w[p + "post_attention_layernorm.weight"])
    m = (F.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[
        p + "mlp.down_proj.weight"
    ].T
    return h + _norm(m, w[p + "post_attention_layernorm_2.weight"]), kv


def load_source(root: Path) -> tuple[dict, dict]:
    config = json.loads((root / "config.json").read_text())
    w = read_hf_weights(root)
    return config, w


def reference(root: Path, tokens, steps, kept: dict | None = None):
    """Per-loop logits and gate logits of the source, each a list over loops 1..steps. With `kept`
    ({layer: (K, V) of the earlier tokens}, updated in place) the tokens attend to earlier tokens as
    a terminal cache holds them: each layer keeps every token's K/V from its last loop (design §7)."""
    config, w = load_source(root)
    kept = {} if kept is None else kept
    new = {}
    h = w["model.embed_tokens.weight"][tokens]
    logits, gates = [], []
    for _ in range(steps):
        for i in range(config["num_hidden_layers"]):
            h, new[i] = _layer(h, w, i, config["rope_theta"], kept.get(i))
        h = _norm(h, w["model.norm.weight"])
        gates.append((h @ w["model.early_exit_gate.weight"].T + w["model.early_exit_gate.bias"]).squeeze(-1))
        logits.append(h @ w["lm_head.weight"].T)
    kept.update(new)
    return logits, gates


def reference_pdf(gates):
    lam = [torch.sigmoid(g) for g in gates]
    remaining, pdf = torch.ones_like(lam[0]), []
    for i, lam_i in enumerate(lam):
        pdf.append(lam_i * remaining if i < len(lam) - 1 else remaining)
        remaining = remaining * (1 - lam_i)
    return torch.stack(pdf, -1)


# -- conversion matches the source ----------------------------------------------------------------
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_logits_match_the_source_equations(tmp_path, sharded):
    src = make_ouro(tmp_path / "ouro", sharded=sharded)
    out = convert_ouro(src, tmp_path / "converted", dtype="fp32")
    model, tok, job = load_model(out)
    c = model.cfg
    assert (c.n_prelude, c.n_core, c.n_coda, c.injection, c.state_init) == (0, LAYERS, 0, "none", "input")
    assert (c.block_norm, c.exit_norm, c.head_norm, c.exit_gate, c.tie_embeddings) == (
        "branch",
        "rms-gain",
        False,
        True,
        False,
    )
    assert job["depth"]["depth"] == float(STEPS)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, c.vocab_size, (2, 10), generator=g)
    want, _ = reference(src, tokens, STEPS)
    state0 = model.embed(tokens).detach()  # the source's initial state: the embedding, given explicitly
    worst = 0.0
    for depth in (1, 2, 4):
        with torch.no_grad():
            got = model(tokens, depth, state0=state0).logits
            default = model(tokens, depth).logits  # state_init="input": the same state without state0
        torch.testing.assert_close(default, got, rtol=0, atol=0)
        worst = max(worst, (got.double() - want[depth - 1]).abs().max().item())
    print(f"ouro max |delta logit| = {worst:.2e}")
    assert worst <= 1e-4


def test_exit_gate_and_exit_rules_match_the_source(tmp_path):
    src = make_ouro(tmp_path / "ouro")
    model, _, _ = load_model(convert_ouro(src, tmp_path / "converted"))
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    want_logits, want_gates = reference(src, tokens, STEPS)
    with torch.no_grad():
        out = model(tokens, STEPS, return_states=True)
        gates = [model.exit_gate(s) for s in out.states]
        per_loop = [model.logits(s) for s in out.states]  # no coda: the head reads each loop's state
    for got, want in zip(gates, want_gates):
        assert (got.double() - want).abs().max() <= 1e-4
    pdf, want_pdf = exit_distribution(gates), reference_pdf(want_gates)
    assert (pdf.double() - want_pdf).abs().max() <= 1e-5
    torch.testing.assert_close(pdf.sum(-1), torch.ones(2, 9))
    # probability-weighted logits
    want_expected = sum(lg * want_pdf[..., r, None] for r, lg in enumerate(want_logits))
    assert (expected_logits(per_loop, pdf).double() - want_expected).abs().max() <= 1e-4
    # the cumulative-probability threshold rule, per token (q = 1.0 is the release's default)
    for q in (0.3, 0.6, 0.9, 1.0):
        cum = want_pdf.cumsum(-1)
        want_idx = torch.tensor(
            [[next((r for r in range(STEPS) if cum[b, t, r] >= q), STEPS - 1) for t in range(9)] for b in range(2)]
        )
        idx = threshold_exit(pdf.double(), q)
        assert torch.equal(idx, want_idx)
        chosen = select_depth(torch.stack(per_loop, 2), idx)
        V = want_logits[0].shape[-1]
        want_chosen = torch.stack(want_logits, 2).gather(2, want_idx[..., None, None].expand(-1, -1, 1, V)).squeeze(2)
        assert (chosen.double() - want_chosen).abs().max() <= 1e-4


def test_full_cache_decodes_the_tokens_of_the_uncached_forward(tmp_path):
    model, tok, _ = load_model(convert_ouro(make_ouro(tmp_path / "ouro"), tmp_path / "converted"))
    prompt = torch.tensor([tok.encode("the recurrent model")])
    assert_full_cache_decodes_like_the_forward(model, prompt, STEPS, 8)


@pytest.mark.parametrize("cache_mode", ["full", "terminal"])
def test_decoding_with_the_exit_gate_follows_the_source_threshold_rule(tmp_path, cache_mode):
    """Greedy decoding with the exit gate: every loop runs, and each token's logits are those of the
    first loop whose cumulative exit probability reaches q. The source's equations decode the same
    way, recomputing the whole sequence (Ouro's own per-loop cache: looplm's full cache) or keeping
    each token's last-loop K/V (looplm's terminal cache); every step's logits and exit loop agree."""
    src = make_ouro(tmp_path / "ouro")
    model, tok, _ = load_model(convert_ouro(src, tmp_path / "converted"))
    q, n_new = 0.2, 6  # this tiny model's gate exits early at 0.2 (mean decode depth < 4)
    prompt = tok.encode("the recurrent model")
    want, exits, ids, kept = [], [], [], {}
    chunk = torch.tensor([prompt])
    for _ in range(n_new):  # the source: all loops, then the logits of each token's exit loop
        if cache_mode == "full":
            logits, gates = reference(src, torch.tensor([prompt + ids]), STEPS)
        else:
            logits, gates = reference(src, chunk, STEPS, kept)
        cum = reference_pdf(gates)[0, -1].cumsum(-1)
        step = next((r for r in range(STEPS) if cum[r] >= q), STEPS - 1)
        want.append(logits[step][0, -1])
        exits.append(step + 1)
        nxt = int(want[-1].argmax())
        if nxt == tok.eos_id:
            break
        ids.append(nxt)
        chunk = torch.tensor([[nxt]])
    assert min(exits) < STEPS  # the gate exits early
    cache = make_cache(cache_mode, model.cfg, 1, len(prompt) + n_new, STEPS)
    got, used = [], []
    for chunk in [prompt, *([t] for t in ids)][: len(want)]:
        step = extend(model, torch.tensor([chunk]), cache, STEPS, exit_gate=q)
        got.append(step.logits[0, -1])
        used.append(int(step.depths[0, -1]))
    assert used == exits
    assert (torch.stack(got).double() - torch.stack(want)).abs().max() <= 1e-4
    stats: dict = {}
    text = generate(
        model,
        tok,
        ["the recurrent model"],
        DepthRule(STEPS, exit_gate=q),
        cache=cache_mode,
        stats=stats,
        sampling=SamplingConfig(max_new_tokens=n_new),
    )[0]
    assert text == tok.decode(ids)
    assert stats["mean_decode_depth"] == pytest.approx(sum(exits[1:]) / len(exits[1:]))  # the decode steps


def test_the_exit_gate_needs_a_model_with_a_gate(tmp_path):
    plain, _, _ = load_model(convert_ouro(make_ouro(tmp_path / "ouro"), tmp_path / "converted"))
    plain.exit_gate = None
    cache = make_cache("full", plain.cfg, 1, 16, STEPS)
    with pytest.raises(ValueError, match="exit gate"):
        extend(plain, torch.tensor([[1, 2, 3]]), cache, STEPS, exit_gate=0.2)


def test_special_ids_from_config_and_tied_variant(tmp_path):
    src = make_ouro(tmp_path / "ouro", mutate=lambda s: s.pop("lm_head.weight"), tie_word_embeddings=True)
    out = convert_ouro(src, tmp_path / "converted")
    model, tok, _ = load_model(out)
    config = json.loads((src / "config.json").read_text())
    assert tok.eos_id == config["eos_token_id"] and tok.pad_id == tok.eos_id  # no pad: padding uses eos
    assert model.head.weight is model.embed.weight
    notes = json.loads((out / "conversion.json").read_text())["notes"]
    assert any("padding uses eos" in n for n in notes)
    tokens = torch.arange(5)[None] + 4
    want, _ = reference_with_tied(src, tokens)
    with torch.no_grad():
        assert (model(tokens, 2).logits.double() - want).abs().max() <= 1e-4


def reference_with_tied(src, tokens):
    config, w = load_source(src)
    w["lm_head.weight"] = w["model.embed_tokens.weight"]
    h = w["model.embed_tokens.weight"][tokens]
    for _ in range(2):
        for i in range(LAYERS):
            h, _ = _layer(h, w, i, config["rope_theta"])
        h = _norm(h, w["model.norm.weight"])
    return h @ w["lm_head.weight"].T, None


# -- refusals ---------------------------------------------------------------------------------------
def _extra(state):
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(HD, dtype=torch.bfloat16)


def _drop(state):
    del state["model.early_exit_gate.bias"]


@pytest.mark.parametrize(
    "mutate, overrides, match",
    [
        (_extra, {}, "unknown tensor model.layers.0.self_attn.q_norm.weight"),
        (_drop, {}, "missing tensor model.early_exit_gate.bias"),
        (None, {"num_key_value_heads": 4}, r"k_proj.weight has shape \(16, 32\), config.json implies \(32, 32\)"),
        (None, {"use_sliding_window": True, "layer_types": ["full_attention", "sliding_attention"]}, "sliding-window"),
        (None, {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        (None, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope_parameters"),
        (None, {"rope_scaling": ["x"]}, r"rope_scaling = \['x'\]: looplm converts only plain RoPE"),
        (None, {"max_position_embeddings": None}, "config.json max_position_embeddings = None is not an integer"),
        (None, {"rope_theta": "big"}, "config.json rope_theta = 'big' is not a number"),
        (None, {"total_ut_steps": 0}, "config.json total_ut_steps = 0 must be > 0"),
        (None, {"layer_types": ["full_attention"] * (LAYERS + 1)}, f"layer_types has {LAYERS + 1} entries"),
        (
            None,
            {"vocab_size": 999},
            r"(embed_tokens|lm_head)\.weight has shape \(\d+, 32\), config.json implies \(999, 32\)",
        ),
        (None, {"hidden_act": "gelu"}, "hidden_act = 'gelu': looplm converts only silu"),
        (None, {"mlp_bias": True}, "attention/MLP biases"),
        (None, {"head_dim": HD // 2}, f"head_dim {HD // 2} x num_attention_heads"),
    ],
)
def test_refuses_folders_it_cannot_map(tmp_path, mutate, overrides, match):
    src = make_ouro(tmp_path / "ouro", mutate=mutate, **overrides)
    with pytest.raises(CheckpointError, match=match) as err:
        convert_ouro(src, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_refuses_a_missing_shard(tmp_path):
    src = make_ouro(tmp_path / "ouro", sharded=True)
    (src / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00001-of-00002.safetensors named in"):
        convert_ouro(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _drop_keys(root: Path, *keys, section=None):
    config = json.loads((root / "config.json").read_text())
    target = config if section is None else config[section]
    for k in keys:
        target.pop(k)
    (root / "config.json").write_text(json.dumps(config))


def test_ouro_keeps_the_release_norm_eps_and_defaults_to_four_loops(tmp_path):
    """OuroConfig's total_ut_steps default is 4."""
    from looplm.checkpoint import load_model
    from looplm.convert import convert_ouro

    src = make_ouro(tmp_path / "src", rms_norm_eps=1e-5)
    _drop_keys(src, "total_ut_steps")
    model, _, job = load_model(convert_ouro(src, tmp_path / "out"))
    assert model.cfg.norm_eps == 1e-5
    assert job["depth"]["depth"] == 4


def test_context_length_and_untied_head_follow_ouroconfig(tmp_path):
    """Guards against: max_seq_len not read from max_position_embeddings (64 here), and tie_word_embeddings defaulting
    to True: OuroConfig's default is False, so a config.json without the key keeps its own lm_head (whose logits are the
    source's, not the embedding's)."""
    src = make_ouro(tmp_path / "ouro")
    _drop_keys(src, "tie_word_embeddings")
    model, _, _ = load_model(convert_ouro(src, tmp_path / "converted"))
    assert model.cfg.max_seq_len == 64 and not model.cfg.tie_embeddings
    tokens = torch.arange(5)[None] + 4
    want, _ = reference(src, tokens, 2)
    with torch.no_grad():
        assert (model(tokens, 2).logits.double() - want[-1]).abs().max() <= 1e-4


def test_default_rope_scaling_and_a_long_loop_are_converted(tmp_path):
    """Guards against: rope_scaling {"rope_type": "default"} (plain RoPE, as transformers writes it) refused, and
    max_depth capped at 64 below the release's total_ut_steps."""
    src = make_ouro(tmp_path / "ouro", rope_scaling={"rope_type": "default"}, total_ut_steps=80)
    model, _, job = load_model(convert_ouro(src, tmp_path / "converted"))
    assert model.cfg.max_depth == 80 and job["depth"]["depth"] == 80


def test_rope_theta_is_read_from_transformers_5s_rope_parameters(tmp_path):
    """transformers 5 saves rope_theta inside rope_parameters: read only from the top level, a config saved so
    converted with RoPE base 10000 instead of its own."""
    src = make_ouro(tmp_path / "ouro", rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    config = json.loads((src / "config.json").read_text())
    del config["rope_theta"]
    (src / "config.json").write_text(json.dumps(config))
    model, _, _ = load_model(convert_ouro(src, tmp_path / "converted"))
    assert model.cfg.rope_base == 5000.0
