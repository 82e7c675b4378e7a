"""Fixed-point diagnostics (looplm.analyze) on constructed models with known answers: the convergence profile,
the trajectory, KV settling and carryover alignment."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch import nn

from looplm.analyze import (
    NEVER,
    carryover_alignment,
    convergence_depths,
    convergence_profile,
    kv_settling,
    run_trajectory,
    spearman,
    start,
)
from looplm.model import LoopedLM

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread


class ScaleCore(nn.Module):
    """A core layer x -> lam * x that reports its input as K and V (a known, exact map)."""

    def __init__(self, lam: float, n_kv_heads: int, head_dim: int):
        super().__init__()
        self.lam, self.h, self.hd = lam, n_kv_heads, head_dim

    def forward(self, x, rope, mask, *, offsets=None, kv=None):
        if kv is not None:
            B, L, _ = x.shape
            kv.update(*(x.reshape(B, L, self.h, self.hd).transpose(1, 2),) * 2)
        return self.lam * x


def scaled_model(make_cfg, lam: float, *, zero_input: bool = False) -> LoopedLM:
    """Additive injection and a ScaleCore: F(s) = lam (s + e), an exact contraction toward
    s* = lam e / (1 - lam) for |lam| < 1 (the identity for lam = 1 and e = 0)."""
    cfg = make_cfg(injection="additive", n_core=1, d_model=16, n_heads=2, n_kv_heads=2, max_depth=1024)
    model = LoopedLM(cfg).double().eval()  # fp64 so that closed forms hold to many digits
    model.core = nn.ModuleList([ScaleCore(lam, cfg.n_kv_heads, cfg.head_dim)])
    if zero_input:
        with torch.no_grad():
            model.embed.weight.zero_()  # e = 0: the prelude maps a zero stream to zero
    return model


def tokens(B=3, L=10, vocab=50):
    return torch.randint(0, vocab, (B, L), generator=torch.Generator().manual_seed(1))


# -- convergence ---------------------------------------------------------------------------------
@pytest.mark.parametrize("lam,tau", [(0.5, 0.02), (0.8, 0.02), (0.9, 0.01), (0.3, 0.05)])
def test_exact_contraction_converges_at_the_predicted_depth(tiny_model_config, lam, tau):
    model = scaled_model(tiny_model_config, lam)
    x = tokens()
    traj = run_trajectory(model, start(model, x, init="zero"), horizon=64)
    # From s^0 = 0: s^r = (1 - lam^r) s*, so delta^r = lam^(r-1) (1 - lam) / (1 - lam^(r-1)) for r >= 2,
    # the same for every token; delta^r < tau  <=>  lam^(r-1) < tau / (1 - lam + tau).
    r = torch.arange(2, 65, dtype=torch.float64)
    expected = lam ** (r - 1) * (1 - lam) / (1 - lam ** (r - 1))
    torch.testing.assert_close(
        traj.change[1:].double(), expected[:, None, None].expand_as(traj.change[1:]), rtol=1e-6, atol=1e-12
    )
    predicted = math.floor(math.log(tau / (1 - lam + tau)) / math.log(lam)) + 1
    assert (convergence_depths(traj.change, tau) == predicted).all()


def test_identity_core_is_converged_at_depth_zero(tiny_model_config):
    model = scaled_model(tiny_model_config, 1.0, zero_input=True)  # F(s) = s
    x = tokens()
    begin = start(model, x, example_ids=torch.arange(3))
    assert begin.state0.abs().sum() > 0  # seeded, non-zero start
    traj = run_trajectory(model, begin, horizon=16)
    assert traj.change.abs().max() == 0
    prof = convergence_profile(traj.change, begin.positions, tau=0.02)
    assert (convergence_depths(traj.change, 0.02) == 0).all()
    assert prof["fraction_converged"] == 1.0 and prof["median_depth"] == 0 and prof["histogram"][0] == x.numel()


def test_two_cycle_never_converges(tiny_model_config):
    model = scaled_model(tiny_model_config, -1.0, zero_input=True)  # F(s) = -s: delta = 2 forever
    begin = start(model, tokens(), example_ids=torch.arange(3))
    traj = run_trajectory(model, begin, horizon=16)
    torch.testing.assert_close(traj.change, torch.full_like(traj.change, 2.0))
    assert (convergence_depths(traj.change, 0.02) == NEVER).all()
    prof = convergence_profile(traj.change, begin.positions, tau=0.02)
    assert prof["fraction_converged"] == 0.0 and prof["median_depth"] is None and prof["never"] == 30


def test_convergence_rule_on_handmade_changes():
    t = 0.1
    change = torch.tensor(
        [
            [0.5, 0.05, 0.5, 0.5],
            [0.05, 0.05, 0.5, 0.05],
            [0.05, 0.2, 0.05, 0.05],
            [0.05, 0.05, 0.05, 0.2],
        ]
    )  # [H = 4, 4 tokens]
    # token 0: below from r = 2 on -> depth 1; token 1: rises at r = 3 -> depth 3; token 2 -> 2; token 3: never
    assert convergence_depths(change, t).tolist() == [1, 3, 2, NEVER]
    with pytest.raises(ValueError, match="tau"):
        convergence_depths(change, 0.0)


def test_trajectory_matches_the_native_forward(tiny_model_config):
    model = LoopedLM(tiny_model_config(injection="parcae-decay")).eval()
    x, ids = tokens(), torch.arange(3)
    out = model(x, 6, init="seeded", example_ids=ids, return_states=True)
    traj = run_trajectory(model, start(model, x, example_ids=ids), horizon=6)
    states = [None, *out.states]
    for r in range(2, 7):  # delta^r from the forward's own states
        ref = (states[r] - states[r - 1]).norm(dim=-1) / states[r - 1].norm(dim=-1)
        torch.testing.assert_close(traj.change[r - 1], ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(traj.endpoint, out.endpoint)


def test_profile_intervals_and_spearman_against_a_naive_loop():
    g = torch.Generator().manual_seed(3)
    H, B, L = 12, 4, 40
    change = torch.rand(H, B, L, generator=g) * torch.linspace(1, 0.001, H)[:, None, None] ** 1.5
    positions = torch.arange(L).expand(B, L)
    prof = convergence_profile(change, positions, tau=0.05, interval=16)
    depth = convergence_depths(change, 0.05)
    for b in prof["intervals"]:
        sel = [
            int(depth[i, p]) for i in range(B) for p in range(L) if b["start"] <= p < b["end"] and depth[i, p] != NEVER
        ]
        assert b["median_depth"] == (statistics.median(sel) if sel else None)
    assert [b["start"] for b in prof["intervals"]] == [0, 16, 32]
    assert sum(prof["histogram"]) + prof["never"] == B * L


def test_spearman_matches_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(4)
    x = torch.randint(0, 7, (200,), generator=g)
    y = x + torch.randint(0, 5, (200,), generator=g)
    assert spearman(x, y) == pytest.approx(stats.spearmanr(x.numpy(), y.numpy()).statistic, abs=1e-12)
    assert spearman(torch.ones(5), torch.arange(5)) is None


# -- KV settling --------------------------------------------------------------------------------
def test_kv_settling_of_an_exact_contraction(tiny_model_config):
    lam, span, depths = 0.9, 5, (5, 25, 40)
    model = scaled_model(tiny_model_config, lam)
    kv_at = sorted({r for d in depths for r in (d, d + span)})
    traj = run_trajectory(model, start(model, tokens(), init="zero"), horizon=4, kv_at=tuple(kv_at))
    rows = kv_settling(traj.kv, depths, span)
    # one row per core layer and depth (the checks below would pass on an empty table)
    assert sorted((row["layer"], row["depth"]) for row in rows) == [
        (j, d) for j in range(model.cfg.n_core) for d in depths
    ]
    # K^r is the core input s^(r-1) + e = (1/lam - lam^(r-1)) s*, so
    # |K^(r+k) - K^r| / |K^r| = lam^r (1 - lam^k) / (1 - lam^r) and |K^r| / |K^5| = (1 - lam^r) / (1 - lam^5).
    for row in rows:
        r = row["depth"]
        change = lam**r * (1 - lam**span) / (1 - lam**r)
        assert row["K_change"] == pytest.approx(change, rel=1e-4)
        assert row["V_change"] == pytest.approx(change, rel=1e-4)
        assert row["K_norm_ratio"] == pytest.approx((1 - lam**r) / (1 - lam**5), rel=1e-5)


# -- carryover -----------------------------------------------------------------------------------
def test_orthoinj_amplification_is_one(tiny_model_config):
    model = LoopedLM(tiny_model_config(injection="ortho")).eval()
    begin = start(model, tokens(), example_ids=torch.arange(3))
    traj = run_trajectory(model, begin, horizon=8)
    out = carryover_alignment(model.injection, traj.endpoint, begin.ctx.injected)
    # <carryover, q> = <r, q> eps / (|q|^2 + eps) with eps = 1e-6: amplification 1 up to eps
    assert out["amplification"].sub(1).abs().max() < 1e-5
    assert out["cos"].abs().max() < 1e-3  # fp32 rounding of r - alpha q, relative to a small carryover


def test_parcae_carryover_against_a_direct_computation(tiny_model_config):
    model = LoopedLM(tiny_model_config(injection="parcae-nonorm")).eval()
    with torch.no_grad():
        model.injection.A_log.normal_(0, 0.5)  # a per-channel decay
    begin = start(model, tokens(), example_ids=torch.arange(3))
    traj = run_trajectory(model, begin, horizon=8)
    inj = model.injection
    dt = torch.log1p(torch.exp(inj.dt_raw.double()))
    lam = torch.exp(-dt * torch.exp(inj.A_log.double()))
    e = model.run_prelude(tokens(), begin.ctx.rope, None).double()
    q = dt * (e @ inj.W.weight.double().T)
    c = lam * traj.endpoint.double()
    out = carryover_alignment(inj, traj.endpoint, begin.ctx.injected)
    cq = (c * q).sum(-1)
    torch.testing.assert_close(out["amplification"], 1 + cq / q.square().sum(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["cos"], cq / (c.norm(dim=-1) * q.norm(dim=-1)), rtol=1e-5, atol=1e-6)
    assert (out["amplification"] - 1).abs().mean() > 0.05  # not OrthoInj's 1
    assert carryover_alignment(LoopedLM(tiny_model_config(injection="deq-qkv")).injection, c, q) is None
    # no injection (Ouro): s' = s, nothing is injected to align with (it reported cos 0.98, amplification 2)
    none = LoopedLM(tiny_model_config(injection="none", state_init="input")).injection
    assert carryover_alignment(none, c, q) is None


def test_convergence_needs_a_change_strictly_below_tau():
    """The design: converged at c when
    delta^r < tau for r = c+1..H; a change exactly at tau does not count (binary fractions: exact)."""
    from looplm.analyze import NEVER, convergence_depths

    change = torch.tensor([[0.5, 0.25], [0.25, 0.125]])  # [H = 2, 2 tokens], tau = 0.25
    # token 0: delta^2 = tau is not below it -> never; token 1: delta^1 = tau, delta^2 < tau -> depth 1
    assert convergence_depths(change, 0.25).tolist() == [NEVER, 1]


def test_profile_buckets_and_change_quantiles_against_a_naive_loop():
    """Every bucket field and the per-recurrence quartiles by hand."""
    from looplm.analyze import NEVER, convergence_depths, convergence_profile

    g = torch.Generator().manual_seed(5)
    H, B, L, interval, tau = 6, 3, 20, 8, 0.01
    change = (
        torch.rand(H, B, L, generator=g, dtype=torch.float64)
        * torch.linspace(1, 0.02, H, dtype=torch.float64)[:, None, None]
    )
    change[:, :, :8] *= 0.3  # the first bucket converges more often than the others
    positions = torch.arange(L).expand(B, L)
    prof = convergence_profile(change, positions, tau=tau, interval=interval)
    depth = convergence_depths(change, tau)
    want = []
    for lo in range(0, L, interval):
        cells = [(b, p) for b in range(B) for p in range(L) if lo <= p < lo + interval]
        done = [int(depth[b, p]) for b, p in cells if depth[b, p] != NEVER]
        want.append(
            {
                "start": lo,
                "end": lo + interval,
                "tokens": len(cells),
                "fraction_converged": len(done) / len(cells),
                "median_depth": statistics.median(done) if done else None,
            }
        )
    got = prof["intervals"]
    assert [(b["start"], b["end"], b["tokens"]) for b in got] == [(w["start"], w["end"], w["tokens"]) for w in want]
    for b, w in zip(got, want):
        assert b["fraction_converged"] == pytest.approx(w["fraction_converged"])
        assert b["median_depth"] == w["median_depth"]
    assert len({b["fraction_converged"] for b in got}) > 1  # the buckets differ (a global fraction would not)
    for r in range(H):  # linear-interpolation quartiles (statistics' "inclusive" method) of delta^(r+1)
        q25, q50, q75 = statistics.quantiles(change[r].flatten().tolist(), n=4, method="inclusive")
        assert prof["change"]["q25"][r] == pytest.approx(q25)
        assert prof["change"]["median"][r] == pytest.approx(q50)
        assert prof["change"]["q75"][r] == pytest.approx(q75)
        assert prof["change"]["q25"][r] < prof["change"]["q75"][r]


def test_summarize_quantiles_by_hand():
    """Guards against q10 and q90 swapped."""
    from looplm.analyze.carryover import summarize

    s = summarize(torch.arange(11, dtype=torch.float32).flip(0))  # 0..10: deciles are 1 and 9
    assert s == {"mean": 5.0, "median": 5.0, "q10": 1.0, "q90": 9.0, "min": 0.0, "max": 10.0}


def _changes_for_depths(depths: list[int], H: int, tau: float = 0.1) -> torch.Tensor:
    """delta [H, 1, len(depths)] whose convergence depths at tau are `depths` (NEVER: every change large)."""
    cols = [[1.0] * H if c == NEVER else [1.0] * c + [tau / 10] * (H - c) for c in depths]
    return torch.tensor(cols, dtype=torch.float64).T[:, None, :]


def test_last_bucket_holds_a_position_on_an_interval_boundary():
    """With positions
    0..16 and interval 8 the token at 16 opens a third bucket; every token lies in one bucket."""
    from looplm.analyze import convergence_profile

    change = _changes_for_depths([0, 1, 2] * 5 + [3, 1], H=4)  # 17 tokens
    prof = convergence_profile(change, torch.arange(17)[None], tau=0.1, interval=8)
    assert [(b["start"], b["end"], b["tokens"]) for b in prof["intervals"]] == [(0, 8, 8), (8, 16, 8), (16, 24, 1)]
    assert prof["intervals"][-1]["median_depth"] == 1


def test_spearman_is_over_the_converged_tokens_only():
    """Depths rise with position
    among the converged tokens (rank correlation exactly 1); the late never-converged tokens do not count."""
    from looplm.analyze import convergence_profile

    change = _changes_for_depths([0, 1, 2, 3, NEVER, NEVER], H=4)
    prof = convergence_profile(change, torch.arange(6)[None], tau=0.1)
    assert prof["spearman_position_depth"] == pytest.approx(1.0, abs=1e-12)
    assert prof["never"] == 2 and prof["histogram"] == [1, 1, 1, 1]


def test_change_mean_is_the_plain_mean_per_recurrence():
    """A skewed delta whose mean and
    median differ, against statistics.fmean per recurrence."""
    from looplm.analyze import convergence_profile

    g = torch.Generator().manual_seed(6)
    change = torch.rand(5, 3, 9, generator=g, dtype=torch.float64) ** 4  # skewed: mean well above the median
    prof = convergence_profile(change, torch.arange(9).expand(3, 9), tau=0.05)
    for r in range(5):
        want = statistics.fmean(change[r].flatten().tolist())
        assert prof["change"]["mean"][r] == pytest.approx(want, rel=1e-12)
        assert abs(want - prof["change"]["median"][r]) > 1e-3


def test_relative_change_of_bf16_states_is_computed_in_fp32():
    """bf16 states (an autocast run): the norms are taken in fp32, not in bf16, whose 8-bit mantissa
    would put ~1% error on delta; compared against fp64 on the same bf16 values."""
    from looplm.analyze import relative_change

    g = torch.Generator().manual_seed(7)
    old = torch.randn(2, 5, 512, generator=g).bfloat16()
    new = (old.float() + 0.01 * torch.randn(2, 5, 512, generator=g)).bfloat16()
    got = relative_change(new, old)
    want = (new.double() - old.double()).norm(dim=-1) / old.double().norm(dim=-1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)
    assert got.dtype == torch.float32


def test_trajectory_runs_to_the_horizon_past_the_last_kv_depth(tiny_model_config):
    """kv_at below the horizon: the recurrence still runs `horizon` times (the change curve has H rows
    and the endpoint is s^H), with the K/V recorded at the requested recurrences on the way."""
    lam = 0.8
    model = scaled_model(tiny_model_config, lam)
    x = tokens()
    traj = run_trajectory(model, start(model, x, init="zero"), horizon=9, kv_at=(2, 4))
    assert traj.change.shape[0] == 9 and sorted(traj.kv) == [2, 4]
    # from s^0 = 0: s^r = (1 - lam^r) s* with s* = lam e / (1 - lam); K^r is the core input s^(r-1) + e
    e = model.run_prelude(x, start(model, x).ctx.rope, None)
    s_star = lam * e / (1 - lam)
    torch.testing.assert_close(traj.endpoint, (1 - lam**9) * s_star, rtol=1e-9, atol=1e-12)
    B, L, _ = e.shape
    for r in (2, 4):
        k = ((1 - lam ** (r - 1)) * s_star + e).reshape(B, L, 2, -1).transpose(1, 2)
        torch.testing.assert_close(traj.kv[r][0][0], k, rtol=1e-9, atol=1e-12)


def test_trajectory_start_takes_the_seed_and_the_documents(tiny_model_config):
    """`start(seed=..., doc_ids=...)` is the native forward's s^0 and context: on packed rows (attention
    confined to each document, positions restarting) with a non-default seed, the trajectory's changes
    and endpoint equal those of LoopedLM.forward's own states."""
    model = LoopedLM(tiny_model_config(injection="parcae-decay")).eval()
    x, ids = tokens(B=2, L=10), torch.tensor([3, 8])
    doc = torch.tensor([[0] * 4 + [1] * 6, [0] * 7 + [1] * 3])
    pos = torch.stack([torch.cat([torch.arange(4), torch.arange(6)]), torch.cat([torch.arange(7), torch.arange(3)])])
    kw = dict(doc_ids=doc, positions=pos, example_ids=ids, seed=11)
    with torch.no_grad():
        out = model(x, 4, init="seeded", return_states=True, **kw)
    traj = run_trajectory(model, start(model, x, **kw), horizon=4)
    torch.testing.assert_close(traj.endpoint, out.endpoint)
    for r in range(2, 5):
        prev, cur = out.states[r - 2], out.states[r - 1]
        torch.testing.assert_close(
            traj.change[r - 1], (cur - prev).norm(dim=-1) / prev.norm(dim=-1), rtol=1e-5, atol=1e-7
        )


