"""attach(): two lines, harmless, hooks removed on close, records in wire format."""

import inspect
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import trainvitals.agent as tv
from trainvitals.wire import Batch


def _train(
    agent: object, model: nn.Module, opt: torch.optim.Optimizer, steps: int, step: object = None
) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        agent.step(loss=loss, tokens=32, step=step)  # type: ignore[attr-defined]
        losses.append(loss.item())
    return losses


def _recorded(tmp_path: Path) -> list:
    """Every record rank 0 sent, from its record_file (the first line is the registration)."""
    lines = (tmp_path / "rec-0.jsonl").read_bytes().splitlines()
    return [r for line in lines[1:] for r in Batch.model_validate_json(line).records]


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def test_records_follow_the_wire_format_and_reach_the_collector(collector, tmp_path: Path) -> None:
    model, opt = _model()
    record = tmp_path / "rec-{rank}.jsonl"
    agent = tv.attach(
        model,
        opt,
        run="r1",
        config=tv.AgentConfig(
            collector=collector.url, spill_dir=str(tmp_path / "spool"), record_file=str(record)
        ),
    )
    losses = _train(agent, model, opt, 5)
    agent.close()
    records = _recorded(tmp_path)
    steps = [r for r in records if r.kind == "step"]
    assert [s.step for s in steps] == [0, 1, 2, 3, 4]
    assert [s.loss for s in steps] == pytest.approx(losses)
    assert {r.event for r in records if r.kind == "event"} == {"start", "stop"}
    grads = [r for r in records if r.kind == "grad" and r.group == "__global__"]
    assert len(grads) == 5 and all(g.owned_sq > 0 for g in grads)
    with collector.app.state.sessionmaker() as session:
        from trainvitals.service.store import queries

        assert queries.count_step_rows(session, run_id="r1") == 5
        assert queries.list_runs(session)[0].status == "finished"


def test_a_loss_tensor_the_job_reuses_in_place_is_reported_per_step(collector, tmp_path: Path) -> None:
    """Each step record carries the loss and grad norm of its own step, even when the job writes
    them into the same tensors every step (on CPU they are read at step(); on GPU copied there)."""
    model, opt = _model()
    record = tmp_path / "rec-{rank}.jsonl"
    config = tv.AgentConfig(collector=collector.url, spill_dir=str(tmp_path / "spool"), record_file=str(record))
    agent = tv.attach(model, opt, run="r1", config=config)
    loss_slot, norm_slot = torch.zeros(()), torch.zeros(())  # the job's reused tensors
    expected = []
    for step in range(4):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        opt.zero_grad()
        loss_slot.fill_(float(step) + 0.5)
        norm_slot.copy_(norm)
        expected.append((float(step) + 0.5, norm.item()))
        agent.step(loss=loss_slot, grad_norm=norm_slot)
    loss_slot.fill_(-1.0)  # after the last step, before the exporter has shipped it
    norm_slot.fill_(-1.0)
    agent.close()
    steps = [r for r in _recorded(tmp_path) if r.kind == "step"]
    assert [s.loss for s in steps] == [loss for loss, _ in expected]  # exact: 0.5, 1.5, ... in float32
    assert [s.grad_norm for s in steps] == pytest.approx([norm for _, norm in expected])


