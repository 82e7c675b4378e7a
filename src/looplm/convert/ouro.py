"""Convert Ouro (ByteDance's looped LMs, Ouro-1.4B / Ouro-2.6B; `modeling_ouro.py` and
`configuration_ouro.py`, as copied in github LoopedLMs/ouro_rl) into a looplm checkpoint.

The source is a local Hugging Face folder: config.json (OuroConfig), model.safetensors or
model.safetensors.index.json with its shards, tokenizer.json (+ tokenizer_config.json,
special_tokens_map.json). Its forward, as the source computes it:

  h = embed_tokens[x] (no prelude, no coda, no injection: the state starts at the embedding);
  repeated total_ut_steps times: every layer in turn, then the final norm `model.norm` (with its
  gain), whose output feeds the next loop;
  layers with "branch" norms: h = h + n2(attn(n1 h)); h = h + n4(mlp(n3 h)) (input_layernorm,
  input_layernorm_2, post_attention_layernorm, post_attention_layernorm_2); attention with separate
  q/k/v/o projections, no biases, rotate-half RoPE (looplm's own half-split layout), scale
  1/sqrt(head_dim), grouped-query heads; SwiGLU MLP silu(gate) * up -> down;
  logits = lm_head(h) on the already normalised state;
  exit gate: lambda_r = sigmoid(early_exit_gate(h_r)) after every loop; exit rules in
  `looplm.model.exit_gate`.

Mapped onto looplm's switches (design §14): n_prelude = n_coda = 0, n_core = num_hidden_layers,
injection="none" with state_init="input", block_norm="branch", exit_norm="rms-gain" (the gain is
`model.norm.weight`), head_norm=False, exit_gate=True. No tensor is transformed. Ouro's cache keeps
one K/V slot per (loop, layer): looplm's full cache.
"""

from __future__ import annotations

from pathlib import Path

import torch

from looplm.config import ModelConfig
from looplm.convert.common import (
    check_family,
    config_number,
    check_model,
    check_tied,
    check_vocab,
    job_dict,
    open_source,
    read_checked,
    refuse,
    write_checkpoint,
)

FAMILY = "Ouro (OuroForCausalLM)"


def _config(config: dict) -> tuple[ModelConfig, dict]:
    if config.get("model_type") not in (None, "ouro"):
        raise refuse(f"config.json model_type = {config.get('model_type')!r}: not an Ouro config")
    if config.get("hidden_act", "silu") != "silu":
        raise refuse(f"config.json hidden_act = {config['hidden_act']!r}: looplm converts only silu (SwiGLU)")
    # transformers < 5 writes rope_theta and rope_scaling; 5 writes both into rope_parameters
    rope = {"rope_theta": config.get("rope_theta", 10000.0)}
    for key in ("rope_scaling", "rope_parameters"):
        given = config.get(key)
        if given in (None, {}):
            continue
        if not isinstance(given, dict) or given.get("rope_type", given.get("type", "default")) != "default":
            raise refuse(f"config.json {key} = {given!r}: looplm converts only plain RoPE")
        rope.update({k: v for k, v in given.items() if k == "rope_theta"})
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise refuse("config.json asks for attention/MLP biases: looplm's Ouro blocks have none")
    try:
        d = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        n_layers = int(config["num_hidden_layers"])
        ffn = int(config["intermediate_size"])
        vocab = int(config["vocab_size"])
    except (KeyError, TypeError, ValueError) as err:
        raise refuse(f"config.json lacks an Ouro field or has a wrong type ({err}); not an Ouro config") from None
    layer_types = config.get("layer_types") or []
    if config.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        raise refuse("config.json uses sliding-window attention: looplm converts only full attention")
    if layer_types and len(layer_types) != n_layers:
        raise refuse(f"config.json layer_types has {len(layer_types)} entries for {n_layers} layers")
    head_dim = int(config.get("head_dim") or d // max(heads, 1))
    if heads < 1 or head_dim * heads != d:
        raise refuse(
            f"head_dim {head_dim} x num_attention_heads {heads} != hidden_size {d}: looplm derives head_dim = d / heads"
        )
    steps = config_number(config, "total_ut_steps", 4, int, positive=True)
    cfg = ModelConfig(
        vocab_size=vocab,
        d_model=d,
        n_heads=heads,
        n_kv_heads=kv,
        ffn_dim=ffn,
        n_prelude=0,
        n_core=n_layers,
        n_coda=0,
        max_seq_len=config_number(config, "max_position_embeddings", 32768, int, positive=True),
        injection="none",
        rope_base=config_number(rope, "rope_theta", 10000.0, positive=True),
        norm_eps=config_number(config, "rms_norm_eps", 1e-6),
        max_depth=max(64, steps),
        block_norm="branch",
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        exit_norm="rms-gain",
        head_norm=False,
        state_init="input",
        exit_gate=True,
    )
    try:
        cfg.validate()
    except ValueError as err:
        raise refuse(f"config.json gives an invalid looplm shape: {err}") from None
    return cfg, {"total_ut_steps": steps, "early_exit_threshold": config.get("early_exit_threshold")}


def _shapes(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    d, hd, f, V = cfg.d_model, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
    req: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (V, d),
        "model.norm.weight": (d,),
        "model.early_exit_gate.weight": (1, d),
        "model.early_exit_gate.bias": (1,),
    }
    for i in range(cfg.n_core):
        p = f"model.layers.{i}."
        req.update(
            {
                p + n + ".weight": (d,)
                for n in (
                    "input_layernorm",
                    "input_layernorm_2",
                    "post_attention_layernorm",
                    "post_attention_layernorm_2",
                )
            }
        )
        q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
        req.update(
            {
                p + "self_attn.q_proj.weight": (q, d),
                p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d),
                p + "self_attn.o_proj.weight": (d, q),
                p + "mlp.gate_proj.weight": (f, d),
                p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f),
            }
        )
    opt: dict[str, tuple[int, ...]] = {}
    (opt if cfg.tie_embeddings else req)["lm_head.weight"] = (V, d)
    return req, opt


