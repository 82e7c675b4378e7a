"""Initial recurrent state s0 (design §2): determinism, batch independence and N(0, 1/d) statistics
checked against closed-form moments of the normal distribution."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from looplm.config import ModelConfig
from looplm.model import LoopedLM, initial_state, seeded_normal

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
PHI_1 = math.erf(1 / math.sqrt(2))  # P(|Z| < 1) = 0.6827 for a standard normal


def seeded(ids, L, d, **kw):
    ids = torch.as_tensor(ids)
    return initial_state(
        "seeded",
        (len(ids), L, d),
        device=torch.device("cpu"),
        dtype=torch.float32,
        example_ids=ids,
        positions=torch.arange(L).expand(len(ids), L),
        **kw,
    )


def check_normal_moments(x: torch.Tensor, var: float) -> None:
    """Mean 0, variance `var`, P(|x| < sd) = 0.6827 and kurtosis 3, each within ~5 standard errors."""
    z = x.double().flatten()
    n = z.numel()
    sd = math.sqrt(var)
    assert abs(z.mean().item()) < 5 * sd / math.sqrt(n)
    assert abs(z.var().item() / var - 1) < 5 * math.sqrt(2 / n)
    assert abs((z.abs() < sd).double().mean().item() - PHI_1) < 5 * math.sqrt(PHI_1 * (1 - PHI_1) / n)
    kurt = (z.pow(4).mean() / z.pow(2).mean().square()).item()
    assert abs(kurt - 3) < 5 * math.sqrt(24 / n)


def test_seeded_is_deterministic():
    a = seeded([0, 1, 2], 16, 32)
    b = seeded([0, 1, 2], 16, 32)
    assert torch.equal(a, b)
    # the seed, the example id, the position and the channel all matter
    assert not torch.equal(a, seeded([0, 1, 2], 16, 32, seed=1))
    assert not torch.equal(a[0], a[1])
    assert not torch.equal(a[0, 0], a[0, 1])
    assert (a[0, 0, 1:] != a[0, 0, :-1]).all()


def _hash_normal(seed: int, example: int, position: int, channel: int) -> float:
    """One seeded standard normal in plain Python integers: a 32-bit finalizer chained over (seed,
    example id, position, channel), two more rounds for two uniforms, then Box-Muller (design §2)."""
    M = 0xFFFFFFFF

    def mix(h: int) -> int:
        for _ in range(2):
            h = ((h >> 16) ^ h) * 0x45D9F3B & M
        return (h >> 16) ^ h

    h = mix((seed & M) ^ 0x9E3779B9)
    for part in (example & M, position & M, channel):
        h = mix(h ^ part)
    h1 = mix(h ^ 0x85EBCA6B)
    h2 = mix(h1 ^ 0xC2B2AE35)
    u1, u2 = (h1 + 1.0) / (2.0**32 + 1.0), h2 / 2.0**32
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def test_seeded_normal_is_the_documented_hash():
    """The seeded state is a fixed function of (seed, example id, position, channel), pinned here in
    plain integers so that an evaluation (and a converted model's or the vLLM plugin's states) gives
    the same numbers in every looplm version: an equally good but different hash fails."""
    ids, positions = torch.tensor([0, 7, 2**40 + 5]), torch.tensor([[0, 1, 30], [5, 6, 7], [0, 2, 4]])
    got = seeded_normal(ids, positions, 5, seed=3)
    want = [
        [[_hash_normal(3, e, p, c) for c in range(5)] for p in row] for e, row in zip(ids.tolist(), positions.tolist())
    ]
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-6)


def test_seeded_is_independent_of_batch_composition():
    alone = seeded([7], 20, 32)
    batch = seeded([3, 7, 100, 2**40 + 5], 20, 32)
    other_order = seeded([7, 3], 20, 32)
    assert torch.equal(alone[0], batch[1])
    assert torch.equal(alone[0], other_order[0])
    # a row depends on (id, position), not on where the position sits in the tensor
    shifted = initial_state(
        "seeded",
        (1, 5, 32),
        device=torch.device("cpu"),
        dtype=torch.float32,
        example_ids=torch.tensor([7]),
        positions=torch.arange(10, 15)[None],
    )
    assert torch.equal(shifted[0], alone[0, 10:15])


def test_seeded_statistics():
    d = 64
    x = seeded(list(range(32)), 64, d)  # 131072 values
    check_normal_moments(x, 1 / d)
    # neighbouring channels, positions and examples are uncorrelated
    z = x.double() * math.sqrt(d)
    for a, b in ((z[..., 1:], z[..., :-1]), (z[:, 1:], z[:, :-1]), (z[1:], z[:-1])):
        assert abs((a * b).mean().item()) < 5 / math.sqrt(a.numel())


def test_seeded_normal_is_standard():
    z = seeded_normal(torch.arange(16), torch.arange(128).expand(16, 128), 48, seed=123)
    assert z.shape == (16, 128, 48) and torch.isfinite(z).all()
    check_normal_moments(z, 1.0)


def test_zero_state():
    s = initial_state("zero", (2, 5, 32), device=torch.device("cpu"), dtype=torch.float32)
    assert s.shape == (2, 5, 32) and torch.equal(s, torch.zeros(2, 5, 32))


def test_gaussian_state_statistics_and_freshness():
    d = 48
    shape = (16, 64, d)
    a = initial_state("gaussian", shape, device=torch.device("cpu"), dtype=torch.float32)
    b = initial_state("gaussian", shape, device=torch.device("cpu"), dtype=torch.float32)
    check_normal_moments(a, 1 / d)
    assert not torch.equal(a, b)  # fresh each call
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(
        initial_state("gaussian", shape, device=torch.device("cpu"), dtype=torch.float32, generator=g1),
        initial_state("gaussian", shape, device=torch.device("cpu"), dtype=torch.float32, generator=g2),
    )


def test_unknown_init_raises():
    with pytest.raises(ValueError):
        initial_state("uniform", (1, 2, 4), device=torch.device("cpu"), dtype=torch.float32)  # type: ignore[arg-type]


@pytest.mark.parametrize("injection", ["parcae-nonorm", "ortho", "deq-qkv"])
def test_model_eval_seeded_is_batch_independent(injection):
    """The same example (id 7) gives the same logits alone and inside a batch of others."""
    torch.manual_seed(0)
    model = LoopedLM(dataclasses.replace(TINY, injection=injection)).eval()
    batch = torch.randint(0, 50, (4, 12))
    ids = torch.tensor([3, 7, 8, 21])
    with torch.no_grad():
        together = model(batch, 4, init="seeded", example_ids=ids).logits
        alone = model(batch[1:2], 4, init="seeded", example_ids=ids[1:2]).logits
        again = model(batch[1:2], 4, init="seeded", example_ids=ids[1:2]).logits
        other_id = model(batch[1:2], 4, init="seeded", example_ids=torch.tensor([8])).logits
    assert torch.equal(alone, again)
    torch.testing.assert_close(alone[0], together[1], rtol=1e-5, atol=1e-5)
    # the state matters: a different example id (different s0) changes the logits
    assert (alone - other_id).abs().amax() > 1e-4


def test_model_gaussian_init_uses_generator():
    torch.manual_seed(0)
    model = LoopedLM(TINY).eval()
    tokens = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        a = model(tokens, 3, generator=torch.Generator().manual_seed(9)).logits
        b = model(tokens, 3, generator=torch.Generator().manual_seed(9)).logits
        c = model(tokens, 3, generator=torch.Generator().manual_seed(10)).logits
    assert torch.equal(a, b)
    assert (a - c).abs().amax() > 1e-5


def test_truncated_normal_is_the_quantile_map_of_the_normal_cut_at_3():
    """truncate_normal(z) is the Phi(z)-quantile of N(0, 1) truncated to [-3, 3] (reference: the standard
    library's NormalDist): odd, 0 at 0, and +-3 in the far tails."""
    from statistics import NormalDist

    from looplm.model.state import truncate_normal

    n = NormalDist()
    z = torch.linspace(-7.0, 7.0, 57, dtype=torch.float64)
    lo, hi = n.cdf(-3.0), n.cdf(3.0)
    want = torch.tensor([n.inv_cdf(lo + n.cdf(float(v)) * (hi - lo)) for v in z], dtype=torch.float64)
    torch.testing.assert_close(truncate_normal(z), want, rtol=0, atol=1e-9)
    assert truncate_normal(torch.tensor([40.0, -40.0], dtype=torch.float64)).tolist() == pytest.approx([3.0, -3.0])


def test_seeded_defaults_are_the_row_index_and_the_position():
    """Without example ids or positions the seeded state uses row b as example id b and position l as l."""
    B, L, d = 3, 5, 16
    got = initial_state("seeded", (B, L, d), device=torch.device("cpu"), dtype=torch.float32, seed=4)
    want = seeded_normal(torch.arange(B), torch.arange(L).expand(B, L), d, seed=4) / math.sqrt(d)
    assert torch.equal(got, want)
