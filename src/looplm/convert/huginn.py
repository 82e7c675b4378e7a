"""Convert Huginn-0125 (github seal-rg/recurrent-pretraining, `recpre/raven_modeling_minimal.py`;
the Hugging Face release `tomg-group-umd/huginn-0125`) into a looplm checkpoint.

The source is a local Hugging Face folder: config.json (the RavenConfig fields), model.safetensors
or model.safetensors.index.json with its shards, tokenizer.json (+ tokenizer_config.json,
special_tokens_map.json). Its forward, as the source computes it:

  e = sqrt(d) * wte[x] (the source ignores init_values.embed_scale; one that differs is refused), then
  the prelude blocks;
  s0 ~ truncated normal, std = init_values.std * sqrt(d) (~0.632 for d = 5280), cut at +-3 std;
  each recurrence: s = adapter([s; e]) (Linear(2d -> d)), then the core blocks; no exit norm;
  after the loop s = ln_f(s) once, then the coda blocks, then ln_f again and the head;
  "sandwich" blocks: x = n2(x + attn(n1 x)); x = n4(x + mlp(n3 x));
  attention: one fused Wqkv (rows [q; k; v]), qk_bias [2, 1, heads, head_dim] added to q and k
  before RoPE, RoPE on interleaved channel pairs (2j, 2j+1), scale 1/sqrt(head_dim), no masks
  beyond causal; MLP: fc -> [gate; up] (halves of its output), silu(gate) * up -> proj;
  RMSNorm with a plain gain (weight, not an offset); tied embeddings (lm_head = wte).

Mapped onto looplm's switches (design §14): block_norm="sandwich", qk_bias, embed_scale,
tie_embeddings, injection="huginn-linear" with exit_norm="none", post_loop_norm, state_init=
"trunc-normal" with state_std. Tensor transforms: Wqkv is split into wq, wk, wv; the q/k rows and
the q/k bias are permuted per head from interleaved to half-split pairs (exact: scores unchanged);
fc is split into w1 (gate) and w3 (up); adapter [d, 2d] into A_state (columns :d) and A_input
(columns d:). The persistent `freqs_cis` buffer (cos/sin tables, bf16 in the release) is not read:
looplm computes the tables in fp32, so bf16 checkpoints differ from the source by that rounding.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from looplm.config import ModelConfig
from looplm.convert.common import (
    check_family,
    config_number,
    check_model,
    check_tied,
    check_vocab,
    interleaved_to_half_split,
    job_dict,
    open_source,
    read_checked,
    refuse,
    write_checkpoint,
)

FAMILY = "Huginn (RavenForCausalLM)"
# RavenConfig fields whose other values change the forward in ways looplm's model does not have:
# (field, accepted values); a field the config omits is not checked.
_REQUIRED = (
    ("block_class_name", ("SandwichBlock",)),
    ("mlp_class_name", ("GatedMLP",)),
    ("nonlin_name", ("SiLU",)),
    ("injection_type", ("linear",)),
    ("test_time_noise", (0, 0.0)),
    ("use_fused_head", (None, False, "pytorch")),
    ("qk_norm", (False,)),
)


def _get(config: dict, *names, default=None):
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return default


def _config(config: dict, tokenizer_vocab: int) -> tuple[ModelConfig, dict]:
    for name, allowed in _REQUIRED:
        if name in config and config[name] not in allowed:
            raise refuse(f"config.json {name} = {config[name]!r}: looplm converts only {name} in {list(allowed)}")
    try:
        d = int(_get(config, "n_embd", "hidden_size"))
        heads = int(_get(config, "n_heads", "num_attention_heads"))
        kv = int(_get(config, "num_key_value_heads", default=heads))
        n_prelude = int(config["n_layers_in_prelude"])
        n_core = int(config["n_layers_in_recurrent_block"])
        n_coda = int(config["n_layers_in_coda"])
        ffn = int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError) as err:
        raise refuse(f"config.json lacks a Huginn field or has a wrong type ({err}); not a Huginn config") from None
    head_dim = int(_get(config, "head_dim", default=d // max(heads, 1)))
    if heads < 1 or head_dim * heads != d:
        raise refuse(f"head_dim {head_dim} x n_heads {heads} != n_embd {d}: looplm derives head_dim = d / heads")
    if "n_layers" in config and int(config["n_layers"]) != n_prelude + n_core + n_coda:
        raise refuse(f"prelude {n_prelude} + core {n_core} + coda {n_coda} layers != n_layers {config['n_layers']}")
    qk_bias = bool(config.get("qk_bias", False))
    if qk_bias and kv != heads:
        raise refuse(
            f"qk_bias with {kv} key/value heads != {heads} query heads: the source adds one "
            "per-query-head bias to the keys, which needs as many key heads"
        )
    vocab = int(_get(config, "padded_vocab_size", "vocab_size", default=tokenizer_vocab))
    init = config.get("init_values") if isinstance(config.get("init_values"), dict) else {}
    # The source scales embeddings and the initial state by sqrt(n_embd) and ignores
    # init_values.embed_scale (since commit c1fbabc; earlier versions read it): a config whose value
    # differs would compute differently under the two, so it is refused rather than guessed.
    embed_scale = math.sqrt(d)
    given_scale = config_number(init, "embed_scale", embed_scale)
    if not math.isclose(given_scale, embed_scale, rel_tol=1e-6):
        raise refuse(
            f"config.json init_values.embed_scale = {given_scale:g} differs from sqrt(n_embd) = {embed_scale:g}: "
            "the source's current modeling code scales by sqrt(n_embd) and ignores the value (versions before "
            "its commit c1fbabc used it); set it to sqrt(n_embd), or remove it, to convert as the current code computes"
        )
    std = config_number(init, "std", math.sqrt(2 / (5 * d)))
    if not std > 0:
        raise refuse("init_values.std <= 0 (a zero initial state) has no looplm state_init; use init='zero'")
    mean_recurrence = config_number(config, "mean_recurrence", 32, int, positive=True)
    cfg = ModelConfig(
        vocab_size=vocab,
        d_model=d,
        n_heads=heads,
        n_kv_heads=kv,
        ffn_dim=ffn,
        n_prelude=n_prelude,
        n_core=n_core,
        n_coda=n_coda,
        max_seq_len=config_number(config, "block_size", 4096, int, positive=True),
        injection="huginn-linear",
        rope_base=config_number(config, "rope_base", 50_000.0, positive=True),
        norm_eps=config_number(config, "norm_eps", 1e-6),
        max_depth=max(64, 2 * mean_recurrence),
        block_norm="sandwich",
        qk_bias=qk_bias,
        embed_scale=embed_scale,
        tie_embeddings=bool(config.get("tie_embeddings", config.get("tie_word_embeddings", True))),
        exit_norm="none",
        post_loop_norm=True,
        head_norm=True,
        state_init="trunc-normal",
        state_std=std * embed_scale,
    )
    try:
        cfg.validate()
    except ValueError as err:
        raise refuse(f"config.json gives an invalid looplm shape: {err}") from None
    return cfg, {
        "mean_recurrence": mean_recurrence,
        "bias": bool(config.get("bias", False)),
        "block_size": cfg.max_seq_len,
    }


def _shapes(cfg: ModelConfig, bias: bool) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(required, optional) source tensor names and shapes."""
    d, hd, f, V = cfg.d_model, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
    req: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (V, d),
        "transformer.ln_f.weight": (d,),
        "transformer.adapter.weight": (d, 2 * d),
    }
    if bias:
        req["transformer.adapter.bias"] = (d,)
    for stack, n in (("prelude", cfg.n_prelude), ("core_block", cfg.n_core), ("coda", cfg.n_coda)):
        for i in range(n):
            p = f"transformer.{stack}.{i}."
            req.update({p + f"norm_{k}.weight": (d,) for k in (1, 2, 3, 4)})
            req.update(
                {
                    p + "attn.Wqkv.weight": ((cfg.n_heads + 2 * cfg.n_kv_heads) * hd, d),
                    p + "attn.proj.weight": (d, cfg.n_heads * hd),
                    p + "mlp.fc.weight": (2 * f, d),
                    p + "mlp.proj.weight": (d, f),
                }
            )
            if cfg.qk_bias:
                req[p + "attn.qk_bias"] = (2, 1, cfg.n_heads, hd)
    opt: dict[str, tuple[int, ...]] = {}
    if cfg.tie_embeddings:
        opt["lm_head.weight"] = (V, d)  # a tied release may store the shared matrix twice
    else:
        req["lm_head.weight"] = (V, d)
    return req, opt


