"""The exactness tests' model (`_models.decisive_model`) has the properties they rely on: its argmax
moves with the context and with the depth, and its recurrence is contractive."""

import pytest
import torch
from _models import decisive_model

from looplm.model import StateStart

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: one intra-op thread


@pytest.fixture(scope="module")
def model():
    return decisive_model()


@torch.no_grad()
def test_argmax_depends_on_context_and_depth(model):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (8, 24), generator=g)
    y = x.clone()
    y[:, :12] = torch.randint(0, 256, (8, 12), generator=g)  # another context before the same 12 tokens
    at6 = model(x, 6, init="seeded").logits
    other_context = model(y, 6, init="seeded").logits
    at2 = model(x, 2, init="seeded").logits
    moved_by_context = (at6[:, 12:].argmax(-1) != other_context[:, 12:].argmax(-1)).float().mean()
    moved_by_depth = (at6.argmax(-1) != at2.argmax(-1)).float().mean()
    assert moved_by_context > 0.5 and moved_by_depth > 0.2, (moved_by_context, moved_by_depth)
    top2 = at6.topk(2, -1).values
    assert (top2[..., 0] - top2[..., 1]).median() > 0.3  # greedy choices are not near-ties
    assert at6.abs().max() > 8  # log-probabilities spread well beyond a uniform guess


@torch.no_grad()
def test_recurrence_is_contractive(model):
    """Two runs from different initial states approach each other at every recurrence, and the
    relative state change falls with depth (so `exit_tau` fires, and rounding is not amplified)."""
    x = torch.randint(0, 256, (4, 20), generator=torch.Generator().manual_seed(2))
    ctx, a = model.begin(x, StateStart("seeded"))
    _, b = model.begin(x, StateStart("seeded", seed=7))
    gaps, changes = [], []
    for _ in range(12):
        prev = a
        a, b = model.recurrence(a, ctx), model.recurrence(b, ctx)
        gaps.append(float((a - b).norm() / a.norm()))
        changes.append(float(((a - prev).norm(dim=-1) / prev.norm(dim=-1)).mean()))
    assert all(later < earlier for earlier, later in zip(gaps, gaps[1:])), gaps
    assert gaps[-1] < 0.05 * gaps[0], gaps
    assert changes[2] > 0.05 > changes[-1], changes  # exit thresholds around 0.05 separate depths
