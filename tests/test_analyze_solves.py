"""Fixed-point solves (looplm.analyze.solves): joint vs frozen-prefix solves on a contractive model, and
the solve rule against naive loops, two-cycles and slow drifts."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from test_analyze_convergence import scaled_model, tokens

from looplm.analyze import SolveRule, solve, span_solves, start
from looplm.model import LoopedLM

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread


# -- fixed-point solves --------------------------------------------------------------------------
def contractive_model(make_cfg) -> LoopedLM:
    """A real looped model (attention, SwiGLU) with core weights large enough that tokens interact,
    still contractive thanks to Parcae's decay 1/sqrt(5)."""
    model = LoopedLM(make_cfg(injection="parcae-decay", max_depth=1024)).eval()
    with torch.no_grad():
        for block in model.core:
            for p in block.parameters():
                if p.ndim == 2:
                    p.mul_(6.0)
    return model


def test_joint_and_frozen_prefix_solves_agree_on_a_contractive_model(tiny_model_config):
    model = contractive_model(tiny_model_config)
    x, ids = tokens(3, 12), torch.arange(3)
    out = span_solves(model, x, example_ids=ids, rule=SolveRule(max_depth=400), control_depth=2)
    for name in ("prefix", "joint", "frozen", "control"):
        assert out[f"{name}_qualified"].all(), name
    assert out["gap"].max() < 1e-6
    assert out["kl"].abs().max() < 1e-9
    # The prefix matters: freezing a depth-2 prefix instead leaves a far larger gap.
    assert out["control_gap"].min() > 1e3 * out["gap"].max()
    # The joint solve reached the fixed point of the native forward (an independent path).
    native = model(x, 300, init="seeded", example_ids=ids).endpoint[:, -1]
    assert out["joint_depth"].max() < 300
    begin = start(model, x, example_ids=ids)
    joint = solve(lambda s: model.recurrence(s, begin.ctx, return_kv=True), begin.state0, SolveRule(max_depth=400))
    assert ((joint.state[:, -1] - native).norm(dim=-1) / native.norm(dim=-1)).max() < 1e-5


def test_solve_with_a_document_mask_matches_a_masked_span(tiny_model_config):
    """Packed rows: the current token's document starts mid-span, so its frozen prefix attention must
    follow the document mask; the solve then equals one on the document alone."""
    model = contractive_model(tiny_model_config)
    x = tokens(2, 12)
    doc = torch.tensor([[0] * 5 + [1] * 7, [0] * 8 + [1] * 4])
    pos = torch.stack([torch.cat([torch.arange(5), torch.arange(7)]), torch.cat([torch.arange(8), torch.arange(4)])])
    out = span_solves(model, x, doc_ids=doc, positions=pos, example_ids=torch.arange(2), rule=SolveRule(max_depth=400))
    assert out["joint_qualified"].all() and out["frozen_qualified"].all()
    assert out["gap"].max() < 1e-6 and out["kl"].abs().max() < 1e-9


def test_rule_on_a_scalar_contraction_matches_a_naive_loop():
    """A scalar geometric contraction: the qualifying depth is where 8 steps in a row first change
    the state by <= tol (confirmation and the final check then pass trivially)."""
    lam, target = 0.7, 3.0
    s0 = torch.full((1, 1, 4), 1000.0, dtype=torch.float64)
    step = lambda s: (target + lam * (s - target), [])  # noqa: E731
    rule = SolveRule(max_depth=300)
    got = solve(step, s0, rule)
    # Naive loop: record |s^r - s^(r-1)| / |s^(r-1)| and find the end of the first 8-run <= tol.
    # The first recurrence has no earlier K/V to compare with, so it never counts as stable.
    s, run, expected = 1000.0, 0, None
    for r in range(1, 300):
        new = target + lam * (s - target)
        run = run + 1 if (r > 1 and abs(new - s) / abs(s) <= rule.tol) else 0
        s = new
        if run == rule.stable_steps:
            expected = r
            break
    assert got.qualified.item() and got.depth.item() == expected
    assert got.steps == expected + rule.confirm_steps + 1


