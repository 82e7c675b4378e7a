"""Tests of LoopedLM (design §1-3): causality, document masking, truncated backprop, per-recurrence
states, input validation and that every injection scheme trains.

References are written independently in this file: an explicit unrolled loop over the model's
low-level pieces (embedding, blocks, injection module, head) with autograd, and simple
perturbation experiments.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from looplm.config import INJECTIONS, ModelConfig
from looplm.model import LoopedLM, build_injection
from looplm.model.blocks import (
    Block,
    RMSNorm,
    document_block_mask,
    document_mask,
    per_head_norm,
    rope_tables,
)
from looplm.model.kv import KVBank

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = ModelConfig(vocab_size=50, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)


def tiny(**overrides) -> ModelConfig:
    return dataclasses.replace(TINY, **overrides)


def make_model(injection: str, seed: int = 0, **overrides) -> LoopedLM:
    torch.manual_seed(seed)
    model = LoopedLM(tiny(injection=injection, **overrides))
    # Perturb every parameter a little so that identity/zero inits (W = I, b = 0, norm gains = 1)
    # do not hide a missing term, and every parameter influences the output.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def reference_forward(
    model: LoopedLM,
    tokens: torch.Tensor,
    depth: int,
    window: int | None,
    state0: torch.Tensor,
    return_states: bool = False,
):
    """An explicit unrolled forward from the model's low-level pieces (no doc mask, positions 0..L-1).

    design §3: the state entering recurrence R-k (k = min(R, b)) is cut from the graph; the injected
    input q and the DEQ-QKV offsets keep their graph in every recurrence.
    """
    cfg = model.cfg
    B, L = tokens.shape
    positions = torch.arange(L).expand(B, L)
    rope = rope_tables(positions, cfg.head_dim, cfg.rope_base)
    x = model.embed(tokens)
    for block in model.prelude:
        x = block(x, rope, None)
    inj = model.injection
    q = inj.prepare(x)
    offsets = inj.qkv_offsets(x)
    k = depth if window is None else min(depth, window)
    s = state0.detach()
    states = []
    for r in range(depth):
        if r == depth - k:
            s = s.detach()
        s = inj(s, q)
        for i, block in enumerate(model.core):
            s = block(s, rope, None, offsets=offsets[i] if offsets is not None else None)
        s = inj.exit(s)
        states.append(s)
    z = s
    for block in model.coda:
        z = block(z, rope, None)
    logits = model.head(model.norm(z)).float()
    return (logits, states) if return_states else logits


def grads_of(model: LoopedLM, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return {n: (torch.zeros_like(p) if g is None else g) for n, p, g in zip(names, params, grads)}


# ---------------------------------------------------------------------------------------------
# 1. Causality and document masking
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("injection", INJECTIONS)
@pytest.mark.parametrize("init", ["seeded", "zero"])
@pytest.mark.parametrize("with_docs", [False, True])
def test_causality_every_injection(injection, init, with_docs):
    model = make_model(injection).eval()
    B, L, t = 2, 12, 5
    tokens = torch.randint(0, 50, (B, L))
    changed = tokens.clone()
    changed[:, t + 1] = (changed[:, t + 1] + 7) % 50
    kwargs = dict(init=init, example_ids=torch.tensor([3, 11]))
    if with_docs:
        # one document per row covering the whole row: the mask must equal plain causal masking
        kwargs["doc_ids"] = torch.zeros(B, L, dtype=torch.long)
    with torch.no_grad():
        a = model(tokens, 3, **kwargs).logits
        b = model(changed, 3, **kwargs).logits
    torch.testing.assert_close(
        a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-6, msg=f"{injection}: a future token changed a past logit"
    )
    # and the perturbation is visible from t+1 on (so the test can fail)
    assert (a[:, t + 1 :] - b[:, t + 1 :]).abs().amax() > 1e-3


@pytest.mark.parametrize("injection", INJECTIONS)
def test_document_mask_isolates_documents(injection):
    """Changing document 1 leaves document 2 of the same row unchanged, and document 2 equals the
    same tokens run alone (positions restart per document, seeded state from (id, position))."""
    model = make_model(injection).eval()
    n1, n2 = 5, 7
    doc1 = torch.randint(0, 50, (1, n1))
    doc2 = torch.randint(0, 50, (1, n2))
    row = torch.cat([doc1, doc2], 1)
    doc_ids = torch.tensor([[0] * n1 + [1] * n2])
    positions = torch.cat([torch.arange(n1), torch.arange(n2)])[None]
    kw = dict(doc_ids=doc_ids, positions=positions, init="seeded", example_ids=torch.tensor([4]))
    other = row.clone()
    other[0, :n1] = (other[0, :n1] + 13) % 50
    with torch.no_grad():
        a = model(row, 4, **kw).logits
        b = model(other, 4, **kw).logits
        alone = model(doc2, 4, init="seeded", example_ids=torch.tensor([4])).logits
    torch.testing.assert_close(
        a[:, n1:], b[:, n1:], rtol=0, atol=1e-6, msg="a token of document 1 leaked into document 2"
    )
    assert (a[:, :n1] - b[:, :n1]).abs().amax() > 1e-3
    torch.testing.assert_close(a[:, n1:], alone, rtol=1e-5, atol=1e-5)


def test_single_document_mask_equals_plain_causal():
    """doc_ids with one document per row takes the explicit-mask path; it must match is_causal."""
    model = make_model("ortho").eval()
    tokens = torch.randint(0, 50, (2, 11))
    with torch.no_grad():
        plain = model(tokens, 3, init="zero").logits
        masked = model(tokens, 3, init="zero", doc_ids=torch.full((2, 11), 5)).logits
    torch.testing.assert_close(masked, plain, rtol=1e-5, atol=1e-5)


def test_rope_tables_keep_the_phase_of_long_positions():
    """The angles p * base^(-2i/hd) are computed in float64: at the positions of an 8192-token context an
    fp32 product is off by up to ~3e-4 rad. Reference: math.cos/sin of the closed form."""
    hd, base = 64, 1e6
    pos = torch.tensor([[0, 1, 4095, 8191], [7, 100, 5003, 8190]])
    cos, sin = rope_tables(pos, hd, base)
    assert cos.shape == sin.shape == (2, 1, 4, hd // 2) and cos.dtype == torch.float32
    angles = [[[p * base ** (-2 * i / hd) for i in range(hd // 2)] for p in row] for row in pos.tolist()]
    want_cos = torch.tensor([[[math.cos(a) for a in t] for t in row] for row in angles], dtype=torch.float64)
    want_sin = torch.tensor([[[math.sin(a) for a in t] for t in row] for row in angles], dtype=torch.float64)
    torch.testing.assert_close(cos[:, 0].double(), want_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0].double(), want_sin, rtol=0, atol=1e-6)


def test_qk_norm_eps_is_the_fp32_machine_eps():
    """qk_norm's per-head RMSNorm has eps = 2^-23 (Parcae): visible on heads of RMS ~1e-3, where a 1e-6
    eps would shrink them by ~25%."""
    x = 1e-3 * torch.randn(2, 4, 6, 8)
    want = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 2.0**-23)
    torch.testing.assert_close(per_head_norm(x).double(), want, rtol=1e-5, atol=1e-6)


def test_attention_over_a_cached_prefix_needs_a_boolean_mask():
    """With a slot that holds earlier tokens, mask=None would be SDPA's is_causal, aligned top-left (the
    chunk's first token would see only the first cached key), and a FlexAttention block mask is built for
    the parallel forward only: both are refused."""
    cfg = tiny()
    att = Block(cfg).attn
    x = torch.randn(1, 2, cfg.d_model)
    rope = rope_tables(torch.tensor([[3, 4]]), cfg.head_dim, cfg.rope_base)
    bank = KVBank(1, cfg.n_kv_heads, 8, cfg.head_dim, "cpu", torch.float32)
    flex = document_mask(torch.zeros(1, 8, dtype=torch.long), "flex")  # a mask as long as the bank
    with torch.no_grad():
        with pytest.raises(ValueError, match="attention over a cached prefix needs an explicit mask"):
            att(x, rope, None, kv=bank.slot(3))
        with pytest.raises(ValueError, match="FlexAttention block masks serve the parallel forward"):
            att(x, rope, flex, kv=bank.slot(3))


def test_attention_takes_a_bare_block_mask_and_document_mask_names_its_kernels():
    """A FlexAttention `BlockMask` passed as it is (without FlexMask) masks as the boolean mask written out
    here (causal, same document); an unknown kernel name is refused, not served by SDPA."""
    torch.manual_seed(0)
    cfg = tiny()
    att = Block(cfg).attn
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 2, 2]])
    x = torch.randn(2, 8, cfg.d_model)
    rope = rope_tables(torch.arange(8).expand(2, 8), cfg.head_dim, cfg.rope_base)
    q, kv = torch.arange(8)[:, None], torch.arange(8)[None, :]
    by_hand = ((q >= kv) & (doc[:, :, None] == doc[:, None, :]))[:, None]
    with torch.no_grad():
        torch.testing.assert_close(att(x, rope, document_block_mask(doc)), att(x, rope, by_hand), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="unknown attention kernel 'xla'; choose sdpa or flex"):
        document_mask(doc, "xla")
    assert torch.equal(document_mask(doc, "sdpa"), by_hand)


# ---------------------------------------------------------------------------------------------
# 2. Truncated backprop through depth
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("injection", ["parcae-nonorm", "ortho", "deq-qkv", "parcae-decay", "huginn-linear"])
@pytest.mark.parametrize("window", [None, 1, 2, 7])
def test_tbptt_gradients_match_unrolled_reference(injection, window):
    depth = 4
    model = make_model(injection)
    B, L = 2, 10
    tokens = torch.randint(0, 50, (B, L))
    targets = torch.randint(0, 50, (B, L))
    state0 = torch.randn(B, L, 32) / math.sqrt(32)

    out = model(tokens, depth, bptt_window=window, state0=state0)
    loss = F.cross_entropy(out.logits.reshape(-1, 50), targets.reshape(-1))
    got = grads_of(model, loss)

    ref_logits = reference_forward(model, tokens, depth, window, state0)
    ref_loss = F.cross_entropy(ref_logits.reshape(-1, 50), targets.reshape(-1))
    want = grads_of(model, ref_loss)

    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-7, msg=f"grad of {name} (b={window})")

    if window == 1:
        # design §3: the injected input keeps its gradient, so the prelude and embedding learn
        # through the last injection even with a one-recurrence window ...
        assert got["embed.weight"].abs().amax() > 0
        assert any(got[n].abs().amax() > 0 for n in got if n.startswith("prelude."))
        # ... and the truncation does change the gradient relative to full BPTT.
        full = grads_of(model, reference_forward_loss(model, tokens, targets, depth, None, state0))
        diff = max((got[n] - full[n]).abs().amax().item() for n in got)
        assert diff > 1e-6, "b=1 gave the full-BPTT gradient: truncation has no effect"


def reference_forward_loss(model, tokens, targets, depth, window, state0):
    logits = reference_forward(model, tokens, depth, window, state0)
    return F.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1))


def test_tbptt_window_at_least_depth_is_full_bptt():
    model = make_model("ortho")
    tokens = torch.randint(0, 50, (2, 8))
    state0 = torch.randn(2, 8, 32) / math.sqrt(32)
    losses = {}
    for w in (None, 3, 10):
        out = model(tokens, 3, bptt_window=w, state0=state0)
        losses[w] = grads_of(model, out.logits.square().mean())
    for w in (3, 10):
        for n in losses[None]:
            torch.testing.assert_close(losses[w][n], losses[None][n], rtol=1e-5, atol=1e-8)


def test_state0_gets_no_gradient():
    model = make_model("parcae-nonorm")
    tokens = torch.randint(0, 50, (1, 6))
    state0 = (torch.randn(1, 6, 32) / math.sqrt(32)).requires_grad_(True)
    out = model(tokens, 3, state0=state0)
    out.logits.sum().backward()
    assert state0.grad is None


# ---------------------------------------------------------------------------------------------
# 10. return_states
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("injection", INJECTIONS)
def test_return_states_match_hand_recurrence(injection):
    model = make_model(injection).eval()
    depth, B, L = 5, 2, 9
    tokens = torch.randint(0, 50, (B, L))
    state0 = torch.randn(B, L, 32) / math.sqrt(32)
    with torch.no_grad():
        out = model(tokens, depth, state0=state0, return_states=True)
        ref_logits, ref_states = reference_forward(model, tokens, depth, None, state0, return_states=True)
    assert len(out.states) == depth
    torch.testing.assert_close(out.states[-1], out.endpoint, rtol=0, atol=0)
    for r in range(depth):
        torch.testing.assert_close(out.states[r], ref_states[r], rtol=1e-5, atol=1e-6, msg=f"state {r + 1}")
    torch.testing.assert_close(out.logits, ref_logits, rtol=1e-5, atol=1e-5)
    # consecutive states differ (the recurrence is not a no-op)
    assert (out.states[1] - out.states[0]).abs().amax() > 1e-4


def test_compute_logits_false_returns_endpoint_only():
    model = make_model("ortho").eval()
    tokens = torch.randint(0, 50, (1, 5))
    with torch.no_grad():
        a = model(tokens, 3, init="zero", compute_logits=False)
        b = model(tokens, 3, init="zero")
    assert a.logits is None
    torch.testing.assert_close(a.endpoint, b.endpoint, rtol=0, atol=0)
    assert b.logits.shape == (1, 5, 50) and b.logits.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# 7. Every injection scheme trains
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("injection", INJECTIONS)
def test_every_injection_trains(injection):
    torch.manual_seed(0)
    model = LoopedLM(tiny(injection=injection))
    period, B, L = 8, 16, 16
    pattern = torch.randperm(50)[:period]  # next token is a function of the current one
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.98), weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(60):
        start = torch.randint(0, period, (B, 1), generator=gen)
        seq = pattern[(start + torch.arange(L + 1)) % period]
        out = model(seq[:, :-1], 3, bptt_window=2, init="gaussian", generator=gen)
        loss = F.cross_entropy(out.logits.reshape(-1, 50), seq[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses)
    initial, final = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert final < 0.7 * initial, f"{injection}: loss {initial:.3f} -> {final:.3f}"


# ---------------------------------------------------------------------------------------------
# 8. Input validation
# ---------------------------------------------------------------------------------------------
def test_input_validation():
    model = LoopedLM(tiny(max_depth=8))
    ok = torch.randint(0, 50, (2, 8))
    with pytest.raises(ValueError):
        model(ok, 0)
    with pytest.raises(ValueError):
        model(ok, -1)
    with pytest.raises(ValueError):
        model(ok, 9)
    model(ok, 8, init="zero")  # the cap itself is allowed
    with pytest.raises(ValueError):
        model(torch.randint(0, 50, (2, 33)), 2)
    model(torch.randint(0, 50, (1, 32)), 1, init="zero")  # exactly max_seq_len is allowed
    # matched: `B, L = tokens.shape` raises a ValueError of its own without the check
    with pytest.raises(ValueError, match=r"tokens must be \[batch, length\]"):
        model(torch.randint(0, 50, (8,)), 2)
    with pytest.raises(ValueError, match=r"tokens must be \[batch, length\]"):
        model(torch.randint(0, 50, (1, 2, 8)), 2)


def test_unknown_injection_rejected():
    bad = tiny(injection="multiplicative")
    with pytest.raises(ValueError):
        bad.validate()
    with pytest.raises(ValueError):
        build_injection(bad)
    with pytest.raises(ValueError):
        LoopedLM(bad)


def test_left_padding_without_a_cache_is_refused():
    """`pad` is read by the cache's chunk only: the parallel forward ignored it without a word, so a padded
    row's real tokens attended to the padding at shifted positions (logits off by ~1 from the row alone)."""
    model = LoopedLM(tiny())
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 6))
    with pytest.raises(ValueError, match="pad \\(left padding\\) is for a cached forward"):
        model(tokens, 2, pad=torch.tensor([2, 0]))


