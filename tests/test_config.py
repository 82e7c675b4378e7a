"""The architecture switches of ModelConfig (design §14): each default is looplm's own model, and
each switch computes the equation it names (checked against plain torch written here)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from looplm.checkpoint import load_tensors, save_tensors
from looplm.config import ModelConfig, check_depth, model_preset
from looplm.model import LoopedLM
from looplm.model.blocks import Block, apply_rope, rope_tables
from looplm.model.exit_gate import exit_distribution, expected_logits, select_depth, threshold_exit

D = 32


def tiny(**fields) -> ModelConfig:
    return ModelConfig(
        vocab_size=50, d_model=D, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=32, max_depth=8, **fields
    )


def perturbed(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter moved off its initial value (norm gains away from 1, biases away from 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _norm(x, w=None, eps=1e-6):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def test_defaults_are_looplms_own_model():
    cfg = ModelConfig()
    assert (
        cfg.block_norm,
        cfg.qk_bias,
        cfg.embed_scale,
        cfg.tie_embeddings,
        cfg.exit_norm,
        cfg.post_loop_norm,
        cfg.head_norm,
        cfg.state_init,
        cfg.state_std,
        cfg.exit_gate,
    ) == ("pre", False, 1.0, False, "auto", False, True, "normal", 0.0, False)
    keys = set(LoopedLM(tiny()).state_dict())
    assert not [k for k in keys if any(s in k for s in ("out_norm", "_bias", "exit_gate", "exit_norm"))]
    assert {"head.weight", "norm.weight", "embed.weight"} <= keys
    # the older config dict (without the switch fields) still loads
    old = {
        k: v
        for k, v in tiny().to_dict().items()
        if k in {f.name for f in dataclasses.fields(ModelConfig)}
        and k
        not in (
            "block_norm",
            "qk_bias",
            "embed_scale",
            "tie_embeddings",
            "exit_norm",
            "post_loop_norm",
            "head_norm",
            "state_init",
            "state_std",
            "exit_gate",
        )
    }
    assert ModelConfig.from_dict(old) == tiny()


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"block_norm": "post"}, "unknown block_norm 'post'"),
        ({"exit_norm": "layer"}, "unknown exit_norm"),
        ({"state_init": "uniform"}, "unknown state_init"),
        ({"injection": "none"}, "needs state_init='input'"),
        ({"post_loop_norm": True, "head_norm": False}, "post_loop_norm reuses"),
        ({"embed_scale": 0.0}, "embed_scale must be > 0"),
        ({"state_std": -1.0}, "state_std must be >= 0"),
        ({"ffn_act": "gelu"}, "unknown ffn_act 'gelu'"),
        ({"value_embeds": "all"}, "unknown value_embeds 'all'"),
    ],
)
def test_validate_names_the_bad_switch_in_one_line(fields, match):
    with pytest.raises(ValueError, match=match) as err:
        tiny(**fields).validate()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("eps", [1e-6, 0.25])  # 0.25: each norm must read cfg.norm_eps, not RMSNorm's default
@pytest.mark.parametrize("placement", ["pre", "sandwich", "branch"])
def test_block_norm_placement(placement, eps):
    block = perturbed(Block(tiny(block_norm=placement, norm_eps=eps)))
    x = torch.randn(2, 7, D)
    rope = rope_tables(torch.arange(7).expand(2, 7), D // 4, 1e6)
    with torch.no_grad():
        got = block(x, rope, None)
        attn = lambda h: block.attn(h, rope, None)  # noqa: E731  (the sublayers themselves are tested elsewhere)
        ffn = block.ffn
        n1, n3 = (lambda h: _norm(h, block.attn_norm.weight, eps)), (lambda h: _norm(h, block.ffn_norm.weight, eps))
        if placement == "pre":
            h = x + attn(n1(x))
            want = h + ffn(n3(h))
        elif placement == "sandwich":
            h = _norm(x + attn(n1(x)), block.attn_out_norm.weight, eps)
            want = _norm(h + ffn(n3(h)), block.ffn_out_norm.weight, eps)
        else:
            h = x + _norm(attn(n1(x)), block.attn_out_norm.weight, eps)
            want = h + _norm(ffn(n3(h)), block.ffn_out_norm.weight, eps)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("placement", ["pre", "sandwich"])
def test_block_parameters_keep_their_registration_order(placement):
    """build_block registers attn_norm, attn, ffn_norm, ffn, then the second norms: the order of the
    parameters, which a saved optimizer state follows (torch pairs its states with parameters by position)."""
    names = [n for n, _ in Block(tiny(block_norm=placement)).named_parameters()]
    attn = [f"attn.{w}.weight" for w in ("wq", "wk", "wv", "wo")]
    want = ["attn_norm.weight", *attn, "ffn_norm.weight", "ffn.w1.weight", "ffn.w3.weight", "ffn.w2.weight"]
    if placement == "sandwich":
        want += ["attn_out_norm.weight", "ffn_out_norm.weight"]
    assert names == want


def test_qk_bias_is_added_before_rope():
    block = perturbed(Block(tiny(qk_bias=True)))
    att = block.attn
    x = torch.randn(1, 6, D)
    rope = rope_tables(torch.arange(6)[None], 8, 1e6)
    with torch.no_grad():
        got = att(x, rope, None)
        q = (x @ att.wq.weight.T + att.q_bias).view(1, 6, 4, 8).transpose(1, 2)
        k = (x @ att.wk.weight.T + att.k_bias).view(1, 6, 2, 8).transpose(1, 2)
        v = (x @ att.wv.weight.T).view(1, 6, 2, 8).transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
        want = y.transpose(1, 2).reshape(1, 6, D) @ att.wo.weight.T
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert att.q_bias.shape == (32,) and att.k_bias.shape == (16,)


def test_embed_scale_and_tied_embeddings(tmp_path):
    model = perturbed(LoopedLM(tiny(embed_scale=math.sqrt(D), tie_embeddings=True)))
    tokens = torch.randint(0, 50, (2, 5))
    torch.testing.assert_close(model.embed(tokens), model.embed.weight[tokens] * math.sqrt(D))
    assert model.head.weight is model.embed.weight
    state = model.state_dict()
    assert "head.weight" not in state
    save_tensors(tmp_path, "w.safetensors", state)  # one matrix: nothing shared between two names
    again = LoopedLM(model.cfg)
    again.load_state_dict(load_tensors(tmp_path, "w.safetensors"))
    assert again.head.weight is again.embed.weight
    torch.testing.assert_close(again.embed.weight, model.embed.weight)
    with torch.no_grad():
        h = torch.randn(1, 3, D)
        torch.testing.assert_close(model.logits(h), _norm(h, model.norm.weight) @ model.embed.weight.T)


@pytest.mark.parametrize(
    "injection, kind, params",
    [
        ("huginn-linear", "auto", 0),
        ("huginn-linear", "none", None),
        ("parcae-nonorm", "auto", None),
        ("parcae-nonorm", "rms", 0),
        ("additive", "rms-gain", D),
    ],
)
def test_exit_norm_kinds(injection, kind, params):
    model = perturbed(LoopedLM(tiny(injection=injection, exit_norm=kind)))
    inj = model.injection
    s = torch.randn(2, 4, D) * 3
    if params is None:
        assert inj.exit_norm is None
        torch.testing.assert_close(inj.exit(s), s)
        return
    assert sum(p.numel() for p in inj.exit_norm.parameters()) == params
    w = inj.exit_norm.weight if params else None
    torch.testing.assert_close(inj.exit(s), _norm(s, w))


def test_post_loop_norm_and_head_without_norm():
    model = perturbed(LoopedLM(tiny(post_loop_norm=True, n_coda=1)))
    z = torch.randn(1, 5, D)
    rope = rope_tables(torch.arange(5)[None], 8, 1e6)
    with torch.no_grad():
        want = model.coda[0](_norm(z, model.norm.weight), rope, None)
        want = _norm(want, model.norm.weight) @ model.head.weight.T
        torch.testing.assert_close(model.run_coda(z, rope, None), want, rtol=1e-5, atol=1e-5)
    bare = perturbed(LoopedLM(tiny(head_norm=False, n_coda=0)))
    assert "norm.weight" not in bare.state_dict()
    torch.testing.assert_close(bare.logits(z), z @ bare.head.weight.T)


def test_state_kinds():
    e = torch.randn(3, 40, D)
    model = LoopedLM(tiny(state_init="input", injection="none", n_prelude=0))
    assert model.initial_state(e, "seeded") is e
    tokens = torch.randint(0, 50, (1, 6))
    ctx, s0 = model.begin(tokens)
    torch.testing.assert_close(s0, model.embed(tokens))
    normal = LoopedLM(tiny(state_std=0.5))
    assert normal.initial_state(e, "gaussian").std().item() == pytest.approx(0.5, rel=0.05)
    default = LoopedLM(tiny())
    assert default.initial_state(e, "gaussian").std().item() == pytest.approx(1 / math.sqrt(D), rel=0.05)
    trunc = LoopedLM(tiny(state_init="trunc-normal", state_std=0.5))
    for init in ("gaussian", "seeded"):
        s = trunc.initial_state(e, init)
        assert s.abs().max().item() <= 1.5 + 1e-6
        assert s.std().item() == pytest.approx(0.5 * 0.9866, rel=0.05)  # the std of N(0,1) cut at +-3
    a = trunc.initial_state(e, "seeded", example_ids=torch.tensor([1, 2, 3]))
    b = trunc.initial_state(e, "seeded", example_ids=torch.tensor([1, 2, 3]))
    assert torch.equal(a, b)  # still a function of the hash


def test_exit_gate_rules():
    model = perturbed(
        LoopedLM(
            tiny(
                exit_gate=True,
                state_init="input",
                injection="none",
                n_prelude=0,
                n_coda=0,
                exit_norm="rms-gain",
                head_norm=False,
            )
        )
    )
    assert {"exit_gate.proj.weight", "exit_gate.proj.bias"} <= set(model.state_dict())
    tokens = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        out = model(tokens, 4, return_states=True)
        gates = [model.exit_gate(s) for s in out.states]
        per_depth = [model.logits(s) for s in out.states]
    pdf = exit_distribution(gates)
    lam = torch.sigmoid(torch.stack(gates, -1))
    want = torch.stack(
        [
            lam[..., 0],
            lam[..., 1] * (1 - lam[..., 0]),
            lam[..., 2] * (1 - lam[..., 0]) * (1 - lam[..., 1]),
            (1 - lam[..., 0]) * (1 - lam[..., 1]) * (1 - lam[..., 2]),
        ],
        -1,
    )
    torch.testing.assert_close(pdf, want)
    torch.testing.assert_close(pdf.sum(-1), torch.ones(2, 6))
    assert torch.equal(threshold_exit(pdf, 0.0), torch.zeros(2, 6, dtype=torch.long))
    assert torch.equal(threshold_exit(pdf, 2.0), torch.full((2, 6), 3))  # never reached: the last recurrence
    idx = threshold_exit(pdf, 0.5)
    chosen = select_depth(torch.stack(per_depth, 2), idx)
    for b in range(2):
        for t in range(6):
            torch.testing.assert_close(chosen[b, t], per_depth[int(idx[b, t])][b, t])
    torch.testing.assert_close(
        expected_logits(per_depth, pdf), sum(lg * pdf[..., r, None] for r, lg in enumerate(per_depth))
    )
    torch.testing.assert_close(out.logits, per_depth[-1])


def test_threshold_exit_stops_where_the_cumulative_probability_reaches_the_threshold():
    """`>=`: a token whose cumulative exit probability equals q exactly exits there (reference: a loop)."""
    pdf = torch.tensor([[[0.5, 0.25, 0.25], [0.0, 0.75, 0.25], [0.125, 0.125, 0.75]]])
    for q in (0.125, 0.25, 0.5, 0.75, 1.0):
        cum = pdf.cumsum(-1)
        want = [next((r for r in range(3) if cum[0, t, r] >= q), 2) for t in range(3)]
        assert threshold_exit(pdf, q)[0].tolist() == want, q
    assert threshold_exit(pdf, 0.5)[0].tolist() == [0, 1, 2]


def test_a_fresh_exit_gate_has_zero_bias_and_small_weights():
    """ExitGate's init: bias 0 (hazard sigmoid(w . s) near 1/2 for any state) and weights N(0, 0.02^2)."""
    from looplm.model.exit_gate import ExitGate

    torch.manual_seed(0)
    gate = ExitGate(4096)
    assert torch.equal(gate.proj.bias, torch.zeros(1))
    std = gate.proj.weight.std().item()
    assert abs(std / 0.02 - 1) < 5 * math.sqrt(1 / (2 * 4096))  # 5 standard errors of a sample std
    assert abs(gate.proj.weight.mean().item()) < 5 * 0.02 / math.sqrt(4096)