def test_solve_rule_rejects_a_two_cycle_and_a_slow_drift(tiny_model_config):
    model = scaled_model(tiny_model_config, -1.0, zero_input=True)  # F(s) = -s
    begin = start(model, tokens(), example_ids=torch.arange(3))
    cyc = solve(lambda s: model.recurrence(s, begin.ctx, return_kv=True), begin.state0, SolveRule(max_depth=200))
    assert not cyc.qualified.any() and (cyc.depth == -1).all() and cyc.steps == 200
    # Per-step change 4e-6 <= tol passes the stable run, but the drift over the confirmation exceeds 5e-5.
    drift = solve(lambda s: (s * (1 + 4e-6), []), torch.ones(1, 2, 3, dtype=torch.float64), SolveRule(max_depth=300))
    assert not drift.qualified.any()
    slow = solve(lambda s: (s * (1 + 2e-6), []), torch.ones(1, 2, 3, dtype=torch.float64), SolveRule(max_depth=300))
    assert slow.qualified.all()  # 16 x 2e-6 stays within the drift bound
    # A still state whose layer K/V keep moving does not qualify either.
    clock = iter(range(1, 10_000))

    def moving_kv(s):
        k = torch.ones(1, 1, 2, 3, dtype=torch.float64) * (1 + 1e-3 * next(clock))
        return s, [(k, k.clone())]

    assert not solve(moving_kv, torch.ones(1, 2, 3, dtype=torch.float64), SolveRule(max_depth=100)).qualified.any()


def test_rows_are_judged_separately():
    lam = 0.5
    s0 = torch.ones(2, 3, 4, dtype=torch.float64)
    sign = torch.tensor([1.0, -1.0], dtype=torch.float64)[:, None, None]

    def step(s):  # row 0 contracts toward 2, row 1 flips sign forever
        return torch.where(sign > 0, 2 + lam * (s - 2), -s), []

    out = solve(step, s0, SolveRule(max_depth=120))
    assert out.qualified.tolist() == [True, False]
    assert out.depth[0] > 0 and out.depth[1] == -1
    torch.testing.assert_close(out.state[0], torch.full((3, 4), 2.0, dtype=torch.float64), rtol=1e-5, atol=0)


@pytest.mark.parametrize("bad", [dict(tol=0), dict(drift_tol=-1), dict(stable_steps=0), dict(max_depth=10)])
def test_solve_rule_validation(bad):
    with pytest.raises(ValueError):
        SolveRule(**bad).validate()


def test_the_shortest_allowed_solve_can_qualify_an_exact_fixed_point():
    # step 1 never counts (no earlier K/V), so 8 stable + 16 confirmation + 1 final need 26 steps;
    # 25 was allowed and then could never qualify anything
    rule = SolveRule()
    shortest = rule.stable_steps + rule.confirm_steps + 2
    with pytest.raises(ValueError, match="leaves no room"):
        SolveRule(max_depth=shortest - 1).validate()
    SolveRule(max_depth=shortest).validate()
    out = solve(lambda s: (s, []), torch.ones(1, 2, 3, dtype=torch.float64), SolveRule(max_depth=shortest))
    assert out.qualified.all()


def test_prediction_kl_is_kl_p_to_q_by_hand():
    """Guards against KL(q || p) in place of KL(p || q)."""
    import math

    from looplm.analyze.solves import prediction_kl

    p, q = [0.7, 0.2, 0.1], [0.2, 0.3, 0.5]
    want = sum(a * math.log(a / b) for a, b in zip(p, q))  # 0.5838..., KL(q || p) = 0.5318...
    got = prediction_kl(torch.tensor([p], dtype=torch.float64).log(), torch.tensor([q], dtype=torch.float64).log())
    assert float(got[0]) == pytest.approx(want, rel=1e-9)


def test_a_moving_value_cache_alone_never_qualifies():
    """State and K fixed, V keeps
    moving by 1e-3 per step, far above tol = 1e-5 (the existing test moves K and V together)."""
    from looplm.analyze import SolveRule, solve

    clock = iter(range(10**6))

    def moving_v(s):
        k = torch.ones(1, 1, 2, 3, dtype=torch.float64)
        v = k * (1 + 1e-3 * next(clock))
        return s, [(k, v)]

    assert not solve(moving_v, torch.ones(1, 2, 3, dtype=torch.float64), SolveRule(max_depth=100)).qualified.any()


