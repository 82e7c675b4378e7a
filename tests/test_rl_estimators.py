"""Update estimators (design §10, paper A.2): the Neumann update against closed forms and dense
Jacobians, reuse vs recompute, and the saved-state checks."""

from __future__ import annotations

import copy

import pytest
import torch

from looplm.data import ByteTokenizer
from looplm.model import LoopedLM
from looplm.rl import (
    ESTIMATORS,
    SavedStateError,
    SavedStates,
    action_logprobs,
    check_saved_states,
    clipped_policy_loss,
    endpoint_backward,
    group_advantages,
    neumann_backward,
    rollout,
    score_and_backward,
    token_hash,
)
from looplm.rl.estimators import bptt_backward, recompute_endpoints, reference_logits

pytestmark = pytest.mark.usefixtures("single_thread")
torch_f64 = torch.float64


# -- a linear contractive recurrence with a known Jacobian ----------------------------------------
def _linear_problem(kappa: float = 0.7, d: int = 6, m: int = 3, k: int = 4):
    gen = torch.Generator().manual_seed(3)
    A = torch.randn(d, d, generator=gen, dtype=torch_f64)
    A = (kappa * A / torch.linalg.matrix_norm(A, ord=2)).requires_grad_()  # ||A||_2 = kappa < 1
    W = torch.randn(d, m, generator=gen, dtype=torch_f64).requires_grad_()
    H = torch.randn(k, d, generator=gen, dtype=torch_f64).requires_grad_()
    x = torch.randn(m, generator=gen, dtype=torch_f64)
    y = torch.randn(k, generator=gen, dtype=torch_f64)
    recurrence = lambda z: A @ z + W @ x  # noqa: E731  F(z; theta) with J = A, B^T v = (v z^T, v x^T)
    head = lambda z: 0.5 * ((H @ z - y) ** 2).sum()  # noqa: E731  direct parameter H
    return A, W, H, x, y, recurrence, head


def _neumann_grads(A, W, H, recurrence, head, z, steps):
    for p in (A, W, H):
        p.grad = None
    neumann_backward(recurrence, head, z, steps)
    return A.grad.clone(), W.grad.clone(), H.grad.clone()


@pytest.mark.parametrize("b", [1, 2, 3, 5, 8])
def test_neumann_b_equals_the_closed_form_on_a_linear_recurrence(b):
    A, W, H, x, y, recurrence, head = _linear_problem()
    z = torch.randn(A.shape[0], dtype=torch_f64, generator=torch.Generator().manual_seed(5))  # any state
    with torch.no_grad():
        z_bar = A @ z + W @ x
        r = H @ z_bar - y
        g, c_H = H.T @ r, torch.outer(r, z_bar)
        v = sum(torch.linalg.matrix_power(A.T, k) @ g for k in range(b))  # sum_{k<b} (J^T)^k g
    got_A, got_W, got_H = _neumann_grads(A, W, H, recurrence, head, z, steps=b - 1)
    torch.testing.assert_close(got_A, torch.outer(v, z), rtol=1e-12, atol=1e-12)  # B_A^T v
    torch.testing.assert_close(got_W, torch.outer(v, x), rtol=1e-12, atol=1e-12)  # B_W^T v
    torch.testing.assert_close(got_H, c_H, rtol=1e-12, atol=1e-12)  # the direct head gradient c


def test_neumann_approaches_the_implicit_gradient_within_the_contraction_bound():
    kappa = 0.7
    A, W, H, x, y, recurrence, head = _linear_problem(kappa)
    d = A.shape[0]
    with torch.no_grad():
        z_star = torch.linalg.solve(torch.eye(d, dtype=torch_f64) - A, W @ x)  # the fixed point
        r = H @ z_star - y
        g = H.T @ r
        v_inf = torch.linalg.solve(torch.eye(d, dtype=torch_f64) - A.T, g)  # (I - J^T)^{-1} g
        implicit = torch.cat(
            [torch.outer(v_inf, z_star).flatten(), torch.outer(v_inf, x).flatten(), torch.outer(r, z_star).flatten()]
        )
        B_norm = torch.cat([z_star, x]).norm()  # ||B||_2 for B^T v = (v z*^T, v x^T)
    errors = []
    for b in range(1, 25):
        got = torch.cat([t.flatten() for t in _neumann_grads(A, W, H, recurrence, head, z_star, steps=b - 1)])
        err = float((got - implicit).norm())
        assert err <= float(B_norm * g.norm()) * kappa**b / (1 - kappa) + 1e-12  # paper A.2 bound
        errors.append(err)
    assert all(e2 < e1 for e1, e2 in zip(errors, errors[1:]))  # strictly closer with every product
    assert errors[-1] < 1e-3 * errors[0]


