"""FP8 monitor in shadow mode: the headroom a delayed-scaling recipe would see (fp8.md)."""

import math

import pytest
import torch
from torch import nn

from trainvitals.agent._fp8_monitor import Fp8Monitor
from trainvitals.agent._guard import ErrorBudget
from trainvitals.wire import FP8_MAX


def _run(monitor: Fp8Monitor, model: nn.Module, scale: float) -> tuple[dict, bool]:
    x = torch.full((4, 8), scale)
    x[0, 0] = -scale  # amax is |x|, the sign must not matter
    model(x).sum().backward()
    vec, expensive = monitor.end_step()
    assert vec is not None
    records = monitor.records(0, vec.tolist(), expensive)
    return {(r["tensor"], r["role"]): r for r in records}, expensive


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def test_amax_headroom_lag_and_staleness_follow_delayed_scaling() -> None:
    model = _model()
    mon = Fp8Monitor(
        model,
        history_len=4,
        margin=1,
        amax_algo="max",
        mode="shadow",
        module_filter=lambda n, m: isinstance(m, nn.Linear),
        expensive_every=0,
    )
    first, _ = _run(mon, model, 1.0)
    rec = first[("0", "input")]
    assert rec["amax"] == 1.0 and rec["format"] == "e4m3" and rec["shadow"] is True
    assert "headroom_bits" not in rec  # no history yet: a recipe would have no scale either
    assert first[("0", "grad_output")]["format"] == "e5m2"
    assert first[("0", "weight")]["amax"] == pytest.approx(model[0].weight.abs().max().item())

    steady, _ = _run(mon, model, 1.0)
    assert steady[("0", "input")]["headroom_bits"] == pytest.approx(1.0)  # margin + log2(A/amax) = 1 + 0
    jump, _ = _run(mon, model, 8.0)  # an 8x jump (fp8.md: H = -3 bits at margin 0)
    assert jump[("0", "input")]["headroom_bits"] == pytest.approx(1.0 - 3.0)
    assert jump[("0", "input")]["lag_bits"] == pytest.approx(3.0)
    back, _ = _run(mon, model, 1.0)  # 'max' holds the spike in the history: headroom goes high
    assert back[("0", "input")]["headroom_bits"] == pytest.approx(1.0 + 3.0)
    assert back[("0", "input")]["staleness_steps"] == 0
    later, _ = _run(mon, model, 1.0)
    assert later[("0", "input")]["staleness_steps"] == 1
    for _ in range(3):  # after L = 4 steps the spike leaves the history
        out, _ = _run(mon, model, 1.0)
    assert out[("0", "input")]["headroom_bits"] == pytest.approx(1.0)
    mon.close()


def test_most_recent_algorithm_uses_only_the_last_amax() -> None:
    model = _model()
    mon = Fp8Monitor(
        model,
        history_len=16,
        margin=0,
        amax_algo="most_recent",
        mode="shadow",
        module_filter=lambda n, m: n == "0",
        expensive_every=0,
    )
    _run(mon, model, 4.0)
    out, _ = _run(mon, model, 1.0)
    assert out[("0", "input")]["headroom_bits"] == pytest.approx(2.0)  # log2(4 / 1)
    assert len(out) == 3  # the filter kept one module, three roles
    mon.close()


