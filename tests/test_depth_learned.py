"""The learned depth prior (design §4) against independent references: autograd of the objective, finite
differences of the entropy, hand-computed baseline sequences, and a synthetic bandit."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from looplm.depth import DepthConfig, LearnedDepthPrior, LearnedPriorConfig, build_sampler
from looplm.depth.learned import entropy, initial_logits, masked_softmax, objective_gradient
from looplm.depth.pln import pln_pmf
from looplm.train.config import TrainJob, job_from_dict

CAP = 64


def prior(**cfg) -> LearnedDepthPrior:
    depth = dict(sampler="learned", depth=5.0, seed=cfg.pop("seed", 0))
    for k in ("low", "high"):
        if k in cfg:
            depth[k] = cfg.pop(k)
    return build_sampler(DepthConfig(**depth, learned=LearnedPriorConfig(**cfg)))


def autograd_objective_gradient(logits, active, depths, adv, w, target, lam_m, lam_h):
    """J(phi) written directly in torch and differentiated by autograd (the design §4 objective)."""
    phi = torch.tensor(np.where(active, logits, 0.0), dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(active)
    logp = torch.log_softmax(phi.masked_fill(~mask, -math.inf), 0)
    p = logp.exp()
    k = torch.arange(1, len(logits) + 1, dtype=torch.float64)
    pg = sum(wi * ai * logp[r - 1] for r, ai, wi in zip(depths, adv, w))
    ent = -(p[mask] * logp[mask]).sum()
    J = pg + lam_m * ((k * p).sum() - target) ** 2 - lam_h * ent
    J.backward()
    return phi.grad.numpy()


@pytest.mark.parametrize("restricted", [False, True])
def test_objective_gradient_equals_autograd(restricted):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, CAP)
    if restricted:
        logits[10:] = -np.inf
    active = np.isfinite(logits)
    depths = [3, 5, 5, 9, 1]
    adv = rng.normal(0, 1, len(depths))
    w = rng.random(len(depths))
    w /= w.sum()
    got = objective_gradient(logits, active, depths, adv, w, target=5.0, mean_weight=0.7, entropy_weight=0.05)
    want = autograd_objective_gradient(logits, active, depths, adv, w, 5.0, 0.7, 0.05)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-13)
    if restricted:
        assert (got[10:] == 0).all()


def test_entropy_gradient_formula_matches_finite_differences():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 1, 12)
    active = np.ones(12, dtype=bool)
    p = masked_softmax(logits, active)
    formula = -p * (np.log(p) + entropy(p))  # dH/dphi(r) = -p(r) [ln p(r) + H]
    h = 1e-6
    fd = np.array(
        [
            (entropy(masked_softmax(logits + h * e, active)) - entropy(masked_softmax(logits - h * e, active)))
            / (2 * h)
            for e in np.eye(12)
        ]
    )
    np.testing.assert_allclose(formula, fd, rtol=1e-6, atol=1e-10)
    # the implementation's entropy term is -lambda_H * dH/dphi
    g = objective_gradient(
        logits, active, [], np.array([]), np.array([]), target=5.0, mean_weight=0.0, entropy_weight=1.0
    )
    np.testing.assert_allclose(g, -formula, rtol=1e-12, atol=1e-15)


def step(s: LearnedDepthPrior, obs) -> dict:
    for depth, ce, n in obs:
        s.observe(depth, ce * n, n)
    return s.update()


def test_baselines_follow_a_hand_computed_sequence():
    s = prior(reward="ce", warmup_updates=1000)  # cost = CE: both baselines see the same numbers
    step(s, [(5, 1.0, 1), (5, 3.0, 1)])  # n = 0: copy mean 2 and within-step variance 1
    assert (s.base_ce, s.var_ce, s.base_cost, s.var_cost) == pytest.approx((2.0, 1.0, 2.0, 1.0))
    step(s, [(5, 2.0, 1), (5, 2.0, 1)])  # v = .95 * 1 + .05 * 0 + .95 * .05 * 0; b = 2
    assert (s.base_ce, s.var_ce) == pytest.approx((2.0, 0.95))
    step(s, [(5, 4.0, 1), (5, 4.0, 1)])  # v = .95 * .95 + .95 * .05 * (4 - 2)^2 = 1.0925; b = 2.1
    assert (s.base_ce, s.var_ce) == pytest.approx((2.1, 1.0925))
    assert (s.base_cost, s.var_cost) == pytest.approx((2.1, 1.0925))
    # token weights: CE 1 on 1 target and 3 on 3 targets -> mean 2.5, variance .25 * 1.5^2 + .75 * .5^2 = .75
    t = prior(reward="ce")
    step(t, [(5, 1.0, 1), (5, 3.0, 3)])
    assert (t.base_ce, t.var_ce) == pytest.approx((2.5, 0.75))


def test_popart_scale_and_advantage_by_hand():
    s = prior(reward="inv_ppl", warmup_updates=1000)
    m = step(s, [(2, 1.0, 1), (7, 2.0, 1)])
    assert m["scale"] == 1.0  # n = 0
    c = [-math.exp(-1.0), -math.exp(-2.0)]
    # the first observation initialises the baseline (mean of c), so |c_i - mean| = |c0 - c1| / 2 each
    assert m["advantage_abs"] == pytest.approx(abs(c[0] - c[1]) / 2)
    assert s.base_cost == pytest.approx(sum(c) / 2) and s.var_cost == pytest.approx(((c[0] - c[1]) / 2) ** 2)
    m = step(s, [(3, 1.5, 1)])
    assert m["scale"] == pytest.approx(math.sqrt(0.25) / abs((c[0] - c[1]) / 2))  # std(CE) / std(cost)
    assert m["cost"] == pytest.approx(-math.exp(-1.5))
    # a constant CE stream has zero variance: the floor keeps the scale finite
    z = prior(reward="ce", warmup_updates=1000)
    step(z, [(5, 1.0, 1)])
    assert step(z, [(5, 1.0, 1)])["scale"] == 1.0  # 1e-12 / 1e-12


def test_first_update_centres_on_the_first_observation_by_hand():
    """Paper App. B.3: the first (token-)weighted CE initialises the baseline. With no warmup the very
    first update already steps the logits, against that baseline rather than against 0."""
    lr, eps = 0.1, 1e-8  # the prior's Adam eps
    s = prior(reward="ce", warmup_updates=0, lr=lr, mean_weight=0.0, entropy_weight=0.0)
    phi0 = np.log(pln_pmf(5.0, 0.5, CAP))
    # depth 2: CE 1.0 on 1 target; depth 7: CE 3.0 on 3 targets -> w = (1/4, 3/4), weighted mean 2.5,
    # within-step variance 1/4 * 1.5^2 + 3/4 * 0.5^2 = 0.75; cost = CE, so the cost baseline is the same
    m = step(s, [(2, 1.0, 1), (7, 3.0, 3)])
    assert (s.base_ce, s.var_ce, s.base_cost, s.var_cost) == pytest.approx((2.5, 0.75, 2.5, 0.75))
    assert m["scale"] == 1.0
    # advantages 1.0 - 2.5 = -1.5 and 3.0 - 2.5 = 0.5; token-weighted |A| = 0.375 + 0.375
    # (with a zero baseline they would be 1 and 3, |A| = 2.5)
    assert m["advantage_abs"] == pytest.approx(0.75)
    # dJ/dphi = sum_i w_i a_i (onehot(R_i) - p) with sum_i w_i a_i = 0: -0.375 at depth 2, +0.375 at 7,
    # 0 elsewhere. Adam's first step moves by lr * g / (|g| + eps) (bias corrections cancel).
    g = np.zeros(CAP)
    g[1], g[6] = 0.25 * -1.5, 0.75 * 0.5
    want = phi0 - lr * g / (np.abs(g) + eps)
    np.testing.assert_allclose(s.logits.detach().numpy(), want, rtol=0, atol=1e-12)
    assert s.pmf()[1] > pln_pmf(5.0, 0.5, CAP)[1]  # the cheaper depth gained mass


@pytest.mark.parametrize("reward", ["inv_ppl", "ce"])
def test_single_first_observation_has_zero_advantage(reward):
    """One microbatch in the first update is its own baseline: zero advantage, so (without the mean and
    entropy terms) the logits do not move; the scale starts at one and the variances at 0."""
    s = prior(reward=reward, warmup_updates=0, lr=0.5, mean_weight=0.0, entropy_weight=0.0)
    start = s.logits.detach().clone()
    m = step(s, [(9, 1.7, 40)])
    assert m["advantage_abs"] == 0.0 and m["scale"] == 1.0
    cost = 1.7 if reward == "ce" else -math.exp(-1.7)
    assert (s.base_ce, s.var_ce, s.base_cost, s.var_cost) == pytest.approx((1.7, 0.0, cost, 0.0))
    assert torch.equal(s.logits.detach(), start)


@pytest.mark.parametrize(
    "reward,expected",
    [("inv_ppl", -math.exp(-1.3)), ("ce", 1.3), ("neg_log_ce", math.log(1.3)), ("neg_exp_ce", math.exp(1.3))],
)
def test_rewards_give_the_spec_costs(reward, expected):
    s = prior(reward=reward)
    assert step(s, [(4, 1.3, 10)])["cost"] == pytest.approx(expected)


def test_logits_frozen_during_warmup_then_move():
    s = prior(warmup_updates=32, lr=0.05)
    start = s.logits.detach().clone()
    rng = np.random.default_rng(2)
    for i in range(32):
        step(s, [(s.draw(), float(rng.uniform(1, 3)), 16) for _ in range(2)])
        assert torch.equal(s.logits.detach(), start), i
    step(s, [(s.draw(), float(rng.uniform(1, 3)), 16) for _ in range(2)])
    assert not torch.equal(s.logits.detach(), start)


def bandit(s: LearnedDepthPrior, updates: int, good: int = 3, seed: int = 0) -> LearnedDepthPrior:
    """Depth `good` has CE 1.0, every other depth CE 2.0 (plus small noise); 4 microbatches per update."""
    rng = np.random.default_rng(seed)
    for _ in range(updates):
        obs = []
        for _ in range(4):
            r = s.draw()
            obs.append((r, (1.0 if r == good else 2.0) + float(rng.normal(0, 0.05)), 100))
        step(s, obs)
    return s


def test_bandit_moves_toward_the_cheap_depth_while_the_mean_penalty_holds_the_mean():
    p0 = pln_pmf(5.0, 0.5, CAP)
    held = bandit(prior(warmup_updates=4, lr=0.05, mean_weight=1.0), 300)
    free = bandit(prior(warmup_updates=4, lr=0.05, mean_weight=0.0), 300)
    assert held.pmf()[2] > 2 * p0[2]  # p(3) at least doubles
    assert abs(held.mean() - 5.0) < 0.5
    assert free.pmf()[2] > held.pmf()[2]
    assert free.mean() < held.mean() - 0.5  # without the penalty the mean drifts toward the cheap depth


def test_more_entropy_weight_gives_more_entropy():
    ents = [entropy(bandit(prior(warmup_updates=4, lr=0.05, entropy_weight=lam), 200).pmf()) for lam in (0.0, 0.1, 1.0)]
    assert ents[0] < ents[1] < ents[2]


def test_frozen_arm_samples_fixed_logits():
    s = prior(warmup_updates=0, lr=0.5, frozen=True)
    start = s.pmf().copy()
    np.testing.assert_allclose(start, pln_pmf(5.0, 0.5, CAP), rtol=1e-12)
    bandit(s, 50)
    np.testing.assert_array_equal(s.pmf(), start)
    assert s.n == 50  # baselines still run, for logging


def test_restricted_prior_never_leaves_its_support():
    s = bandit(prior(init="restricted", low=1, high=10, warmup_updates=0, lr=0.2), 100, good=8)
    assert (s.pmf()[10:] == 0).all() and s.pmf()[:10].min() > 0
    assert all(1 <= s.draw() <= 10 for _ in range(500))
    assert s.pmf()[7] > 0.1  # moved toward the cheap depth inside the support


def test_a_target_mean_outside_the_restricted_support_is_refused():
    # depth 5 over 1..3 was accepted: the mean penalty could never be met and pushed mass to depth 3
    with pytest.raises(ValueError, match="outside its active depths 1..3"):
        prior(init="restricted", low=1, high=3)
    assert prior(init="restricted", low=3, high=7).target == 5.0


@pytest.mark.parametrize("bad", [dict(entropy_weight=math.nan), dict(mean_weight=math.nan), dict(lr=math.nan)])
def test_nan_settings_are_refused_at_once(bad):
    """NaN passed the `< 0` checks: the prior then failed at its first update with advice to change the lr (or
    torch's own "Invalid learning rate: nan")."""
    with pytest.raises(ValueError, match="depth-prior lr must be > 0"):
        prior(**bad)


def test_uniform_init_and_bad_settings():
    np.testing.assert_array_equal(prior(init="uniform").pmf(), np.full(CAP, 1 / CAP))
    with pytest.raises(ValueError, match="reward"):
        prior(reward="nope")
    with pytest.raises(ValueError, match="init"):
        initial_logits("nope", CAP, 5.0, 0.5, 1, 9)
    with pytest.raises(ValueError, match="ema_decay"):
        prior(ema_decay=1.0)


def test_collapse_is_an_error():
    s = prior(warmup_updates=0)
    with torch.no_grad():
        s.logits.copy_(torch.tensor([0.0] + [-800.0] * (CAP - 1), dtype=torch.float64))  # p underflows to 0
    with pytest.raises(FloatingPointError, match="collapsed"):
        step(s, [(1, 1.0, 1)])


def test_state_dict_round_trip_reproduces_the_trajectory():
    a = bandit(prior(warmup_updates=3, lr=0.05, entropy_weight=0.01), 10)
    saved = json.loads(json.dumps(a.state_dict()))  # through JSON, as in trainer_state.json
    b = prior(warmup_updates=3, lr=0.05, entropy_weight=0.01)
    b.load_state_dict(saved)
    assert b.counter == a.counter and b.n == a.n
    bandit(a, 10, seed=5)
    bandit(b, 10, seed=5)
    assert torch.equal(a.logits, b.logits)
    assert a.state_dict() == b.state_dict()


def test_loading_a_non_learned_sampler_state_is_refused():
    pln = build_sampler(DepthConfig(sampler="pln"))
    with pytest.raises(ValueError, match="not a learned prior"):
        prior().load_state_dict(pln.state_dict())


def test_job_config_round_trips_through_dict():
    job = TrainJob()
    job.depth.sampler = "learned"
    job.depth.learned.entropy_weight = 0.05
    back = job_from_dict(json.loads(json.dumps(job.to_dict())))
    assert back.depth == job.depth
    old = job.to_dict()
    del old["depth"]["learned"]  # checkpoints written before the learned prior existed
    assert job_from_dict(old).depth.learned == LearnedPriorConfig()


# learned.py advantages against the baseline *after* this step's EMA update instead of before it
def test_advantage_uses_the_baseline_taken_before_the_update():
    s = prior(reward="inv_ppl", warmup_updates=1000, ema_decay=0.9)
    step(s, [(2, 1.0, 1), (7, 2.0, 1)])
    c = [-math.exp(-1.0), -math.exp(-2.0)]
    b = sum(c) / 2  # the first observation initialises the baseline
    m = step(s, [(3, 1.5, 1)])
    scale = math.sqrt(0.25) / abs((c[0] - c[1]) / 2)  # std(CE) / std(cost), both from the first update
    assert m["advantage_abs"] == pytest.approx(scale * abs(-math.exp(-1.5) - b), rel=1e-12)
    assert s.base_cost == pytest.approx(0.9 * b + 0.1 * -math.exp(-1.5))  # the baseline moved after


# -- the prior's feedback, support, cap, optimizer bounds and metrics ----------------------------------
# learned.py observe `if n_targets > 0` -> `>= 0` (a microbatch without targets divided by zero)
def test_a_microbatch_without_targets_is_not_feedback():
    s = prior(reward="ce", warmup_updates=1000)
    s.observe(3, 0.0, 0)
    assert s.update()["updates"] == 0  # nothing observed: no update, no baselines
    s.observe(3, 0.0, 0)
    s.observe(4, 2.0, 1)
    m = s.update()
    assert m["updates"] == 1 and m["baseline_ce"] == 2.0  # the empty microbatch took no weight


# learned.py logits_from_run lost the `-inf` of the inactive depths (a restricted prior read back
# from its run covered every depth)
def test_a_restricted_prior_read_from_its_run_keeps_its_support(tmp_path):
    from looplm.checkpoint import write_json
    from looplm.depth.learned import logits_from_run

    source = bandit(prior(init="restricted", low=3, high=7, warmup_updates=0, lr=0.2), 5, good=4)
    write_json(tmp_path, "trainer_state.json", {"sampler": json.loads(json.dumps(source.state_dict()))})
    logits = logits_from_run(tmp_path)
    assert np.isneginf(logits[:2]).all() and np.isneginf(logits[7:]).all() and np.isfinite(logits[2:7]).all()
    follow = build_sampler(DepthConfig(sampler="learned", learned=LearnedPriorConfig(init_from=tmp_path, frozen=True)))
    np.testing.assert_allclose(follow.pmf(), source.pmf(), rtol=1e-12, atol=0)
    assert (follow.pmf()[:2] == 0).all() and (follow.pmf()[7:] == 0).all()


# learned.py load_state_dict lost its cap check (a torch shape error instead of the message)
def test_loading_a_prior_of_another_cap_is_refused_by_name():
    from looplm.errors import UserError

    short = build_sampler(DepthConfig(sampler="learned", cap=8, depth=5.0))
    with pytest.raises(UserError, match="checkpoint's depth prior has 64 depths, this run 8"):
        short.load_state_dict(prior().state_dict())


# the prior's Adam settings: betas in [0, 1), lr > 0
@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ({"beta1": 1.0}, r"beta1 must be in \[0, 1\), got 1.0"),
        ({"beta2": 1.0}, r"beta2 must be in \[0, 1\), got 1.0"),
        ({"lr": 0.0}, "lr must be > 0"),
    ],
)
def test_prior_optimizer_settings_on_the_open_bound_are_refused(setting, match):
    with pytest.raises(ValueError, match=match):
        prior(**setting)
    prior(beta1=0.0, beta2=0.0, ema_decay=0.0)  # the closed bound is allowed


