"""`moe-proxy bisect PREFIX --out DIR --fail-on SIGNATURE [build options] [--dataset ...]
[repro options]`: the earliest checkpoint of a training run whose proxy reproduces the failure,
in O(log n) proxy builds (docs/diagnosis.md, "Where the failure began")."""

from __future__ import annotations

import argparse

from moe_proxy.commands._common import add_listing_args
from moe_proxy.commands.diagnose import add_repro_pass_through


def add_parser(sub) -> None:
    from moe_proxy.commands._common import add_replace_arg
    from moe_proxy.investigate.diagnose import AtOnce, Seeds
    from moe_proxy.metrics.detect import FAIL_ON_CHOICES, FailOnOption
    from moe_proxy.options import add_arguments

    p = sub.add_parser("bisect", help="the earliest checkpoint of a run whose proxy reproduces a failure",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prefix", metavar="PREFIX", help="the run's checkpoints: a directory or s3:// prefix "
                   "(as moe-proxy checkpoints lists them)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="report.json, report.md and probes/step-<N>/ (stats, proxy, run), reused by a rerun")
    add_arguments(p, FailOnOption, required=("fail_on",), helps={"fail_on": f"the failure: {FAIL_ON_CHOICES}"})
    add_listing_args(p)
    p.add_argument("--good", type=int, metavar="STEP", help="a step known clean: the search starts after it "
                   "(probed, to confirm)")
    p.add_argument("--bad", type=int, metavar="STEP", help="a step known to reproduce: the search ends there")
    add_arguments(p, Seeds, defaults={"seeds": 1}, helps={
        "seeds": "runs per probe, on seeds --seed, --seed+1, ...: a checkpoint is bad when it reproduces on any "
                 "seed, clean when every seed ran all its steps without it, else inconclusive"})
    add_arguments(p, AtOnce, only=("parallel",), helps={
        "parallel": "probes a round, side by side (each a build and its runs, with its share of the CPU threads or "
                    "devices of its own): the range left is cut in P + 1 parts a round, so n checkpoints take "
                    "about log_{P+1}(n) rounds; the same answer as one at a time"})
    add_replace_arg(p, "bisection")
    p.set_defaults(func=run)
    add_probe_args(p)


def add_probe_args(p) -> None:
    """How each probe is made: its build, calibration and repro options, passed on as written
    (into build_flags, calibrate_flags, repro_flags; bisect, triage)."""
    from moe_proxy.investigate.bisect import PROBE_BUILD, PROBE_CALIBRATION
    from moe_proxy.options import PruningOptions, TokenOptions, add_pass_through

    p.set_defaults(build_flags=[], calibrate_flags=[], repro_flags=[])
    add_pass_through(p.add_argument_group("build options (each probe's proxy; see moe-proxy build -h)"),
                     PruningOptions, "build_flags", only=PROBE_BUILD)
    add_pass_through(p.add_argument_group("calibration (with --dataset each probe is calibrated on its checkpoint, "
                                          "then built as a calibrated build is)"), TokenOptions, "calibrate_flags",
                     only=PROBE_CALIBRATION)
    add_repro_pass_through(p)


def run(args: argparse.Namespace) -> int:
    import sys

    from moe_proxy.commands._common import check_output_dir
    from moe_proxy.errors import BisectStopped
    from moe_proxy.investigate.bisect import bisect, probe_settings, rounds_line, where
    from moe_proxy.investigate.processes import signals_interrupt

    check_output_dir(args.out, "--out")
    settings = probe_settings(args.fail_on, args.build_flags, args.calibrate_flags, args.repro_flags, args.seeds)
    try:
        with signals_interrupt():  # Ctrl-C or SIGTERM: the probe's child stops, a partial report (Interrupted)
            report = bisect(args.prefix, args.out, settings, args.pattern, args.step_regex, args.good, args.bad,
                            replace=args.replace, parallel=args.parallel)
    except BisectStopped as exc:
        print(f"moe-proxy bisect: error: {exc}; partial report: {args.out}/report.md", file=sys.stderr)
        return 1
    print(f"first bad checkpoint: {where(report['first_bad'])}")
    print(report["boundary"])
    if report["inconclusive"]:
        print("could not judge: " + "; ".join(f"step {c['step']} ({c['why']})" for c in report["inconclusive"]))
    if not report["monotone"]:
        print("not monotone: " + "; ".join(report["not_monotone"]))
    if reused := [str(p["step"]) for p in report["probes"] if p["reused"]]:
        print(f"reused (same checkpoint content, moe-proxy version and flags): the probes of step(s) "
              f"{', '.join(reused)}")
    print(rounds_line(report))
    print(f"report: {args.out}/report.md")
    return 0