def test_counts_passed_as_tensors_arrive_as_numbers(collector, tmp_path: Path) -> None:
    """tokens=attention_mask.sum() is a tensor, as an lr from a scheduler may be: each reached the
    JSON encoder as a tensor, and its batch (every record of the send interval) was lost."""
    model, opt = _model()
    record = tmp_path / "rec-{rank}.jsonl"
    config = tv.AgentConfig(collector=collector.url, spill_dir=str(tmp_path / "spool"), record_file=str(record))
    registration = {"model": {"non_embedding_params": 100, "layers": 2, "hidden": 8, "seq_len": 4}}
    agent = tv.attach(model, opt, run="tensors", config=config, registration=registration)
    for i in range(4):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mask = torch.ones(4, 4 + i)  # a float mask: its sum is a float tensor
        agent.step(loss=loss, tokens=mask.sum(), lr=torch.tensor(0.5), flops=None)
    agent.step(loss=1.0, tokens=torch.tensor(7), flops=torch.tensor(1e12))  # flops passed wins
    agent.close()
    assert agent.stats()["errors"] == 0
    steps = [r for r in _recorded(tmp_path) if r.kind == "step"]
    assert [s.tokens for s in steps] == [16, 20, 24, 28, 7]
    per_token = 6 * 100 + 12 * 2 * 8 * 4  # 6N + 12LHQT: the agent's own FLOPs per token
    expected = [16 * per_token, 20 * per_token, 24 * per_token, 28 * per_token, 1e12]
    assert [s.flops for s in steps] == pytest.approx(expected, rel=1e-6)  # float32 on the way back
    assert [s.lr for s in steps[:4]] == [0.5] * 4
    with collector.app.state.sessionmaker() as session:
        from trainvitals.service.store import queries

        assert queries.count_step_rows(session, run_id="tensors") == 5


def test_flops_follow_the_parameters_that_train(collector, tmp_path: Path) -> None:
    """A frozen backbone's steps carry the FLOPs its backward does (no weight gradients below the
    trained blocks, no backward at all under the first of them); unfrozen mid-run, as Lightning's
    BaseFinetuning does, the next step carries full training's 6N + 12LHQT. Each change is a note
    event with the shares. Until 2026-12-03 every step counted 6N: a fine-tune's MFU read up to
    1.5x (LoRA) or more (a frozen backbone) what the hardware did, and hid an MFU gap."""
    from trainvitals.examples.train_gpt import GPT

    torch.manual_seed(0)
    model = GPT(vocab=512, d=64, layers=4, heads=4, seq=32)
    model.requires_grad_(False)
    for module in (model.layers[3], model.ln_f, model.lm_head):
        module.requires_grad_(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # frozen ones too: no gradient, no update
    config = tv.AgentConfig(
        collector=collector.url, spill_dir=str(tmp_path / "spool"), record_file=str(tmp_path / "rec-{rank}.jsonl")
    )
    agent = tv.attach(model, opt, run="frozen", config=config, registration={"model": {"seq_len": 32}})
    idx = torch.randint(0, 512, (2, 32))
    for i in range(6):
        if i == 3:
            model.requires_grad_(True)
        model(idx).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        agent.step(loss=1.0, tokens=64)
    agent.close()
    assert agent.stats()["errors"] == 0
    records = _recorded(tmp_path)
    n = sum(p.numel() for p in model.parameters()) - 512 * 64 - 32 * 64  # less the two tables
    full = 6 * n + 12 * 4 * 64 * 32
    top = sum(p.numel() for m in (model.layers[3], model.ln_f, model.lm_head) for p in m.parameters())
    frozen = 2 * n + 4 * top + (4 + 8 * top / n) * 4 * 64 * 32  # forward, and backward over the top
    steps = [r for r in records if r.kind == "step"]
    assert [s.flops for s in steps] == pytest.approx([64 * frozen] * 3 + [64 * full] * 3, rel=1e-6)
    notes = [r.detail for r in records if r.kind == "event" and r.event == "note"]
    assert len(notes) == 2, notes
    assert f"{top / n:.2%} of the non-embedding parameters trained" in notes[0]
    assert notes[1].startswith(f"FLOPs per token {full:.4g}, 100% of full training's 6N+12LHQT")


def test_a_schedulers_lr_list_and_numpy_counts_arrive_as_numbers(
    collector, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """lr=scheduler.get_last_lr() is a list (one lr per parameter group): the collector refused every
    batch of the run (422, step.lr not a number) and stored nothing; a numpy count could not be
    encoded and cost its step record. A value that is no number is left out, said once."""
    model, opt = _model()
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))], "lr": 0.5})  # a second group
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    record = tmp_path / "rec-{rank}.jsonl"
    config = tv.AgentConfig(collector=collector.url, spill_dir=str(tmp_path / "spool"), record_file=str(record))
    agent = tv.attach(model, opt, run="lr-list", config=config)
    lrs = []
    for i in range(4):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
        agent.step(loss=loss, tokens=np.int64(32 + i), flops=np.float32(1e9), lr=sched.get_last_lr())
    with caplog.at_level(logging.WARNING, logger="trainvitals.agent"):
        agent.step(loss=1.0, tokens=8, lr="3e-4")  # type: ignore[arg-type]
        agent.step(loss=1.0, tokens=8, lr="3e-4")  # type: ignore[arg-type]
    agent.close()
    assert agent.stats()["errors"] == 0 and agent.stats()["rejected_batches"] == 0
    steps = [r for r in _recorded(tmp_path) if r.kind == "step"]
    assert [s.lr for s in steps] == [*lrs, None, None]  # the first group's, as HF logs it
    assert [s.tokens for s in steps] == [32, 33, 34, 35, 8, 8]
    assert [s.flops for s in steps[:4]] == [1e9] * 4
    said = [r.getMessage() for r in caplog.records if "step(lr=...)" in r.getMessage()]
    assert said == [
        "trainvitals agent: step(lr=...) got a str, not a number: left out of the step records; pass a "
        "number or a one-element tensor (a scheduler's: scheduler.get_last_lr()[0])"
    ]
    with collector.app.state.sessionmaker() as session:
        from trainvitals.service.store import queries

        assert queries.count_step_rows(session, run_id="lr-list") == 6