def test_a_tied_checkpoint_stays_tied_through_looplm_export(tmp_path):
    pytest.importorskip("transformers")
    from looplm.checkpoint import load_model, save_model
    from looplm.data import ByteTokenizer
    from looplm.hf import export
    from looplm.train.config import job_preset

    cfg = dataclasses.replace(
        tiny(
            tie_embeddings=True,
            embed_scale=2.0,
            block_norm="sandwich",
            qk_bias=True,
            post_loop_norm=True,
            state_init="trunc-normal",
            state_std=0.3,
        ),
        vocab_size=258,
    )
    model = perturbed(LoopedLM(cfg))
    job = dataclasses.replace(job_preset("tiny"), model=cfg).resolved().to_dict()
    run = save_model(tmp_path / "run", model, job, ByteTokenizer())
    loaded, _, _ = load_model(run)
    assert loaded.head.weight is loaded.embed.weight
    hf_dir = export(tmp_path / "run", tmp_path / "hf")
    again, _, _ = load_model(hf_dir)
    assert again.cfg == cfg and again.head.weight is again.embed.weight
    tokens, s0 = torch.randint(0, 258, (1, 7)), torch.randn(1, 7, D) * 0.3
    with torch.no_grad():
        torch.testing.assert_close(again(tokens, 3, state0=s0).logits, model(tokens, 3, state0=s0).logits)


