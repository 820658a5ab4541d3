"""Gradient norms in one process equal torch.nn.utils.clip_grad_norm_'s total norm."""

import math

import pytest
import torch
from torch import nn

from trainvitals.agent._grad_norms import GLOBAL_GROUP, GradNormTracker, block_group


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("module.layers.3.attn.q.weight", "layers.3"),
        ("tok_emb.weight", "tok_emb"),
        ("_orig_mod.blocks.0.mlp.fc.bias", "blocks.0"),
        ("scale", "scale"),
    ],
)
def test_block_group(name: str, group: str) -> None:
    assert block_group(name) == group


def test_global_and_group_norms_match_clip_grad_norm() -> None:
    torch.manual_seed(0)
    model = Tiny()
    model(torch.randint(0, 10, (4, 5))).pow(2).mean().backward()
    tracker = GradNormTracker(model, groups="block")
    vec = tracker.compute()
    assert vec is not None and vec.shape == (tracker.width,)
    records = tracker.records(7, vec.tolist())
    by_group = {r["group"]: r for r in records}
    assert set(by_group) == {"emb", "layers.0", "layers.1", "layers.2", "head", GLOBAL_GROUP}
    expected = nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf")).item()
    assert math.sqrt(by_group[GLOBAL_GROUP]["owned_sq"]) == pytest.approx(expected, rel=1e-5)
    # Groups partition the parameters: their squares add up to the global one.
    assert sum(r["local_sq"] for g, r in by_group.items() if g != GLOBAL_GROUP) == pytest.approx(
        by_group[GLOBAL_GROUP]["local_sq"], rel=1e-6
    )
    layer1 = sum(p.grad.pow(2).sum().item() for p in model.layers[1].parameters())
    assert by_group["layers.1"]["owned_sq"] == pytest.approx(layer1, rel=1e-5)


def test_nonfinite_gradients_are_counted_not_hidden() -> None:
    model = Tiny()
    model(torch.randint(0, 10, (2, 3))).sum().backward()
    model.layers[2].weight.grad[0, 0] = float("nan")
    vec = tracker_vec = GradNormTracker(model).compute()
    records = {r["group"]: r for r in GradNormTracker(model).records(0, tracker_vec.tolist())}
    assert vec is not None
    assert records["layers.2"]["nonfinite"] == 1
    assert records[GLOBAL_GROUP]["nonfinite"] == 1
    assert records["layers.0"]["nonfinite"] == 0
    assert math.isnan(records[GLOBAL_GROUP]["owned_sq"])


def test_missing_gradients_are_skipped() -> None:
    model = Tiny()
    assert GradNormTracker(model).compute() is None
    model.head(torch.randn(2, 8)).sum().backward()  # only the head gets a gradient
    records = {
        r["group"]: r for r in GradNormTracker(model).records(0, GradNormTracker(model).compute().tolist())
    }
    assert records["layers.0"]["local_sq"] == 0.0
    assert records["head"]["local_sq"] > 0
