"""`looplm convert --from parcae`: Parcae (sandyresearch/parcae; parcae_lm/models/parcae/parcae.py) -> looplm.

Each test builds a tiny random checkpoint in the source's layout (the Parcae state dict saved as
safetensors: transformer.{wte, prelude.i, adapter.{A_log, dt_bias, B}, core_block.j, C, coda.i, ln_f,
ln_prelude}, value_embeds.i on the blocks the source gives a table, attn.ve_gate on those with a gate,
the freqs_cis buffer, tied head; config.json with the ParcaeConfig fields; tokenizer.json with
<|bos|>, <|eos|>, <|pad|>). The converted model's logits are compared with a reference forward written
here from the source's equations (interleaved RoPE, ReLU^2 with its 1/2, q/k rms norm, gated value
embeddings, diagonal injection, C before the coda), not with looplm's code.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _jobs import assert_full_cache_decodes_like_the_forward, read_hf_weights, write_hf_weights
from test_convert_huginn import hf_tokenizer

from looplm.checkpoint import CheckpointError, load_model
from looplm.convert import convert_parcae
from looplm.infer.cache import make_cache
from looplm.infer.extend import extend
from looplm.model import StateStart

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread

D, HEADS, FFN, P, K, C, STEPS, BACKPROP = 64, 4, 96, 2, 2, 2, 4, 2
HD = D // HEADS
BLOCK = 64
SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")


def parcae_config(vocab: int, **overrides) -> dict:
    config = {  # the ParcaeConfig fields of parcae-small-140m, scaled down
        "_class_name": "ParcaeConfig",
        "name": "parcae-tiny",
        "block_size": BLOCK,
        "vocab_size": vocab,
        "padding_multiple": 64,
        "padded_vocab_size": vocab,
        "n_embd": D,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "intermediate_size": FFN,
        "bias": False,
        "tie_embeddings": True,
        "architecture_class_name": "Parcae",
        "block_class_name": "TransformerPreNormBlock",
        "norm_class_name": "RMSNorm",
        "norm_eps": 1e-5,
        "mlp_class_name": "BaseMLP",
        "nonlin_name": "ReLU2",
        "qk_norm": True,
        "qk_bias": False,
        "clip_qkv": None,
        "logit_softcap": None,
        "prelude_norm": True,
        "init_strategy": "scaled-zero",
        "init_orthogonal": True,
        "injection_type": "diagonal",
        "state_init": "like-init",
        "recurrent_embedding_dimension": D,
        "recurrent_intermediation_embedding_dimension": FFN,
        "recurrent_num_attention_heads": None,
        "n_layers_in_recurrent_block": K,
        "n_layers_in_prelude": P,
        "n_layers_in_coda": C,
        "mean_recurrence": STEPS,
        "sampling_scheme": "poisson-truncated-full",
        "mean_backprop_depth": BACKPROP,
        "recurrent_iteration_method": "per-sequence",
        "model_class_name": "Parcae",
        "mup_model_scaling_factor": 1,
        "rope_settings": {"use_rope": True, "rope_condense_ratio": 1, "rope_base": 50000},
    }
    config.update(overrides)
    return config


def _blocks():
    """(source prefix, flat value-embedding index, has value embedding) per block."""
    out = []
    for stack, n, offset in (("prelude", P, 0), ("core_block", K, P), ("coda", C, P + K)):
        out += [(f"transformer.{stack}.{i}.", offset + i, i % 2 == 1) for i in range(n)]
    return out


def parcae_state(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.2, mean=0.0):
        return (mean + torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    state = {
        "transformer.wte.weight": rnd(vocab, D, std=1.0),
        "transformer.ln_f.weight": rnd(D, mean=1.0, std=0.1),
        "transformer.ln_prelude.weight": rnd(D, mean=1.0, std=0.1),
        "transformer.adapter.A_log": rnd(D, std=0.5),
        "transformer.adapter.dt_bias": rnd(D, std=0.5),
        "transformer.adapter.B": rnd(D, D),
        "transformer.C.weight": rnd(D, D, std=0.2),
    }
    for p, flat, ve in _blocks():
        state.update(
            {
                p + "norm_1.weight": rnd(D, mean=1.0, std=0.1),
                p + "norm_2.weight": rnd(D, mean=1.0, std=0.1),
                p + "attn.c_q.weight": rnd(D, D),
                p + "attn.c_k.weight": rnd(D, D),
                p + "attn.c_v.weight": rnd(D, D),
                p + "attn.c_proj.weight": rnd(D, D),
                p + "mlp.fc.weight": rnd(FFN, D),
                p + "mlp.proj.weight": rnd(D, FFN),
            }
        )
        if ve:
            state[p + "attn.ve_gate.weight"] = rnd(HEADS, 32, std=0.5)
            state[f"value_embeds.{flat}.weight"] = rnd(vocab, D, std=0.5)
    inv = 1.0 / (50000 ** (torch.arange(0, HD, 2).float() / HD))
    freqs = torch.outer(torch.arange(BLOCK).float(), inv)
    state["freqs_cis"] = torch.stack([freqs.cos()[None, :, None], freqs.sin()[None, :, None]], dim=4)
    return state


def make_parcae(root: Path, *, mutate=None, sharded: bool = True, **overrides) -> Path:
    root.mkdir(parents=True)
    tok = hf_tokenizer(SPECIALS)
    tok.save(str(root / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    config = parcae_config(vocab, **overrides)
    state = parcae_state(vocab)
    if mutate:
        mutate(state)
    write_hf_weights(root, state, 2 if sharded else 1)
    (root / "config.json").write_text(json.dumps(config))
    return root


# -- the source's forward, from its equations ---------------------------------------------------
def load_source(root: Path) -> dict:
    w = read_hf_weights(root)
    return w


def _rms(t, w=None, eps=1e-5):
    y = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def _rope_interleaved(t, start=0):  # t [B, L, H, hd] at positions start..: pairs (2j, 2j+1) rotate by p * b^(-2j/hd)
    L = t.shape[1]
    inv = 1.0 / (50000 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    ang = torch.arange(start, start + L, dtype=torch.float64)[:, None] * inv
    c, s = ang.cos()[None, :, None], ang.sin()[None, :, None]
    a, b = t[..., 0::2], t[..., 1::2]
    return torch.stack((a * c - b * s, b * c + a * s), -1).flatten(-2)


def _block(h, w, p, flat, x, past=None, qk_norm=True):
    """One block over the chunk h [B, L, D] (tokens x); `past` = (K, V) [B, P, H, HD] of P earlier
    tokens (K after RoPE and the q/k norm) that the chunk, at positions P.., also attends to.
    Returns (output, (K, V) of the past and the chunk)."""
    B, L, _ = h.shape
    start = 0 if past is None else past[0].shape[1]
    n = _rms(h, w[p + "norm_1.weight"])
    q = (n @ w[p + "attn.c_q.weight"].T).view(B, L, HEADS, HD)
    k = (n @ w[p + "attn.c_k.weight"].T).view(B, L, HEADS, HD)
    v = (n @ w[p + "attn.c_v.weight"].T).view(B, L, HEADS, HD)
    if p + "attn.ve_gate.weight" in w:
        gate = 2 * torch.sigmoid(n[..., :32] @ w[p + "attn.ve_gate.weight"].T)  # [B, L, H_kv]
        v = v + gate[..., None] * w[f"value_embeds.{flat}.weight"][x].view(B, L, HEADS, HD)
    eps = torch.finfo(torch.float32).eps
    q, k = _rope_interleaved(q, start), _rope_interleaved(k, start)
    if qk_norm:
        q, k = _rms(q, eps=eps), _rms(k, eps=eps)
    if past is not None:
        k, v = torch.cat([past[0], k], 1), torch.cat([past[1], v], 1)
    att = torch.einsum("blhd,bmhd->bhlm", q, k) / math.sqrt(HD)
    att = att.masked_fill(~torch.ones(L, start + L, dtype=torch.bool).tril(start), float("-inf")).softmax(-1)
    y = torch.einsum("bhlm,bmhd->blhd", att, v).reshape(B, L, D)
    h = h + y @ w[p + "attn.c_proj.weight"].T
    n2 = _rms(h, w[p + "norm_2.weight"])
    return h + (0.5 * F.relu(n2 @ w[p + "mlp.fc.weight"].T).pow(2)) @ w[p + "mlp.proj.weight"].T, (k, v)


def reference(
    w: dict, x: torch.Tensor, state0: torch.Tensor, steps: int, kept: dict | None = None, qk_norm: bool = True
) -> torch.Tensor:
    """Logits of the tokens x at `steps` recurrences from the initial state `state0`. With `kept`
    ({block: (K, V) of the earlier tokens}, updated in place) the chunk attends to earlier tokens as
    a terminal cache holds them: every block's K/V of each token, the core blocks' from the token's
    last recurrence (design §7). Without ln_prelude (prelude_norm false) e~ = e; an lm_head is untied."""
    blocks = _blocks()
    kept = {} if kept is None else kept
    new = {}
    e = w["transformer.wte.weight"][x]
    for p, flat, _ in blocks[:P]:
        e, new[p] = _block(e, w, p, flat, x, kept.get(p), qk_norm)
    if "transformer.ln_prelude.weight" in w:
        e = _rms(e, w["transformer.ln_prelude.weight"])
    dt = F.softplus(w["transformer.adapter.dt_bias"])
    decay = torch.exp(-dt * torch.exp(w["transformer.adapter.A_log"]))
    s = state0.double()
    for _ in range(steps):
        s = decay * s + dt * (e @ w["transformer.adapter.B"].T)
        for p, flat, _ in blocks[P : P + K]:
            s, new[p] = _block(s, w, p, flat, x, kept.get(p), qk_norm)  # the last recurrence's K/V stay
    h = s @ w["transformer.C.weight"].T
    for p, flat, _ in blocks[P + K :]:
        h, new[p] = _block(h, w, p, flat, x, kept.get(p), qk_norm)
    kept.update(new)
    return _rms(h, w["transformer.ln_f.weight"]) @ w.get("lm_head.weight", w["transformer.wte.weight"]).T


# -- conversion matches the source ----------------------------------------------------------------
@pytest.mark.parametrize("sharded", [True, False], ids=["sharded", "single"])
def test_logits_match_the_source_equations(tmp_path, sharded):
    src = make_parcae(tmp_path / "parcae", sharded=sharded)
    model, tok, job = load_model(convert_parcae(src, tmp_path / "converted", dtype="fp32"))
    c = model.cfg
    assert (c.n_prelude, c.n_core, c.n_coda, c.injection, c.exit_norm) == (P, K, C, "parcae-decay", "none")
    assert (c.ffn_act, c.qk_norm, c.value_embeds, c.coda_proj, c.tie_embeddings, c.state_init) == (
        "relu2",
        True,
        "odd",
        True,
        True,
        "trunc-normal",
    )
    assert c.state_std == pytest.approx(math.sqrt(2 / (5 * D)))
    assert job["depth"]["depth"] == float(STEPS)
    assert model.head.weight is model.embed.weight
    w = load_source(src)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, c.vocab_size, (2, 11), generator=g)
    state0 = torch.randn(2, 11, D, generator=g) * c.state_std
    worst = 0.0
    for depth in (1, 2, 4):
        with torch.no_grad():
            got = model(tokens, depth, state0=state0).logits
        want = reference(w, tokens, state0, depth)
        worst = max(worst, (got.double() - want).abs().max().item())
    print(f"parcae max |delta logit| = {worst:.2e}")
    assert worst <= 1e-4


def test_nonorm_untied_variant_without_qk_norm_matches_the_source(tmp_path):
    """Guards against: injection always "parcae-decay" (prelude_norm false has no ln_prelude: e~ = e), an untied lm_head
    replaced by the embedding, qk_norm forced on, and max_seq_len not read from block_size (64 here)."""

    def untie(state):
        del state["transformer.ln_prelude.weight"]
        state["lm_head.weight"] = (torch.randn(*state["transformer.wte.weight"].shape) * 0.3).bfloat16()

    src = make_parcae(tmp_path / "parcae", mutate=untie, prelude_norm=False, tie_embeddings=False, qk_norm=False)
    model, _, _ = load_model(convert_parcae(src, tmp_path / "converted", dtype="fp32"))
    c = model.cfg
    assert (c.injection, c.tie_embeddings, c.qk_norm, c.max_seq_len) == ("parcae-nonorm", False, False, BLOCK)
    w = load_source(src)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, c.vocab_size, (2, 9), generator=g)
    state0 = torch.randn(2, 9, D, generator=g) * c.state_std
    for depth in (1, 3):
        with torch.no_grad():
            got = model(tokens, depth, state0=state0).logits.double()
        assert (got - reference(w, tokens, state0, depth, qk_norm=False)).abs().max() <= 1e-4


def test_vocabulary_is_padded_up_to_the_padding_multiple(tmp_path):
    """Guards against: the padded vocabulary rounded down instead of up when config.json has no padded_vocab_size (the
    source pads vocab_size up to a multiple of padding_multiple)."""
    vocab = hf_tokenizer(SPECIALS).get_vocab_size()
    assert vocab % 64
    padded = -(-vocab // 64) * 64

    def pad(state):
        for k in [k for k in state if k == "transformer.wte.weight" or k.startswith("value_embeds.")]:
            state[k] = torch.cat([state[k], torch.zeros(padded - vocab, state[k].shape[1], dtype=state[k].dtype)])

    src = make_parcae(tmp_path / "parcae", mutate=pad, padded_vocab_size=None)
    model, tok, _ = load_model(convert_parcae(src, tmp_path / "converted"))
    assert model.cfg.vocab_size == padded and tok.vocab_size == vocab


def test_refuses_value_embeddings_on_blocks_looplm_does_not_map(tmp_path):
    """Guards against: the odd-blocks check dropped. One block per stack, one recurrence, backprop depth 1: the source
    puts a table and a gate on prelude.0 and coda.0 (flat 0 and 2), consistent with config.json, but looplm's
    value_embeds="odd" has none there, so converting would silently drop them."""

    def even(state):
        for k in [k for k in state if k.startswith("value_embeds.") or ".1." in k or "ve_gate" in k]:
            del state[k]
        g = torch.Generator().manual_seed(3)
        for flat, p in ((0, "transformer.prelude.0."), (2, "transformer.coda.0.")):
            state[p + "attn.ve_gate.weight"] = (torch.randn(HEADS, 32, generator=g) * 0.5).bfloat16()
            state[f"value_embeds.{flat}.weight"] = torch.randn(*state["transformer.wte.weight"].shape).bfloat16()

    one = {"n_layers_in_prelude": 1, "n_layers_in_recurrent_block": 1, "n_layers_in_coda": 1}
    src = make_parcae(tmp_path / "parcae", mutate=even, mean_recurrence=1, mean_backprop_depth=1, **one)
    with pytest.raises(CheckpointError, match=r"looplm maps only the odd blocks of each stack") as err:
        convert_parcae(src, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_tokenizer_specials_fall_back_to_the_release_names(tmp_path):
    src = make_parcae(tmp_path / "parcae")
    _, tok, _ = load_model(convert_parcae(src, tmp_path / "converted"))
    backend = json.loads((src / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in backend["added_tokens"]}
    assert tok.eos_id == ids["<|eos|>"] and tok.pad_id == ids["<|pad|>"]


def test_config_specials_norm_eps_and_scaled_stuck_are_kept(tmp_path):
    """Guards against: the <|eos|>/<|pad|> fallback overriding eos/pad ids config.json gives, norm_eps not read from
    config.json, and init_strategy "scaled-stuck" (same scales as scaled-zero) refused."""
    tokens = json.loads(hf_tokenizer(SPECIALS).to_str())["added_tokens"]
    ids = {t["content"]: t["id"] for t in tokens}
    bos = ids["<|bos|>"]
    src = make_parcae(
        tmp_path / "parcae", eos_token_id=bos, pad_token_id=bos, norm_eps=1e-6, init_strategy="scaled-stuck"
    )
    model, tok, _ = load_model(convert_parcae(src, tmp_path / "converted"))
    assert (tok.eos_id, tok.pad_id, model.cfg.norm_eps) == (bos, bos, 1e-6)


def test_full_cache_decodes_the_tokens_of_the_uncached_forward(tmp_path):
    model, tok, _ = load_model(convert_parcae(make_parcae(tmp_path / "parcae"), tmp_path / "converted"))
    prompt = torch.tensor([tok.encode("the recurrent model")])
    assert_full_cache_decodes_like_the_forward(model, prompt, STEPS, 8, init="seeded")


def test_terminal_cache_decoding_matches_the_source_equations(tmp_path):
    """Prefill at one depth and decode at another with the terminal cache: each step's logits equal
    the source's equations run as a terminal cache (earlier tokens' core K/V from their last
    recurrence, value embeddings and q/k norms included), from the same seeded initial states."""
    src = make_parcae(tmp_path / "parcae")
    model, tok, _ = load_model(convert_parcae(src, tmp_path / "converted", dtype="fp32"))
    w = load_source(src)
    prompt = torch.tensor([tok.encode("the recurrent model")])
    P0, n_new, r_pre, r_dec = prompt.shape[1], 6, 2, STEPS

    def state0(start, n):  # the seeded initial state of example 0 at positions start.. (an input, as in the test above)
        return model.initial_state(torch.zeros(1, n, D), "seeded", positions=torch.arange(start, start + n)[None])

    cache = make_cache("terminal", model.cfg, 1, P0 + n_new, STEPS)
    kept: dict = {}
    got = [extend(model, prompt, cache, r_pre).logits[0, -1]]
    want = [reference(w, prompt, state0(0, P0), r_pre, kept)[0, -1]]
    for i in range(n_new - 1):
        nxt = got[-1].argmax().view(1, 1)
        got.append(extend(model, nxt, cache, r_dec).logits[0, -1])
        want.append(reference(w, nxt, state0(P0 + i, 1), r_dec, kept)[0, -1])
    worst = (torch.stack(got).double() - torch.stack(want)).abs().max().item()
    assert worst <= 1e-4, worst


def test_paths_without_the_value_embeddings_refuse(tmp_path):
    model, tok, _ = load_model(convert_parcae(make_parcae(tmp_path / "parcae"), tmp_path / "converted"))
    tokens = torch.tensor([tok.encode("the recurrent")])
    ctx, s = model.begin(tokens, StateStart("zero"))
    with torch.no_grad():
        with pytest.raises(ValueError, match="value embedding"):
            model.run_coda(s, ctx.rope, ctx.mask)  # no ctx: the coda's value embeddings are missing
        with pytest.raises(ValueError, match="value embedding"):
            model.context(model.embed(tokens), ctx.rope, ctx.mask)  # no tokens
        with pytest.raises(ValueError, match="value_embed"):
            model.core[1](s, ctx.rope, ctx.mask)


def test_serving_engine_gives_generate_greedy_text(tmp_path):
    from looplm.infer.generate import DepthRule, SamplingConfig, generate
    from looplm.serve import Engine, EngineConfig, Request

    model, tok, _ = load_model(convert_parcae(make_parcae(tmp_path / "parcae"), tmp_path / "converted"))
    prompts = ["the recurrent model", "deeper and", "the"]
    for mode in ("terminal", "full"):
        want = [
            generate(
                model, tok, [p], DepthRule(3), cache=mode, sampling=SamplingConfig(max_new_tokens=6, temperature=0.0)
            )[0]
            for p in prompts
        ]
        engine = Engine(model, tok, EngineConfig(max_batch=2, depth=3, max_depth=3, cache=mode))
        got = engine.generate(
            [Request(tok.encode(p), SamplingConfig(6, temperature=0.0), DepthRule(3)) for p in prompts]
        )
        assert [f.text for f in got] == want


# -- refusals ---------------------------------------------------------------------------------------
def _extra(state):
    state["transformer.prelude.0.attn.qk_bias"] = torch.zeros(2, 1, HEADS, HD, dtype=torch.bfloat16)


def _drop(state):
    del state["transformer.adapter.A_log"]


def _lone_table(state):
    del state["transformer.coda.1.attn.ve_gate.weight"]


@pytest.mark.parametrize(
    "mutate, overrides, match",
    [
        (_extra, {}, "unknown tensor transformer.prelude.0.attn.qk_bias"),
        (_drop, {}, "missing tensor transformer.adapter.A_log"),
        (_lone_table, {}, "value_embeds.5.weight has no partner transformer.coda.1.attn.ve_gate.weight"),
        (
            None,
            {"intermediate_size": 128, "recurrent_intermediation_embedding_dimension": 128},
            r"mlp\.(fc|proj)\.weight has shape \((96, 64|64, 96)\), config.json implies \((128, 64|64, 128)\)",
        ),
        (None, {"injection_type": "linear"}, "injection_type"),
        (None, {"nonlin_name": "GELU"}, "nonlin_name"),
        (None, {"block_size": None}, "config.json block_size = None is not an integer"),
        (None, {"norm_eps": "small"}, "config.json norm_eps = 'small' is not a number"),
        (None, {"mean_recurrence": 0}, "config.json mean_recurrence = 0: must be >= 1"),
        (None, {"rope_settings": {"use_rope": True, "rope_condense_ratio": 2, "rope_base": 50000}}, "condenses"),
        (None, {"num_key_value_heads": 2}, "num_key_value_heads"),
        (
            None,
            {"padded_vocab_size": 512},
            r"(wte|lm_head)\.weight has shape \(\d+, 64\), config.json implies \(512, 64\)",
        ),
        (None, {"mup_model_scaling_factor": 2}, "mup_model_scaling_factor != 1"),
        (None, {"qk_bias": True}, "qk_bias = true: looplm's Parcae blocks have no biases"),
    ],
)
def test_refuses_folders_it_cannot_map(tmp_path, mutate, overrides, match):
    src = make_parcae(tmp_path / "parcae", mutate=mutate, **overrides)
    with pytest.raises(CheckpointError, match=match) as err:
        convert_parcae(src, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_refuses_a_missing_shard(tmp_path):
    src = make_parcae(tmp_path / "parcae", sharded=True)
    (src / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00001-of-00002.safetensors named in") as err:
        convert_parcae(src, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_refuses_a_pickle_only_folder(tmp_path):
    src = tmp_path / "parcae"
    src.mkdir()
    hf_tokenizer(SPECIALS).save(str(src / "tokenizer.json"))
    (src / "config.json").write_text(json.dumps(parcae_config(300)))
    (src / "pytorch_model.bin").write_bytes(b"\x80\x02not really a pickle")
    with pytest.raises(CheckpointError, match="pytorch_model.bin is a pickle file") as err:
        convert_parcae(src, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_student_prefill_and_rl_estimators_carry_the_value_embeddings(tmp_path):
    """The distilled student's blocks copy the core's gates and read the teacher's core value embeddings
    (training and prefill); the RL one-recurrence update scores the forward's own logits."""
    from looplm.distill.student import EndpointStudent
    from looplm.rl.estimators import endpoint_logits

    model, tok, _ = load_model(convert_parcae(make_parcae(tmp_path / "parcae"), tmp_path / "converted"))
    tokens = torch.tensor([tok.encode("the recurrent model")])
    student = EndpointStudent.from_teacher(model).eval()
    assert student.blocks[1].has_value_embed and not student.blocks[0].has_value_embed
    ctx, _ = model.begin(tokens, StateStart("zero"))
    e = model.run_prelude(tokens, ctx.rope, ctx.mask)
    with torch.no_grad():
        want = student(e, ctx.rope, ctx.mask, values=ctx.core_values)
        with pytest.raises(ValueError, match="value embeddings"):
            student(e, ctx.rope, ctx.mask)
        seen = []
        cache = make_cache("terminal", model.cfg, 1, tokens.shape[1], 1)
        extend(model, tokens, cache, 1, initial=lambda *a, **kw: seen.append(student(*a, **kw)) or seen[-1])
    torch.testing.assert_close(seen[0], want)
    with torch.no_grad():
        out = model(tokens, 3, init="seeded", return_states=True)
        logits = endpoint_logits(model, tokens, out.states[1])
    torch.testing.assert_close(logits, out.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("key", "default"), [("nonlin_name", "GELU"), ("norm_class_name", "LayerNorm"), ("init_strategy", "scaled")]
)
def test_an_absent_key_takes_the_sources_default(tmp_path, key, default):
    """The source builds ParcaeConfig(**config.json), so a key left out takes the dataclass's default (GELU,
    LayerNorm, "scaled"), not the released value: converted as the released value, such a model's logits were off
    by 6-9 from the source's."""
    src = make_parcae(tmp_path / "parcae")
    config = json.loads((src / "config.json").read_text())
    del config[key]
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"config.json {key} = absent \(the source's default '{default}'\)"):
        convert_parcae(src, tmp_path / "out")