@pytest.mark.parametrize(
    "overrides", [dict(d_model=30), dict(n_kv_heads=3), dict(n_heads=8, d_model=24), dict(n_core=0)]
)
def test_inconsistent_shapes_rejected(overrides):
    with pytest.raises(ValueError):
        tiny(**overrides).validate()


# ---------------------------------------------------------------------------------------------
# 9. Initialisation statistics (design §1-2)
# ---------------------------------------------------------------------------------------------
def truncated_normal_moments(c: float) -> tuple[float, float]:
    """E[x^2], E[x^4] of a standard normal truncated to [-c, c] (integration by parts)."""
    phi = math.exp(-c * c / 2) / math.sqrt(2 * math.pi)
    mass = math.erf(c / math.sqrt(2))
    return 1 - 2 * c * phi / mass, 3 - (2 * c**3 + 6 * c) * phi / mass


def assert_truncated_normal(name: str, w: torch.Tensor, std: float, cut: float = 3.0, k: float = 5.0) -> None:
    """w ~ N(0, std^2) truncated to +-cut*std: every value within the cut; the empirical mean and
    standard deviation within k standard errors of the truncated law's (sigma*sqrt(m2), with the
    standard error of a sample std, sigma*sqrt((m4 - m2^2) / (4 m2 n))); on large tensors the tails
    reach the cut and the empirical CDF stays within the Kolmogorov-Smirnov 0.1% band."""
    x = w.detach().double().flatten()
    n, bound = x.numel(), cut * std
    m2, m4 = truncated_normal_moments(cut)
    sd = std * math.sqrt(m2)
    se_sd = std * math.sqrt((m4 - m2**2) / (4 * m2 * n))
    assert x.abs().max() <= bound * (1 + 1e-6), f"{name}: max |w| {x.abs().max():.5f} beyond {cut} sigma = {bound:.5f}"
    assert abs(x.mean()) <= k * sd / math.sqrt(n), f"{name}: mean {x.mean():.2e}"
    assert abs(x.std() - sd) <= k * se_sd, f"{name}: std {x.std():.6f}, want {sd:.6f} +- {k * se_sd:.1e} (n={n})"
    if n >= 50_000:
        # P(no value within 1% of a cut) < 1e-7 here: a narrower cut fails this
        assert x.abs().max() >= 0.99 * bound, f"{name}: max |w| {x.abs().max():.5f} never reaches the cut {bound:.5f}"
        z = x.sort().values / std
        normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), 1.0)
        lo, hi = normal.cdf(torch.tensor(-cut, dtype=torch.float64)), normal.cdf(torch.tensor(cut, dtype=torch.float64))
        cdf = (normal.cdf(z) - lo) / (hi - lo)
        ranks = torch.arange(1, n + 1, dtype=torch.float64)
        ks = torch.maximum(ranks / n - cdf, cdf - (ranks - 1) / n).max()
        assert ks <= 1.95 / math.sqrt(n), f"{name}: KS distance {ks:.2e} from the truncated normal"


