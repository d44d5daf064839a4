"""`moe-proxy triage METRICS CHECKPOINTS --out DIR --fail-on SIGNATURE [build options]
[--dataset ...] [repro options]`: the closed loop in one command. Finds the failure in the original
run's own metrics, bisects its checkpoints up to the failing step to the first whose proxy
reproduces it, diagnoses the catalogue's candidates for that failure on that proxy, and writes
one report (docs/triage.md)."""

from __future__ import annotations

import argparse

from moe_proxy.commands._common import add_listing_args, add_replace_arg, add_storage_args
from moe_proxy.commands.bisect import add_probe_args
from moe_proxy.commands.diagnose import add_candidate_args
from moe_proxy.commands.watch import add_reading_options


def add_parser(sub) -> None:
    from moe_proxy.investigate.diagnose import AtOnce, Seeds
    from moe_proxy.metrics.detect import FAIL_ON_CHOICES, FailOnOption
    from moe_proxy.options import add_arguments

    p = sub.add_parser("triage", help="the loop: a failing run's metrics and checkpoints to the first bad "
                       "checkpoint and the fixes that cure it", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", metavar="METRICS", help="the original run's metrics: verl JSON lines, a TensorBoard "
                   "directory or trainer_state.json (as moe-proxy watch reads them), finished or still growing")
    p.add_argument("prefix", metavar="CHECKPOINTS", help="the run's checkpoints: a directory or s3:// prefix "
                   "(as moe-proxy checkpoints lists them)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="report.json, report.md, the pictures, bisect/ and diagnose/ (a rerun reuses what they hold)")
    add_arguments(p, FailOnOption, required=("fail_on",), helps={"fail_on": f"the failure: {FAIL_ON_CHOICES}"})
    add_reading_options(p)
    add_storage_args(p, only=("endpoint_url", "region"))  # an s3:// METRICS (the checkpoints: the environment's)
    add_listing_args(p)
    add_arguments(p, Seeds, helps={"seeds": "runs per probe and per candidate, on seeds --seed, --seed+1, ... (the "
                                            "same seeds: the first bad probe's reproduction is the diagnosis's "
                                            "baseline)"})
    add_candidate_args(p, "; default: the catalogue's for the failure (moe-proxy diagnose --list, docs/triage.md)")
    add_arguments(p, AtOnce, helps={"parallel": "probes a round (bisect) and runs at a time (diagnose), side by side"})
    add_replace_arg(p, "triage")
    p.set_defaults(func=run)
    add_probe_args(p)


def run(args: argparse.Namespace) -> int:
    from moe_proxy.commands._common import check_output_dir, store_options
    from moe_proxy.commands.diagnose import chosen_candidates
    from moe_proxy.commands.watch import reading_options
    from moe_proxy.errors import BaselineFailed, MoeProxyError
    from moe_proxy.investigate.bisect import probe_settings
    from moe_proxy.investigate.processes import signals_interrupt
    from moe_proxy.investigate.triage import TriageSettings, triage

    if args.parallel < 1:
        raise MoeProxyError(f"--parallel {args.parallel}: at least 1")
    check_output_dir(args.out, "--out")
    probe = probe_settings(args.fail_on, args.build_flags, args.calibrate_flags, args.repro_flags, args.seeds)
    settings = TriageSettings(args.metrics, args.prefix, probe, chosen_candidates(args) or None, args.pattern,
                              args.step_regex, reading_options(args), args.parallel, args.all_seeds)
    try:
        with signals_interrupt():  # Ctrl-C or SIGTERM: the child stops, partial reports; the same command resumes
            report = triage(settings, args.out, replace=args.replace, store_options=store_options(args))
    except BaselineFailed as exc:
        import sys

        print(f"moe-proxy triage: error: {exc}; partial reports under {args.out}", file=sys.stderr)
        return 1
    return said(report, args.out)


def said(report: dict, out: str) -> int:
    """The answer on stdout; exit 0 when the loop reached a diagnosis, 3 when there was nothing to
    diagnose (no failure in the log, none before a checkpoint, no checkpoint's proxy reproduces it)."""
    from moe_proxy.investigate.triage import STATE_DIAGNOSED, cost_line
    from moe_proxy.reports import EXIT_NOT_REPRODUCED

    print(report["answer"])
    if cost := report.get("cost"):
        print(cost_line(cost))
    print(f"report: {out}/report.md")
    return 0 if report["state"] == STATE_DIAGNOSED else EXIT_NOT_REPRODUCED