def test_expensive_tier_counts_saturation_and_underflow_exactly() -> None:
    model = nn.Linear(4, 1, bias=False)
    mon = Fp8Monitor(
        model,
        history_len=1,
        margin=0,
        mode="shadow",
        module_filter=lambda n, m: isinstance(m, nn.Linear),
        expensive_every=2,
    )
    x = torch.ones(2, 4)
    model(x).sum().backward()
    mon.end_step()  # step 0: history [1.0] -> the shadow scale for the next step is 448 / 1
    model(x).sum().backward()
    mon.end_step()  # step 1
    assert mon.expensive_next
    x = torch.tensor([[2.0, 1.0, 1e-6, 0.0], [1.0, 1.0, 1.0, 1.0]])  # history now 1.0 -> s = 448
    model(x).sum().backward()
    vec, expensive = mon.end_step()
    assert expensive
    rec = {r["role"]: r for r in mon.records(2, vec.tolist(), expensive)}["input"]
    # 2.0 * 448 > 448 saturates (1 of 8); 1e-6 * 448 < 2^-10 flushes to zero (1 of 8; exact 0 is not counted).
    assert rec["sat_frac"] == pytest.approx(1 / 8)
    assert rec["underflow_frac"] == pytest.approx(1 / 8)
    assert rec["headroom_bits"] == pytest.approx(-1.0)
    assert rec["nonfinite"] == 0
    assert rec["crest_bits"] == pytest.approx(math.log2(2.0 / 1.0))
    mon.close()
    assert mon.hooks == 0


def test_fp8_max_constants_match_torch() -> None:
    assert FP8_MAX["e4m3"] == torch.finfo(torch.float8_e4m3fn).max
    assert FP8_MAX["e5m2"] == torch.finfo(torch.float8_e5m2).max


def test_recipe_mode_reads_the_emulated_recipe_and_sees_a_jump_clip() -> None:
    """A model that really trains through FP8 (the emulated delayed-scaling Linear): the monitor
    reads the recipe's own amax history and scale, and an 8x jump shows as H = -3 bits (fp8.md)."""
    from trainvitals.agent.fp8_emulation import DelayedScalingRecipe, convert_linears

    model = _model()
    assert convert_linears(model, DelayedScalingRecipe(history_len=8, margin=0)) == 2
    mon = Fp8Monitor(model, mode="auto", expensive_every=0)
    assert {t.recipe for t in mon.tensors} == {True} and len(mon.tensors) == 6
    for _ in range(3):
        steady, _ = _run(mon, model, 1.0)
    assert steady[("0", "input")]["headroom_bits"] == pytest.approx(0.0, abs=1e-6)
    assert steady[("0", "input")]["shadow"] is False
    jump, _ = _run(mon, model, 8.0)
    assert jump[("0", "input")]["headroom_bits"] == pytest.approx(-3.0, abs=1e-6)
    assert jump[("0", "input")]["amax"] == pytest.approx(8.0)
    after, _ = _run(mon, model, 1.0)
    assert after[("0", "input")]["headroom_bits"] == pytest.approx(3.0, abs=1e-6)  # 'max' holds the spike
    mon.close()


def test_recipe_mode_with_history_of_one() -> None:
    from trainvitals.agent.fp8_emulation import DelayedScalingRecipe, convert_linears

    model = _model()
    convert_linears(model, DelayedScalingRecipe(history_len=1, amax_compute_algo="most_recent"))
    mon = Fp8Monitor(model, mode="recipe", history_len=1, amax_algo="most_recent", expensive_every=0)
    _run(mon, model, 2.0)
    out, _ = _run(mon, model, 4.0)
    assert out[("0", "input")]["amax"] == pytest.approx(4.0)
    assert out[("0", "input")]["headroom_bits"] == pytest.approx(-1.0, abs=1e-6)
    mon.close()


