"""Print the checkpoint-cadence simulator table (and the cost model's fit on seed 002).

For each trace family: the advisor's interval (fitted on a separate history trace) against the
interval with the least simulated waste on a long evaluation trace, and what plain Young/Daly
(M = exposure / raw events, as LLNL SCR counts it) loses.

    python benchmarks/advisor_report.py [--seed 7] [--eval-mtbfs 20000] [--history-mtbfs 400]
"""

from __future__ import annotations

import argparse

from trainvitals.service.advisors.cadence import CadenceInputs, advise_cadence
from trainvitals.service.advisors.cost_model import (
    DEFAULT_CALIBRATION,
    HELD_OUT_ROWS,
    SEED_002_ROWS,
    relative_errors,
)
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
    args = parser.parse_args()

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

    print("\nCost model fit on seed 002 (H200, KempnerForge configs):")
    for label, rows in (("fit set (seed 002)", SEED_002_ROWS), ("held-out rows", HELD_OUT_ROWS)):
        errs = relative_errors(DEFAULT_CALIBRATION, rows)
        for row, err in zip(rows, errs, strict=True):
            print(f"  {row.label:<28} measured {row.mfu:6.1%}  predicted {row.mfu * (1 + err):6.1%}  "
                  f"error {err:+6.1%}")
        print(f"  {label}: mean |error| {abs(errs).mean():.1%}, max {abs(errs).max():.1%}")
    c = DEFAULT_CALIBRATION
    print(f"  leave-one-out on the fit set: mean {c.loo_mean_abs_error:.1%}, max {c.loo_max_abs_error:.1%}; "
          f"eta {c.eta:.3f}, tp_efficiency {c.tp_efficiency:.3f}, dp_exposed {c.dp_exposed:.3f}")


if __name__ == "__main__":
    main()