# -- Parcae's switches: ffn_act, qk_norm, value_embeds, coda_proj ----------------------------------
def test_new_switch_defaults_leave_the_model_unchanged():
    cfg = ModelConfig()
    assert (cfg.ffn_act, cfg.qk_norm, cfg.value_embeds, cfg.coda_proj) == ("swiglu", False, "none", False)
    keys = set(LoopedLM(tiny()).state_dict())
    assert not [k for k in keys if any(s in k for s in ("value_embeds", "ve_gate", "coda_proj"))]
    with pytest.raises(ValueError, match="value_embeds needs d_model >= 32") as err:
        ModelConfig(vocab_size=50, d_model=16, n_heads=2, n_kv_heads=2, ffn_dim=32, value_embeds="odd").validate()
    assert "\n" not in str(err.value)


def test_relu2_ffn():
    block = perturbed(Block(tiny(ffn_act="relu2")))
    assert {n for n, _ in block.ffn.named_parameters()} == {"w1.weight", "w2.weight"}
    h = torch.randn(2, 5, D)
    with torch.no_grad():
        want = F.relu(h @ block.ffn.w1.weight.T).pow(2) @ block.ffn.w2.weight.T
        torch.testing.assert_close(block.ffn(h), want, rtol=1e-5, atol=1e-5)


