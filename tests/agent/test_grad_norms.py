"""Gradient norms in one process equal torch.nn.utils.clip_grad_norm_'s total norm."""

import math

import pytest
import torch
from torch import nn

from trainvitals.agent._grad_norms import GradNormTracker
from trainvitals.wire import GLOBAL_GROUP
from trainvitals.wire import layer_of as block_group  # the agent's 'block' groups are the wire's layer labels


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
    grads = tracker.compute()
    assert grads is not None and grads.norms.shape == (len(list(model.parameters())),)  # one norm per parameter
    records = grads.decode(7, grads.norms.tolist())
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
    grads = GradNormTracker(model).compute()
    assert grads is not None
    records = {r["group"]: r for r in grads.decode(0, grads.norms.tolist())}
    assert records["layers.2"]["nonfinite"] == 1
    assert records[GLOBAL_GROUP]["nonfinite"] == 1
    assert records["layers.0"]["nonfinite"] == 0
    assert math.isnan(records[GLOBAL_GROUP]["owned_sq"])


def test_a_square_past_float32s_range_counts_as_nonfinite() -> None:
    """The groups are summed on the exporter thread in Python floats, but within float32's range,
    as the device's float32 sums were before: a float64 gradient with a finite norm of ~2.8e20
    squares past it, to inf, and counts as non-finite."""
    model = Tiny().double()
    model(torch.randint(0, 10, (2, 3))).sum().backward()
    model.layers[1].bias.grad.fill_(1e20)
    grads = GradNormTracker(model).compute()
    assert grads is not None and math.isfinite(max(grads.norms.tolist()))
    records = {r["group"]: r for r in grads.decode(0, grads.norms.tolist())}
    assert records["layers.1"]["nonfinite"] == 1 and records["layers.1"]["local_sq"] == math.inf
    assert records[GLOBAL_GROUP]["nonfinite"] == 1 and records["layers.0"]["nonfinite"] == 0


def test_missing_gradients_are_skipped() -> None:
    model = Tiny()
    assert GradNormTracker(model).compute() is None
    model.head(torch.randn(2, 8)).sum().backward()  # only the head gets a gradient
    grads = GradNormTracker(model).compute()
    assert grads is not None and grads.norms.numel() == 1  # the head's weight (no bias)
    records = {r["group"]: r for r in grads.decode(0, grads.norms.tolist())}
    assert set(records) == {"head", GLOBAL_GROUP}  # no gradient is not a norm of 0: no record
    assert records["head"]["local_sq"] == records[GLOBAL_GROUP]["local_sq"] > 0


def _step_records(tracker: GradNormTracker, model: nn.Module, step: int) -> dict[str, dict]:
    model.zero_grad(set_to_none=True)
    model(torch.randint(0, 10, (4, 5))).pow(2).mean().backward()
    grads = tracker.compute()
    assert grads is not None
    return {r["group"]: r for r in grads.decode(step, grads.norms.tolist())}


def test_layers_unfrozen_after_attach_count_from_their_first_gradient() -> None:
    """A frozen backbone unfrozen later (Lightning's BaseFinetuning, a fine-tune's warm-up): until
    2026-11-29 the tracker watched only the parameters trainable when it was made, so after the
    unfreeze the global norm left the backbone out and read below clip_grad_norm_'s."""
    torch.manual_seed(0)
    model = Tiny()
    for frozen in (model.emb, model.layers[0]):
        frozen.requires_grad_(False)
    tracker = GradNormTracker(model, groups="block")

    frozen_step = _step_records(tracker, model, 0)
    assert set(frozen_step) == {"layers.1", "layers.2", "head", GLOBAL_GROUP}
    expected = nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf")).item()
    assert math.sqrt(frozen_step[GLOBAL_GROUP]["owned_sq"]) == pytest.approx(expected, rel=1e-5)

    for unfrozen in (model.emb, model.layers[0]):
        unfrozen.requires_grad_(True)
    unfrozen_step = _step_records(tracker, model, 1)
    assert set(unfrozen_step) == {"emb", "layers.0", "layers.1", "layers.2", "head", GLOBAL_GROUP}
    expected = nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf")).item()
    assert math.sqrt(unfrozen_step[GLOBAL_GROUP]["owned_sq"]) == pytest.approx(expected, rel=1e-5)
    emb = model.emb.weight.grad.pow(2).sum().item()
    assert unfrozen_step["emb"]["owned_sq"] == pytest.approx(emb, rel=1e-5)