def _map(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {
        "embed.weight": state["model.embed_tokens.weight"],
        "injection.exit_norm.weight": state["model.norm.weight"],  # applied after every loop
        "exit_gate.proj.weight": state["model.early_exit_gate.weight"],
        "exit_gate.proj.bias": state["model.early_exit_gate.bias"],
    }
    if not cfg.tie_embeddings:
        out["head.weight"] = state["lm_head.weight"]
    for i in range(cfg.n_core):
        p, q = f"model.layers.{i}.", f"core.{i}."
        out.update(
            {
                q + "attn_norm.weight": state[p + "input_layernorm.weight"],
                q + "attn_out_norm.weight": state[p + "input_layernorm_2.weight"],
                q + "ffn_norm.weight": state[p + "post_attention_layernorm.weight"],
                q + "ffn_out_norm.weight": state[p + "post_attention_layernorm_2.weight"],
                **{q + f"attn.w{x}.weight": state[p + f"self_attn.{x}_proj.weight"] for x in "qkvo"},
                q + "ffn.w1.weight": state[p + "mlp.gate_proj.weight"],  # silu(gate x) * up x -> down
                q + "ffn.w3.weight": state[p + "mlp.up_proj.weight"],
                q + "ffn.w2.weight": state[p + "mlp.down_proj.weight"],
            }
        )
    return {k: v.contiguous() for k, v in out.items()}


def convert_ouro(src: Path, out: Path, dtype: str | None = None, *, data: str | None = None) -> Path:
    """Convert the Ouro folder `src` into the looplm checkpoint folder `out` (new or empty).

    `dtype`: 'fp32' (default; every bf16 value is an fp32 value) or 'bf16'. `data`: the held-out text
    source recorded in the checkpoint (what `looplm eval` reads; default the built-in text corpus). Raises CheckpointError
    (a ValueError) with a one-line reason for anything it cannot convert exactly."""
    src, out = Path(src), Path(out)
    check_family(src, "ouro")
    config, tokenizer, tok_note = open_source(src, out, dtype, "an Ouro folder")
    cfg, extra = _config(config)
    check_vocab(tokenizer, cfg)
    required, optional = _shapes(cfg)
    state = read_checked(src, required, optional, family=FAMILY)
    check_tied(src, cfg, state, "lm_head.weight", "model.embed_tokens.weight")
    weights = _map(state, cfg)
    check_model(cfg, weights, src)
    job = job_dict(cfg, str(out.resolve()), extra["total_ut_steps"], data)
    provenance = {
        "from": "ouro",
        "source": str(src.resolve()),
        "rope": "rotate-half (looplm's layout), unchanged",
        "release_total_ut_steps": extra["total_ut_steps"],
        "release_early_exit_threshold": extra["early_exit_threshold"],
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
        "notes": [n for n in (tok_note,) if n]
        + [
            "initial state: the embedding itself (state_init='input'); the exit gate's rules live in "
            "looplm.model.exit_gate (the plain forward exits at the requested depth)"
        ],
    }
    return write_checkpoint(out, weights, job, provenance, tokenizer, dtype)