class _ScaleCore(nn.Module):
    """x -> lam x, reporting x as K and V (tokens do not interact in the core)."""

    def __init__(self, lam, h, hd):
        super().__init__()
        self.lam, self.h, self.hd = lam, h, hd

    def forward(self, x, rope, mask, *, offsets=None, kv=None):
        if kv is not None:
            B, L, _ = x.shape
            kv.update(*(x.reshape(B, L, self.h, self.hd).transpose(1, 2),) * 2)
        return self.lam * x


def test_control_prediction_uses_the_depth_r_prefix_state(tiny_model_config):
    """Additive injection and a scaling core: s^r = lam (s^(r-1) + e), so the depth-R prefix state is
    lam^R s0 + lam (1 - lam^R) / (1 - lam) e and every fixed point is lam e / (1 - lam); the control's
    KL(joint || control) is the coda's KL between [s*_prefix, s*_cur] and [s^R_prefix, s*_cur]."""
    from looplm.analyze import SolveRule, span_solves, start
    from looplm.model import LoopedLM

    lam, R = 0.9, 1
    cfg = tiny_model_config(injection="additive", n_core=1, d_model=16, n_heads=2, n_kv_heads=2, max_depth=1024)
    model = LoopedLM(cfg).eval()
    model.core = nn.ModuleList([_ScaleCore(lam, cfg.n_kv_heads, cfg.head_dim)])
    with torch.no_grad():  # a coda whose last token reads the prefix strongly
        for p in model.coda.parameters():
            if p.ndim == 2:
                p.mul_(6.0)
    x, ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(2)), torch.arange(2)
    out = span_solves(model, x, example_ids=ids, rule=SolveRule(max_depth=400), control_depth=R)
    assert out["joint_qualified"].all() and out["control_qualified"].all()
    begin = start(model, x, example_ids=ids)
    e, s0 = begin.ctx.injected.double(), begin.state0.double()
    star = lam * e / (1 - lam)
    s_r = lam**R * s0 + lam * (1 - lam**R) / (1 - lam) * e
    ctrl = torch.cat([s_r[:, :-1], star[:, -1:]], dim=1).float()
    with torch.no_grad():
        p = model.run_coda(star.float(), begin.ctx.rope, begin.ctx.mask, begin.ctx)[:, -1].double().log_softmax(-1)
        q = model.run_coda(ctrl, begin.ctx.rope, begin.ctx.mask, begin.ctx)[:, -1].double().log_softmax(-1)
    want = (p.exp() * (p - q)).sum(-1)
    assert want.min() > 1e3 * out["kl"].abs().max()  # the unconverged prefix matters; the solves agree
    torch.testing.assert_close(out["control_kl"], want, rtol=1e-2, atol=1e-10)


def _scripted(factors):
    """A step that multiplies the state by the next of `factors` (1 + e: relative change |e|), no K/V."""
    it = iter(factors)
    return lambda s: (s * next(it), [])


def test_a_failed_confirmation_starts_a_fresh_stable_run():
    """Guards against the stable streak kept after a failed confirmation, and against the depth of the first
    stable run reported, not of the one that qualified. Scripted changes:
    r = 1 never counts; r = 2..9 change 1e-6 (the stable run completes at r = 9); a 1e-4 jump at r = 14
    (5th confirmation step) breaks the drift bound; r = 15..22 rebuild the 8-step run (depth 22), 16
    confirmation steps (r = 23..38) and the final check (r = 39) qualify."""
    e = 1 + 1e-6
    factors = [e] * 13 + [1 + 1e-4] + [e] * 200
    got = solve(_scripted(factors), torch.ones(1, 2, 3, dtype=torch.float64), SolveRule(max_depth=100))
    assert got.qualified.item() and got.depth.item() == 22 and got.steps == 39


def test_confirmation_drift_is_measured_from_the_stable_runs_end():
    """A steady
    relative change of 3e-6 per step: 16 confirmation steps drift (1 + 3e-6)^16 - 1 = 4.80e-5 <= 5e-5
    from the run's endpoint (qualifies); from one step earlier it would be 17 steps, 5.10e-5 (never)."""
    assert (1 + 3e-6) ** 16 - 1 < 5e-5 < (1 + 3e-6) ** 17 - 1
    out = solve(_scripted([1 + 3e-6] * 400), torch.ones(1, 2, 3, dtype=torch.float64), SolveRule(max_depth=300))
    assert out.qualified.item() and out.depth.item() == 9 and out.steps == 9 + 16 + 1