# --------------------------------------------------------------------------- Agent.clip_grad_norm_


def _recorded_grads(path) -> dict[int, dict[str, dict]]:
    import json

    out: dict[int, dict[str, dict]] = {}
    for line in path.read_text().splitlines():
        for r in json.loads(line).get("records", []):  # the first line is the run registration
            if r["kind"] == "grad":
                out.setdefault(r["step"], {})[r["group"]] = r
    return out


def _twin_models() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    import copy

    torch.manual_seed(0)
    model = Tiny()
    return model, copy.deepcopy(model), torch.randint(0, 10, (4, 5))


def _attached_twins(tmp_path):
    """An agent on one of two identical models (the other clips with torch), recording to a file."""
    import trainvitals.agent as tv

    ours, theirs, x = _twin_models()
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    record = tmp_path / "rec.jsonl"
    config = tv.AgentConfig(collector="", spill_dir=str(tmp_path), record_file=str(record))
    return tv.attach(ours, opt, run="clip", config=config), opt, ours, theirs, x, record


def test_agent_clip_is_torchs_clip_with_one_norm_pass(tmp_path, monkeypatch) -> None:
    agent, opt, ours, theirs, x, record = _attached_twins(tmp_path)
    passes = 0
    real_norm = torch._foreach_norm

    def counting_norm(*args, **kwargs):
        nonlocal passes
        passes += 1
        return real_norm(*args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", counting_norm)
    try:
        ours(x).pow(2).mean().backward()
        theirs(x).pow(2).mean().backward()
        total = agent.clip_grad_norm_(ours.parameters(), max_norm=0.05)
        passes_agent = passes
        opt.step()  # the optimizer hook must not measure again this step
        agent.step(loss=0.0)
        passes_after_step = passes
        expected = nn.utils.clip_grad_norm_(theirs.parameters(), max_norm=0.05)
    finally:
        monkeypatch.setattr(torch, "_foreach_norm", real_norm)
        agent.close()
    assert passes_agent == 1 and passes_after_step == 1  # torch's clip alone also makes one
    assert total.item() == pytest.approx(expected.item(), rel=1e-6) and total.dtype == expected.dtype
    assert total.item() > 0.05  # it clipped
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        # ours were also updated by opt.step(): compare the update direction via the grads it used
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-9)
    grads = _recorded_grads(record)[0]
    # Pre-clip group norms: the global one is the total clip_grad_norm_ returned, not max_norm.
    assert math.sqrt(grads[GLOBAL_GROUP]["owned_sq"]) == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("case", ["inf_norm", "subset", "nonfinite"])
def test_agent_clip_falls_back_to_torch_where_one_pass_cannot_answer(tmp_path, case) -> None:
    agent, opt, ours, theirs, x, record = _attached_twins(tmp_path)
    try:
        ours(x).pow(2).mean().backward()
        theirs(x).pow(2).mean().backward()
        if case == "nonfinite":
            ours.head.weight.grad[0, 0] = float("inf")
            theirs.head.weight.grad[0, 0] = float("inf")
            with pytest.raises(RuntimeError, match="non-finite") as ours_err:
                agent.clip_grad_norm_(ours.parameters(), 1.0, error_if_nonfinite=True)
            with pytest.raises(RuntimeError, match="non-finite") as theirs_err:
                nn.utils.clip_grad_norm_(theirs.parameters(), 1.0, error_if_nonfinite=True)
            assert str(ours_err.value) == str(theirs_err.value)  # the job sees torch's own error
            return
        args = {"inf_norm": (list(ours.parameters()), 0.01, float("inf")), "subset": (ours.layers.parameters(), 0.01)}
        targs = {
            "inf_norm": (list(theirs.parameters()), 0.01, float("inf")),
            "subset": (theirs.layers.parameters(), 0.01),
        }
        total = agent.clip_grad_norm_(*args[case])
        expected = nn.utils.clip_grad_norm_(*targs[case])
        opt.step()
        agent.step(loss=0.0)
    finally:
        agent.close()
    assert total.item() == pytest.approx(expected.item(), rel=1e-6)
    for p, q in zip(ours.layers.parameters(), theirs.layers.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-9)
    # measured before clipping (grads_ready), so the global norm is the unclipped L2 total
    ours_grads = _recorded_grads(record)[0]
    assert ours_grads[GLOBAL_GROUP]["owned_sq"] > 0.01**2