def test_agent_reads_recipes_every_step_and_samples_shadow_modules(tmp_path) -> None:
    """Default cadence on a model with one FP8-recipe Linear and one plain Linear: the recipe's
    tensors have a record every step (the cheap tier costs a few reads there), the plain one only
    every fp8_every_steps-th step (its amax is a pass over the activations). A jump on a step the
    shadow hooks skip is still seen in full by the recipe reader, with the scale used that step."""
    import json

    import trainvitals.agent as tv
    from trainvitals.agent.fp8_emulation import DelayedScalingRecipe, convert_linears

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 2))
    assert convert_linears(model[0], DelayedScalingRecipe(history_len=8, margin=0)) == 1  # "0.0" only
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    record = tmp_path / "rec.jsonl"
    config = tv.AgentConfig(collector="", spill_dir=str(tmp_path), record_file=str(record), fp8_ranks="all")
    assert config.fp8_every_steps == 20
    agent = tv.attach(model, opt, run="cadence", config=config)
    try:
        for step in range(25):
            scale = 8.0 if step == 13 else 1.0  # 13: not a shadow-sampled step
            x = torch.full((4, 8), scale)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            agent.step(loss=0.0)
    finally:
        agent.close()
    steps: dict[tuple[str, str], list[int]] = {}
    by_step: dict[int, dict] = {}
    for line in record.read_text().splitlines():
        for r in json.loads(line).get("records", []):
            if r["kind"] == "tensor":
                steps.setdefault((r["tensor"], r["role"]), []).append(r["step"])
                if (r["tensor"], r["role"]) == ("0.0", "input"):
                    by_step[r["step"]] = r
    assert steps[("0.0", "input")] == list(range(25))  # recipe: every step
    assert steps[("2", "input")] == [0, 20]  # shadow: sampled
    assert by_step[13]["amax"] == pytest.approx(8.0) and by_step[13]["headroom_bits"] == pytest.approx(-3.0, abs=1e-6)
    assert by_step[14]["headroom_bits"] == pytest.approx(3.0, abs=1e-6)


def _hooked(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if m._forward_pre_hooks or m._forward_hooks}


def test_module_hooks_exist_only_for_measured_steps(tmp_path) -> None:
    """Off-cadence steps leave the monitored modules without hooks (nn.Module.__call__'s fast path);
    shadow hooks come back for the sampled steps, recipe hooks only for the expensive ones."""
    import trainvitals.agent as tv
    from trainvitals.agent.fp8_emulation import DelayedScalingRecipe, convert_linears

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 2))
    convert_linears(model[0], DelayedScalingRecipe(history_len=8))  # "0.0": recipe; "2": shadow
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    config = tv.AgentConfig(
        collector="", spill_dir=str(tmp_path), fp8_ranks="all", fp8_every_steps=4, fp8_expensive_every_steps=8
    )
    agent = tv.attach(model, opt, run="hooks", config=config)
    hooked: dict[int, set[str]] = {}
    try:
        for step in range(17):
            hooked[step] = _hooked(model) - {""}  # the root module carries the step timer's hook
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            agent.step(loss=0.0)
    finally:
        agent.close()
    assert {s for s, names in hooked.items() if "2" in names} == {0, 4, 8, 12, 16}
    assert {s for s, names in hooked.items() if "0.0" in names} == {8, 16}
    assert _hooked(model) == set() and agent.hooks == 0


def test_sampled_steps_measure_the_same_with_hooks_registered_per_step() -> None:
    """A monitor switched off and on between steps measures exactly what an always-on one does."""
    ref_model, model = _model(), _model()
    kwargs = {"history_len": 4, "mode": "shadow", "expensive_every": 2, "module_filter": lambda n, m: True}
    ref = Fp8Monitor(ref_model, **kwargs)  # type: ignore[arg-type]
    mon = Fp8Monitor(model, **kwargs)  # type: ignore[arg-type]
    for scale in (1.0, 3.0, 0.5, 8.0, 1.0):
        mon.observing = False
        model(torch.randn(4, 8)).sum().backward()  # an off-cadence step: not measured
        mon.observing = True
        a, ea = _run(ref, ref_model, scale)
        b, eb = _run(mon, model, scale)
        assert ea == eb and a == b
    ref.close()
    mon.close()
    assert mon.hooks == 0 and not _hooked(model)


def test_a_bare_linear_is_named_model_not_left_nameless() -> None:
    # The wire refuses a tensor without a name, and with it the whole batch (steps included).
    mon = Fp8Monitor(nn.Linear(4, 4), history_len=4, margin=0, amax_algo="max", mode="shadow", expensive_every=0)
    assert {t.fqn for t in mon.tensors} == {"model"}
    mon.close()