# -- the Neumann update of a LoopedLM against a dense Jacobian -----------------------------------
def _model(tiny_model_config, **kw):
    model = LoopedLM(tiny_model_config(**kw))
    model.double()
    return model


def test_model_neumann_update_matches_a_dense_jacobian_reference(tiny_model_config):
    model = _model(tiny_model_config, d_model=8, n_heads=2, n_kv_heads=1, ffn_dim=16, vocab_size=11)
    tokens = torch.tensor([[1, 4, 2, 7], [3, 3, 9, 0]])
    targets = torch.tensor([[4, 2, 7, 5], [3, 9, 0, 1]])
    mask = torch.tensor([[False, True, True, True], [False, False, True, True]])
    adv = torch.tensor([0.7, -1.3], dtype=torch_f64)
    ids = torch.tensor([0, 1])
    z = recompute_endpoints(model, tokens, ids, 3) + 0.05 * torch.randn(2, 4, 8, dtype=torch_f64)  # off the trajectory

    def objective(logits):
        return clipped_policy_loss(action_logprobs(logits, targets), adv, mask)[0]

    steps = 3
    model.zero_grad()
    endpoint_backward(model, tokens, z, objective, steps)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    # reference: J as a dense [N*L*d, N*L*d] matrix, v = sum_{k<=steps} (J^T)^k g by matrix powers,
    # then c + B^T v by plain autograd of <F(z), v> and of the head at a fixed z_bar
    from looplm.model.blocks import rope_tables

    positions = torch.arange(4).expand(2, 4)
    rope = rope_tables(positions, model.cfg.head_dim, model.cfg.rope_base)

    def F(state):
        ctx = model.context(model.run_prelude(tokens, rope, None), rope, None)
        return model.recurrence(state, ctx)

    J = torch.autograd.functional.jacobian(F, z).reshape(z.numel(), z.numel())
    z_bar = F(z).detach().requires_grad_()
    model.zero_grad()
    objective(model.run_coda(z_bar, rope, None)).backward()
    g = z_bar.grad.flatten()
    c = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    v = sum(torch.linalg.matrix_power(J.T, k) @ g for k in range(steps + 1))
    model.zero_grad()
    (F(z) * v.view_as(z)).sum().backward()
    for n, p in model.named_parameters():
        want = c[n] + (p.grad if p.grad is not None else torch.zeros_like(p))
        torch.testing.assert_close(got[n], want, rtol=1e-8, atol=1e-10, msg=n)
    assert all(
        got[n].abs().sum() > 0
        for n in (
            "embed.weight",
            "prelude.0.attn.wq.weight",
            "core.1.ffn.w2.weight",
            "coda.0.ffn.w1.weight",
            "head.weight",
        )
    )


def test_neumann_update_approaches_bptt_at_a_fixed_point(tiny_model_config):
    """Near a fixed point, full BPTT through many recurrences tends to the implicit gradient, and so
    does the Neumann update at the endpoint as the number of state products grows (paper A.2)."""
    model = _model(tiny_model_config)
    with torch.no_grad():  # a strongly contractive core: small block outputs, decay 1/e
        for block in model.core:
            for lin in (block.attn.wo, block.ffn.w2):
                lin.weight.mul_(0.2)
    tokens = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 10, dtype=torch.bool)
    ids = torch.tensor([0, 1])
    adv = torch.tensor([1.0, -0.5], dtype=torch_f64)

    def objective(logits):
        return clipped_policy_loss(action_logprobs(logits, targets), adv, mask)[0]

    def flat():
        out = torch.cat([p.grad.flatten() for p in model.parameters()])
        model.zero_grad()
        return out

    R = 60
    model.zero_grad()
    bptt_backward(model, tokens, ids, R, objective)
    bptt = flat()
    z = recompute_endpoints(model, tokens, ids, R)
    errs = []
    for steps in (0, 1, 2, 4, 8, 16):
        endpoint_backward(model, tokens, z, objective, steps)
        errs.append(float((flat() - bptt).norm() / bptt.norm()))
    assert all(e2 < e1 for e1, e2 in zip(errs, errs[1:])), errs  # geometric: ~0.06, 0.02, ..., 1e-8
    assert errs[0] > 1e-2 and errs[-1] < 1e-6, errs


