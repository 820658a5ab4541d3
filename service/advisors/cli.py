"""argparse subcommands `plan` and `advise`; the only advisor module besides the log loaders that does I/O.

The console script registers them with `add_plan_parser(subparsers)` and
`add_advise_parser(subparsers)`; each sets `func(args) -> int` (0 ok, 1 does not fit / infeasible,
2 bad input). Standalone: `python -m trainvitals.service.advisors.cli plan --config cfg.yaml --json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from trainvitals.service.advisors.cadence import CadenceAdvice, CadenceInputs, TierSpec, advise_cadence
from trainvitals.service.advisors.cost_model import PlanResult, plan
from trainvitals.service.advisors.failure_log import RADIUS_LEVELS, analyze_log, load_events
from trainvitals.service.advisors.model_config import parse_plan_input
from trainvitals.service.advisors.recommend import (
    DEFAULT_CRITICAL_BATCH_TOKENS,
    Recommendation,
    recommend_from_config,
)
from trainvitals.service.json_output import to_json  # inf (a tier no incident reaches): null

GIB = 1024**3


def _load_config(path: str) -> dict[str, Any]:
    text = Path(path).read_text(encoding="utf-8")
    if path.endswith(".json"):
        data = json.loads(text)
    else:
        data = yaml.safe_load(text)  # YAML is a superset of JSON
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping")
    return data


def _format_plan(result: PlanResult) -> str:
    m, s, f = result.memory, result.step, result.mfu
    lines = [
        f"params: {result.params_total / 1e9:.2f} B total, {result.params_active / 1e9:.2f} B active",
        f"memory per GPU: params {m.params / GIB:.1f} + grads {m.grads / GIB:.1f} + optimizer "
        f"{m.optimizer / GIB:.1f} + activations {m.activations / GIB:.1f} + overhead {m.overhead / GIB:.1f} "
        f"= {m.total / GIB:.1f} GiB of {m.capacity / GIB:.0f} GiB -> {'fits' if m.fits else 'DOES NOT FIT'}",
        f"step: {s.total_s:.2f} s = compute {s.compute_s:.2f} + tp {s.tp_comm_s:.2f} + cp {s.cp_comm_s:.2f} "
        f"+ pp {s.pp_comm_s:.2f} + ep {s.ep_comm_s:.2f} + bubble {s.bubble_s:.2f} "
        f"+ exposed dp {s.dp_comm_exposed_s:.2f}",
        f"tokens/s: {result.tokens_per_s:,.0f}",
        f"MFU: {f.predicted:.1%} (band {f.low:.1%}-{f.high:.1%}, +-{f.band:.0%} from {f.regime or 'no regime'}"
        f"{'' if f.in_domain else '; outside the calibrated domain'})",
        f"binding wall: {result.binding_wall}",
    ]
    lines += [f"assumes: {d}" for d in result.defaults]
    lines += [f"warning: {w}" for w in result.warnings]
    return "\n".join(lines)


def _format_recommendation(rec: Recommendation) -> str:
    lines = [f"rung: {s.wall} -> {s.axis} ({s.detail})" for s in rec.steps]
    if rec.config is None:
        lines.append("no layout fits" + (f"; minimum GPUs: {rec.min_gpus}" if rec.min_gpus else ""))
    else:
        c = rec.config
        lines.append(
            f"config: tp={c.tp} cp={c.cp} pp={c.pp} vpp={c.vpp} dp={c.dp} ep={c.ep} zero={c.zero} "
            f"micro_batch={c.micro_batch} global_batch={c.global_batch}"
            + (" uneven_stages" if c.uneven_stages else "")
        )
        assert rec.result is not None
        lines.append(_format_plan(rec.result))
    lines += [f"warning: {w}" for w in rec.warnings if rec.result is None or w not in rec.result.warnings]
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    """`trainvitals plan`."""
    try:
        data = _load_config(args.config)
        if args.recommend:
            rec = recommend_from_config(data, critical_batch_tokens=args.critical_batch_tokens)
            print(to_json(rec.as_dict()) if args.json else _format_recommendation(rec))
            return 0 if rec.feasible else 1
        result = plan(parse_plan_input(data))
    except (ValueError, OSError, yaml.YAMLError) as exc:
        print(f"trainvitals plan: {exc}", file=sys.stderr)
        return 2
    print(to_json(result.as_dict()) if args.json else _format_plan(result))
    return 0 if result.memory.fits else 1


def _parse_tier(text: str) -> TierSpec:
    parts = text.split(":")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"--tier: expected NAME:COST_S:SURVIVES, got {text!r}")
    try:
        return TierSpec(name=parts[0], cost_s=float(parts[1]), survives=parts[2])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _parse_mix(text: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for item in text.split(","):
        radius, _, share = item.partition("=")
        if radius not in RADIUS_LEVELS:
            raise argparse.ArgumentTypeError(
                f"--radius-mix: unknown radius {radius!r} ({', '.join(RADIUS_LEVELS)})"
            )
        mix[radius] = float(share)
    return mix


def _format_advice(a: CadenceAdvice) -> str:
    def mins(s: float) -> str:
        return f"{s / 60:.1f} min"

    lines = [
        f"recommended interval: {mins(a.recommended_interval_s)} (flat-basin band {mins(a.band_s[0])}-"
        f"{mins(a.band_s[1])}; confidence band {mins(a.confidence_band_s[0])}-"
        f"{mins(a.confidence_band_s[1])})",
        f"young {mins(a.young_interval_s)}, daly {mins(a.daly_interval_s)}, exact optimum "
        f"{mins(a.optimal_interval_s)}",
        f"expected waste: {a.expected_waste:.2%} of wall time (young: {a.expected_waste_young:.2%})",
        f"failure rate: MTBF {a.mtbf_s / 3600:.3g} h "
        + ("(given)" if a.incidents is None else f"from {a.incidents} incident(s) of the log"),
        f"retention: keep {a.retention.keep} generations (risk {a.retention.risk_at_keep:.2g})"
        + (f", 1 of every {a.retention.keep_every}" if a.retention.keep_every > 1 else ""),
    ]
    lines += [f"tier {t.name}: every {mins(t.interval_s)}" for t in a.tiers]
    if a.schedule_s:
        lines.append(
            "after a restart: "
            + ", ".join(mins(s) for s in a.schedule_s)
            + f" (saves {a.schedule_gain:.2%} of wall time)"
        )
    lines += [f"assumes: {x}" for x in a.assumptions] + [f"warning: {w}" for w in a.warnings]
    return "\n".join(lines)


def run_advise(args: argparse.Namespace) -> int:
    """`trainvitals advise`."""
    try:
        log = None
        if args.events:
            # `is not None` throughout: a 0 given is refused by the advisor, not read as "not given".
            exposure = args.exposure_h * 3600 if args.exposure_h is not None else None
            log = analyze_log(
                load_events(args.events),
                exposure_s=exposure,
                window_s=args.window_s,
                restart_s=args.restart_s,
                domain_window_s=args.domain_window_s,
            )
        mtbf = args.mtbf_s if args.mtbf_s is not None else (args.mtbf_h * 3600 if args.mtbf_h is not None else None)
        if log is None and mtbf is None:
            raise ValueError("give --mtbf-s/--mtbf-h or --events FILE")
        latency = (
            args.sdc_latency_s
            if args.sdc_latency_s is not None
            else (args.sdc_latency_h * 3600 if args.sdc_latency_h is not None else None)
        )
        advice = advise_cadence(
            CadenceInputs(
                stall_s=args.stall_s,
                persist_s=args.persist_s,
                mtbf_s=mtbf,  # with a log: the prior for one of too few incidents
                log=log,
                restart_s=args.restart_s,
                detect_s=args.detect_s,
                sdc_latency_s=latency,
                acceptable_risk=args.risk,
                checkpoint_bytes=args.checkpoint_gib * GIB if args.checkpoint_gib is not None else None,
                storage_budget_bytes=(
                    args.storage_budget_gib * GIB if args.storage_budget_gib is not None else None
                ),
                tiers=tuple(args.tier or ()),
                radius_mix=args.radius_mix,
            )
        )
    except (ValueError, OSError) as exc:
        print(f"trainvitals advise: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = advice.as_dict()
        if log is not None:
            out["log"] = {
                "events": log.n_events,
                "incidents": log.n_incidents,
                "counted": log.n_counted,
                "cluster_factor": log.cluster_factor,
                "exposure_s": log.exposure_s,
                "exposure_given": log.exposure_given,
                "rate_per_hour": log.rate_per_s * 3600,
                "rate_ci_per_hour": [r * 3600 for r in log.rate_ci_per_s],
                "radius_counts": log.radius_counts,
                "tests": {
                    t.name: {
                        "estimate": t.estimate,
                        "ci": t.ci,
                        "p_value": t.p_value,
                        "rejects": t.rejects,
                        "detail": t.detail,
                    }
                    for t in (
                        log.tests.dispersion,
                        log.tests.cv,
                        log.tests.weibull,
                        log.tests.trend,
                        log.tests.cascade,
                    )
                    if t is not None
                },
            }
        print(to_json(out))
    else:
        print(_format_advice(advice))
    return 0


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `plan` on an argparse subparsers object."""
    p = subparsers.add_parser("plan", help="predict memory, step time and MFU for a parallelism config")
    p.add_argument("--config", required=True, help="JSON or YAML file with model, parallelism, hardware")
    p.add_argument("--recommend", action="store_true", help="climb the ladder and choose tp/pp/dp/ep")
    p.add_argument(
        "--critical-batch-tokens",
        type=float,
        default=DEFAULT_CRITICAL_BATCH_TOKENS,
        help="tokens per step past which more data parallelism stops helping",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run_plan)
    return p


