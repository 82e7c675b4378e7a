"""`looplm.infer.row_kernels`: the written-out one-row linear and few-query attention against torch's
own kernels (F.linear, SDPA with `enable_gqa`), and the compile backend that swaps them in: which
calls it rewrites, which it leaves to torch, and a batch-1 decode step compiled through it equal to
the eager step."""

import pytest
import torch
import torch.nn.functional as F
from _models import decisive_model

from looplm.infer import extend, make_cache
from looplm.infer.row_kernels import (
    FEW_QUERIES,
    TransposedWeights,
    few_query_attention,
    rewrite,
    row_kernels_backend,
    row_linear,
)
from looplm.infer.step import DecodeStep, StepRows

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("shape", [(5,), (1, 5), (1, 1, 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_row_linear_equals_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    w, b = torch.randn(7, 5, generator=g), torch.randn(7, generator=g) if bias else None
    got = row_linear(x, w, b)
    ref = F.linear(x, w, b)
    assert got.shape == ref.shape
    assert torch.allclose(got, ref, atol=1e-6)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize(("H", "Hk"), [(4, 4), (4, 2), (6, 1)])
def test_few_query_attention_equals_sdpa_under_a_partial_mask(H, Hk, n):
    """One query per row (a decode step) and a causal chunk of three (a verify chunk): rows with masked
    keys at the front (left padding) and the back (positions not yet written), grouped-query heads, a
    mask per row and one shared by the rows, the default and a given scale."""
    g = torch.Generator().manual_seed(1)
    B, S, hd = 3, 9, 8
    q, k, v = (
        torch.randn(B, H, n, hd, generator=g),
        torch.randn(B, Hk, S, hd, generator=g),
        torch.randn(B, Hk, S, hd, generator=g),
    )
    keys = torch.arange(S)
    first = torch.tensor([0, 2, 4])
    last = torch.tensor([6, 5, 4])[:, None] + torch.arange(n)  # [B, n]: query i sees keys up to last + i
    per_row = ((keys >= first[:, None, None]) & (keys <= last[:, :, None]))[:, None]  # [B, 1, n, S]
    for mask in (per_row, per_row[1:2]):
        for scale in (None, 0.3):
            got = few_query_attention(q, k, v, mask, scale)
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=H != Hk)
            assert torch.allclose(got, ref, atol=1e-6), (mask.shape, scale)


def _calls(gm) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")}


def test_the_backend_rewrites_one_row_and_few_query_calls_only():
    """Through `torch.compile` with the backend (graphs recorded as rewritten, run as traced): one-row
    fp32 linears and SDPA calls of up to FEW_QUERIES queries under a boolean [B, 1, n, S] mask are
    replaced, fp32 linears of several rows multiply a transposed copy of their weight (a new input), the
    others are kept; the results equal the eager calls."""
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    g = torch.Generator().manual_seed(2)
    w = torch.randn(6, 4, generator=g)
    q, k, v = (torch.randn(2, h, n, 8, generator=g) for h, n in ((4, 1), (2, 5), (2, 5)))
    q3 = torch.randn(2, 4, 3, 8, generator=g)
    many = torch.randn(2, 4, FEW_QUERIES + 1, 8, generator=g)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[0, 0, 0, :2] = False
    xs = (torch.randn(1, 4, generator=g), torch.randn(2, 4, generator=g), torch.randn(1, 4, generator=g).double())

    def calls(x1, x2, x3):
        return (
            F.linear(x1, w),  # rewritten
            F.linear(x2, w),  # two rows: the BLAS, on w's transpose
            F.linear(x3, w.double()),  # not fp32
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),  # rewritten
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True),  # no boolean mask
            F.scaled_dot_product_attention(  # rewritten: three queries
                q3, k, v, attn_mask=torch.ones(2, 1, 3, 5, dtype=torch.bool), enable_gqa=True
            ),
            F.scaled_dot_product_attention(  # more queries than FEW_QUERIES
                many, k, v, attn_mask=torch.ones(2, 1, FEW_QUERIES + 1, 5, dtype=torch.bool), enable_gqa=True
            ),
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask.float(), enable_gqa=True),  # additive mask
        )

    got = torch.compile(calls, backend=row_kernels_backend(recording), dynamic=False)(*xs)
    (gm,) = graphs
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("row_linear" in t for t in targets) == 1 and sum("_sdpa_few_queries" in t for t in targets) == 2
    assert sum("transposed_linear" in t for t in targets) == 1
    assert targets.count(str(F.linear)) == 1 and targets.count(str(F.scaled_dot_product_attention)) == 3
    for a, b in zip(got, calls(*xs), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_batch_1_step_compiled_through_the_backend_equals_the_eager_step():
    """`DecodeStep(compile=True)` on a CPU compiles its pieces through the backend: at batch 1 no graph of
    a step holds a linear or an SDPA call (an inner backend that records each rewritten graph, then
    runs it as traced), and the logits and the banks equal the eager step's on a twin cache. Depth 2,
    whole=0 and one recurrence per graph: the three pieces of a deep step; inductor compiles the mode's graphs in
    `test_infer_step.py`'s compiled-step test (batch 4) and the engine's warm-up test."""
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = decisive_model(50, max_seq_len=32, max_depth=8)
    prompt = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(3))
    cache = make_cache("terminal", model.cfg, 1, 32, 4)
    extend(model, prompt, cache, 3, example_ids=torch.zeros(1, dtype=torch.long))
    twin = cache.take(torch.arange(1))
    step = DecodeStep(model, cache, compile=True, unroll=1, whole=0, compile_options={"backend": recording})
    assert step.row_kernels
    eager = DecodeStep(model, twin)
    zero = torch.zeros(1, dtype=torch.long)
    for t in range(3):
        rows = StepRows(torch.tensor([7 + t]), torch.tensor([6 + t]), zero, zero)
        got, _ = step(rows, 2)
        ref, _ = eager(rows, 2)
        assert (got - ref).abs().max() <= 1e-5, t
        for a, b in zip(cache.banks(), twin.banks(), strict=True):
            assert (a.k - b.k).abs().max() <= 1e-5 and (a.v - b.v).abs().max() <= 1e-5
    assert len(graphs) == 3  # prelude, one recurrence, coda: traced once
    # a second step (as each `generate` call makes one) runs the graphs the first compiled: one backend
    # object per (inner backend, options), so Dynamo's cache entries match (a new one per step filled
    # the cache up to its limit, after which the pieces ran eagerly)
    again = DecodeStep(model, cache, compile=True, unroll=1, whole=0, compile_options={"backend": recording})
    got, _ = again(StepRows(torch.tensor([3]), torch.tensor([9]), zero, zero), 2)
    assert len(graphs) == 3
    called = " ".join(set().union(*map(_calls, graphs)))
    assert "row_linear" in called and "_sdpa_few_queries" in called, called
    assert str(F.linear) not in called and str(F.scaled_dot_product_attention) not in called, called
    with pytest.raises(ValueError, match="compiled steps"):
        DecodeStep(model, cache, row_kernels=True)


