"""Print the detector evaluation table: injected faults (detected? onset vs injection, lead time
before the loss moves, pages raised) and healthy runs (false pages and tickets over many seeds).

    python benchmarks/detector_eval.py [--fault-seeds 10] [--healthy-seeds 30] [--first-seed 0]

Scenarios come from trainvitals.testing.scenarios (seeded, deterministic); detection uses
the default DetectorConfig. 'detect' is the step at which a live collector would have raised the
finding (Finding.detected_step); 'lead' = step the loss starts to move - detect.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

from trainvitals.service.detectors import DetectorConfig, detect
from trainvitals.testing.scenarios import (
    FAULT_FAMILIES,
    HEALTHY_FAMILIES,
    Outcome,
    make_scenario,
    score,
)


def _span(values: list[int]) -> str:
    if not values:
        return "-"
    return f"{min(values)}/{int(statistics.median(values))}/{max(values)}"


def _counts(items: Counter[str]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(items.items())) or "-"


def run(families: tuple[str, ...], seeds: range) -> dict[str, list[Outcome]]:
    out: dict[str, list[Outcome]] = {}
    cfg = DetectorConfig()
    for fam in families:
        out[fam] = [score(sc, detect(sc.series, config=cfg)) for sc in (make_scenario(fam, s) for s in seeds)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault-seeds", type=int, default=10)
    parser.add_argument("--healthy-seeds", type=int, default=30)
    parser.add_argument("--first-seed", type=int, default=0)
    args = parser.parse_args()
    t0 = time.perf_counter()
    window = DetectorConfig().stragglers.window_steps

    faults = run(FAULT_FAMILIES, range(args.first_seed, args.first_seed + args.fault_seeds))
    print(f"Injected faults: {args.fault_seeds} seeds each (from seed {args.first_seed}); "
          "min/median/max over seeds\n")
    header = (f"{'scenario':<23} {'detected':>8}  {'first kind':<22} {'onset-inj':>14} {'detect-inj':>14} "
              f"{'lead (steps)':>16}  {'misdiag':>7}  pages raised (all seeds)")
    print(header)
    print("-" * len(header))
    for fam, outs in faults.items():
        hit = [o for o in outs if o.detected]
        kinds = Counter(o.kind for o in hit if o.kind)
        onset = [o.onset_step - o.injected_step for o in hit
                 if o.onset_step is not None and o.injected_step is not None]
        delay = [o.detected_step - o.injected_step for o in hit
                 if o.detected_step is not None and o.injected_step is not None]
        lead = [o.lead_steps for o in hit if o.lead_steps is not None]
        pages = Counter(k for o in outs for k in set(o.pages))
        mis = sum(1 for o in outs if o.misdiagnosed)
        delay_s = _span(delay)
        if fam in ("straggler", "intermittent_straggler", "slow_stage") and delay:
            delay_s += f" ({statistics.median(delay) / window:.1f} win)"
        print(f"{fam:<23} {len(hit):>3}/{len(outs):<4}  {kinds.most_common(1)[0][0] if kinds else '-':<22} "
              f"{_span(onset):>14} {delay_s:>14} {_span(lead):>16}  {mis:>7}  {_counts(pages)}")
    missed = [o.scenario for outs in faults.values() for o in outs if not o.detected]
    early = [o.scenario for outs in faults.values() for o in outs
             if o.lead_steps is not None and o.lead_steps <= 0]
    print(f"\nmissed: {', '.join(missed) or 'none'}; "
          f"detected only after the loss moved: {', '.join(early) or 'none'}")

    healthy = run(HEALTHY_FAMILIES, range(args.first_seed, args.first_seed + args.healthy_seeds))
    print(f"\nHealthy runs: {args.healthy_seeds} seeds each "
          "(odd seeds: FP8 history L = 1024, even: L = 16)\n")
    header = f"{'family':<22} {'runs':>5} {'paged runs':>10} {'ticketed runs':>13}  pages / tickets raised"
    print(header)
    print("-" * len(header))
    total_pages = 0
    for fam, outs in healthy.items():
        paged = sum(1 for o in outs if o.pages)
        total_pages += sum(len(o.pages) for o in outs)
        ticketed = sum(1 for o in outs if o.tickets)
        pages = Counter(k for o in outs for k in o.pages)
        tickets = Counter(k for o in outs for k in set(o.tickets))
        print(f"{fam:<22} {len(outs):>5} {paged:>10} {ticketed:>13}  pages: {_counts(pages)}; "
              f"tickets: {_counts(tickets)}")
    n_healthy = sum(len(v) for v in healthy.values())
    print(f"\nfalse pages: {total_pages} over {n_healthy} healthy runs; "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