def _expensive_records(*calls: torch.Tensor, first: torch.Tensor | None = None) -> dict:
    """The records by role of an expensive step that calls a module once per tensor in `calls`
    (micro-batches, shared weights); its shadow scale comes from a first step on `first` (default
    ones: history [1.0], e4m3 scale 448)."""
    width = calls[0].shape[-1]
    model = nn.Linear(width, 1, bias=False)
    errors = ErrorBudget()
    mon = Fp8Monitor(model, history_len=1, margin=0, mode="shadow", expensive_every=1, errors=errors)
    model(torch.ones(2, width) if first is None else first).sum().backward()
    mon.end_step()
    assert mon.expensive_next
    for x in calls:
        model(x).sum().backward()
    vec, expensive = mon.end_step()
    assert expensive and vec is not None
    recs = {r["role"]: r for r in mon.records(1, vec.tolist(), expensive)}
    mon.close()
    assert errors.errors == 0  # nothing raised inside a hook
    return recs


def _expensive_input_record(x: torch.Tensor) -> dict:
    """The input record of an expensive step whose shadow scale is 448 (history [1.0], e4m3)."""
    return _expensive_records(x)["input"]


def test_large_tensor_counts_saturation_and_non_finite_exactly_and_samples_underflow() -> None:
    """Above the sample size saturation and non-finite stay exact counts (one element of 2M is
    seen); underflow is estimated from a strided sample that visits every column."""
    torch.manual_seed(0)
    x = torch.rand(2048, 1024) * 0.5 + 0.25  # |x| * 448 well inside e4m3, no underflow
    x[:, 7] = 1e-7  # one column underflows (1e-7 * 448 < 2^-10): 1/1024 of the elements
    x[1000, 3] = 3.0  # saturates: 3 * 448 > 448
    rec = _expensive_input_record(x)
    n = x.numel()
    assert rec["sat_frac"] == pytest.approx(1 / n)
    assert rec["nonfinite"] == 0
    assert rec["underflow_frac"] == pytest.approx(1 / 1024, rel=0.1)
    assert rec["amax"] == pytest.approx(3.0)
    x[5, 5] = math.inf
    x[6, 6] = math.nan
    rec = _expensive_input_record(x)
    assert rec["nonfinite"] == 2


def test_amax_is_the_max_over_the_calls_of_a_step() -> None:
    x = torch.full((4, 8), 0.5)
    x[0, 0] = -2.0  # the second call has the larger |x|, on the negative side
    model = nn.Linear(8, 1, bias=False)
    mon = Fp8Monitor(model, history_len=4, mode="shadow", expensive_every=0)
    model(torch.full((4, 8), 1.0)).sum().backward()
    model(x).sum().backward()
    vec, _ = mon.end_step()
    assert vec is not None
    rec = {r["role"]: r for r in mon.records(0, vec.tolist(), False)}
    assert rec["input"]["amax"] == 2.0
    model(torch.full((4, 8), -0.25)).sum().backward()  # the next step starts afresh
    vec, _ = mon.end_step()
    assert vec is not None
    assert {r["role"]: r for r in mon.records(1, vec.tolist(), False)}["input"]["amax"] == 0.25
    mon.close()


