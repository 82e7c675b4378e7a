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


class TransposedWeights:
    """The extra inputs of a rewritten graph: for each of its inputs `indices` (weights), a contiguous
    transposed copy, made on the first call and again whenever that input is another tensor object or
    was changed in place (its version counter moved: an optimizer step, `load_state_dict`); a tensor
    without a version counter (made under inference mode) is transposed on every call."""

    def __init__(self, indices: list[int]):
        self.indices = indices
        self._made: list[tuple | None] = [None] * len(indices)  # (weakref to the weight, its version)
        self._copies: list[torch.Tensor | None] = [None] * len(indices)

    def __call__(self, args) -> list[torch.Tensor]:
        out = []
        for j, i in enumerate(self.indices):
            weight, made = args[i], self._made[j]
            try:
                version = weight._version
            except RuntimeError:  # an inference tensor: no version counter, so no way to know it is unchanged
                version = None
            if version is None or made is None or made[0]() is not weight or made[1] != version:
                self._copies[j] = weight.detach().t().contiguous()
                self._made[j] = None if version is None else (weakref.ref(weight), version)
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


def _one_row(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.numel() == x.shape[-1]


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


def rewrite(gm: torch.fx.GraphModule) -> tuple[int, list[int]]:
    """Replace the one-row linears and few-query attention calls of a graph Dynamo captured (decided
    on each call's example values) by their written-out forms, and the linears of several rows whose
    weight is a graph input by `transposed_linear` on a new input appended per weight;
    returns (how many calls were replaced, the input indices of the weights whose transposes the new
    inputs are, in their order)."""
    replaced, transposed = 0, {}  # weight placeholder -> its transpose's placeholder
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    last_input = inputs[-1] if inputs else None
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (F.linear, F.scaled_dot_product_attention):
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("example_value"))
        new_args, new_kwargs = node.args, node.kwargs
        if node.target is F.linear:
            weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            if isinstance(args[0], torch.Tensor) and _one_row(args[0]):
                target = row_linear
            elif weight in inputs and _several_rows(args[0], weight.meta.get("example_value")):
                if weight not in transposed:
                    with gm.graph.inserting_after(last_input):
                        transposed[weight] = last_input = gm.graph.placeholder(f"{weight.name}_transposed")
                    # an input of no source in the user's code (AOTAutograd reads Dynamo's for each input)
                    last_input._dynamo_source = None
                bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
                target, new_args, new_kwargs = transposed_linear, (node.args[0], transposed[weight], bias), {}
            else:
                continue
        elif _few_queries(*args, **kwargs):
            target = _sdpa_few_queries
        else:
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(target, new_args, new_kwargs)
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        replaced += 1
    if replaced:
        gm.recompile()
    return replaced, [inputs.index(w) for w in transposed]


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
        _, indices = rewrite(gm)
        if not indices:
            return compile_inner(gm, example_inputs)
        extra = TransposedWeights(indices)
        inner = compile_inner(gm, [*example_inputs, *extra(example_inputs)])

        def run(*args):
            return inner(*args, *extra(args))

        return run

    return compile_graph