def test_agent_clip_after_an_unfreeze_clips_the_jobs_list_and_measures_every_gradient(tmp_path) -> None:
    """The job clips the list of parameters trainable when it built it, then unfreezes a layer: its
    clip must stay torch's over that list, and the measured global norm must count the unfrozen
    layer's gradient too (the list's one pass no longer gives both, so the agent measures apart)."""
    agent, opt, ours, theirs, x, record = _attached_twins(tmp_path)
    for model in (ours, theirs):
        model.layers[0].requires_grad_(False)
    ours_list = [p for p in ours.parameters() if p.requires_grad]
    theirs_list = [p for p in theirs.parameters() if p.requires_grad]
    totals, expected, every = [], [], []
    try:
        for step in range(2):
            if step == 1:
                for model in (ours, theirs):
                    model.layers[0].requires_grad_(True)
            for model in (ours, theirs):
                model.zero_grad(set_to_none=True)
                model(x).pow(2).mean().backward()
            every.append(nn.utils.clip_grad_norm_(theirs.parameters(), float("inf")).item())
            totals.append(agent.clip_grad_norm_(ours_list, max_norm=0.05).item())
            expected.append(nn.utils.clip_grad_norm_(theirs_list, max_norm=0.05).item())
            opt.step()
            agent.step(loss=0.0)
            with torch.no_grad():  # the twins stay equal: theirs takes the same update
                for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
                    q.copy_(p)
    finally:
        agent.close()
    assert totals == pytest.approx(expected, rel=1e-6)
    recorded = _recorded_grads(record)
    assert "layers.0" not in recorded[0] and "layers.0" in recorded[1]
    measured = [math.sqrt(recorded[s][GLOBAL_GROUP]["owned_sq"]) for s in (0, 1)]
    assert measured == pytest.approx(every, rel=1e-5)
    assert measured[1] > expected[1] * (1 + 1e-4)  # the unfrozen layer's gradient is in it, not in the list


def test_noop_agent_clips_like_torch(monkeypatch) -> None:
    import trainvitals.agent as tv

    monkeypatch.setenv("TRAINVITALS_DISABLE", "1")
    ours, theirs, x = _twin_models()
    agent = tv.attach(ours, None, run="clip")
    ours(x).pow(2).mean().backward()
    theirs(x).pow(2).mean().backward()
    assert agent.clip_grad_norm_(ours.parameters(), 0.05).item() == pytest.approx(
        nn.utils.clip_grad_norm_(theirs.parameters(), 0.05).item()
    )


def test_sparse_embedding_gradients_are_measured_like_dense_ones() -> None:
    """nn.Embedding(sparse=True) under SparseAdam: no norm kernel takes a sparse gradient, and
    every step's measurement failed (an agent error a step, no gradient records for the run)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"emb": nn.Embedding(50, 8, sparse=True), "head": nn.Linear(8, 3)})
    tracker = GradNormTracker(model, groups="block")
    for _ in range(2):  # the second step takes the path the first one chose
        ids = torch.tensor([3, 7, 3, 3, 41])  # repeated indices: an uncoalesced gradient
        model["head"](model["emb"](ids)).pow(2).sum().backward()
        assert model["emb"].weight.grad is not None and model["emb"].weight.grad.is_sparse
        grads = tracker.compute()
        assert grads is not None
        by_group = {r["group"]: r for r in grads.decode(0, grads.norms.tolist())}
        dense_emb = model["emb"].weight.grad.to_dense().pow(2).sum().item()
        assert by_group["emb"]["owned_sq"] == pytest.approx(dense_emb, rel=1e-5)
        head = sum(p.grad.pow(2).sum().item() for p in model["head"].parameters())
        assert by_group[GLOBAL_GROUP]["owned_sq"] == pytest.approx(dense_emb + head, rel=1e-5)
        model.zero_grad(set_to_none=True)