# -- reuse vs recompute and the saved-state checks -----------------------------------------------
@pytest.fixture
def setup(tiny_model_config):
    tok = ByteTokenizer()
    model = LoopedLM(tiny_model_config(vocab_size=tok.vocab_size, max_seq_len=48))
    ro = rollout(model, tok, ["+12,34=", "+5,6="], group_size=3, depth=3, max_new_tokens=5, seed=7)
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0]), 3)

    def objective(logits):
        return clipped_policy_loss(action_logprobs(logits, ro.targets), adv, ro.mask)[0]

    return model, ro, objective


def _grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return out


def test_reuse_and_recompute_are_identical_given_the_same_endpoints(setup):
    model, ro, objective = setup
    model.zero_grad()
    score_and_backward("recompute", model, ro, objective, depth=3, neumann_steps=4)
    recompute = _grads(model)
    endpoints = recompute_endpoints(model, ro.tokens, ro.example_ids, 3)
    same = SavedStates(endpoints, 3, ro.states.version, ro.states.tokens)
    score_and_backward("reuse", model, ro, objective, depth=3, neumann_steps=4, states=same)
    reuse = _grads(model)
    for n in recompute:
        assert torch.equal(recompute[n], reuse[n]), n


def test_every_estimator_gives_a_gradient_to_every_parameter(setup):
    model, ro, objective = setup
    for est in ESTIMATORS:
        model.zero_grad()
        out = score_and_backward(est, model, ro, objective, depth=3, neumann_steps=2)
        assert torch.isfinite(torch.tensor(out["loss"]))
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters()), est


def test_stale_saved_states_are_rejected_after_an_optimizer_step(setup):
    model, ro, objective = setup
    score_and_backward("reuse", model, ro, objective, depth=3)  # fine before the step
    torch.optim.SGD(model.parameters(), lr=1e-3).step()
    with pytest.raises(SavedStateError, match="stale saved states"):
        score_and_backward("reuse", model, ro, objective, depth=3)
    with pytest.raises(SavedStateError, match="stale"):  # any in-place parameter change counts
        fresh = rollout(model, ByteTokenizer(), ["+1,2="], group_size=2, depth=3, max_new_tokens=2)
        with torch.no_grad():
            next(model.parameters()).add_(0.0)
        check_saved_states(fresh.states, model, fresh.tokens, fresh.example_ids, 3)


def test_mismatched_and_missing_saved_states_are_rejected(setup):
    model, ro, objective = setup
    s = ro.states
    other = ro.tokens.clone()
    other[0, 1] += 1
    with pytest.raises(SavedStateError, match="token hash mismatch"):
        check_saved_states(s, model, other, ro.example_ids, 3)
    with pytest.raises(SavedStateError, match="token hash mismatch"):  # same tokens, other s0 seeds
        check_saved_states(s, model, ro.tokens, ro.example_ids + 1, 3)
    with pytest.raises(SavedStateError, match="depth 3, the update runs at depth 4"):
        check_saved_states(s, model, ro.tokens, ro.example_ids, 4)
    with pytest.raises(SavedStateError, match="none were given"):
        check_saved_states(None, model, ro.tokens, ro.example_ids, 3)
    with pytest.raises(SavedStateError, match="none were given"):
        score_and_backward("reuse", model, ro, objective, depth=3, states=SavedStates(None, 3, s.version, s.tokens))
    wrong_shape = SavedStates(s.endpoints[:, :-1], 3, s.version, s.tokens)
    with pytest.raises(SavedStateError, match="shape"):
        check_saved_states(wrong_shape, model, ro.tokens, ro.example_ids, 3)
    assert token_hash(ro.tokens, ro.example_ids) == s.tokens
    with pytest.raises(ValueError, match="unknown estimator"):
        score_and_backward("implicit", model, ro, objective, depth=3)


