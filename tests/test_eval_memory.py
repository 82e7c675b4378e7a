"""The depth report's memory estimate (`looplm.eval.memory`) against bytes measured on the CPU, and
the paper presets' end-of-training report sized to fit a GPU."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from looplm.config import ModelConfig
from looplm.data import PackedDataset, build_datasets
from looplm.data.tokenizer import ByteTokenizer
from looplm.eval.cached import sharing_table
from looplm.eval.memory import eval_peak_bytes, parameter_count, perplexity_bytes, sharing_bytes
from looplm.eval.perplexity import native_perplexity
from looplm.model import LoopedLM
from looplm.train.config import job_preset

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors created while it is active: every op's output storage
    is counted once until the last tensor viewing it is freed (CPU: freed memory is released at once)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, tensors alive on it]
        self.now = self.peak = 0

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.live:
                    self.live[ptr] = [t.untyped_storage().nbytes(), 0]
                    self.now += self.live[ptr][0]
                    self.peak = max(self.peak, self.now)
                self.live[ptr][1] += 1
                weakref.finalize(t, self._release, ptr)
        return out


CFG = ModelConfig(vocab_size=2048, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64, max_depth=16)


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> PackedDataset:
    """Validation rows of 64 byte tokens (documents longer than a row, so each row is one document)."""
    folder = tmp_path_factory.mktemp("texts")
    for i in range(40):
        (folder / f"{i:02d}.txt").write_text(f"text {i}: " + "the quick brown fox jumps over the lazy dog " * 4)
    return build_datasets(str(folder), ByteTokenizer(), seq_len=64, holdout=0.5, cache_dir=folder / "cache")[1]


def test_perplexity_estimate_bounds_the_measured_peak(rows):
    """A batch of 4 x 64 tokens at R = 8, CE in chunks of 64 rows: the estimate is an upper bound of the
    measured peak, and a close one (the [B, L, V] fp32 logits and log-softmax of a whole batch, 4 MB here,
    or every recurrence state, are far above it)."""
    torch.manual_seed(0)
    model = LoopedLM(CFG).eval()
    with LiveBytes() as mem:
        native_perplexity(model, rows, [8], batch_size=4, max_sequences=4, ce_chunk_rows=64)
    estimate = perplexity_bytes(CFG, 64, 4, ce_chunk_rows=64)
    full_logits = 2 * 4 * 64 * CFG.vocab_size * 4
    assert mem.peak <= estimate <= 2 * mem.peak, (mem.peak, estimate)
    assert estimate < full_logits


def test_sharing_estimate_bounds_the_measured_peak(rows):
    """One row with the full cache at R = 8 (the largest of the table's three protocols)."""
    torch.manual_seed(0)
    model = LoopedLM(CFG).eval()
    for span in (None, (16, 24), (42, 21), (48, 8), (56, 4)):  # a prompt longer than its continuation too
        with LiveBytes() as mem:
            sharing_table(model, rows, [8], max_sequences=1, span=span)
        estimate = sharing_bytes(CFG, 64, 8, span)
        assert mem.peak <= estimate <= 2 * mem.peak, (span, mem.peak, estimate)


def test_parameter_count_is_the_models():
    assert parameter_count(CFG) == sum(p.numel() for p in LoopedLM(CFG).parameters())


GPU_BUDGET = 40e9


@pytest.mark.parametrize("preset", ["S", "M", "L"])
def test_paper_presets_report_fits_a_40_gb_budget(preset):
    """The end-of-training report of `looplm train S/M/L` (8,192-token rows, a 64,256 BPE vocabulary,
    depths to 32) fits in 40 GB: batch 4, 32 rows, the sharing table on CacheEval spans."""
    job = job_preset(preset)
    cfg = ModelConfig(**{**job.model.to_dict(), "vocab_size": job.data.bpe_vocab_size})
    est = eval_peak_bytes(cfg, job.data.seq_len, job.eval)
    assert est["peak"] < GPU_BUDGET, {k: f"{v / 1e9:.1f} GB" for k, v in est.items()}
    assert max(job.eval.depths) == 32 and job.eval.max_sequences * job.data.seq_len >= 2**18


def test_cache_estimate_counts_k_and_v_of_every_layer_visit(tiny_model_config):
    """One more prelude layer
    adds exactly one visit's K and V, 2 x T x n_kv_heads x head_dim fp32 values."""
    from looplm.eval.memory import sharing_bytes

    a, b = tiny_model_config(n_prelude=1), tiny_model_config(n_prelude=2)
    for span, T in ((None, 32), ((20, 9), 28)):
        diff = sharing_bytes(b, 32, 5, span) - sharing_bytes(a, 32, 5, span)
        assert diff == 2 * T * a.n_kv_heads * a.head_dim * 4


def test_attention_estimate_counts_q_k_and_v(tiny_model_config):
    """With attention the widest block (long rows, a small
    FFN and vocabulary), two more KV heads add K and V of B x L tokens x 2 heads x head_dim fp32 values."""
    from looplm.eval.memory import perplexity_bytes

    a = tiny_model_config(n_heads=4, n_kv_heads=2, ffn_dim=8, vocab_size=8, max_seq_len=512)
    b = tiny_model_config(n_heads=4, n_kv_heads=4, ffn_dim=8, vocab_size=8, max_seq_len=512)
    B, L = 2, 512
    assert perplexity_bytes(b, L, B, ce_chunk_rows=4) - perplexity_bytes(a, L, B, ce_chunk_rows=4) == (
        B * L * 2 * 2 * a.head_dim * 4
    )


def test_peak_is_the_weights_and_the_larger_protocol():
    """A CacheEval
    span whose full cache and logits outweigh one perplexity row."""
    from looplm.eval.report import EvalConfig

    weights = parameter_count(CFG) * 4
    cfg = EvalConfig(depths=(1, 16), batch_size=32, max_sequences=1, sharing_sequences=1, cacheeval_span=(8, 56))
    est = eval_peak_bytes(CFG, 64, cfg)
    ppl, sharing = perplexity_bytes(CFG, 64, 1), sharing_bytes(CFG, 64, 16, (8, 56))
    assert sharing > ppl and est == {
        "weights": weights,
        "perplexity": ppl,
        "sharing": sharing,
        "peak": weights + sharing,
    }
    cfg.sharing_sequences = 0
    assert eval_peak_bytes(CFG, 64, cfg) == {"weights": weights, "perplexity": ppl, "sharing": 0, "peak": weights + ppl}


def test_cache_estimate_counts_the_coda_visits(tiny_model_config):
    """One more coda layer adds exactly one visit's K and V, 2 x T x n_kv_heads x head_dim fp32 values."""
    a, b = tiny_model_config(n_coda=1), tiny_model_config(n_coda=2)
    for span, T in ((None, 32), ((20, 9), 28)):
        assert sharing_bytes(b, 32, 5, span) - sharing_bytes(a, 32, 5, span) == 2 * T * a.n_kv_heads * a.head_dim * 4


def test_sharing_forward_is_the_longer_of_the_prompt_and_the_scored_chunk(tiny_model_config):
    """On FFN-wide models a wider FFN costs the sharing estimate what it costs one forward over max(P, C) tokens, the
    same for a span (4, 60) as for (60, 4) (the cache and the logits do not depend on the FFN)."""
    kw = dict(d_model=32, n_heads=4, n_kv_heads=2, vocab_size=8, max_seq_len=64)
    a, b = tiny_model_config(ffn_dim=512, **kw), tiny_model_config(ffn_dim=1024, **kw)
    forward = perplexity_bytes(b, 60, 1, ce_chunk_rows=0) - perplexity_bytes(a, 60, 1, ce_chunk_rows=0)
    assert forward > 0
    for span in ((4, 60), (60, 4)):
        assert sharing_bytes(b, 64, 3, span) - sharing_bytes(a, 64, 3, span) == forward, span


@pytest.mark.parametrize(
    "shape",
    [dict(d_model=32, ffn_dim=1024, vocab_size=260), dict(d_model=128, ffn_dim=32, vocab_size=260)],
    ids=["ffn-wide", "state-wide"],
)
def test_perplexity_estimate_bounds_the_measured_peak_of_other_shapes(rows, shape):
    """The estimate bounds the measured peak where the FFN or the state, not the logits, is the widest: SwiGLU's silu(a)
    * b holds four [B, L, ffn] tensors (a, b, silu(a) and the product), and the seeded initial state's int64/float64
    hashes (`looplm.model.state.seeded_normal`) stay within the states counted. (The paper presets' perplexity term is
    FFN-bound: counting three was 2.3 GB short at L.)"""
    torch.manual_seed(0)
    cfg = ModelConfig(n_heads=4, n_kv_heads=2, max_seq_len=64, max_depth=16, **shape)
    model = LoopedLM(cfg).eval()
    with LiveBytes() as mem:
        native_perplexity(model, rows, [4], batch_size=1, max_sequences=1, ce_chunk_rows=64)
    assert mem.peak <= perplexity_bytes(cfg, 64, 1, ce_chunk_rows=64), mem.peak
