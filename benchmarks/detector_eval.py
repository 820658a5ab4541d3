"""Print the detector evaluation table: injected faults (detected? onset vs injection, lead time
before the loss moves, pages raised) and healthy runs (false pages and tickets over many seeds).

    python benchmarks/detector_eval.py [--fault-seeds 10] [--healthy-seeds 30] [--first-seed 0] [--jobs 2]

Scenarios come from trainvitals.testing.scenarios (seeded, deterministic); detection uses
the default DetectorConfig. 'detect' is the step at which a live collector would have raised the
finding (Finding.detected_step); 'page' the step it paged (Finding.paged_step; families marked
expect_page count as detected only once paged); 'lead' = step the loss starts to move - detect (or
- page for expect_page families). Healthy runs: 'open at end' counts runs with a ticket still open at
their last step (a benign loss bump's ticket must have closed itself).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from trainvitals.service.detectors import DetectorConfig, detect
from trainvitals.testing.scenarios import (
    FAULT_FAMILIES,
    HEALTHY_FAMILIES,
    LONG_HEALTHY_STEPS,
    Outcome,
    make_scenario,
    score,
)

_WINDOWED = ("straggler", "intermittent_straggler", "slow_stage", "slow_stage_10pct", "shared_host_straggler")
"""Families whose delay is also shown in straggler windows."""


def _span(values: list[int]) -> str:
    if not values:
        return "-"
    return f"{min(values)}/{int(statistics.median(values))}/{max(values)}"


def _ratio_span(values: list[float]) -> str:
    return "/".join(f"{v:.3f}" for v in (min(values), statistics.median(values), max(values))) if values else "-"


def _loss_rise(o: Outcome) -> float:
    """How far the loss had climbed when the finding was raised (the ramp's own size, not the fit)."""
    assert o.detected_step is not None and o.injected_step is not None
    loss = make_scenario(o.family, o.seed).series.steps.loss
    now = float(np.nanmedian(loss[o.detected_step - 250 : o.detected_step + 1]))
    return now / float(np.nanmedian(loss[o.injected_step - 250 : o.injected_step]))


def _counts(items: Counter[str]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(items.items())) or "-"


def _outcome(job: tuple[str, int]) -> Outcome:
    sc = make_scenario(*job)
    return score(sc, detect(sc.series, config=DetectorConfig()))


def run(families: tuple[str, ...], seeds: range, jobs: int) -> dict[str, list[Outcome]]:
    work = [(fam, s) for fam in families for s in seeds]
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(_outcome, work, chunksize=4))
    else:
        results = [_outcome(w) for w in work]
    out: dict[str, list[Outcome]] = {fam: [] for fam in families}
    for o in results:
        out[o.family].append(o)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault-seeds", type=int, default=10)
    parser.add_argument("--healthy-seeds", type=int, default=30)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (this machine has 2 cores)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    window = DetectorConfig().stragglers.window_steps

    faults = run(FAULT_FAMILIES, range(args.first_seed, args.first_seed + args.fault_seeds), args.jobs)
    print(f"Injected faults: {args.fault_seeds} seeds each (from seed {args.first_seed}); "
          "min/median/max over seeds\n")
    header = (f"{'scenario':<23} {'detected':>8}  {'first kind':<22} {'onset-inj':>14} {'detect-inj':>14} "
              f"{'page-inj':>14} {'lead (steps)':>16}  {'misdiag':>7}  pages raised (all seeds)")
    print(header)
    print("-" * len(header))
    for fam, outs in faults.items():
        hit = [o for o in outs if o.detected]
        kinds = Counter(o.kind for o in hit if o.kind)
        onset = [o.onset_step - o.injected_step for o in hit
                 if o.onset_step is not None and o.injected_step is not None]
        delay = [o.detected_step - o.injected_step for o in hit
                 if o.detected_step is not None and o.injected_step is not None]
        paged = [o.paged_step - o.injected_step for o in hit
                 if o.paged_step is not None and o.injected_step is not None]
        lead = [o.lead_steps for o in hit if o.lead_steps is not None]
        pages = Counter(k for o in outs for k in set(o.pages))
        mis = sum(1 for o in outs if o.misdiagnosed)
        delay_s = _span(delay)
        if fam in _WINDOWED and delay:
            delay_s += f" ({statistics.median(delay) / window:.1f} win)"
        print(f"{fam:<23} {len(hit):>3}/{len(outs):<4}  {kinds.most_common(1)[0][0] if kinds else '-':<22} "
              f"{_span(onset):>14} {delay_s:>14} {_span(paged):>14} {_span(lead):>16}  {mis:>7}  "
              f"{_counts(pages)}")
    if "loss_ramp" in faults:
        rises = [_loss_rise(o) for o in faults["loss_ramp"] if o.detected]
        print(f"\nloss_ramp: loss at detection / loss at injection (smoothed, 250 steps) "
              f"min/median/max {_ratio_span(rises)}")
    missed = [o.scenario for outs in faults.values() for o in outs if not o.detected]
    early = [o.scenario for outs in faults.values() for o in outs
             if o.lead_steps is not None and o.lead_steps <= 0]
    print(f"\nmissed: {', '.join(missed) or 'none'}; "
          f"detected only after the loss moved: {', '.join(early) or 'none'}")

    healthy = run(HEALTHY_FAMILIES, range(args.first_seed, args.first_seed + args.healthy_seeds), args.jobs)
    print(f"\nHealthy runs: {args.healthy_seeds} seeds each "
          f"(odd seeds: FP8 history L = 1024, even: L = 16; healthy_long: {LONG_HEALTHY_STEPS:,} steps)\n")
    header = (f"{'family':<22} {'runs':>5} {'paged runs':>10} {'ticketed runs':>13} {'open at end':>11}  "
              "pages / tickets raised")
    print(header)
    print("-" * len(header))
    total_pages = 0
    for fam, outs in healthy.items():
        paged = sum(1 for o in outs if o.pages)
        total_pages += sum(len(o.pages) for o in outs)
        ticketed = sum(1 for o in outs if o.tickets)
        pages = Counter(k for o in outs for k in o.pages)
        tickets = Counter(k for o in outs for k in set(o.tickets))
        still_open = sum(1 for o in outs if o.open_tickets)
        print(f"{fam:<22} {len(outs):>5} {paged:>10} {ticketed:>13} {still_open:>11}  pages: {_counts(pages)}; "
              f"tickets: {_counts(tickets)}")
    n_healthy = sum(len(v) for v in healthy.values())
    print(f"\nfalse pages: {total_pages} over {n_healthy} healthy runs; "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
