"""Print the checkpoint-cadence simulator table and the cost model's calibration report.

For each trace family: the advisor's interval (fitted on a separate history trace) against the
interval with the least simulated waste on a long evaluation trace, and what plain Young/Daly
(M = exposure / raw events, as LLNL SCR counts it) loses.

Cost model: every published calibration point (calibration_points.py) with its prediction and
error, the fitted constants, and the held-out error by regime (hardware, layout, GPU count, source).

    python benchmarks/advisor_report.py [--seed 7] [--eval-mtbfs 20000] [--history-mtbfs 400]
    python benchmarks/advisor_report.py --cost-model     # the cost-model part only (a second)
"""

from __future__ import annotations

import argparse

from trainvitals.service.advisors.cadence import CadenceInputs, advise_cadence
from trainvitals.service.advisors.calibration import (
    REGIME_KEYS,
    calibrate,
    error_table,
    leave_one_source_out,
    point_errors,
)
from trainvitals.service.advisors.calibration_points import SOURCES
from trainvitals.service.advisors.failure_log import analyze_log
from trainvitals.service.advisors.simulator import (
    evaluate_family,
    generate_trace,
    standard_families,
    trace_events,
)

M = 4 * 3600.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--eval-mtbfs", type=float, default=20000, help="evaluation trace length in M")
    parser.add_argument("--history-mtbfs", type=float, default=400, help="history trace length in M")
    parser.add_argument("--cost-model", action="store_true", help="print only the cost-model calibration")
    args = parser.parse_args()
    if args.cost_model:
        cost_model_report()
        return

    print(f"Simulator: M = {M / 3600:.0f} h, stall 60 s, detect 60 s + restart 540 s, seed {args.seed}")
    print(f"history {args.history_mtbfs:.0f} M for fitting, evaluation {args.eval_mtbfs:.0f} M\n")
    header = (f"{'family':<11} {'events':>7} {'rec min':>8} {'rec waste':>9} {'opt min':>8} "
              f"{'opt waste':>9} {'rec excess':>10} {'young min':>9} {'young loss':>10} "
              f"{'daly min':>8} {'daly loss':>9}  rejected by tests")
    print(header)
    print("-" * len(header))
    for family in standard_families(M):
        r = evaluate_family(family, history_horizon_s=args.history_mtbfs * M,
                            eval_horizon_s=args.eval_mtbfs * M, seed=args.seed)
        print(f"{r.family:<11} {r.n_events:>7} {r.recommended_s / 60:>8.1f} {r.recommended_waste:>9.2%} "
              f"{r.optimum_s / 60:>8.1f} {r.optimum_waste:>9.2%} {r.recommended_excess:>10.2%} "
              f"{r.young_s / 60:>9.1f} {r.young_excess:>10.2%} {r.daly_s / 60:>8.1f} "
              f"{r.daly_excess:>9.2%}  {', '.join(r.rejected) or '-'}")
        if r.family == "weibull":
            history = generate_trace(family, horizon_s=args.history_mtbfs * M, seed=args.seed)
            advice = advise_cadence(CadenceInputs(
                stall_s=60, restart_s=540, detect_s=60,
                log=analyze_log(trace_events(history), start_s=0.0, end_s=args.history_mtbfs * M)))
            assert advice.schedule_s is not None and advice.schedule_gain is not None
            weibull_gain = (advice.schedule_s, advice.schedule_gain, advice.shape)
    print("\n'loss' = simulated waste / simulated optimum waste - 1 (waste = wall time not kept as progress)")
    schedule, gain, shape = weibull_gain
    print(f"weibull: fitted shape {shape:.2f}; hazard-adapted schedule after a restart "
          f"{', '.join(f'{s / 60:.0f}' for s in schedule)} min saves {gain:.2%} of wall time (model)")

    print()
    cost_model_report()


def cost_model_report() -> None:
    cal = calibrate()
    print("Cost model calibration (fit on split=fit, errors = predicted/published - 1):")
    errors = point_errors(cal)
    for e in errors:
        print(f"  {e.point.split:<8} {e.point.label:<58} published {e.point.mfu:6.1%}  "
              f"predicted {e.predicted:6.1%}  error {e.error:+6.1%}")
    eta = ", ".join(f"{k} {v:.3f}" for k, v in cal.eta.items())
    print(f"\n  fitted: eta {{{eta}}}; tp_efficiency (fsdp) {cal.tp_efficiency:.3f}; "
          f"h0 {cal.gemm_h0:.0f}; m0 {cal.gemm_m0:.0f}; overlap {cal.overlap:.3f}")
    fit = [e for e in errors if e.point.split == "fit"]
    held = [e for e in errors if e.point.split == "held_out"]
    for name, group in (("fit", fit), ("held-out", held)):
        abs_err = [abs(e.error) for e in group]
        print(f"  {name}: {len(group)} points, mean |error| {sum(abs_err) / len(abs_err):.1%}, "
              f"max {max(abs_err):.1%}")
    for key, by in REGIME_KEYS.items():
        print(f"\n  held-out error by {key}:")
        for group, n, mean, worst in error_table(held, by):
            print(f"    {group:<22} {n:>3} points  mean {mean:6.1%}  max {worst:6.1%}")
    print("\n  leave one source out (fit on the other sources, error on all of this source's points):")
    for source, n, mean, worst in leave_one_source_out():
        print(f"    {source:<22} {n:>3} points  mean {mean:6.1%}  max {worst:6.1%}")
    print("\n  sources: " + "; ".join(f"{k} = {v}" for k, v in SOURCES.items()))

if __name__ == "__main__":
    main()