# metrics `p{target}` read p[target] (the next depth's mass); `allocation` counted 1 per depth drawn
def test_metrics_report_the_targets_mass_and_every_draw():
    s = build_sampler(DepthConfig(sampler="learned", depth=4.6, seed=3))
    draws = [s.draw() for _ in range(200)]
    m = s.metrics()
    assert m["p5"] == s.pmf()[4]  # round(4.6) = 5: the probability of depth 5 (index 4)
    assert m["allocation"] == [draws.count(r) for r in range(1, CAP + 1)] and sum(m["allocation"]) == 200


# -- the learned prior: targets at the ends, weights, a restored support, metrics ------------------------------------
@pytest.mark.parametrize(
    ("init", "low", "high", "target"), [("restricted", 5, 9, 5.0), ("restricted", 5, 9, 9.0), ("uniform", 1, 9, 1.0)]
)
def test_a_target_on_an_end_of_the_active_depths_is_allowed(init, low, high, target):
    """The mean penalty can be met at either end of the active depths (all mass there), so a target
    equal to the smallest or largest active depth, depth 1 included, is accepted."""
    s = build_sampler(
        DepthConfig(sampler="learned", depth=target, low=low, high=high, learned=LearnedPriorConfig(init=init))
    )
    assert s.target == target


@pytest.mark.parametrize("setting", ["mean_weight", "entropy_weight", "warmup_updates"])
def test_negative_prior_weights_are_refused(setting):
    """A negative lambda_m would push the mean away from its target (lambda_H: toward collapse)."""
    with pytest.raises(ValueError, match="mean_weight >= 0"):
        prior(**{setting: -1})