def test_a_validation_pass_inside_a_sampled_step_is_not_measured() -> None:
    """A loop that validates every N steps (N a multiple of fp8_every_steps, as eval intervals are)
    runs its eval forwards while the step's hooks are on: under no_grad or inference_mode they
    must neither set the step's amax nor pay for its reads."""
    model = nn.Linear(8, 2)
    mon = Fp8Monitor(model, history_len=4, mode="shadow", expensive_every=0)
    with torch.no_grad():
        model(torch.full((4, 8), 100.0))  # eval data 100x the training data's scale
    with torch.inference_mode():
        model(torch.full((4, 8), -50.0))
    model(torch.full((4, 8), 1.0)).sum().backward()  # the step's one training micro-batch
    vec, _ = mon.end_step()
    assert vec is not None
    rec = {r["role"]: r for r in mon.records(0, vec.tolist(), False)}
    assert rec["input"]["amax"] == 1.0
    assert rec["grad_output"]["amax"] == 1.0
    mon.close()


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_activation_checkpointing_is_measured_at_its_recompute(use_reentrant: bool) -> None:
    """Reentrant checkpointing runs the first forward under no_grad, which the monitor skips: the
    recompute in backward (grad enabled, the same inputs) is where it sees the module."""
    from torch.utils.checkpoint import checkpoint

    model = nn.Linear(8, 2)
    mon = Fp8Monitor(model, history_len=4, mode="shadow", expensive_every=0)
    x = torch.full((4, 8), 3.0, requires_grad=True)
    checkpoint(model, x, use_reentrant=use_reentrant).sum().backward()
    vec, _ = mon.end_step()
    assert vec is not None
    rec = {r["role"]: r for r in mon.records(0, vec.tolist(), False)}
    assert rec["input"]["amax"] == 3.0
    assert rec["grad_output"]["amax"] == 1.0
    assert rec["weight"]["amax"] == pytest.approx(model.weight.abs().max().item())
    mon.close()


def test_a_module_that_did_not_run_has_no_record_and_keeps_its_history() -> None:
    """A MoE expert no token reached does not run, and nn.MultiheadAttention uses out_proj's weight
    without calling it: every sampled step sent amax 0 for them, and with 'most_recent' the next
    step that ran them had no scale to compare with (the 0 was the newest sample)."""

    class TwoExperts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, route: str) -> torch.Tensor:
            return self.a(x) if route == "a" else self.b(x)

    model = TwoExperts()
    mon = Fp8Monitor(model, history_len=4, amax_algo="most_recent", mode="shadow", expensive_every=0)

    def step(route: str, scale: float) -> dict:
        model(torch.full((2, 4), scale), route).sum().backward()
        vec, _ = mon.end_step()
        assert vec is not None
        return {(r["tensor"], r["role"]): r for r in mon.records(0, vec.tolist(), False)}

    assert {t for t, _ in step("a", 1.0)} == {"a"}  # b did not run: no record of it
    assert {t for t, _ in step("b", 2.0)} == {"b"}
    again = step("a", 1.0)
    assert again[("a", "input")]["amax"] == 1.0
    assert again[("a", "input")]["headroom_bits"] == pytest.approx(0.0)  # against its own last amax, 1.0
    mon.close()

    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    mon = Fp8Monitor(layer, history_len=4, mode="shadow", expensive_every=0)
    layer(torch.randn(2, 3, 8)).sum().backward()
    vec, _ = mon.end_step()
    assert vec is not None
    recorded = {r["tensor"] for r in mon.records(0, vec.tolist(), False)}
    assert recorded == {"linear1", "linear2"}  # not self_attn.out_proj
    mon.close()


def test_expensive_stats_sum_over_the_calls_of_a_step() -> None:
    """Micro-batches, recompute, shared modules: a NaN or a saturated value in the first call of a
    step still counts when a clean call follows (the last call overwrote the first)."""
    clean = torch.full((2, 4), 0.5)
    bad = clean.clone()
    bad[0, 0] = math.nan
    bad[0, 1] = 2.0  # 2 * 448 > 448: saturates
    rec = _expensive_records(bad, clean)["input"]
    assert rec["nonfinite"] == 1
    assert rec["sat_frac"] == pytest.approx(1 / 16)  # summed counts over summed elements
    assert rec["crest_bits"] == pytest.approx(math.log2(0.5 / 0.5))  # the clean call's; the NaN one has none
    tiny = torch.full((2, 4), 1e-7)  # 1e-7 * 448 < 2^-10: every element flushes
    rec = _expensive_records(tiny, clean)["input"]
    assert rec["underflow_frac"] == pytest.approx(8 / 16)
    assert rec["nonfinite"] == 0 and rec["sat_frac"] == 0.0


