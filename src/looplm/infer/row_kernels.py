"""How the compiled decode step computes a layer at few rows on a CPU (design §16).

At batch 1 a recurrence of the tiny preset is 14 matrix-vector products and 2 attention calls of a
few microseconds of arithmetic each, and inside an inductor graph each of them is a call out of the
generated code (the BLAS's `mm`, the CPU SDPA kernel) that costs more than its arithmetic.
`row_kernels_backend` is a `torch.compile` backend that rewrites three kinds of call in the graph
Dynamo captured (shapes are static there) before it hands the graph on (to inductor by default):

- `F.linear` of one row (x with a single row of features, fp32): y = sum(x[..., None, :] * W, -1),
  a broadcast product and a sum, which inductor generates as one loop of its own, fused with what
  follows;
- `F.scaled_dot_product_attention` of at most `FEW_QUERIES` queries per row (a one-token step, a
  verify chunk) under a boolean mask [B or 1, 1, n, S]: softmax(q K^T / sqrt(hd) + mask) V written
  out as two batched products and a softmax, grouped-query heads as a reshape (query head h reads
  key/value head h // (H / H_kv), as SDPA's `enable_gqa`). The CPU SDPA kernel's blocking costs
  more than the arithmetic at so few queries (a 5-token verify chunk ran ~10% faster without it);
- `F.linear` of several rows (fp32) whose weight is a graph input (a parameter): x @ W_t, with W_t a
  contiguous copy of W^T made once and kept (`TransposedWeights`; made again when the weight changes, in
  place or as another tensor). The BLAS multiplies few rows by a [in, out] matrix faster than by the
  transpose of an [out, in] one, which is what `F.linear` hands it: 1.3-2x at 2-32 rows of the tiny
  preset's products on a Sapphire Rapids CPU (MKL), so the verify chunk of self-speculation and the
  serving engine's batches gain. It costs a second copy of the weights the compiled step multiplies.
  Bias-free linears of the same input (a layer's q, k and v; its gate and up projections) share one
  copy, their weights' transposes side by side, and one `mm`, whose output each reads its columns of:
  a product of few rows costs mostly its call, so a layer makes 4 calls instead of 7.

Every other call, and these of other shapes, stay as they were; results equal the eager step's to
float rounding (tested). Measured on the 2-core CPU (BENCHMARKS.md): a batch-1 R = 32 step 1.5x
faster (1.6-2.1x at d 512); at 16 rows the written-out products lose to the BLAS, so a linear of more
than one row keeps `mm` (on the transposed copy). Eagerly the products would allocate [rows, out, in]: they are for compiled graphs.
"""

from __future__ import annotations

import weakref

import torch
import torch.fx
import torch.nn.functional as F

__all__ = [
    "FEW_QUERIES",
    "TransposedWeights",
    "few_query_attention",
    "rewrite",
    "row_kernels_backend",
    "row_linear",
    "transposed_linear",
]


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) as a broadcast product and a sum over the input features."""
    y = (x[..., None, :] * weight).sum(-1)
    return y if bias is None else y + bias


def transposed_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) given weight_t = weight^T [in, out], contiguous: one `mm`."""
    y = (x.reshape(-1, x.shape[-1]) @ weight_t).reshape(*x.shape[:-1], weight_t.shape[1])
    return y if bias is None else y + bias


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: no version counter, so no way to know it is unchanged
        return None