def test_an_exact_fixed_point_qualifies_after_the_first_step_and_without_confirmation():
    """Guards against step 1, with no earlier K/V, counted as stable, and against confirm_steps = 0
    still spending a confirmation step. For F(s) = s the
    stable run ends at r = 1 + stable_steps; with no confirmation the final check is the next step."""
    s0 = torch.ones(1, 2, 3, dtype=torch.float64)
    identity = lambda s: (s, [])  # noqa: E731
    out = solve(identity, s0, SolveRule())
    assert out.qualified.item() and out.depth.item() == 9 and out.steps == 9 + 16 + 1
    bare = SolveRule(max_depth=10, confirm_steps=0)  # the shortest rule: 1 + 8 + 0 + 1 steps
    out = solve(identity, s0, bare)
    assert out.qualified.item() and out.depth.item() == 9 and out.steps == 10


def test_each_rows_endpoint_is_the_state_and_kv_of_its_own_final_step():
    """Guards against a row's endpoint frozen one step early (before its final check) and its K/V taken
    from the other row: two rows contracting at different rates finish at different steps; each keeps
    the state and K/V of its own final recurrence (depth + 16 + 1), from a plain loop over the step."""
    lam = torch.tensor([0.3, 0.8], dtype=torch.float64)[:, None, None]

    def step(s):
        new = 3.0 + lam * (s - 3.0)
        return new, [(new[:, None] * 2.0, new[:, None] - 1.0)]  # K, V [B, 1, L, d]

    s0 = torch.full((2, 2, 4), 1000.0, dtype=torch.float64)
    out = solve(step, s0, SolveRule(max_depth=300))
    assert out.qualified.all() and out.depth[0] < out.depth[1]
    states, kvs, s = [s0], [None], s0
    for _ in range(out.steps):
        s, kv = step(s)
        states.append(s)
        kvs.append(kv)
    for i in range(2):
        final = int(out.depth[i]) + 16 + 1
        assert torch.equal(out.state[i], states[final][i]), i
        assert torch.equal(out.kv[0][0][i], kvs[final][0][0][i]) and torch.equal(out.kv[0][1][i], kvs[final][0][1][i])
    assert out.steps == int(out.depth[1]) + 16 + 1


def test_a_change_equal_to_tol_counts_as_stable():
    """Guards `change <= tol` (not <): a state alternating 1 <-> 1 + 2^-20 changes by exactly tol = 2^-20
    (then 2^-20 / (1 + 2^-20)); every step is stable, so it qualifies at the earliest depth."""
    t = 2.0**-20
    step = lambda s: (torch.where(s == 1, 1 + t, torch.ones_like(s)), [])  # noqa: E731
    out = solve(step, torch.ones(1, 1, 1, dtype=torch.float64), SolveRule(max_depth=100, tol=t))
    assert out.qualified.item() and out.depth.item() == 9 and out.steps == 26


def test_confirmation_drift_bound_is_inclusive_and_relative_to_the_anchor():
    """Guards `drift <= drift_tol` (not <) and the drift's denominator |anchor| (not |new|): identity steps,
    one jump at the first confirmation step (r = 10), then still. A jump of exactly drift_tol passes
    (depth 9); a jump just above drift_tol relative to the anchor fails and restarts (depth 18)."""
    D = 2.0**-15
    ok = solve(
        _scripted([1.0] * 9 + [1 + D] + [1.0] * 100),
        torch.ones(1, 1, 1, dtype=torch.float64),
        SolveRule(max_depth=100, drift_tol=D),
    )
    assert ok.qualified.item() and ok.depth.item() == 9 and ok.steps == 26
    over = solve(
        _scripted([1.0] * 9 + [1 + 3.00005e-5] + [1.0] * 100),
        torch.ones(1, 1, 1, dtype=torch.float64),
        SolveRule(max_depth=100, drift_tol=3e-5),
    )
    assert over.qualified.item() and over.depth.item() == 18 and over.steps == 18 + 16 + 1