def test_relu2_flops_count_two_matrices():
    from looplm.train.flops import flops_per_token

    swiglu, relu2 = tiny(), tiny(ffn_act="relu2")
    L, R = 16, 3
    layers = relu2.n_prelude + relu2.n_coda + relu2.n_core * R
    # 6 FLOPs per multiply-accumulate unit with full BPTT: one d x F matrix fewer per layer visit
    diff = flops_per_token(swiglu, L, R, None) - flops_per_token(relu2, L, R, None)
    assert diff == pytest.approx(6 * layers * D * relu2.ffn_dim, rel=1e-12)
    proj = flops_per_token(tiny(coda_proj=True), L, R, None) - flops_per_token(swiglu, L, R, None)
    assert proj == pytest.approx(6 * D * D, rel=1e-12)


def _attention_reference(att, x, rope, value_rows=None, qk_norm=False):
    B, L, _ = x.shape
    q = (x @ att.wq.weight.T).view(B, L, 4, 8).transpose(1, 2)
    k = (x @ att.wk.weight.T).view(B, L, 2, 8).transpose(1, 2)
    v = (x @ att.wv.weight.T).view(B, L, 2, 8)
    if value_rows is not None:
        gate = 2 * torch.sigmoid(x[..., :32] @ att.ve_gate.weight.T)  # [B, L, H_kv]
        v = v + gate[..., None] * value_rows.view(B, L, 2, 8)
    v = v.transpose(1, 2)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    if qk_norm:
        q, k = _norm(q, eps=torch.finfo(torch.float32).eps), _norm(k, eps=torch.finfo(torch.float32).eps)
    y = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    return y.transpose(1, 2).reshape(B, L, D) @ att.wo.weight.T