def add_advise_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `advise` on an argparse subparsers object."""
    p = subparsers.add_parser("advise", help="checkpoint interval, bands and retention")
    p.add_argument("--stall-s", type=float, required=True, help="training blocked per checkpoint, s")
    p.add_argument("--persist-s", type=float, default=0.0, help="async lag until durable, s (0 = sync)")
    p.add_argument("--mtbf-s", type=float, help="job-level mean time between interruptions, s")
    p.add_argument("--mtbf-h", type=float, help="the same in hours (with --events: the prior for a thin log)")
    p.add_argument("--events", help="failure event log (CSV or JSON)")
    p.add_argument("--exposure-h", type=float, help="observed period of the log, hours")
    p.add_argument(
        "--window-s", type=float, help="incident merge window (default max(300, median restart, else --restart-s))"
    )
    p.add_argument(
        "--domain-window-s",
        type=float,
        default=3600.0,
        help="merge window for events sharing a failure-domain tag, s",
    )
    p.add_argument("--restart-s", type=float, default=600.0, help="restart/recovery time R, s")
    p.add_argument("--detect-s", type=float, default=60.0, help="failure detection time D, s")
    p.add_argument("--sdc-latency-s", type=float, help="mean SDC detection latency, s")
    p.add_argument("--sdc-latency-h", type=float, help="the same in hours")
    p.add_argument("--risk", type=float, default=0.01, help="acceptable probability of an unrecoverable SDC")
    p.add_argument("--checkpoint-gib", type=float, help="size of one checkpoint generation, GiB")
    p.add_argument("--storage-budget-gib", type=float, help="storage for retained generations, GiB")
    p.add_argument(
        "--tier",
        type=_parse_tier,
        action="append",
        help="NAME:COST_S:SURVIVES, fastest first (SURVIVES in rank,node,rack,pod,cluster)",
    )
    p.add_argument("--radius-mix", type=_parse_mix, help="without a log: e.g. node=0.9,rack=0.1")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run_advise)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point until the `trainvitals` console script wires these in."""
    parser = argparse.ArgumentParser(prog="trainvitals-advisors")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    add_advise_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