def test_the_backends_edges_few_queries_included_broadcast_masks_dropout_and_row_blocks_excluded():
    """The rewrite's edges: exactly FEW_QUERIES queries are rewritten; a mask broadcast over the queries
    ([B, 1, 1, S]) and an SDPA with dropout are left to torch, a linear of several rows in one batch entry
    ([1, 3, in]) multiplies its weight's transpose; the rewritten graph's code calls the written-out forms
    (an inner backend that runs `gm` runs them), and the results equal the eager ones."""
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    g = torch.Generator().manual_seed(4)
    w = torch.randn(6, 4, generator=g)
    k, v = torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    few = torch.randn(2, 4, FEW_QUERIES, 8, generator=g)
    q3 = torch.randn(2, 4, 3, 8, generator=g)
    shared = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    shared[1, 0, 0, :2] = False
    full = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    x1, block = torch.randn(1, 4, generator=g), torch.randn(1, 3, 4, generator=g)

    def calls(x1, block):
        return (
            F.linear(x1, w),  # rewritten
            F.linear(block, w),  # three rows: the BLAS, on w's transpose
            F.scaled_dot_product_attention(  # rewritten: FEW_QUERIES queries
                few, k, v, attn_mask=torch.ones(2, 1, FEW_QUERIES, 5, dtype=torch.bool), enable_gqa=True
            ),
            F.scaled_dot_product_attention(q3, k, v, attn_mask=shared, enable_gqa=True),  # broadcast over queries
            F.scaled_dot_product_attention(q3, k, v, attn_mask=full, dropout_p=0.5, enable_gqa=True),  # dropout
        )

    got = torch.compile(calls, backend=row_kernels_backend(recording), dynamic=False)(x1, block)
    (gm,) = graphs
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("row_linear" in t for t in targets) == 1 and sum("_sdpa_few_queries" in t for t in targets) == 1
    assert sum("transposed_linear" in t for t in targets) == 1
    assert targets.count(str(F.linear)) == 0 and targets.count(str(F.scaled_dot_product_attention)) == 2
    assert "row_linear" in gm.code and "_sdpa_few_queries" in gm.code
    ref = calls(x1, block)
    for a, b in zip(got[:4], ref[:4], strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_linears_of_one_input_share_one_product_of_their_weights_side_by_side():
    """Bias-free linears of several rows that read the same input (a layer's q, k and v) become one
    `transposed_linear` on one new input holding their transposes side by side, each reading its
    columns; the same weights on another input (the next recurrence) reuse that input; a linear with a
    bias keeps a product and a copy of its own. The results equal F.linear's."""
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    g = torch.Generator().manual_seed(6)
    wq, wk, wv, wb = (torch.randn(n, 4, generator=g) for n in (6, 3, 3, 5))
    b = torch.randn(5, generator=g)

    def layer(x):
        return F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)

    def calls(x):
        q, k, v = layer(x)
        again = layer(q[..., :4] + k[..., :1])  # the same weights, another input
        return q, k, v, *again, F.linear(x, wb, b)

    x = torch.randn(3, 4, generator=g)
    got = torch.compile(calls, backend=row_kernels_backend(recording), dynamic=False)(x)
    (gm,) = graphs
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("transposed_linear" in t for t in targets) == 3  # two of q, k, v; one with the bias
    assert sum("narrow" in t for t in targets) == 6 and targets.count(str(F.linear)) == 0
    copies = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name.endswith("_transposed")]
    assert len(copies) == 2
    for a, ref in zip(got, calls(x), strict=True):
        assert a.shape == ref.shape and torch.allclose(a, ref, atol=1e-6)


