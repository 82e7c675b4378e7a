"""Input-injection schemes (SPEC 2) against closed forms written out in float64 in this file."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from looplm.config import INJECTIONS, ModelConfig
from looplm.model import LoopedLM, build_injection
from looplm.model.blocks import rope_tables
from looplm.model.injection import project_off

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
D = TINY.d_model


def tiny(**overrides) -> ModelConfig:
    return dataclasses.replace(TINY, **overrides)


def perturb_(module: torch.nn.Module, scale: float = 0.05) -> None:
    """Move every parameter off its (identity / zero / one) init so no term hides."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn_like(p))


def rms_norm64(x: torch.Tensor, gain: torch.Tensor | None, eps: float) -> torch.Tensor:
    x = x.double()
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if gain is None else y * gain.double()


# ---------------------------------------------------------------------------------------------
# 3. OrthoInj
# ---------------------------------------------------------------------------------------------
def along_u(s_new: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """<s', u> / |u|^2 per token, in float64."""
    s_new, u = s_new.double(), u.double()
    return (s_new * u).sum(-1) / u.pow(2).sum(-1)


@pytest.mark.parametrize("s_scale", [1e-3, 1.0, 30.0])
def test_ortho_component_along_u_is_u(s_scale):
    """eps = 0: <s', u>/|u|^2 = 1 for random s and e (SPEC 2). In fp32 the residual of the
    projection is ~1e-7 * |r|/|u|, so the tolerance is 1e-6 scaled by that ratio when |s| >> |u|."""
    torch.manual_seed(1)
    inj = build_injection(tiny(injection="ortho", ortho_eps=0.0))
    perturb_(inj)
    e = torch.randn(4, 16, D)
    s = s_scale * torch.randn(4, 16, D)
    u = inj.prepare(e)
    s_new = inj(s, u)
    ratio = along_u(s_new, u)
    scale = (s.double().norm(dim=-1) / u.double().norm(dim=-1)).clamp(min=1.0)
    assert ((ratio - 1).abs() <= 1e-6 * scale).all(), (ratio - 1).abs().max()
    # and the part orthogonal to u is the retained state's orthogonal part: s' - u = Q_u (decay*s)
    r = inj.decay().double() * s.double()
    u64 = u.double()
    expected = r - ((r * u64).sum(-1, keepdim=True) / u64.pow(2).sum(-1, keepdim=True)) * u64 + u64
    torch.testing.assert_close(s_new.double(), expected, rtol=0, atol=2e-6 * max(1.0, s_scale))


def test_ortho_float64_exact_on_large_norm_state():
    """With |s| = 1e4 |u| the fp32 rounding of the projection is visible; the along-u component
    still stays within the fp32 bound relative to |r|/|u|."""
    torch.manual_seed(2)
    inj = build_injection(tiny(injection="ortho", ortho_eps=0.0))
    e = torch.randn(3, 8, D)
    s = 1e4 * torch.randn(3, 8, D)
    u = inj.prepare(e)
    ratio = along_u(inj(s, u), u)
    rel = (inj.decay().double() * s.double()).norm(dim=-1) / u.double().norm(dim=-1)
    assert torch.isfinite(ratio).all()
    assert ((ratio - 1).abs() <= 1e-6 * rel).all()


def test_ortho_along_u_at_every_recurrence_of_a_forward():
    torch.manual_seed(3)
    model = LoopedLM(tiny(injection="ortho", ortho_eps=0.0)).eval()
    perturb_(model.injection)
    tokens = torch.randint(0, 50, (2, 12))
    state0 = torch.randn(2, 12, D) / math.sqrt(D)
    with torch.no_grad():
        out = model(tokens, 6, state0=state0, return_states=True)
        positions = torch.arange(12).expand(2, 12)
        rope = rope_tables(positions, model.cfg.head_dim, model.cfg.rope_base)
        e = model.run_prelude(tokens, rope, None)
        u = model.injection.prepare(e)
        prev = [state0, *out.states[:-1]]
        for r, s in enumerate(prev):
            ratio = along_u(model.injection(s, u), u)
            scale = (s.double().norm(dim=-1) / u.double().norm(dim=-1)).clamp(min=1.0)
            assert ((ratio - 1).abs() <= 1e-6 * scale).all(), f"recurrence {r + 1}: {(ratio - 1).abs().max()}"


@pytest.mark.parametrize("eps", [0.0, 1e-6, 0.3])
def test_project_off_matches_float64_closed_form(eps):
    torch.manual_seed(4)
    r = torch.randn(5, 7, D) * 3
    u = torch.randn(5, 7, D) * torch.rand(5, 7, 1)
    got = project_off(r, u, eps)
    r64, u64 = r.double(), u.double()
    alpha = (r64 * u64).sum(-1, keepdim=True) / (u64.pow(2).sum(-1, keepdim=True) + eps)
    want = r64 - alpha * u64
    assert got.dtype == r.dtype
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    if eps == 0.0:  # exactly orthogonal to u, up to fp32 rounding relative to |r|
        cos = (got.double() * u64).sum(-1) / (u64.norm(dim=-1) * r64.norm(dim=-1))
        assert cos.abs().max() < 1e-6


def test_project_off_bf16_inputs_use_fp32_inner_products():
    torch.manual_seed(5)
    r = torch.randn(4, D).bfloat16()
    u = torch.randn(4, D).bfloat16()
    got = project_off(r, u, 0.0)
    assert got.dtype == torch.bfloat16
    r64, u64 = r.double(), u.double()
    want = r64 - ((r64 * u64).sum(-1, keepdim=True) / u64.pow(2).sum(-1, keepdim=True)) * u64
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=2e-2)


