"""Input-injection schemes (design §2) against closed forms written out in float64 in this file."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from looplm.config import INJECTIONS, ModelConfig
from looplm.model import LoopedLM, StateStart, build_injection
from looplm.model.blocks import apply_rope, rope_tables
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
    """eps = 0: <s', u>/|u|^2 = 1 for random s and e (design §2). In fp32 the residual of the
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
    # what the forward itself feeds the core at each recurrence: the first core block's input
    seen: list[torch.Tensor] = []
    hook = model.core[0].register_forward_pre_hook(lambda block, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            out = model(tokens, 6, state0=state0, return_states=True)
    finally:
        hook.remove()
    assert len(seen) == 6
    with torch.no_grad():
        positions = torch.arange(12).expand(2, 12)
        rope = rope_tables(positions, model.cfg.head_dim, model.cfg.rope_base)
        u = model.injection.prepare(model.run_prelude(tokens, rope, None))
    for r, (x, s) in enumerate(zip(seen, [state0, *out.states[:-1]])):
        ratio = along_u(x, u)
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


@pytest.mark.parametrize("eps", [0.0, 1e-6, 0.3])
def test_ortho_carryover_is_the_projected_contraction(eps):
    """The carryover is linear in s with matrix Q_u Lambda, Q_u = I - u u^T / (|u|^2 + eps) (design §2,
    paper 4.2), written out here in float64 per token. Only the projection gives its two
    properties: the direction u is (for eps = 0: exactly) annihilated, u^T Q_u Lambda =
    eps / (|u|^2 + eps) u^T Lambda, and |Q_u Lambda|_2 <= |Lambda|_2 < 1. Tokens with |u|^2 from
    ~eps to >> eps make the eps placement in alpha = <r,u>/(|u|^2 + eps) visible."""
    torch.manual_seed(6)
    inj = build_injection(tiny(injection="ortho", ortho_eps=eps))
    perturb_(inj, 0.3)  # a non-uniform decay: Lambda is not a multiple of I, so Q_u and Lambda do not commute
    decay = inj.decay().double()
    assert decay.max() < 1 and decay.max() - decay.min() > 0.1
    e = torch.randn(6, D) * torch.tensor([0.02, 0.1, 0.3, 1.0, 3.0, 10.0])[:, None]
    u = inj.prepare(e)
    u64 = u.double()
    eye = torch.eye(D, dtype=torch.float64)
    for t_, ut in enumerate(u64):
        # the module's carryover applied to the basis vectors: its matrix, column by column
        J = inj.carryover(torch.eye(D), u[t_].expand(D, D)).double().T
        Q = eye - torch.outer(ut, ut) / (ut @ ut + eps)
        want = Q @ torch.diag(decay)
        torch.testing.assert_close(J, want, rtol=0, atol=2e-6)
        # the projection direction: u^T J = eps/(|u|^2+eps) u^T Lambda (0 for eps = 0)
        shrink = eps / (ut @ ut + eps)
        torch.testing.assert_close(ut @ J, shrink * (ut * decay), rtol=0, atol=2e-6 * ut.norm().item())
        if eps == 0.0:
            assert (ut @ J).norm() <= 1e-6 * ut.norm() * decay.max()  # vs |u^T Lambda| ~ |u| decay without it
        # contractive: the largest singular value of Q_u Lambda never exceeds max(decay) < 1
        assert torch.linalg.matrix_norm(J, ord=2) <= decay.max() * (1 + 1e-6)
    # the same on state differences: the carryover of s1 - s2 has (for eps = 0) no component along u
    s1, s2 = 5 * torch.randn(6, D), 5 * torch.randn(6, D)
    diff = (inj.carryover(s1, u) - inj.carryover(s2, u)).double()
    along = (diff * u64).sum(-1) / u64.norm(dim=-1)
    want = (eps / (u64.pow(2).sum(-1) + eps)) * ((decay * (s1 - s2).double()) * u64).sum(-1) / u64.norm(dim=-1)
    torch.testing.assert_close(along, want, rtol=0, atol=1e-4)
    assert (diff.norm(dim=-1) <= decay.max() * (s1 - s2).double().norm(dim=-1) * (1 + 1e-5)).all()


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
    # input gain of design §2 (dt ~ 0.805) and a = exp(A_log) = 1
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
        torch.testing.assert_close(
            s.double().pow(2).mean(-1).sqrt(), torch.ones(2, 7, dtype=torch.float64), rtol=0, atol=5e-3
        )  # the states are small, so eps = 1e-6 shows


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


def reference_split(name: str, inj, cfg: ModelConfig, s: torch.Tensor, e: torch.Tensor):
    """design §2's update s' = carryover + q written out in float64 from the raw parameters:
    q depends on e alone, the carryover on s (and q for OrthoInj) and vanishes at s = 0."""
    s, e = s.double(), e.double()
    if name == "additive":  # s' = s + e
        return s, e
    if name == "huginn-linear":  # s' = A [s; e] + b, A = [A_s | A_e] in R^{d x 2d}
        A = torch.cat([inj.A_state.weight, inj.A_input.weight], 1).double()
        return s @ A[:, :D].T, e @ A[:, D:].T + inj.A_input.bias.double()
    dt = torch.log1p(torch.exp(inj.dt_raw.double()))  # softplus
    decay = torch.exp(-dt * torch.exp(inj.A_log.double()))
    e_tilde = rms_norm64(e, inj.prelude_norm.weight, cfg.norm_eps) if name == "parcae-decay" else e
    q = dt * (e_tilde @ inj.W.weight.double().T)
    r = decay * s
    if name == "ortho":  # r - alpha q, alpha = <r, q> / (|q|^2 + eps)
        r = r - ((r * q).sum(-1, keepdim=True) / (q.pow(2).sum(-1, keepdim=True) + cfg.ortho_eps)) * q
    return r, q


@pytest.mark.parametrize("name", [n for n in INJECTIONS if n != "deq-qkv"])
def test_carryover_and_injected_input_match_the_equations(name):
    """design §11 reads `carryover(s, q)` as the part of s' that comes from the state and `prepare(e)`
    as the injected input q; both are checked against the float64 equations above (not against
    each other), and so is their sum, the update itself."""
    torch.manual_seed(11)
    cfg = tiny(injection=name)
    inj = build_injection(cfg)
    perturb_(inj)
    e, s = torch.randn(3, 5, D), 2 * torch.randn(3, 5, D)
    carry_ref, q_ref = reference_split(name, inj, cfg, s, e)
    q = inj.prepare(e)
    torch.testing.assert_close(q.double(), q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inj.carryover(s, q).double(), carry_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inj(s, q).double(), carry_ref + q_ref, rtol=1e-5, atol=1e-5)
    # the split is not trivial: the carryover is neither s itself (but for additive) nor 0
    assert (carry_ref - s.double()).abs().max() > 1e-2 or name == "additive"
    assert torch.equal(inj.carryover(torch.zeros_like(s), q), torch.zeros_like(s))


def test_deq_qkv_offsets_reach_k_and_v_by_name():
    """DEQ-QKV written out for core layer 0 at the first recurrence (s' = s): K = rope(W_k x + P_k e),
    V = W_v x + P_v e with x = attn_norm(s^0). The offsets' K and V swapped went unnoticed: the shape
    test checked only the query's offset, and the naive decoder calls the offsets itself."""
    torch.manual_seed(0)
    m = LoopedLM(tiny(injection="deq-qkv")).eval()
    perturb_(m.injection)
    tok = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        ctx, s0 = m.begin(tok, StateStart("seeded"))
        e = m.run_prelude(tok, ctx.rope, None)
        _, kvs = m.recurrence(s0, ctx, return_kv=True)
        blk, proj = m.core[0], m.injection.proj[0]
        x = blk.attn_norm(s0)
        heads = lambda t: t.view(2, 7, m.cfg.n_kv_heads, m.cfg.head_dim).transpose(1, 2)  # noqa: E731
        want_k = apply_rope(heads(blk.attn.wk(x) + e @ proj["k"].weight.T), *ctx.rope)
        want_v = heads(blk.attn.wv(x) + e @ proj["v"].weight.T)
    torch.testing.assert_close(kvs[0][0], want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kvs[0][1], want_v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["parcae-nonorm", "parcae-decay"])
def test_diagonal_retention_learns_its_rate(name):
    """a = exp(A_log) and dt are both learned: the gradients of sum(w * carryover) with respect to A_log
    and dt_raw equal the float64 closed form, d decay / d A_log = -dt a decay and
    d decay / d dt_raw = -a sigmoid(dt_raw) decay, with decay = exp(-dt a)."""
    torch.manual_seed(12)
    inj = build_injection(tiny(injection=name))
    perturb_(inj, 0.3)
    s, w, e = torch.randn(3, 5, D), torch.randn(3, 5, D), torch.randn(3, 5, D)
    carry = inj.carryover(s, inj.prepare(e))
    g_a, g_dt = torch.autograd.grad((w * carry).sum(), (inj.A_log, inj.dt_raw))
    dt = torch.log1p(torch.exp(inj.dt_raw.double()))
    a = torch.exp(inj.A_log.double())
    decay = torch.exp(-dt * a)
    ws = (w.double() * s.double()).sum((0, 1))
    torch.testing.assert_close(g_a.double(), ws * decay * (-dt * a), rtol=1e-5, atol=1e-6)
    want_dt = ws * decay * (-a * torch.sigmoid(inj.dt_raw.double()))
    torch.testing.assert_close(g_dt.double(), want_dt, rtol=1e-5, atol=1e-6)


def test_reset_parameters_restores_every_injection_init():
    """After training moved them, `reset_parameters` gives back design §2's init: W = I, dt and a at
    their initial values, and Parcae-Decay's prelude norm gain 1."""
    inj = build_injection(tiny(injection="parcae-decay"))
    perturb_(inj, 0.3)
    inj.reset_parameters()
    assert torch.equal(inj.W.weight.detach(), torch.eye(D))
    assert (inj.decay().double() - 1 / math.sqrt(5)).abs().max() <= 1e-7
    assert torch.equal(inj.prelude_norm.weight.detach(), torch.ones(D))


def test_deq_qkv_projections_are_gaussian_with_std_002():
    """design §2: DEQ-QKV's offset projections are bias-free N(0, 0.02^2) (not truncated): the empirical std
    of ~200k weights within 1% of 0.02, and values beyond 3 std occur as for a normal."""
    torch.manual_seed(13)
    cfg = ModelConfig(vocab_size=50, d_model=256, n_heads=4, n_kv_heads=2, ffn_dim=64, injection="deq-qkv")
    w = torch.cat([lin.weight.detach().flatten() for layer in build_injection(cfg).proj for lin in layer.values()])
    assert w.numel() > 200_000
    assert abs(w.std().item() / 0.02 - 1) < 0.01 and abs(w.mean().item()) < 1e-4
    assert (w.abs() > 3 * 0.02).float().mean().item() > 0.001  # a normal has 0.27% beyond 3 sigma


def test_injection_norms_use_the_configured_eps():
    """Parcae-Decay's prelude norm and every exit norm (huginn-linear's gain-free one, a configured rms-gain)
    use cfg.norm_eps: with eps 0.25 and inputs of RMS ~0.5 the float64 RMSNorm written out here differs
    from one with RMSNorm's default 1e-6 by ~40%."""
    torch.manual_seed(15)
    e, s, x = 0.5 * torch.randn(2, 5, D), torch.randn(2, 5, D), 0.5 * torch.randn(2, 5, D)
    cfg = tiny(injection="parcae-decay", norm_eps=0.25)
    inj = build_injection(cfg)
    perturb_(inj)
    _, q_ref = reference_split("parcae-decay", inj, cfg, s, e)
    torch.testing.assert_close(inj.prepare(e).double(), q_ref, rtol=1e-5, atol=1e-5)
    for name, kind in (("huginn-linear", "auto"), ("additive", "rms-gain")):
        inj = build_injection(tiny(injection=name, exit_norm=kind, norm_eps=0.25))
        perturb_(inj)
        gain = inj.exit_norm.weight
        torch.testing.assert_close(inj.exit(x).double(), rms_norm64(x, gain, 0.25), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["parcae-decay", "parcae-nonorm", "ortho"])
def test_an_fp32_injection_keeps_a_bf16_state_bf16(name):
    """FSDP2 keeps the injection's parameters in fp32 (train/parallelize.py) while bf16 blocks may hand it a
    bf16 state and prelude output: dt and the decay are cast to their dtype, so under autocast the update
    stays bf16 (an fp32 dt or decay would promote the state to fp32 at the first recurrence). Values: the
    float64 equations, to bf16 rounding."""
    torch.manual_seed(16)
    cfg = tiny(injection=name)
    inj = build_injection(cfg)
    perturb_(inj)
    e, s = torch.randn(2, 5, D).bfloat16(), torch.randn(2, 5, D).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q = inj.prepare(e)
        out = inj(s, q)
    assert q.dtype == out.dtype == torch.bfloat16
    carry_ref, q_ref = reference_split(name, inj, cfg, s, e)
    torch.testing.assert_close(out.double(), carry_ref + q_ref, rtol=0.02, atol=0.05)