class TransposedWeights:
    """The extra inputs of a rewritten graph: for each group of its inputs `groups` (weights [out_i, in]),
    one contiguous [in, sum out_i] copy of their transposes side by side, made on the first call and
    again whenever one of them is another tensor object or was changed in place (its version counter
    moved: an optimizer step, `load_state_dict`); a group holding a tensor without a version counter
    (made under inference mode) is copied on every call."""

    def __init__(self, groups: list[tuple[int, ...]]):
        self.groups = groups
        self._made: list[list | None] = [None] * len(groups)  # per weight (weakref to it, its version)
        self._copies: list[torch.Tensor | None] = [None] * len(groups)

    def __call__(self, args) -> list[torch.Tensor]:
        out = []
        for j, group in enumerate(self.groups):
            weights, made = [args[i] for i in group], self._made[j]
            versions = [_version(w) for w in weights]
            if (
                None in versions
                or made is None
                or any(ref() is not w or v != was for w, v, (ref, was) in zip(weights, versions, made))
            ):
                self._copies[j] = torch.cat([w.detach().t() for w in weights], 1).contiguous()
                self._made[j] = None if None in versions else [(weakref.ref(w), v) for w, v in zip(weights, versions)]
            out.append(self._copies[j])
        return out


def few_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale=None):
    """SDPA of a few queries per row: q [B, H, n, hd], k/v [B, H_kv, S, hd] (H a multiple of H_kv),
    boolean mask [B or 1, 1, n, S] (True = attend) -> [B, H, n, hd]."""
    B, H, n, hd = q.shape
    Hk, S = k.shape[1], k.shape[2]
    G, Bm = H // Hk, mask.shape[0]
    scale = hd**-0.5 if scale is None else scale
    qg = q.reshape(B, Hk, G * n, hd)  # query head h = kv head * G + g; its n queries in a row
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [B, Hk, G * n, S]
    keep = mask.reshape(Bm, 1, 1, n, S).expand(Bm, 1, G, n, S).reshape(Bm, 1, G * n, S)
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.matmul(scores.softmax(-1), v).reshape(B, H, n, hd)