def test_ortho_carryover_is_contractive():
    """|Q_u Lambda (s1 - s2)| <= max(decay) |s1 - s2| (SPEC 2): the carryover never expands."""
    torch.manual_seed(6)
    inj = build_injection(tiny(injection="ortho", ortho_eps=0.0))
    perturb_(inj, 0.3)
    u = inj.prepare(torch.randn(64, D))
    s1, s2 = torch.randn(64, D), torch.randn(64, D)
    lhs = (inj.carryover(s1, u) - inj.carryover(s2, u)).double().norm(dim=-1)
    bound = inj.decay().double().abs().max() * (s1 - s2).double().norm(dim=-1)
    assert (lhs <= bound * (1 + 1e-5)).all()
    assert inj.decay().max() < 1


# ---------------------------------------------------------------------------------------------
# 4. Initial values and closed forms of each scheme
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["parcae-decay", "ortho"])
def test_parcae_decay_init(name):
    inj = build_injection(tiny(injection=name))
    decay, dt = inj.decay().double(), inj.dt().double()
    assert decay.shape == (D,) and dt.shape == (D,)
    assert (decay - 1 / math.sqrt(5)).abs().max() <= 1e-7
    assert (dt - 0.5 * math.log(5)).abs().max() <= 1e-6
    # input gain of SPEC 2 (dt ~ 0.805) and a = exp(A_log) = 1
    assert abs(dt[0].item() - 0.8047) < 1e-4
    assert torch.equal(inj.A_log.detach(), torch.zeros(D))
    assert torch.equal(inj.W.weight.detach(), torch.eye(D))
    assert inj.W.bias is None


def test_parcae_nonorm_init():
    inj = build_injection(tiny(injection="parcae-nonorm"))
    assert (inj.decay().double() - math.exp(-1)).abs().max() <= 1e-7
    assert (inj.dt().double() - 1.0).abs().max() <= 1e-6
    assert torch.equal(inj.W.weight.detach(), torch.eye(D))
    assert inj.prelude_norm is None


def test_model_reset_keeps_injection_init():
    """LoopedLM's own init must not overwrite the injection's special init (W = I, decay)."""
    model = LoopedLM(tiny(injection="parcae-decay"))
    assert torch.equal(model.injection.W.weight.detach(), torch.eye(D))
    assert (model.injection.decay().double() - 1 / math.sqrt(5)).abs().max() <= 1e-7