def test_kv_settling_table_against_a_naive_sum_over_layers_and_batches():
    """K and V settle separately (V compared with V), every core layer against its own norm at the first
    (smallest) depth, and sums over the batches `KVSums.add` sees before taking the ratio; the depths may
    come unsorted and repeated. Random K/V for 2 layers against sums written out by hand."""
    from looplm.analyze import KVSums

    g = torch.Generator().manual_seed(8)
    depths, span = (4, 1, 4), 2
    recs = (1, 3, 4, 6)

    def draw(B):
        return {
            r: [
                tuple(torch.randn(B, 2, 3, 4, generator=g, dtype=torch.float64) * (1 + j) for _ in "KV")
                for j in range(2)
            ]
            for r in recs
        }

    batches = [draw(2), draw(3)]
    sums = KVSums(depths, span)
    for kv in batches:
        sums.add(kv)
    rows = sums.table()
    assert [(row["layer"], row["depth"]) for row in rows] == [(0, 1), (0, 4), (1, 1), (1, 4)]
    for row in rows:
        j, r = row["layer"], row["depth"]
        for i, name in enumerate("KV"):
            diff = sum(float((kv[r + span][j][i] - kv[r][j][i]).square().sum()) for kv in batches)
            norm = sum(float(kv[r][j][i].square().sum()) for kv in batches)
            base = sum(float(kv[1][j][i].square().sum()) for kv in batches)
            assert row[f"{name}_change"] == pytest.approx(math.sqrt(diff / norm), rel=1e-12)
            assert row[f"{name}_norm_ratio"] == pytest.approx(math.sqrt(norm / base), rel=1e-12)