def test_qk_norm_after_rope():
    att = perturbed(Block(tiny(qk_norm=True))).attn
    x = torch.randn(2, 6, D)
    rope = rope_tables(torch.arange(6).expand(2, 6), 8, 1e6)
    with torch.no_grad():
        torch.testing.assert_close(
            att(x, rope, None), _attention_reference(att, x, rope, qk_norm=True), rtol=1e-5, atol=1e-5
        )


def test_value_embedding_gate_and_refusals():
    att = perturbed(Block(tiny(value_embeds="odd"), value_embed=True)).attn
    assert att.ve_gate.weight.shape == (2, 32)
    x, rows = torch.randn(2, 6, D), torch.randn(2, 6, 16)
    rope = rope_tables(torch.arange(6).expand(2, 6), 8, 1e6)
    with torch.no_grad():
        torch.testing.assert_close(
            att(x, rope, None, value_embed=rows), _attention_reference(att, x, rope, rows), rtol=1e-5, atol=1e-5
        )
        with pytest.raises(ValueError, match="has a value embedding: pass value_embed"):
            att(x, rope, None)
        plain = Block(tiny(value_embeds="odd")).attn
        with pytest.raises(ValueError, match="without a value-embedding gate"):
            plain(x, rope, None, value_embed=rows)


def test_value_embeddings_and_coda_proj_in_the_model():
    """Odd blocks of each stack hold a table and a gate; the forward equals plain torch that looks each
    table up once and hands it to its block (core tables at every recurrence), and C precedes the coda."""
    cfg = tiny(n_prelude=2, n_core=2, n_coda=2, value_embeds="odd", coda_proj=True, injection="parcae-decay")
    model = perturbed(LoopedLM(cfg))
    keys = set(model.state_dict())
    for stack in ("prelude", "core", "coda"):
        assert f"value_embeds.{stack}.1.weight" in keys and f"{stack}.1.attn.ve_gate.weight" in keys
        assert f"value_embeds.{stack}.0.weight" not in keys and f"{stack}.0.attn.ve_gate.weight" not in keys
    tokens = torch.randint(0, 50, (2, 7))
    state0 = torch.randn(2, 7, D) * 0.1
    rope = rope_tables(torch.arange(7).expand(2, 7), 8, 1e6)
    ve = model.value_embeds
    with torch.no_grad():
        x = model.embed(tokens)
        x = model.prelude[0](x, rope, None)
        x = model.prelude[1](x, rope, None, value_embed=ve["prelude"]["1"].weight[tokens])
        q = model.injection.prepare(x)
        s = state0
        for _ in range(3):
            s = model.injection(s, q)
            s = model.core[0](s, rope, None)
            s = model.core[1](s, rope, None, value_embed=ve["core"]["1"].weight[tokens])
        h = s @ model.coda_proj.weight.T
        h = model.coda[0](h, rope, None)
        h = model.coda[1](h, rope, None, value_embed=ve["coda"]["1"].weight[tokens])
        want = _norm(h, model.norm.weight) @ model.head.weight.T
        got = model(tokens, 3, state0=state0).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), pytest.raises(ValueError, match="run_coda needs the forward's Context"):
        model.run_coda(s, rope, None)