def test_per_step_change_is_relative_to_the_previous_state():
    """Guards the step change's denominator |s^(r-1)| (not |s^r|): a steady growth by x = 1.000005e-5 > tol
    per step never counts as stable (x / (1 + x) would pass)."""
    x = 1.000005e-5
    out = solve(
        _scripted([1 + x] * 200), torch.ones(1, 1, 1, dtype=torch.float64), SolveRule(max_depth=100, drift_tol=1.0)
    )
    assert not out.qualified.any() and out.steps == 100


def test_a_failed_final_check_restarts_the_search():
    """Guards against a failed final check (change > tol at r = 26) left in the final phase: the search
    restarts, a new stable run ends at r = 34, 16 confirmation steps and the final check end at r = 51."""
    out = solve(
        _scripted([1.0] * 25 + [1 + 1e-4] + [1.0] * 100),
        torch.ones(1, 1, 1, dtype=torch.float64),
        SolveRule(max_depth=100),
    )
    assert out.qualified.item() and out.depth.item() == 34 and out.steps == 51


def test_every_layers_kv_is_compared():
    """Guards against comparing only the first core layer's K/V: a still state whose first layer's K/V
    are fixed but whose second layer's K keeps moving never qualifies."""
    clock = iter(range(10**6))

    def step(s):
        fixed = torch.ones(1, 1, 2, 3, dtype=torch.float64)
        moving = fixed * (1 + 1e-3 * next(clock))
        return s, [(fixed, fixed.clone()), (moving, fixed.clone())]

    assert not solve(step, torch.ones(1, 2, 3, dtype=torch.float64), SolveRule(max_depth=100)).qualified.any()


def test_gap_and_kl_are_joint_relative_and_kl_joint_to_frozen(tiny_model_config, monkeypatch):
    """Guards the gap's denominator |joint current state| and KL(joint || frozen) (not the reverse): with
    a budget too short to converge the endpoints differ; the expected values are computed by hand from
    the solves' own endpoints (captured) and the coda."""
    from looplm.analyze import solves as mod

    model = contractive_model(tiny_model_config)
    with torch.no_grad():  # a sharp coda, so KL is far from symmetric
        for p in model.coda.parameters():
            if p.ndim == 2:
                p.mul_(6.0)
    got = []
    real = mod.solve
    monkeypatch.setattr(mod, "solve", lambda *a, **k: got.append(real(*a, **k)) or got[-1])
    x = tokens()[:2, :5]
    out = span_solves(
        model, x, example_ids=torch.arange(2), rule=SolveRule(max_depth=3, stable_steps=1, confirm_steps=0)
    )
    prefix, joint, frozen = got[0], got[1], got[2]
    j, f = joint.state[:, -1].double(), frozen.state[:, 0].double()
    gap = (f - j).norm(dim=-1) / j.norm(dim=-1)
    assert gap.min() > 1e-2
    torch.testing.assert_close(out["gap"].double(), gap, rtol=1e-5, atol=0)
    begin = start(model, x, example_ids=torch.arange(2))
    with torch.no_grad():
        p = model.run_coda(joint.state, begin.ctx.rope, begin.ctx.mask, begin.ctx)[:, -1].double().log_softmax(-1)
        both = torch.cat([prefix.state, frozen.state], dim=1)
        q = model.run_coda(both, begin.ctx.rope, begin.ctx.mask, begin.ctx)[:, -1].double().log_softmax(-1)
    want = (p.exp() * (p - q)).sum(-1)
    reverse = (q.exp() * (q - p)).sum(-1)
    assert (want - reverse).abs().max() > 1e-4 * want.abs().max()  # tells the two directions apart
    torch.testing.assert_close(out["kl"], want, rtol=1e-5, atol=1e-14)


def test_a_row_that_began_a_stable_run_but_never_qualified_reports_no_depth():
    """Guards the depth of unqualified rows (-1) even after a stable run was found: a steady growth by
    4e-6 per step completes stable runs but always fails the confirmation drift."""
    out = solve(_scripted([1 + 4e-6] * 400), torch.ones(1, 1, 1, dtype=torch.float64), SolveRule(max_depth=100))
    assert not out.qualified.any() and out.depth.item() == -1