def test_initialisation_statistics():
    """Embedding: truncated normal std 1/sqrt(d) cut at +-3 sigma; every other linear weight (the
    blocks' attention and SwiGLU, the head as model/looped.py sets it, Huginn-Linear's A = [A_s | A_e])
    truncated normal std 0.02 cut at +-3 sigma; b = 0; RMSNorm gains 1 (design §1, 2). A model wide
    enough that most layers have >= 65k weights, so the empirical std is pinned to ~0.3-1.3%."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=4096, d_model=256, n_heads=4, n_kv_heads=2, ffn_dim=768, max_seq_len=32, injection="huginn-linear"
    )
    model = LoopedLM(cfg)
    d = cfg.d_model
    assert_truncated_normal("embed", model.embed.weight, 1 / math.sqrt(d))
    linears = {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not name.startswith("injection.")
    }
    n_blocks = cfg.n_prelude + cfg.n_core + cfg.n_coda
    assert len(linears) == 7 * n_blocks + 1 and "head" in linears  # wq wk wv wo w1 w2 w3 per block, the head
    for name, lin in linears.items():
        assert lin.bias is None, name
        assert_truncated_normal(name, lin.weight, 0.02)
    assert_truncated_normal(
        "all block linears", torch.cat([m.weight.flatten() for n, m in linears.items() if n != "head"]), 0.02
    )
    inj = model.injection
    A = torch.cat([inj.A_state.weight, inj.A_input.weight], 1)
    assert A.shape == (d, 2 * d)
    assert_truncated_normal("huginn A", A, 0.02)
    for half in ("A_state", "A_input"):
        assert_truncated_normal(f"huginn {half}", getattr(inj, half).weight, 0.02)
    assert torch.equal(inj.A_input.bias.detach(), torch.zeros(d)) and inj.A_state.bias is None
    gains = [m.weight for m in model.modules() if isinstance(m, RMSNorm) and m.weight is not None]
    assert len(gains) == 2 * n_blocks + 1 and all(torch.equal(g.detach(), torch.ones(d)) for g in gains)


def test_input_state_keeps_the_embeddings_gradient():
    """state_init="input" (Ouro: s0 = e, no injection): the initial state is the prelude output with its
    graph, so the embedding and the prelude learn through it. Reference: the recurrence unrolled by hand
    from s = e without a detach."""
    model = make_model("none", state_init="input")
    tokens = torch.randint(0, 50, (2, 7))
    targets = torch.randint(0, 50, (2, 7))
    out = model(tokens, 3)
    got = grads_of(model, F.cross_entropy(out.logits.reshape(-1, 50), targets.reshape(-1)))
    rope = rope_tables(torch.arange(7).expand(2, 7), model.cfg.head_dim, model.cfg.rope_base)
    s = model.embed(tokens)
    for block in model.prelude:
        s = block(s, rope, None)
    for _ in range(3):
        for block in model.core:
            s = block(s, rope, None)
    for block in model.coda:
        s = block(s, rope, None)
    logits = model.head(model.norm(s)).float()
    want = grads_of(model, F.cross_entropy(logits.reshape(-1, 50), targets.reshape(-1)))
    assert want["embed.weight"].abs().amax() > 0 and want["prelude.0.attn.wq.weight"].abs().amax() > 0
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-7, msg=name)


def test_initialisation_of_the_switches():
    """design §14 inits: Parcae's coda map C starts as the identity (the coda reads z^R unchanged), a
    value-embedding gate starts at 0 (gate 2 sigmoid(0) = 1), and a tied head leaves the embedding's own
    init, truncated normal with std 1/sqrt(d) (not the head's 0.02)."""
    torch.manual_seed(0)
    model = LoopedLM(tiny(coda_proj=True, value_embeds="odd", n_core=2))
    assert torch.equal(model.coda_proj.weight.detach(), torch.eye(32))
    z = torch.randn(2, 5, 32)
    assert torch.equal(model.coda_input(z), z)
    gates = [b.attn.ve_gate.weight for b in (*model.prelude, *model.core, *model.coda) if b.has_value_embed]
    assert gates and all(torch.equal(g.detach(), torch.zeros_like(g)) for g in gates)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=4096, d_model=64, n_heads=4, n_kv_heads=2, ffn_dim=128, tie_embeddings=True)
    tied = LoopedLM(cfg)
    assert tied.head.weight is tied.embed.weight
    assert_truncated_normal("tied embed", tied.embed.weight, 1 / math.sqrt(64))