# -- check_depth, validate's ranges, from_dict and the presets ---------------------------------------
def test_check_depth_takes_integers_in_range_only():
    """A depth is an integer in 1..max_depth, returned as int; a bool is no depth (True would run one
    recurrence), nor is a float or a string; `what` names the bound."""
    assert check_depth("depth", 8, 8) == 8 and type(check_depth("depth", 1, 8)) is int
    for bad in (True, False, 2.0, "3"):
        with pytest.raises(ValueError, match=r"depth must be an integer in 1..8 \(the cap\), got"):
            check_depth("depth", bad, 8, "the cap")
    with pytest.raises(ValueError, match="depth must be an integer in 1..8"):
        LoopedLM(tiny())(torch.zeros(1, 3, dtype=torch.long), True)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"norm_eps": 0.0}, "norm_eps must be > 0, got 0"),  # an all-zero row would give NaN
        ({"rope_base": 0.0}, "rope_base must be > 0, got 0"),
        ({"ortho_eps": -1e-3}, "ortho_eps must be >= 0, got -0.001"),
        ({"max_depth": 0}, "max_depth must be >= 1, got 0"),
        ({"ffn_dim": 0}, "ffn_dim must be >= 1, got 0"),
        ({"max_seq_len": 0}, "max_seq_len must be >= 1, got 0"),
        ({"vocab_size": 0}, "vocab_size must be >= 1, got 0"),
        ({"n_prelude": -1}, "n_prelude and n_coda must be >= 0"),
        ({"n_coda": -1}, "n_prelude and n_coda must be >= 0"),
    ],
)
def test_validate_refuses_each_number_out_of_its_range(fields, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(tiny(), **fields).validate()
    # the boundary values themselves are valid shapes
    dataclasses.replace(tiny(), ortho_eps=0.0, n_prelude=0, n_coda=0, max_depth=1, ffn_dim=1).validate()


def test_from_dict_names_unknown_fields():
    """A config dict from a newer looplm (or a typo) is refused naming its fields, not a TypeError."""
    with pytest.raises(ValueError, match=r"unknown model config fields: \['n_layers', 'rope_scale'\]"):
        ModelConfig.from_dict({**tiny().to_dict(), "rope_scale": 2.0, "n_layers": 3})


def test_presets_are_the_papers_sizes_and_fresh_copies():
    """design §1: S 1536, 24/6 heads, FFN 4352; M 3072, 48/12, 8704; L 6144, 96/24, 17408; head dim 64;
    1/2/1 blocks. `model_preset` gives a copy: changing it leaves the next caller's preset unchanged."""
    sizes = {"S": (1536, 24, 6, 4352), "M": (3072, 48, 12, 8704), "L": (6144, 96, 24, 17408)}
    for name, (d, heads, kv, ffn) in sizes.items():
        cfg = model_preset(name)
        assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim) == (d, heads, kv, ffn), name
        assert cfg.head_dim == 64 and (cfg.n_prelude, cfg.n_core, cfg.n_coda) == (1, 2, 1)
        cfg.validate()
    mine = model_preset("tiny")
    mine.d_model, mine.n_core = 64, 5
    assert (model_preset("tiny").d_model, model_preset("tiny").n_core) == (128, 2)