def test_one_backend_per_inner_backend_and_options():
    """`row_kernels_backend` returns the same object for the same (inner, options), whatever the options'
    order, and another for other options or another inner backend (an inner callable here: inductor's
    options take the same path without importing inductor)."""

    def inner(gm, example_inputs):
        return gm.forward

    def other(gm, example_inputs):
        return gm.forward

    a = row_kernels_backend(inner, {"cpp_wrapper": True, "size_asserts": False})
    assert a is row_kernels_backend(inner, {"size_asserts": False, "cpp_wrapper": True})
    assert a is not row_kernels_backend(inner, {"cpp_wrapper": False, "size_asserts": False})
    assert a is not row_kernels_backend(inner)
    assert a is not row_kernels_backend(other, {"cpp_wrapper": True, "size_asserts": False})


def test_rewrite_regenerates_the_code_of_a_graph_that_already_ran():
    """`rewrite` on a graph whose code was generated (it ran once): the code is regenerated, so it calls
    the written-out form (Dynamo's graphs generate their code lazily, which hid a missing recompile)."""
    captured = []

    def capture(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    w = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))
    x = torch.randn(1, 4)
    torch.compile(lambda x: F.linear(x, w), backend=capture, dynamic=False)(x)
    (gm,) = captured
    assert "row_linear" not in gm.code
    assert rewrite(gm) == (1, [])
    assert "row_linear" in gm.code


def test_transposed_weights_follow_their_weights():
    """The transposed copy is made once and kept while its weight is the same tensor, unchanged; made
    again after an in-place change (an optimizer step bumps the version counter) or for another tensor;
    an inference tensor (no version counter) is transposed on every call; a group's copy is made again
    when any one of its weights changes."""
    w = torch.nn.Parameter(torch.randn(6, 4))
    other = torch.randn(3, 5)
    store = TransposedWeights([(1,)])
    first = store([other, w])[0]
    assert torch.equal(first, w.detach().t()) and first.is_contiguous()
    assert store([other, w])[0] is first  # kept
    with torch.no_grad():
        w.mul_(2)  # in place, as an optimizer step
    again = store([other, w])[0]
    assert again is not first and torch.equal(again, w.detach().t())
    new = torch.randn(6, 4)
    assert torch.equal(store([other, new])[0], new.t())
    with torch.inference_mode():
        frozen = torch.randn(6, 4)
    a, b = store([other, frozen])[0], store([other, frozen])[0]
    assert a is not b and torch.equal(a, frozen.t())
    # a group: the transposes side by side, made again when any one of them changes
    u = torch.nn.Parameter(torch.randn(2, 4))
    pair = TransposedWeights([(2, 0)])
    both = pair([w, other, u])[0]
    assert torch.equal(both, torch.cat([u.detach().t(), w.detach().t()], 1)) and both.is_contiguous()
    assert pair([w, other, u])[0] is both
    with torch.no_grad():
        w.add_(1)
    assert torch.equal(pair([w, other, u])[0], torch.cat([u.detach().t(), w.detach().t()], 1))


def test_a_compiled_chunk_reads_the_weights_as_they_are_now():
    """A verify chunk (5 rows) compiled through the backend multiplies transposed copies of the weights:
    after the weights change in place (as RL's optimizer changes them between rollouts) the compiled
    chunk's logits equal the eager step's on the new weights. A planted stale copy (the store never
    refreshed) fails this."""
    model = decisive_model(50, max_seq_len=32, max_depth=8)
    prompt = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(3))
    zero = torch.zeros(1, dtype=torch.long)
    chunk = torch.tensor([[7, 8, 9, 10, 11]])
    for round_ in range(2):
        cache = make_cache("full", model.cfg, 1, 32, 4)
        extend(model, prompt, cache, 3, example_ids=zero)
        twin = cache.take(torch.arange(1))
        got, _ = DecodeStep(model, cache, compile=True, unroll=1)(StepRows(chunk, torch.tensor([6]), zero, zero), 3)
        ref, _ = DecodeStep(model, twin)(StepRows(chunk, torch.tensor([6]), zero, zero), 3)
        assert (got - ref).abs().max() <= 1e-4, round_
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.1)