def test_an_all_zero_tensor_has_no_crest_and_keeps_the_layer_measured() -> None:
    """log2(0 / median) raised inside the forward hook: the error lost the layer's grad_output."""
    recs = _expensive_records(torch.zeros(2, 4))
    assert recs["input"]["amax"] == 0.0
    assert "crest_bits" not in recs["input"]
    assert recs["grad_output"]["amax"] == 1.0  # d sum / d output
    assert recs["grad_output"]["nonfinite"] == 0


def test_crest_is_unknown_when_most_values_are_zero() -> None:
    x = torch.zeros(2, 4)
    x[0, :3] = 1.0  # 3 of 8 non-zero: the median is 0
    rec = _expensive_input_record(x)
    assert "crest_bits" not in rec  # was log2(1 / float32 tiny) = 126 bits
    assert rec["sat_frac"] == 0.0


def test_underflow_is_unknown_before_the_shadow_has_a_scale() -> None:
    # The first step's amax is 0: no scale yet (s = 0), every non-zero value counted as underflow.
    rec = _expensive_records(torch.full((2, 4), 0.5), first=torch.zeros(2, 4))["input"]
    assert "underflow_frac" not in rec
    assert "headroom_bits" not in rec
    assert rec["sat_frac"] == 0.0


def test_recipe_mode_follows_the_recipes_own_history_length_and_algorithm() -> None:
    """Megatron's defaults (L = 1, 'most_recent') under a registration with TE's (1024, 'max'): after a
    spike the lag is back to 0 one step later and nothing goes stale."""
    from trainvitals.agent.fp8_emulation import DelayedScalingRecipe, convert_linears

    model = _model()
    convert_linears(model, DelayedScalingRecipe(history_len=1, amax_compute_algo="most_recent"))
    mon = Fp8Monitor(model, mode="recipe", history_len=1024, amax_algo="max", expensive_every=0)
    outs = [_run(mon, model, scale)[0][("0", "input")] for scale in (1.0, 1.0, 8.0, 1.0, 1.0, 1.0)]
    assert outs[2]["lag_bits"] == pytest.approx(3.0, abs=1e-6)
    assert outs[3]["lag_bits"] == pytest.approx(-3.0, abs=1e-6)  # log2(amax_t / A_{t-1}) = log2(1 / 8)
    assert [o["lag_bits"] for o in outs[4:]] == pytest.approx([0.0, 0.0], abs=1e-6)
    assert [o["staleness_steps"] for o in outs[1:]] == [0] * 5
    mon.close()


def test_recipe_tensors_unlike_the_monitors_history_have_unknown_lag_and_staleness() -> None:
    """A recipe module beside a shadow module: the shared history is the registration's, not the
    recipe's, so the recipe tensors' lag and staleness are not known (headroom still is)."""
    from trainvitals.agent.fp8_emulation import DelayedScalingRecipe, Fp8Linear

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    model[2] = Fp8Linear.from_linear(model[2], DelayedScalingRecipe(history_len=1, amax_compute_algo="most_recent"))
    mon = Fp8Monitor(model, mode="auto", history_len=16, amax_algo="max", expensive_every=0)
    for _ in range(3):
        out, _ = _run(mon, model, 1.0)
    assert "lag_bits" not in out[("2", "input")] and "staleness_steps" not in out[("2", "input")]
    assert out[("2", "input")]["headroom_bits"] == pytest.approx(0.0, abs=1e-6)
    assert out[("0", "input")]["lag_bits"] == pytest.approx(0.0)  # the shadow module's own history
    mon.close()