def test_reference_logits_follow_each_estimators_scoring_path(setup):
    """The KL reference is scored along the path the estimator scores the policy with: a copy of the
    policy gets exactly the logits the policy loss sees (KL 0), for every estimator; recompute's is
    the reference's native forward one recurrence deeper, and a moved reference gives a positive KL."""
    model, ro, _ = setup
    seen = {}

    def capture(est):
        def objective(logits):
            seen[est] = logits.detach().clone()
            return logits.float().logsumexp(-1).mean()

        return objective

    twin = copy.deepcopy(model).requires_grad_(False)
    moved = copy.deepcopy(twin)
    with torch.no_grad():
        for p in moved.core.parameters():
            p.add_(0.02 * torch.randn_like(p))
    for est in ESTIMATORS:
        model.zero_grad()
        score_and_backward(est, model, ro, capture(est), depth=3, neumann_steps=1)
        assert torch.equal(reference_logits(est, twin, model, ro, depth=3), seen[est]), est
        logp = action_logprobs(seen[est], ro.targets)
        ref = action_logprobs(reference_logits(est, moved, model, ro, depth=3), ro.targets)
        adv = torch.zeros(ro.tokens.shape[0])
        assert clipped_policy_loss(logp, adv, ro.mask, ref_logp=logp)[1]["kl"] == 0.0
        assert clipped_policy_loss(logp, adv, ro.mask, ref_logp=ref)[1]["kl"] > 1e-6, est
    with torch.no_grad():  # recompute scores F(z^R) of the native forward: the native forward at R + 1
        native = moved(ro.tokens, 4, init="seeded", example_ids=ro.example_ids).logits
    torch.testing.assert_close(reference_logits("recompute", moved, model, ro, depth=3), native, rtol=1e-5, atol=1e-5)
    # reuse reads the policy's saved endpoints, refused once the policy has moved
    torch.optim.SGD(model.parameters(), lr=1e-3).step()
    with pytest.raises(SavedStateError, match="stale"):
        reference_logits("reuse", twin, model, ro, depth=3)
    with pytest.raises(ValueError, match="unknown estimator"):
        reference_logits("implicit", twin, model, ro, depth=3)


def test_saved_states_of_another_model_are_rejected(tiny_model_config):
    """The parameter version names the model object too: two models built alike have equal version
    counters, yet one's rollout states do not describe the other, which may differ through writes the
    counters miss (here `.data`; a fused optimizer's too)."""
    tok = ByteTokenizer()
    cfg = tiny_model_config(vocab_size=tok.vocab_size, max_seq_len=48)
    torch.manual_seed(0)
    a = LoopedLM(cfg)
    torch.manual_seed(0)
    b = LoopedLM(cfg)
    b.head.weight.data.mul_(2.0)
    assert [p._version for p in a.parameters()] == [p._version for p in b.parameters()]
    ro = rollout(a, tok, ["+1,2="], group_size=2, depth=2, max_new_tokens=3)
    check_saved_states(ro.states, a, ro.tokens, ro.example_ids, 2)
    with pytest.raises(SavedStateError, match="stale"):
        check_saved_states(ro.states, b, ro.tokens, ro.example_ids, 2)


def test_estimators_score_a_model_with_value_embeddings(tiny_model_config):
    """The one-recurrence path gives the context its token ids (value embeddings read them): for a
    value-embedding model, recompute's reference logits equal the native forward one recurrence deeper."""
    tok = ByteTokenizer()
    model = LoopedLM(tiny_model_config(vocab_size=tok.vocab_size, max_seq_len=48, value_embeds="odd"))
    ro = rollout(model, tok, ["+12,34=", "+5,6="], group_size=2, depth=2, max_new_tokens=4, seed=1)
    with torch.no_grad():
        native = model(ro.tokens, 3, init="seeded", example_ids=ro.example_ids).logits
    got = reference_logits("recompute", model, model, ro, depth=2)
    torch.testing.assert_close(got, native, rtol=1e-5, atol=1e-5)
    out = score_and_backward("reuse", model, ro, lambda logits: logits.float().logsumexp(-1).mean(), depth=2)
    assert torch.isfinite(torch.tensor(out["loss"]))


def test_endpoint_residual_is_the_mean_relative_change_over_the_real_tokens(setup):
    """residual = mean over the non-padding tokens of |F(z) - z| / |z|. With z the native depth-R
    endpoint (zero at the right padding, as saved endpoints are), F(z) is the native endpoint at R + 1."""
    model, ro, objective = setup
    R = 3
    with torch.no_grad():
        z_r = model(ro.tokens, R, init="seeded", example_ids=ro.example_ids).endpoint
        z_next = model(ro.tokens, R + 1, init="seeded", example_ids=ro.example_ids).endpoint
    real = torch.zeros(ro.tokens.shape, dtype=torch.bool)
    for i, (p, n) in enumerate(zip(ro.prompt_lengths, ro.completion_lengths)):
        real[i, : p + n - 1] = True
    assert not real.all()  # some rows are padded: the check bites
    z = torch.where(real[..., None], z_r, 0.0)
    want = ((z_next - z_r).norm(dim=-1) / z_r.norm(dim=-1))[real].mean()
    out = endpoint_backward(model, ro.tokens, z, objective, 1)
    assert out["residual"] == pytest.approx(float(want), rel=1e-4)