def _map(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    d, hd, H, KV, f = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim
    out = {"embed.weight": state["transformer.wte.weight"], "norm.weight": state["transformer.ln_f.weight"]}
    if not cfg.tie_embeddings:
        out["head.weight"] = state["lm_head.weight"]
    w = state["transformer.adapter.weight"]  # acts on [s; e]
    out["injection.A_state.weight"] = w[:, :d]
    out["injection.A_input.weight"] = w[:, d:]
    out["injection.A_input.bias"] = state.get("transformer.adapter.bias", torch.zeros(d))
    for stack, name, n in (
        ("prelude", "prelude", cfg.n_prelude),
        ("core_block", "core", cfg.n_core),
        ("coda", "coda", cfg.n_coda),
    ):
        for i in range(n):
            p, q = f"transformer.{stack}.{i}.", f"{name}.{i}."
            wq, wk, wv = state[p + "attn.Wqkv.weight"].split([H * hd, KV * hd, KV * hd], dim=0)
            fc = state[p + "mlp.fc.weight"]
            out.update(
                {
                    q + "attn_norm.weight": state[p + "norm_1.weight"],
                    q + "attn_out_norm.weight": state[p + "norm_2.weight"],
                    q + "ffn_norm.weight": state[p + "norm_3.weight"],
                    q + "ffn_out_norm.weight": state[p + "norm_4.weight"],
                    q + "attn.wq.weight": interleaved_to_half_split(wq, H, hd),
                    q + "attn.wk.weight": interleaved_to_half_split(wk, KV, hd),
                    q + "attn.wv.weight": wv,
                    q + "attn.wo.weight": state[p + "attn.proj.weight"],
                    q + "ffn.w1.weight": fc[:f],
                    q + "ffn.w3.weight": fc[f:],
                    q + "ffn.w2.weight": state[p + "mlp.proj.weight"],
                }
            )
            if cfg.qk_bias:
                bias = state[p + "attn.qk_bias"]  # [2, 1, H, hd]: q bias, k bias
                out[q + "attn.q_bias"] = interleaved_to_half_split(bias[0, 0].reshape(H * hd), H, hd)
                out[q + "attn.k_bias"] = interleaved_to_half_split(bias[1, 0].reshape(KV * hd), KV, hd)
    return {k: v.contiguous() for k, v in out.items()}


def convert_huginn(src: Path, out: Path, dtype: str | None = None, *, data: str | None = None) -> Path:
    """Convert the Huginn folder `src` into the looplm checkpoint folder `out` (new or empty).

    `dtype`: 'fp32' (default; every bf16 value is an fp32 value) or 'bf16'. `data`: the held-out text
    source recorded in the checkpoint (what `looplm eval` reads; default the built-in text corpus). Raises CheckpointError
    (a ValueError) with a one-line reason for anything it cannot convert exactly."""
    src, out = Path(src), Path(out)
    check_family(src, "huginn")
    config, tokenizer, tok_note = open_source(src, out, dtype, "a Huginn folder")
    cfg, extra = _config(config, tokenizer.vocab_size)
    check_vocab(tokenizer, cfg)
    required, optional = _shapes(cfg, extra["bias"])
    optional["freqs_cis"] = (1, extra["block_size"], 1, cfg.head_dim // 2, 2)  # RoPE tables: recomputed
    state = read_checked(src, required, optional, family=FAMILY)
    check_tied(src, cfg, state, "lm_head.weight", "transformer.wte.weight")
    weights = _map(state, cfg)
    check_model(cfg, weights, src)
    job = job_dict(cfg, str(out.resolve()), extra["mean_recurrence"], data)
    provenance = {
        "from": "huginn",
        "source": str(src.resolve()),
        "rope": "interleaved pairs permuted to half-split",
        "release_mean_recurrence": extra["mean_recurrence"],
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
        "notes": [n for n in (tok_note,) if n]
        + [
            "initial state: truncated normal (std init_values.std * embed_scale, cut at +-3 std) as in the "
            "source, drawn from looplm's own generator/hash, so sampled states match only in distribution",
            "RoPE tables are computed in fp32; the release's stored freqs_cis buffer (bf16) is not read",
        ],
    }
    return write_checkpoint(out, weights, job, provenance, tokenizer, dtype)