def test_loading_a_restricted_state_restores_its_support():
    """load_state_dict takes the saved active depths: a restricted prior's state loaded into a prior
    built over every depth samples only the saved support (its inactive logits are stored as 0)."""
    source = bandit(prior(init="restricted", low=3, high=7, warmup_updates=0, lr=0.2), 5, good=4)
    state = json.loads(json.dumps(source.state_dict()))
    target = prior(init="uniform")
    target.load_state_dict(state)
    np.testing.assert_array_equal(target.pmf(), source.pmf())
    assert (target.pmf()[:2] == 0).all() and (target.pmf()[7:] == 0).all()
    assert all(3 <= target.draw() <= 7 for _ in range(200))


def test_metrics_report_the_cost_baseline():
    """`baseline_cost` is the EMA of the costs (inv_ppl: -exp(-CE)), not of the CEs."""
    s = prior(reward="inv_ppl", warmup_updates=1000)
    m = step(s, [(2, 1.0, 1), (7, 2.0, 1)])
    assert m["baseline_ce"] == pytest.approx(1.5)
    assert m["baseline_cost"] == pytest.approx(-(math.exp(-1.0) + math.exp(-2.0)) / 2)


def test_init_from_reads_back_as_a_path():
    """A job naming another run's prior (`init_from`) round-trips through its dict as a Path."""
    from pathlib import Path

    job = TrainJob()
    job.depth.sampler = "learned"
    job.depth.learned.init_from = Path("runs/source")
    back = job_from_dict(json.loads(json.dumps(job.to_dict())))
    assert back.depth.learned.init_from == Path("runs/source")
    assert back.depth == job.depth