def test_a_tensor_of_many_elements_is_left_out_and_said_once(
    collector, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """tokens=attention_mask (the mask, not its sum) and a per-sample loss (reduction='none') were
    read by their first element: 1 token a step, which made the run's MFU near zero, and one
    sample's loss for the step's. A tensor of another size than one element is left out, said
    once per field, and the rest of the step record arrives."""
    model, opt = _model()
    record = tmp_path / "rec-{rank}.jsonl"
    config = tv.AgentConfig(collector=collector.url, spill_dir=str(tmp_path / "spool"), record_file=str(record))
    agent = tv.attach(model, opt, run="many", config=config)
    mask = torch.ones(4, 16)
    with caplog.at_level(logging.WARNING, logger="trainvitals.agent"):
        for _ in range(3):
            per_sample = model(torch.randn(4, 8)).pow(2).squeeze(-1)
            per_sample.mean().backward()
            opt.step()
            opt.zero_grad()
            agent.step(loss=per_sample, tokens=mask, grad_norm=torch.ones(2), lr=0.1)
        agent.step(loss=torch.empty(0), tokens=mask.sum(), lr=torch.tensor([0.1, 0.2]))
    agent.close()
    assert agent.stats()["errors"] == 0 and agent.stats()["rejected_batches"] == 0
    steps = [r for r in _recorded(tmp_path) if r.kind == "step"]
    assert [(s.loss, s.tokens, s.grad_norm, s.lr) for s in steps] == [(None, None, None, 0.1)] * 3 + [
        (None, 64, None, None)
    ]
    said = sorted(r.getMessage() for r in caplog.records if "elements, not one" in r.getMessage())
    assert said == [
        "trainvitals agent: step(grad_norm=...) got a tensor of 2 elements, not one: left out of the step "
        "records; pass the total norm (clip_grad_norm_'s result)",
        "trainvitals agent: step(loss=...) got a tensor of 4 elements, not one: left out of the step records; "
        "pass the step's loss as one number (loss.mean() of a per-sample loss)",
        "trainvitals agent: step(lr=...) got a tensor of 2 elements, not one: left out of the step records; "
        "pass one learning rate (scheduler.get_last_lr()[0])",
        "trainvitals agent: step(tokens=...) got a tensor of 64 elements, not one: left out of the step "
        "records; pass a count (attention_mask.sum() or input_ids.numel())",
    ]


def test_step_numbers_as_tensors_numpy_or_floats_arrive_and_no_step_number_is_said(
    collector, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """step=optimizer.state[p]['step'] (a CPU tensor) or a numpy step reached the JSON encoder: every
    record of its send interval was lost, and checkpoint()/loaded() did the same with theirs; a
    negative step made the collector refuse the batch. Each is read as the int it holds, and what
    holds none is said once per entry point, the agent's own numbering standing in."""
    model, opt = _model()
    record = tmp_path / "rec-{rank}.jsonl"
    config = tv.AgentConfig(collector=collector.url, spill_dir=str(tmp_path / "spool"), record_file=str(record))
    agent = tv.attach(model, opt, run="step-kinds", config=config)
    with caplog.at_level(logging.WARNING, logger="trainvitals.agent"):
        for given in (torch.tensor(100.0), np.int64(101), 102.0, -5, "7", torch.tensor([1, 2])):
            _train(agent, model, opt, 1, step=given)
        with agent.checkpoint(step=torch.tensor(105), path=str(tmp_path / "ck")):
            pass
        agent.checkpoint_saved(step=np.int32(105), generation=2.5, path=str(tmp_path / "ck2"))
        agent.event("note", step=-1, detail="before the resume")
        agent.loaded(step=np.int64(50))
        agent.loaded(step=torch.tensor(1.5))
        _train(agent, model, opt, 1)
    agent.close()
    assert agent.stats()["errors"] == 0 and agent.stats()["rejected_batches"] == 0
    records = _recorded(tmp_path)
    assert [r.step for r in records if r.kind == "step"] == [100, 101, 102, 103, 104, 105, 51]
    saves = [(r.step, r.generation, r.path) for r in records if r.kind == "checkpoint" and r.status == "persisted"]
    assert saves == [(105, 105, str(tmp_path / "ck")), (105, 105, str(tmp_path / "ck2"))]
    events = [(r.event, r.step) for r in records if r.kind == "event" and r.event in ("note", "resume")]
    assert events == [("note", 106), ("resume", 50)]
    said = sorted(r.getMessage() for r in caplog.records if "not a step number" in r.getMessage())
    assert said == [
        "trainvitals agent: checkpoint_saved(generation=...) got 2.5, not a step number: the save's step "
        "numbers it; pass a non-negative int (a CPU tensor or numpy integer is read as one)",
        "trainvitals agent: event(step=...) got -1, not a step number: the event takes the agent's step; "
        "pass a non-negative int (a CPU tensor or numpy integer is read as one)",
        "trainvitals agent: loaded(step=...) got a tensor holding 1.5, not a step number: the resume is not "
        "recorded; pass a non-negative int (a CPU tensor or numpy integer is read as one)",
        "trainvitals agent: step(step=...) got -5, not a step number: the agent's own count goes on; pass a "
        "non-negative int (a CPU tensor or numpy integer is read as one)",
    ]
    with collector.app.state.sessionmaker() as session:
        from trainvitals.service.store import queries

        assert queries.count_step_rows(session, run_id="step-kinds") == 7


def _module_hooks(model: nn.Module) -> int:
    return sum(
        len(m._forward_pre_hooks)
        + len(m._backward_pre_hooks)
        + len(m._forward_hooks)
        + len(m._backward_hooks)
        for m in model.modules()
    )


def test_hooks_are_removed_on_close_and_close_is_idempotent(tmp_path: Path) -> None:
    model, opt = _model()
    agent = tv.attach(model, opt, run="r1", config=tv.AgentConfig(collector="", spill_dir=str(tmp_path)))
    assert agent.hooks == 1 + _module_hooks(model) and len(opt._optimizer_step_pre_hooks) == 1
    assert _module_hooks(model) >= 1 + 2  # step timer + one FP8 forward hook on each Linear layer
    agent.close()
    agent.close()
    assert agent.hooks == 0 and len(opt._optimizer_step_pre_hooks) == 0 and _module_hooks(model) == 0


def test_a_step_after_close_is_said_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A loop that closed the agent before its last phase lost every later step in silence."""
    model, opt = _model()
    agent = tv.attach(model, opt, run="r1", config=tv.AgentConfig(collector="", spill_dir=str(tmp_path)))
    _train(agent, model, opt, 2)
    agent.close()
    with caplog.at_level(logging.WARNING, logger="trainvitals.agent"):
        _train(agent, model, opt, 3)
    assert agent.stats()["steps"] == 2
    assert [r.getMessage() for r in caplog.records] == [
        "trainvitals agent: step() after close(): not recorded; attach() again"
    ]


def test_a_step_on_an_agent_a_later_attach_replaced_names_the_agent_to_use(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A second attach() on the same model closes the first agent; a step() on the first told the
    user to "attach() again", which is what they had just done."""
    model, opt = _model()
    first = tv.attach(model, opt, run="r1", config=tv.AgentConfig(collector="", spill_dir=str(tmp_path)))
    second = tv.attach(model, opt, run="r1", config=tv.AgentConfig(collector="", spill_dir=str(tmp_path)))
    caplog.clear()  # the second attach()'s line that it closed the first
    with caplog.at_level(logging.WARNING, logger="trainvitals.agent"):
        _train(first, model, opt, 2)
    assert [r.getMessage() for r in caplog.records] == [
        "trainvitals agent: this agent was replaced by a later attach(); use the agent it returned"
    ]
    second.close()


def test_the_run_id_may_be_the_third_positional_argument(tmp_path: Path) -> None:
    """attach(model, opt, "run-1") raised TypeError (run was keyword-only), though attach() never raises."""
    model, opt = _model()
    agent = tv.attach(model, opt, "run-1", config=tv.AgentConfig(collector="", spill_dir=str(tmp_path)))
    assert isinstance(agent, tv.Agent) and agent.run == "run-1"
    agent.close()


@pytest.mark.parametrize("disabled", [False, True], ids=["enabled", "TRAINVITALS_DISABLE"])
def test_a_token_with_a_space_disables_the_agent_at_attach_not_the_job(
    disabled: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """AgentConfig raised ValueError for such a token from the environment: the job, which builds
    its config before attach() (examples/train_gpt.py), crashed with a traceback, even with
    TRAINVITALS_DISABLE=1. Now attach() says it in one line (never the token) and training goes on."""
    monkeypatch.setenv("TRAINVITALS_TOKEN", "tv_abcdef ghijkl\n")
    if disabled:
        monkeypatch.setenv("TRAINVITALS_DISABLE", "1")
    model, opt = _model()
    with caplog.at_level(logging.WARNING, logger="trainvitals.agent"):
        config = tv.AgentConfig(collector="http://127.0.0.1:9", spill_dir=str(tmp_path))
        agent = tv.attach(model, opt, run="r1", config=config)
    assert isinstance(agent, tv.NoopAgent)
    _train(agent, model, opt, 1)
    lines = [r.getMessage() for r in caplog.records]
    if disabled:
        assert lines == []
        return
    assert lines == [
        "trainvitals agent disabled: the collector token (TRAINVITALS_TOKEN or AgentConfig.token) holds a space "
        "or a control character: pass the token exactly as `trainvitals token create` printed it"
    ]
    assert len(opt._optimizer_step_pre_hooks) == 0 and _module_hooks(model) == 0


def test_agent_errors_never_reach_the_training_loop(tmp_path: Path) -> None:
    model, opt = _model()
    agent = tv.attach(model, opt, run="r1", config=tv.AgentConfig(collector="", spill_dir=str(tmp_path)))
    agent.step(loss=object())  # type: ignore[arg-type] - nonsense input: counted, not raised
    agent.step(loss="not a number")  # type: ignore[arg-type]
    _train(agent, model, opt, 2)  # and the agent keeps working afterwards
    assert agent.stats()["errors"] == 2
    assert agent.stats()["steps"] == 2
    agent.close()


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINVITALS_DISABLE", "1")
    model, opt = _model()
    agent = tv.attach(model, opt, run="r1")
    assert isinstance(agent, tv.NoopAgent)
    assert len(opt._optimizer_step_pre_hooks) == 0
    _train(agent, model, opt, 1)


def test_bad_setup_returns_a_noop_instead_of_raising() -> None:
    agent = tv.attach(None, None, run="bad run id with spaces")
    assert isinstance(agent, tv.NoopAgent)


@pytest.mark.parametrize(
    ("mistake", "said"),
    [
        ("parameters", "got a generator: pass the module itself, not model.parameters()"),
        ("swapped", "got a SGD first and the module second: call attach(model, optimizer)"),
        ("run", "run id 'exp 12/lr=3e-4' (from attach(run=...)) may hold only letters, digits and . _ : -"),
        ("env_run", "run id 'a b' (from $TRAINVITALS_RUN"),
        ("registration", "registration refused: parallelism.tp: Input should be greater than or equal to 1 (got 0)"),
    ],
)
def test_a_mistake_in_attach_is_one_line_that_names_the_fix(
    mistake: str, said: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """attach() never raises, so its one ERROR line is all the user sees of a mistake: it names the
    fix (it was "'generator' object has no attribute 'named_parameters'", or five lines of pydantic)."""
    model, opt = _model()
    monkeypatch.setenv("TRAINVITALS_RUN", "a b")
    args = {
        "parameters": ((model.parameters(), opt), {"run": "r1"}),
        "swapped": ((opt, model), {"run": "r1"}),
        "run": ((model, opt), {"run": "exp 12/lr=3e-4"}),
        "env_run": ((model, opt), {}),
        "registration": ((model, opt), {"run": "r1", "registration": {"parallelism": {"tp": 0}}}),
    }
    positional, named = args[mistake]
    with caplog.at_level(logging.WARNING, logger="trainvitals.agent"):
        agent = tv.attach(*positional, collector="http://127.0.0.1:9", **named)  # type: ignore[arg-type]
    assert isinstance(agent, tv.NoopAgent)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("trainvitals agent disabled: ") and said in line and "\n" not in line
    assert len(opt._optimizer_step_pre_hooks) == 0 and _module_hooks(model) == 0


@pytest.mark.parametrize(
    ("same_model", "same_run", "closes"),
    [(True, True, True), (True, False, True), (False, True, True), (False, False, False)],
    ids=["rerun-cell", "same-model-new-run", "two-models-one-run", "two-models-two-runs"],
)
def test_attaching_again_closes_the_earlier_agent_of_the_model_or_run(
    same_model: bool, same_run: bool, closes: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A re-run attach cell left the first agent's hooks on the model: its FP8 shadow hooks, left on
    by its last step (step 4 of fp8_every_steps=4), ran on every forward from then on, and both
    agents reported as rank 0 of the run. One agent per model and per rank of a run, and one line."""
    model, opt = _model()
    other, other_opt = _model()

    def config() -> tv.AgentConfig:
        return tv.AgentConfig(collector="", spill_dir=str(tmp_path), fp8_every_steps=4)

    first = tv.attach(model, opt, run="nb-1", config=config())
    _train(first, model, opt, 4)
    assert _module_hooks(model) > 0 and len(opt._optimizer_step_pre_hooks) == 1  # shadow hooks on
    model2, opt2 = (model, opt) if same_model else (other, other_opt)
    with caplog.at_level(logging.WARNING, logger="trainvitals.agent"):
        second = tv.attach(model2, opt2, run="nb-1" if same_run else "nb-2", config=config())
    lines = [r.getMessage() for r in caplog.records]
    assert isinstance(second, tv.Agent)
    _train(second, model2, opt2, 3)
    _train(first, model, opt, 2)  # a superseded agent's step() is a no-op
    if closes:
        assert lines == [
            "trainvitals agent: closed the agent attached earlier in this process (run 'nb-1', rank 0, "
            "4 steps) before attaching this one: one agent per model and per rank of a run (re-running "
            "the attach cell does this); to watch two models in one process, give each its own run id"
        ]
        assert first.stats()["steps"] == 4
    else:
        assert lines == [] and first.stats()["steps"] == 6
    second.close()
    # Only an agent left open holds hooks: the second's are gone with it, the first's with it.
    assert (_module_hooks(model) + len(opt._optimizer_step_pre_hooks) == 0) is closes
    first.close()
    assert _module_hooks(model) + len(opt._optimizer_step_pre_hooks) == 0


def test_collector_down_does_not_slow_the_step(tmp_path: Path) -> None:
    model, opt = _model()
    agent = tv.attach(
        model,
        opt,
        run="r1",
        config=tv.AgentConfig(collector="http://127.0.0.1:9", spill_dir=str(tmp_path), send_interval_s=0.05),
    )
    t0 = time.perf_counter()
    _train(agent, model, opt, 50)
    elapsed = time.perf_counter() - t0
    agent.close(timeout=0.5)
    # Generous bound: delivery failures happen on the background thread, never in step().
    assert elapsed < 5.0
    assert agent.stats()["failed_attempts"] >= 1


def test_agent_imports_with_torch_and_pydantic_only() -> None:
    code = (
        "import sys, trainvitals.agent; "
        "bad = [m for m in ('fastapi', 'sqlalchemy', 'prometheus_client', 'uvicorn', 'alembic')"
        " if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_agent_and_its_noop_share_one_protocol(tmp_path: Path) -> None:
    model, opt = _model()
    agent = tv.attach(model, opt, run="r1", config=tv.AgentConfig(collector="", spill_dir=str(tmp_path)))
    assert isinstance(agent, tv.Agent) and isinstance(agent, tv.TrainingAgent)
    assert isinstance(tv.NoopAgent(), tv.TrainingAgent)
    agent.close()

    def params(fn: object) -> list[tuple[str, object, object]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]

    for name, member in vars(tv.TrainingAgent).items():
        if callable(member) and not name.startswith("_") or name in ("__enter__", "__exit__"):
            assert params(getattr(tv.Agent, name)) == params(member) == params(getattr(tv.NoopAgent, name)), name


def test_stats_count_the_records_that_got_through(collector, tmp_path: Path) -> None:
    model, opt = _model()
    config = tv.AgentConfig(
        collector=collector.url, spill_dir=str(tmp_path), record_file=str(tmp_path / "rec.jsonl")
    )
    agent = tv.attach(model, opt, run="r1", config=config)
    _train(agent, model, opt, 3)
    assert agent.flush()
    lines = (tmp_path / "rec.jsonl").read_bytes().splitlines()[1:]
    sent = [r for line in lines for r in Batch.model_validate_json(line).records]
    assert agent.stats()["delivered_records"] == len(sent) > agent.stats()["steps"]  # grad records count too
    agent.close()


_AFTER = " (the next one continues its history, or is refused where its model's dims differ)"


@pytest.mark.parametrize(
    ("env", "argv0", "run", "said"),
    [
        ({}, "/home/u/train_gpt.py", f"run-{socket.gethostname()}-train_gpt",
         f"which every run of this script on this host that names no run shares{_AFTER}"),
        ({}, "-c", f"run-{socket.gethostname()}-0",
         f"which every process without a script (python -c, stdin) on this host that names no run shares{_AFTER}"),
        ({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2"}, "train.py", "run-10.0.0.1-29500",
         f"from MASTER_ADDR-MASTER_PORT, which every job launched on that address and port shares{_AFTER}"),
        ({"SLURM_JOB_ID": "4242", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, "train.py", "slurm-4242",
         "from $SLURM_JOB_ID (a requeue of the job continues it)"),
        ({"TORCHELASTIC_RUN_ID": "sweep-7", "SLURM_JOB_ID": "4242"}, "train.py", "sweep-7", None),  # named
        ({"TORCHELASTIC_RUN_ID": "0c9e4b1e-3a7d-4c52-9f0e-5b8a1d2c3e4f"}, "train.py",
         "0c9e4b1e-3a7d-4c52-9f0e-5b8a1d2c3e4f", "torchrun's rendezvous id, drawn afresh for each launch"),
        ({"TRAINVITALS_RUN": "exp-3", "SLURM_JOB_ID": "4242"}, "train.py", "exp-3", None),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, "train.py",
         "run-10.0.0.1-29500", None),  # rank 0 says it for the job
    ],
)  # fmt: skip
def test_a_run_id_nobody_named_is_said_once_with_who_else_gets_it(
    env: dict[str, str], argv0: str, run: str, said: str | None, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, tmp_path: Path,
) -> None:  # fmt: skip
    """Without run=, every single-process script on a host reported as one run (two toy models tried
    one after the other: the second silently overwrote the first's history), and every job of a
    sweep launched on one node and port too. Now a script and a Slurm job get their own, and the
    id and who else gets it is one line."""
    for name in ("TRAINVITALS_RUN", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "MASTER_ADDR", "MASTER_PORT", "RANK",
                 "WORLD_SIZE"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", [argv0])
    model, opt = _model()
    with caplog.at_level(logging.WARNING, logger="trainvitals.agent"):
        agent = tv.attach(model, opt, config=tv.AgentConfig(collector="", spill_dir=str(tmp_path)))
    assert isinstance(agent, tv.Agent) and agent.run == run
    lines = [r.getMessage() for r in caplog.records if "no run id given" in r.getMessage()]
    if said is None:
        assert lines == []
    else:
        assert lines == [
            f"trainvitals agent: no run id given: this job reports as run {run!r}, {said}; name each run: "
            "attach(run=...) or TRAINVITALS_RUN"
        ]
    agent.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainvitals.agent"):
        named = tv.attach(model, opt, run="mine", config=tv.AgentConfig(collector="", spill_dir=str(tmp_path)))
    assert named.run == "mine" and not [r for r in caplog.records if "no run id given" in r.getMessage()]  # type: ignore[attr-defined]
    named.close()


def test_events_written_the_way_users_write_them_reach_the_collector(
    collector, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A kind of the user's own, a failure's traceback as its detail, a node number as a domain: each
    broke the wire's rules, so the collector refused its whole batch (a 422: every step record of
    the send interval set aside, and refused again on replay). Each now fits, said once."""
    model, opt = _model()
    agent = tv.attach(model, opt, run="events", collector=collector.url,
                      config=tv.AgentConfig(spill_dir=str(tmp_path)))  # fmt: skip
    frames = '  File "train.py", line 1, in step\n' * 200
    traceback = "Traceback (most recent call last):\n" + frames + "OOM: out of memory"
    with caplog.at_level(logging.WARNING, logger="trainvitals.agent"):
        _train(agent, model, opt, 2)
        agent.event("eval", detail="val_loss=0.31")  # type: ignore[arg-type]
        agent.event("eval")  # type: ignore[arg-type]
        agent.event("failure", detail=traceback)
        agent.event("node_replaced", domains={"node": 7, "rack": "r12", **{f"k{i}": i for i in range(20)}})  # type: ignore[dict-item]
        _train(agent, model, opt, 2)
    agent.close()
    assert agent.stats()["rejected_batches"] == 0 and agent.stats()["errors"] == 0
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 3  # once per mistake, not per call
    assert said[0].startswith("trainvitals agent: event('eval') is not a kind the collector takes (failure, ")
    assert said[0].endswith("for a marker of your own, use agent.event('note', detail=...)")
    assert said[1].startswith("trainvitals agent: an event's detail of 7,053 characters is cut to its last 4,096")
    assert said[2] == "trainvitals agent: an event's 22 domains are cut to its first 16"
    with collector.app.state.sessionmaker() as session:
        from trainvitals.service.store import detector_reads, queries

        assert queries.count_step_rows(session, run_id="events") == 4
        stored = [(e.event, e.detail) for e in detector_reads.events(session, run_id="events") if e.event != "start"]
        domains = [e.domains for e in detector_reads.events(session, run_id="events") if e.event == "node_replaced"]
    assert stored[:2] == [("note", "eval: val_loss=0.31"), ("note", "eval")]
    assert stored[2][0] == "failure" and len(stored[2][1]) == 4096 and stored[2][1].endswith("OOM: out of memory")
    assert domains[0]["node"] == "7" and len(domains[0]) == 16


def test_the_jobs_own_ddp_comm_hook_runs_timed(tmp_path: Path) -> None:
    """attach() times DDP's all-reduce with a comm hook, and DDP takes one per model: a job that
    registered its own afterwards (PowerSGD, bf16 compression) got "can only be called once" raised
    into it. The job's hook now runs in the agent's, with its own state, still timed; a second
    registration is refused as DDP refuses it. Real DDP, gloo, one process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = Path(__file__).parent / "dist_scripts" / "comm_hook_job.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path), port], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["calls"] == ["job-state"] * 4  # one bucket a step, the job's state
    assert "can only be called once" in result["second"]
    steps = [r for line in (tmp_path / "rec.jsonl").read_bytes().splitlines()[1:]
             for r in Batch.model_validate_json(line).records if r.kind == "step"]  # fmt: skip
    assert len(steps) == 4 and all(r.wait_seconds is not None and r.wait_seconds >= 0 for r in steps)