def _one_row(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.numel() == x.shape[-1]


FEW_QUERIES = 8
"""The most queries per row whose attention the backend writes out."""


def _few_queries(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False) -> bool:
    """Whether an SDPA call (its arguments) is one `few_query_attention` covers."""
    return (
        q.ndim == 4
        and q.shape[2] <= FEW_QUERIES
        and isinstance(attn_mask, torch.Tensor)
        and attn_mask.dtype == torch.bool
        and attn_mask.ndim == 4
        and attn_mask.shape[1] == 1
        and attn_mask.shape[2] == q.shape[2]
        and dropout_p == 0.0
        and not is_causal
        and (enable_gqa or q.shape[1] == k.shape[1])
    )


def _sdpa_few_queries(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """`few_query_attention` called as SDPA is (what a rewritten graph node calls)."""
    return few_query_attention(q, k, v, attn_mask, scale)


def _several_rows(x, weight) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and x.dtype == weight.dtype == torch.float32
        and x.ndim >= 2
        and weight.ndim == 2
        and x.numel() > x.shape[-1]
    )


def _linear_parts(node: torch.fx.Node) -> tuple:
    """(x, weight, bias) of an `F.linear` node (nodes, or None for no bias)."""
    args, kwargs = node.args, node.kwargs
    weight = args[1] if len(args) > 1 else kwargs.get("weight")
    return args[0], weight, args[2] if len(args) > 2 else kwargs.get("bias")


def _example(n):
    return n.meta.get("example_value") if isinstance(n, torch.fx.Node) else n


def _shared_products(gm: torch.fx.GraphModule, inputs: list) -> dict:
    """The linears of several rows whose weight is a graph input, each mapped to the linears it shares
    one `mm` with, in graph order: the bias-free ones reading the same input together (a layer's
    q, k and v), any other alone."""
    groups: dict = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not F.linear:
            continue
        x, weight, bias = _linear_parts(node)
        if weight not in inputs or not _several_rows(_example(x), _example(weight)):
            continue
        groups.setdefault(x if bias is None else node, []).append(node)
    return {node: members for members in groups.values() for node in members}


def rewrite(gm: torch.fx.GraphModule) -> tuple[int, list[tuple[int, ...]]]:
    """Replace the one-row linears and few-query attention calls of a graph Dynamo captured (decided
    on each call's example values) by their written-out forms, and the linears of several rows whose
    weight is a graph input by `transposed_linear` on a new input per group of weights (bias-free
    linears of one input share it: one product, of which each reads its columns); returns (how many
    calls were replaced, for each new input in order the input indices of the weights whose
    transposes it holds side by side)."""
    replaced, copies, products = 0, {}, {}  # weights -> their copy's input; first linear -> (product, widths)
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    last_input = inputs[-1] if inputs else None
    shared = _shared_products(gm, inputs)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (F.linear, F.scaled_dot_product_attention):
            continue
        if node in shared:
            members = shared[node]
            if members[0] not in products:  # the first of its group: the one product, before it
                weights = tuple(_linear_parts(m)[1] for m in members)
                if weights not in copies:
                    with gm.graph.inserting_after(last_input):
                        name = "_".join(w.name for w in weights)
                        copies[weights] = last_input = gm.graph.placeholder(f"{name}_transposed")
                    # an input of no source in the user's code (AOTAutograd reads Dynamo's for each input)
                    last_input._dynamo_source = None
                x, _, bias = _linear_parts(node)
                with gm.graph.inserting_before(node):
                    product = gm.graph.call_function(transposed_linear, (x, copies[weights], bias))
                widths = [_example(w).shape[0] for w in weights]
                products[members[0]] = (product, widths)
            product, widths = products[members[0]]
            if len(members) == 1:
                new = product
            else:
                j = members.index(node)
                with gm.graph.inserting_before(node):
                    new = gm.graph.call_function(torch.narrow, (product, -1, sum(widths[:j]), widths[j]))
        else:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), _example)
            if node.target is F.linear and _one_row(args[0]):
                target = row_linear
            elif node.target is F.scaled_dot_product_attention and _few_queries(*args, **kwargs):
                target = _sdpa_few_queries
            else:
                continue
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(target, node.args, node.kwargs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.recompile()
    return replaced, [tuple(inputs.index(w) for w in weights) for weights in copies]


def _own_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule of a copy of `gm`'s graph over the same attributes, with what Dynamo and AOTAutograd
    read off a captured graph (its meta, parameter sources, each input's source)."""
    graph, nodes = torch.fx.Graph(), {}
    graph.output(graph.graph_copy(gm.graph, nodes))
    copy = torch.fx.GraphModule(gm, graph)
    copy.meta = dict(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source
    for old, new in nodes.items():
        if old.op == "placeholder" and hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return copy


_BACKENDS: dict = {}


def row_kernels_backend(inner="inductor", options: dict | None = None):
    """A `torch.compile` backend: `rewrite` each captured graph, then compile it with `inner` (inductor
    with its config `options`, or another backend's name or callable). One object per (inner,
    options): Dynamo keeps a compiled graph for the backend that compiled it, so every step (each
    `generate` call makes one) shares the graphs of the ones before."""
    key = (inner, repr(sorted((options or {}).items())))
    if key not in _BACKENDS:
        _BACKENDS[key] = _backend(inner, options)
    return _BACKENDS[key]


def _backend(inner, options: dict | None):
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        def compile_inner(gm, example_inputs):
            return compile_fx(gm, example_inputs, config_patches=options)

    else:
        compile_inner = torch._dynamo.lookup_backend(inner) if isinstance(inner, str) else inner

    def compile_graph(gm: torch.fx.GraphModule, example_inputs):
        gm = _own_copy(gm)  # Dynamo reads its graph's inputs after this returns: new ones go in a copy
        _, groups = rewrite(gm)
        if not groups:
            return compile_inner(gm, example_inputs)
        extra = TransposedWeights(groups)
        inner = compile_inner(gm, [*example_inputs, *extra(example_inputs)])

        def run(*args):
            return inner(*args, *extra(args))

        return run

    return compile_graph
