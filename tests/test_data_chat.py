"""The chat template `looplm export` writes renders messages exactly as `looplm serve` does."""

from __future__ import annotations

import pytest
from _jobs import tiny_job

pytest.importorskip("transformers")
pytest.importorskip("pydantic")

from transformers import AutoTokenizer  # noqa: E402

from looplm import checkpoint as ckpt  # noqa: E402
from looplm.config import ModelConfig  # noqa: E402
from looplm.data import ByteTokenizer  # noqa: E402
from looplm.hf import export  # noqa: E402
from looplm.model import LoopedLM  # noqa: E402
from looplm.serve.protocol import ChatRequest  # noqa: E402

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "two\nlines"},
        {"role": "assistant", "content": "ok"},
        {"role": "developer", "content": "dev note"},
        {"role": "user", "content": "again: ünï"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_exported_chat_template_equals_the_served_rendering(tmp_path, messages):
    job = tiny_job(tmp_path)
    job.model = ModelConfig(
        vocab_size=ByteTokenizer().vocab_size, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=32
    )
    ckpt.save_model(tmp_path / "ckpt", LoopedLM(job.model), job.to_dict(), ByteTokenizer())
    export(tmp_path / "ckpt", tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # written out: `role: content` lines ("developer" shown as "system"), then "assistant:"
    want = "".join(f"{'system' if m['role'] == 'developer' else m['role']}: {m['content']}\n" for m in messages)
    assert rendered == want + "assistant:"
    assert rendered == ChatRequest(messages=messages).render()


def test_chat_replies_stop_where_any_next_turn_starts():
    """A chat reply stops at a new user or system turn (the template's roles), after the caller's stops."""
    from looplm.data.chat import CHAT_TEMPLATE

    stops = ChatRequest(messages=CONVERSATIONS[0], stop="END").stop_strings()
    assert stops[0] == "END"
    for role in ("user", "system"):
        assert "\n" + CHAT_TEMPLATE.format(role=role, content="").split(" ")[0] in stops