def test_parcae_decay_closed_form():
    torch.manual_seed(7)
    cfg = tiny(injection="parcae-decay")
    inj = build_injection(cfg)
    perturb_(inj)
    e, s = torch.randn(2, 5, D), torch.randn(2, 5, D)
    got = inj(s, inj.prepare(e))
    dt = torch.log1p(torch.exp(inj.dt_raw.double()))  # softplus
    decay = torch.exp(-dt * torch.exp(inj.A_log.double()))
    e_tilde = rms_norm64(e, inj.prelude_norm.weight, cfg.norm_eps)
    want = decay * s.double() + dt * (e_tilde @ inj.W.weight.double().T)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_parcae_nonorm_closed_form():
    torch.manual_seed(8)
    inj = build_injection(tiny(injection="parcae-nonorm"))
    perturb_(inj)
    e, s = torch.randn(3, D), torch.randn(3, D)
    got = inj(s, inj.prepare(e))
    dt = torch.log1p(torch.exp(inj.dt_raw.double()))
    decay = torch.exp(-dt * torch.exp(inj.A_log.double()))
    want = decay * s.double() + dt * (e.double() @ inj.W.weight.double().T)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_huginn_linear_closed_form_and_exit_norm():
    torch.manual_seed(9)
    cfg = tiny(injection="huginn-linear")
    inj = build_injection(cfg)
    assert torch.equal(inj.A_input.bias.detach(), torch.zeros(D))
    perturb_(inj)
    e, s = torch.randn(4, D), torch.randn(4, D)
    A = torch.cat([inj.A_state.weight, inj.A_input.weight], 1).double()  # d x 2d
    assert A.shape == (D, 2 * D)
    want = torch.cat([s, e], -1).double() @ A.T + inj.A_input.bias.double()
    torch.testing.assert_close(inj(s, inj.prepare(e)).double(), want, rtol=1e-5, atol=1e-5)
    # exit norm: parameter-free RMSNorm, output RMS 1 whatever the input scale
    # (exactly sqrt(m / (m + eps)) with m = mean(x^2); 1 to 1e-4 once m >> eps)
    for scale in (1e-2, 1.0, 1e3):
        x = scale * torch.randn(6, D)
        y = inj.exit(x).double()
        m = x.double().pow(2).mean(-1)
        torch.testing.assert_close(y.pow(2).mean(-1).sqrt(), torch.sqrt(m / (m + cfg.norm_eps)), rtol=0, atol=1e-6)
        if scale >= 1:
            torch.testing.assert_close(y.pow(2).mean(-1).sqrt(), torch.ones(6, dtype=torch.float64), rtol=0, atol=1e-4)
    assert not list(inj.exit_norm.parameters())


def test_huginn_linear_states_have_unit_rms():
    model = LoopedLM(tiny(injection="huginn-linear")).eval()
    with torch.no_grad():
        out = model(torch.randint(0, 50, (2, 7)), 4, init="seeded", return_states=True)
    for s in out.states:
        torch.testing.assert_close(s.double().pow(2).mean(-1).sqrt(), torch.ones(2, 7, dtype=torch.float64),
                                   rtol=0, atol=5e-3)  # the states are small, so eps = 1e-6 shows


def test_deq_qkv_leaves_state_unchanged_and_offsets_shapes():
    torch.manual_seed(10)
    cfg = tiny(injection="deq-qkv")
    inj = build_injection(cfg)
    e, s = torch.randn(2, 5, D), torch.randn(2, 5, D)
    assert torch.equal(inj(s, inj.prepare(e)), s)
    offsets = inj.qkv_offsets(e)
    assert len(offsets) == cfg.n_core
    for (dq, dk, dv), p in zip(offsets, inj.proj):
        assert dq.shape == (2, 5, cfg.n_heads * cfg.head_dim)
        assert dk.shape == dv.shape == (2, 5, cfg.n_kv_heads * cfg.head_dim)
        torch.testing.assert_close(dq.double(), e.double() @ p["q"].weight.double().T, rtol=1e-5, atol=1e-5)
        assert p["q"].bias is None
    # the offset projections differ between core layers (not shared weights)
    assert not torch.equal(inj.proj[0]["q"].weight, inj.proj[1]["q"].weight)


def test_additive_closed_form():
    inj = build_injection(tiny(injection="additive"))
    e, s = torch.randn(3, D), torch.randn(3, D)
    torch.testing.assert_close(inj(s, inj.prepare(e)), s + e, rtol=0, atol=0)


@pytest.mark.parametrize("name", [n for n in INJECTIONS if n != "deq-qkv"])
def test_carryover_plus_injected_input(name):
    """SPEC 11 convention: s' = carryover(s, q) + q for every scheme but DEQ-QKV."""
    torch.manual_seed(11)
    inj = build_injection(tiny(injection=name))
    perturb_(inj)
    e, s = torch.randn(3, D), torch.randn(3, D)
    q = inj.prepare(e)
    torch.testing.assert_close(inj(s, q), inj.carryover(s, q) + q, rtol=1e-6, atol=1e-6)
