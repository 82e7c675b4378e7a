"""Convert Parcae (github sandyresearch/parcae: looped LMs of 140M-1.3B parameters;
`parcae_lm/models/parcae/{parcae,config}.py`, `parcae_lm/modules/{mixer,mlp,basic,injection,norms}.py`)
into a looplm checkpoint.

The release publishes its weights as pickles (pytorch_model.bin / model.pt), which looplm never
unpickles: the source folder holds the same state dict saved as safetensors (`model.safetensors`,
or shards with model.safetensors.index.json), config.json (the ParcaeConfig dict, with
`_class_name`) and tokenizer.json (<|bos|>, <|eos|>, <|pad|>). Its forward, as the source computes it:

  e = wte[x]; prelude blocks; e~ = ln_prelude(e) (prelude_norm);
  s^0: truncated normal (+-3 std) with std sqrt(2/(5d)) ("like-init", scaled-zero init);
  repeated R times: s = exp(-softplus(dt_bias) exp(A_log)) * s + softplus(dt_bias) * (B e~), then the
  core blocks; no exit norm; the coda reads C(s^R) (bias-free d x d), then ln_f and the tied head;
  blocks: pre-norm, h = x + c_proj(attn(norm_1 x)); out = h + proj(0.5 relu(fc(norm_2 h))^2);
  attention: q, k, v from n = norm_1 x; in a block with a value embedding v += 2 sigmoid(ve_gate(n[..., :32]))
  * value_embeds.i[x] per kv head; interleaved RoPE; gain-free rms_norm of q and k (qk_norm, eps = fp32
  machine eps); scale 1/sqrt(head_dim);
  value embeddings: `value_embeds.i` indexed over the P + K + C distinct blocks (prelude i, core P + j,
  coda P + K + i; core tables shared by every recurrence); a block uses one iff it has both its table
  and its gate (`attn.ve_gate`). In the released configs these are the odd blocks of each stack.

Mapped onto looplm's switches (design §14): injection="parcae-decay" (prelude_norm = ln_prelude,
dt_raw = dt_bias, W = B; "parcae-nonorm" without ln_prelude), exit_norm="none", coda_proj (C),
ffn_act="relu2" (the 1/2 folded into w2), qk_norm, value_embeds="odd", tied head,
state_init="trunc-normal" with state_std sqrt(2/(5d)). q/k rows are permuted from interleaved to
looplm's half-split RoPE layout (the gain-free q/k norm is permutation invariant).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from looplm.config import VALUE_GATE_CHANNELS, ModelConfig
from looplm.convert.common import (
    check_family,
    config_number,
    check_folders,
    check_model,
    check_tied,
    check_vocab,
    hf_tokenizer,
    interleaved_to_half_split,
    job_dict,
    read_checked,
    read_json,
    refuse,
    refuse_pickles,
    write_checkpoint,
)

FAMILY = "Parcae"
STACKS = (("prelude", "transformer.prelude"), ("core", "transformer.core_block"), ("coda", "transformer.coda"))


def _source_has_ve(layer_idx: int, n_layer: int) -> bool:
    """mixer.has_ve: alternating, the last layer always included."""
    return layer_idx % 2 == (n_layer - 1) % 2


def _config(config: dict) -> tuple[ModelConfig, dict]:
    name = config.get("_class_name", config.get("model_class_name", "Parcae"))
    if name not in ("Parcae", "ParcaeConfig") or config.get("model_class_name", "Parcae") != "Parcae":
        raise refuse(f"config.json _class_name = {name!r}: not a Parcae config")
    checks = {  # key: (the released value looplm converts, the source's default for an absent key)
        "injection_type": ("diagonal", "diagonal"),
        "block_class_name": ("TransformerPreNormBlock", "TransformerPreNormBlock"),
        "norm_class_name": ("RMSNorm", "LayerNorm"),
        "mlp_class_name": ("BaseMLP", "BaseMLP"),
        "nonlin_name": ("ReLU2", "GELU"),
        "state_init": ("like-init", "like-init"),
    }
    for key, (want, default) in checks.items():
        if config.get(key, default) != want:
            given = f"{config[key]!r}" if key in config else f"absent (the source's default {default!r})"
            raise refuse(f"config.json {key} = {given}: looplm converts only Parcae's {want!r}")
    for key in ("bias", "qk_bias"):
        if config.get(key):
            raise refuse(f"config.json {key} = true: looplm's Parcae blocks have no biases")
    for key in ("clip_qkv", "logit_softcap", "randomize_positions_from"):
        if config.get(key) is not None:
            raise refuse(f"config.json {key} = {config[key]!r}: looplm converts only the released setting None")
    if config.get("init_strategy", "scaled") not in ("scaled-zero", "scaled-stuck"):
        given = (
            f"{config['init_strategy']!r}" if "init_strategy" in config else "absent (the source's default 'scaled')"
        )
        raise refuse(
            f"config.json init_strategy = {given}: its embedding/logit scales are not "
            "mapped (looplm converts scaled-zero and scaled-stuck)"
        )
    if int(config.get("mup_model_scaling_factor", 1)) != 1:
        raise refuse("config.json mup_model_scaling_factor != 1: its width/logit scaling is not mapped")
    try:
        d = int(config["n_embd"])
        heads = int(config["num_attention_heads"])
        kv = int(config.get("num_key_value_heads") or heads)
        ffn = int(config["intermediate_size"])
        vocab = int(config["vocab_size"])
        multiple = int(config.get("padding_multiple", 512))
        padded = int(config.get("padded_vocab_size") or -(-vocab // multiple) * multiple)
        P, K, C = (int(config[k]) for k in ("n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda"))
        steps = int(config.get("mean_recurrence", 32))
        backprop = int(config.get("mean_backprop_depth", 8))
    except (KeyError, TypeError, ValueError) as err:
        raise refuse(f"config.json lacks a Parcae field or has a wrong type ({err}); not a Parcae config") from None
    for key, value in (("mean_recurrence", steps), ("mean_backprop_depth", backprop)):
        if value < 1:
            raise refuse(f"config.json {key} = {value}: must be >= 1")
    if kv != heads:
        raise refuse(
            f"config.json num_key_value_heads {kv} != num_attention_heads {heads}: Parcae's core always "
            "uses full heads, so looplm converts only multi-head attention"
        )
    rec = {
        "recurrent_embedding_dimension": d,
        "recurrent_intermediation_embedding_dimension": ffn,
        "recurrent_num_attention_heads": heads,
    }
    for key, want in rec.items():
        if config.get(key) is not None and int(config[key]) != want:
            raise refuse(
                f"config.json {key} = {config[key]} differs from the prelude/coda's {want}: looplm's core "
                "has the width of the other blocks"
            )
    rope = config.get("rope_settings") or {}
    if not isinstance(rope, dict):
        raise refuse(f"config.json rope_settings = {rope!r} is not an object")
    if not rope.get("use_rope", True) or int(rope.get("rope_condense_ratio", 1)) != 1:
        raise refuse("config.json rope_settings turns RoPE off or condenses positions: looplm converts only plain RoPE")
    cfg = ModelConfig(
        vocab_size=padded,
        d_model=d,
        n_heads=heads,
        n_kv_heads=kv,
        ffn_dim=ffn,
        n_prelude=P,
        n_core=K,
        n_coda=C,
        max_seq_len=config_number(config, "block_size", 4096, int, positive=True),
        injection="parcae-decay" if config.get("prelude_norm", False) else "parcae-nonorm",
        rope_base=config_number(rope, "rope_base", 50_000, positive=True),
        norm_eps=config_number(config, "norm_eps", 1e-5),
        max_depth=max(64, steps),
        tie_embeddings=bool(config.get("tie_embeddings", False)),
        exit_norm="none",
        state_init="trunc-normal",
        state_std=math.sqrt(2 / (5 * d)),
        ffn_act="relu2",
        qk_norm=bool(config.get("qk_norm", False)),
        value_embeds="odd",
        coda_proj=True,
    )
    if d < VALUE_GATE_CHANNELS:
        raise refuse(f"config.json n_embd {d} < {VALUE_GATE_CHANNELS}: the value-embedding gate reads 32 channels")
    try:
        cfg.validate()
    except ValueError as err:
        raise refuse(f"config.json gives an invalid looplm shape: {err}") from None
    # which blocks the source builds a table / a gate for (parcae.py, mixer.py)
    n_eff, n_layer = P + K + C, K * backprop
    tables = {i for i in range(n_eff) if _source_has_ve(i, n_eff)}
    layer_ids = [i for i in range(P)] + [P + j for j in range(K)] + [P + K * steps + i for i in range(C)]
    gates = {i for i, lid in enumerate(layer_ids) if _source_has_ve(lid, n_layer)}
    return cfg, {"steps": steps, "tables": tables, "gates": gates}


def _block_names(cfg: ModelConfig) -> list[tuple[str, int, str, int]]:
    """(looplm stack, index in stack, source prefix, flat block index) of every block."""
    out, flat = [], 0
    for (stack, prefix), n in zip(STACKS, (cfg.n_prelude, cfg.n_core, cfg.n_coda)):
        for i in range(n):
            out.append((stack, i, f"{prefix}.{i}.", flat))
            flat += 1
    return out


def _shapes(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    d, f, V = cfg.d_model, cfg.ffn_dim, cfg.vocab_size
    kv_dim = cfg.n_kv_heads * cfg.head_dim
    req: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (V, d),
        "transformer.ln_f.weight": (d,),
        "transformer.C.weight": (d, d),
        "transformer.adapter.A_log": (d,),
        "transformer.adapter.dt_bias": (d,),
        "transformer.adapter.B": (d, d),
    }
    if cfg.injection == "parcae-decay":
        req["transformer.ln_prelude.weight"] = (d,)
    opt: dict[str, tuple[int, ...]] = {}
    for _, _, p, flat in _block_names(cfg):
        req.update(
            {
                p + "norm_1.weight": (d,),
                p + "norm_2.weight": (d,),
                p + "attn.c_q.weight": (d, d),
                p + "attn.c_k.weight": (kv_dim, d),
                p + "attn.c_v.weight": (kv_dim, d),
                p + "attn.c_proj.weight": (d, d),
                p + "mlp.fc.weight": (f, d),
                p + "mlp.proj.weight": (d, f),
            }
        )
        opt[p + "attn.ve_gate.weight"] = (cfg.n_kv_heads, VALUE_GATE_CHANNELS)
        opt[f"value_embeds.{flat}.weight"] = (V, kv_dim)
    (opt if cfg.tie_embeddings else req)["lm_head.weight"] = (V, d)
    return req, opt


def _check_value_embeds(src: Path, cfg: ModelConfig, state: dict, extra: dict) -> None:
    """Every table has its gate and vice versa; they sit where config.json puts them, on the odd blocks
    of each stack (looplm's value_embeds="odd")."""
    blocks = _block_names(cfg)
    for stack, i, p, flat in blocks:
        table, gate = f"value_embeds.{flat}.weight", p + "attn.ve_gate.weight"
        if (table in state) != (gate in state):
            have, lack = (table, gate) if table in state else (gate, table)
            raise refuse(f"{src}: {have} has no partner {lack} (a value embedding needs its table and its gate)")
    tables = {flat for _, _, _, flat in blocks if f"value_embeds.{flat}.weight" in state}
    gates = {flat for _, _, p, flat in blocks if p + "attn.ve_gate.weight" in state}
    if tables != extra["tables"] or gates != extra["gates"]:
        raise refuse(
            f"{src}: value embeddings on blocks {sorted(tables)}, config.json implies tables "
            f"{sorted(extra['tables'])} and gates {sorted(extra['gates'])}"
        )
    odd = {flat for stack, i, _, flat in blocks if cfg.has_value_embed(i)}
    if tables != odd:
        raise refuse(
            f"{src}: value embeddings on flat blocks {sorted(tables)}, looplm maps only the odd blocks of "
            f"each stack ({sorted(odd)})"
        )


def _map(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    H, hd = cfg.n_heads, cfg.head_dim
    out = {
        "embed.weight": state["transformer.wte.weight"],
        "norm.weight": state["transformer.ln_f.weight"],
        "coda_proj.weight": state["transformer.C.weight"],
        "injection.dt_raw": state["transformer.adapter.dt_bias"],
        "injection.A_log": state["transformer.adapter.A_log"],
        "injection.W.weight": state["transformer.adapter.B"],
    }
    if cfg.injection == "parcae-decay":
        out["injection.prelude_norm.weight"] = state["transformer.ln_prelude.weight"]
    if not cfg.tie_embeddings:
        out["head.weight"] = state["lm_head.weight"]
    for stack, i, p, flat in _block_names(cfg):
        q = f"{stack}.{i}."
        out.update(
            {
                q + "attn_norm.weight": state[p + "norm_1.weight"],
                q + "ffn_norm.weight": state[p + "norm_2.weight"],
                q + "attn.wq.weight": interleaved_to_half_split(state[p + "attn.c_q.weight"], H, hd),
                q + "attn.wk.weight": interleaved_to_half_split(state[p + "attn.c_k.weight"], cfg.n_kv_heads, hd),
                q + "attn.wv.weight": state[p + "attn.c_v.weight"],
                q + "attn.wo.weight": state[p + "attn.c_proj.weight"],
                q + "ffn.w1.weight": state[p + "mlp.fc.weight"],
                q + "ffn.w2.weight": 0.5 * state[p + "mlp.proj.weight"],  # Relu2's mul(0.5) folded in
            }
        )
        if cfg.has_value_embed(i):
            out[q + "attn.ve_gate.weight"] = state[p + "attn.ve_gate.weight"]
            out[f"value_embeds.{stack}.{i}.weight"] = state[f"value_embeds.{flat}.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _tokenizer(src: Path, config: dict):
    """The release tokenizer; eos/pad fall back to <|eos|>/<|pad|> when nothing names them."""
    from tokenizers import Tokenizer as HFTokenizer

    names = dict(config)
    if (src / "tokenizer.json").is_file():
        try:
            backend = HFTokenizer.from_file(str(src / "tokenizer.json"))
        except Exception as err:  # tokenizers raises its own error types
            raise refuse(f"{src}: cannot read tokenizer.json ({err})") from None
        for key, token in (("eos_token_id", "<|eos|>"), ("pad_token_id", "<|pad|>")):
            if names.get(key) is None and backend.token_to_id(token) is not None:
                names[key] = backend.token_to_id(token)
    return hf_tokenizer(src, names)


def convert_parcae(src: Path, out: Path, dtype: str | None = None, *, data: str | None = None) -> Path:
    """Convert the Parcae folder `src` (its state dict saved as safetensors) into the looplm checkpoint
    folder `out` (new or empty). `dtype`: 'fp32' (default) or 'bf16'. `data`: the held-out text source
    recorded in the job. Raises CheckpointError (a ValueError) with a one-line reason for anything it
    cannot convert exactly."""
    src, out = Path(src), Path(out)
    check_family(src, "parcae")
    check_folders(src, out, dtype)
    refuse_pickles(src)
    config = read_json(src / "config.json", "a Parcae folder")
    tokenizer, tok_note = _tokenizer(src, config)
    cfg, extra = _config(config)
    check_vocab(tokenizer, cfg)
    required, optional = _shapes(cfg)
    state = read_checked(src, required, optional, family=FAMILY, ignore=("freqs_cis",))
    check_tied(src, cfg, state, "lm_head.weight", "transformer.wte.weight")
    _check_value_embeds(src, cfg, state, extra)
    weights = _map(state, cfg)
    check_model(cfg, weights, src)
    job = job_dict(cfg, str(out.resolve()), extra["steps"], data)
    provenance = {
        "from": "parcae",
        "source": str(src.resolve()),
        "rope": "interleaved pairs -> half-split (q/k rows permuted per head)",
        "release_mean_recurrence": extra["steps"],
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
        "notes": [n for n in (tok_note,) if n]
        + [
            "ReLU^2 MLP: the factor 1/2 is folded into ffn.w2",
            "initial state: truncated normal (+-3 std) with std sqrt(2/(5d)), as the source's like-init",
        ],
    }
    return write_checkpoint(out, weights, job, provenance, tokenizer, dtype)