def test_negative_neumann_steps_are_refused():
    """steps = -1 would silently run as 0 state products (range(-1) is empty): it is an error."""
    A, W, H, x, y, recurrence, head = _linear_problem()
    with pytest.raises(ValueError, match="Neumann steps must be >= 0"):
        neumann_backward(recurrence, head, torch.zeros(A.shape[0], dtype=torch_f64), -1)


def test_saved_states_of_a_deeper_rollout_are_refused(setup):
    """The depth must match exactly: endpoints saved at depth 3 do not describe an update at depth 2."""
    model, ro, _ = setup
    with pytest.raises(SavedStateError, match="depth 3, the update runs at depth 2"):
        check_saved_states(ro.states, model, ro.tokens, ro.example_ids, 2)


@pytest.fixture
def offset_rollout(tiny_model_config):
    """A rollout whose example ids start at 9: the ids (which seed s0) differ from the default 0..N-1."""
    tok = ByteTokenizer()
    model = LoopedLM(tiny_model_config(vocab_size=tok.vocab_size, max_seq_len=48))
    ro = rollout(model, tok, ["+12,34=", "+5,6="], group_size=2, depth=3, max_new_tokens=4, seed=2, first_example_id=9)
    assert ro.example_ids.tolist() == [9, 10, 11, 12]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])

    def objective(logits):
        return clipped_policy_loss(action_logprobs(logits, ro.targets), adv, ro.mask)[0]

    return model, ro, objective


def test_every_path_seeds_the_rows_by_their_example_ids(offset_rollout):
    """bptt's replay, recompute's endpoints and the KL reference of both start from s0 seeded by the
    rollout's example ids, not by the row index (the two agree only when the ids start at 0)."""
    model, ro, objective = offset_rollout
    twin = copy.deepcopy(model).requires_grad_(False)
    ids = ro.example_ids
    with torch.no_grad():
        native = {R: twin(ro.tokens, R, init="seeded", example_ids=ids).logits for R in (3, 4)}
    torch.testing.assert_close(reference_logits("bptt", twin, model, ro, depth=3), native[3], rtol=0, atol=0)
    # recompute scores F(z^R): the native forward one recurrence deeper
    torch.testing.assert_close(reference_logits("recompute", twin, model, ro, depth=3), native[4], rtol=1e-5, atol=1e-5)
    model.zero_grad()
    score_and_backward("bptt", model, ro, objective, depth=3)
    got = _grads(model)
    objective(model(ro.tokens, 3, init="seeded", example_ids=ids).logits).backward()
    for n, want in _grads(model).items():
        torch.testing.assert_close(got[n], want, rtol=1e-6, atol=1e-8, msg=n)


def test_reuse_reference_logits_read_the_states_given(setup):
    """reference_logits(..., states=S) scores the reference on the endpoints of S, not the rollout's own:
    given the native depth-R endpoints, a copy of the policy yields the native forward at R + 1."""
    model, ro, _ = setup
    twin = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        z = model(ro.tokens, 3, init="seeded", example_ids=ro.example_ids, compute_logits=False).endpoint
        deeper = model(ro.tokens, 4, init="seeded", example_ids=ro.example_ids).logits
    given = SavedStates(z, 3, ro.states.version, ro.states.tokens)
    got = reference_logits("reuse", twin, model, ro, depth=3, states=given)
    torch.testing.assert_close(got, deeper, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(reference_logits("reuse", twin, model, ro, depth=3), deeper, atol=1e-3)  # it bites


@pytest.mark.parametrize("estimator", ["recompute", "reuse"])
def test_neumann_steps_reach_the_one_recurrence_update(offset_rollout, estimator):
    """neumann_steps = 0 is plain backpropagation through one recurrence from the detached endpoints
    (c + B^T g); the estimator must pass the requested number of state products on (4 differs)."""
    model, ro, objective = offset_rollout
    if estimator == "recompute":
        with torch.no_grad():
            z = model(ro.tokens, 3, init="seeded", example_ids=ro.example_ids).endpoint
    else:
        z = ro.states.endpoints
    from looplm.model.blocks import rope_tables

    model.zero_grad()
    score_and_backward(estimator, model, ro, objective, depth=3, neumann_steps=0)
    got = _grads(model)
    rope = rope_tables(
        torch.arange(ro.tokens.shape[1]).expand(ro.tokens.shape), model.cfg.head_dim, model.cfg.rope_base
    )
    ctx = model.context(model.run_prelude(ro.tokens, rope, None), rope, None, ro.tokens)
    objective(model.run_coda(model.recurrence(z.detach(), ctx), rope, None, ctx)).backward()
    for n, want in _grads(model).items():
        torch.testing.assert_close(got[n], want, rtol=1e-4, atol=1e-6, msg=n)
