"""`moe-proxy bisect PREFIX --out DIR --fail-on SIGNATURE [build options] [--dataset ...]
[repro options]`: the earliest checkpoint of a training run whose proxy reproduces the failure,
in O(log n) proxy builds (docs/diagnosis.md, "Where the failure began")."""

from __future__ import annotations

import argparse
from dataclasses import fields

from moe_proxy.commands.diagnose import OWN, pass_through

# The build options a probe's build takes (the selection seed and the calibration are bisect's:
# --seed is repro's here, and each probe is calibrated on its own checkpoint).
NOT_BUILD = {"seed", "calibration", "max_kl"}
CALIBRATION = {"dataset", "samples", "seq_len"}  # calibrate's token options a probe uses


def add_parser(sub) -> None:
    from moe_proxy.commands._common import add_replace_arg
    from moe_proxy.options import PruningOptions
    from moe_proxy.metrics.detect import FAIL_ON_CHOICES

    p = sub.add_parser("bisect", help="the earliest checkpoint of a run whose proxy reproduces a failure",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prefix", metavar="PREFIX", help="the run's checkpoints: a directory or s3:// prefix "
                   "(as moe-proxy checkpoints lists them)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="report.json, report.md and probes/step-<N>/ (stats, proxy, run), reused by a rerun")
    p.add_argument("--fail-on", required=True, metavar="SIGNATURE",
                   help=f"the failure: {FAIL_ON_CHOICES}")
    p.add_argument("--pattern", metavar="GLOB", help="checkpoint directories to consider (as in checkpoints)")
    p.add_argument("--step-regex", metavar="RE", help="the step in a checkpoint's path (as in checkpoints)")
    p.add_argument("--good", type=int, metavar="STEP", help="a step known clean: the search starts after it "
                   "(probed, to confirm)")
    p.add_argument("--bad", type=int, metavar="STEP", help="a step known to reproduce: the search ends there")
    p.add_argument("--seeds", type=int, default=1, metavar="N",
                   help="runs per probe, on seeds --seed, --seed+1, ...: a checkpoint is bad when it reproduces on "
                   "any seed, clean when every seed ran all its steps without it, else inconclusive")
    add_replace_arg(p, "bisection")
    p.set_defaults(func=run, build_flags=[], calibrate_flags=[], repro_flags=[])
    only = {f.name for f in fields(PruningOptions)} - NOT_BUILD | {"pin"}  # --pin: dest pin, field pins
    pass_through(p.add_argument_group("build options (each probe's proxy; see moe-proxy build -h)"), "build",
                 "build_flags", set(), only=only)
    pass_through(p.add_argument_group("calibration (with --dataset each probe is calibrated on its checkpoint, "
                                      "then built as a calibrated build is)"), "calibrate", "calibrate_flags", set(),
                 only=CALIBRATION)
    pass_through(p.add_argument_group("repro options (each probe's reproduction; see moe-proxy repro -h)"), "repro",
                 "repro_flags", OWN)


def settings_of(args: argparse.Namespace):
    """The probes' settings, every flag checked by its command's parser before anything runs."""
    from moe_proxy.errors import MoeProxyError
    from moe_proxy.options import SELECTION, to_args
    from moe_proxy.investigate.bisect import ProbeSettings, build_options
    from moe_proxy.metrics.detect import Signature
    from moe_proxy.investigate.diagnose import repro_config
    from moe_proxy.investigate.processes import parse_as

    Signature.parse(args.fail_on)
    if args.seeds < 1:
        raise MoeProxyError(f"--seeds {args.seeds}: at least 1")
    try:
        options = build_options(args.build_flags)
    except MoeProxyError as exc:
        raise MoeProxyError(f"the build options: {exc}") from None
    calibrate = []
    if args.calibrate_flags:
        if "--dataset" not in args.calibrate_flags:
            raise MoeProxyError("--samples / --seq-len calibrate each probe: they need --dataset")
        # as the default calibrated build: sequential statistics for the build's count, else one pass
        calibrate = args.calibrate_flags + (to_args(options, only=("experts", *SELECTION), always=("experts",))
                                            if isinstance(options.experts, int) else ["--one-pass"])
        parse_as("calibrate", ["SRC", "--out", "STATS", *calibrate])
    try:
        first_seed = repro_config("PROXY", args.repro_flags).seed
    except MoeProxyError as exc:
        raise MoeProxyError(f"the repro options: {exc}") from None
    return ProbeSettings(args.fail_on, list(args.build_flags), calibrate, list(args.repro_flags), args.seeds,
                         first_seed)


def run(args: argparse.Namespace) -> int:
    import sys

    from moe_proxy.commands._common import check_output_dir
    from moe_proxy.errors import BisectStopped
    from moe_proxy.investigate.bisect import bisect, where
    from moe_proxy.investigate.processes import signals_interrupt

    check_output_dir(args.out, "--out")
    settings = settings_of(args)
    try:
        with signals_interrupt():  # Ctrl-C or SIGTERM: the probe's child stops, a partial report (Interrupted)
            report = bisect(args.prefix, args.out, settings, args.pattern, args.step_regex, args.good, args.bad,
                            replace=args.replace)
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
    print(f"report: {args.out}/report.md")
    return 0

