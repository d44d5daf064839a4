"""`moe-proxy watch METRICS_FILE`: follow another framework's metrics (verl's FileLogger lines,
TensorBoard events, an HF Trainer's trainer_state.json) and write the same verdict as `repro`.
Torch-free: it runs as a sidecar."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def add_parser(subparsers) -> None:
    from moe_proxy.commands._common import add_storage_args
    from moe_proxy.metrics.detect import FAIL_ON_CHOICES, FailOnOption
    from moe_proxy.options import OutputOptions, add_arguments
    from moe_proxy.rl.run_options import PlacementOptions

    p = subparsers.add_parser(
        "watch", help="follow a training run's metrics file and decide whether a failure came back",
        description="Follow METRICS_FILE as it grows (verl FileLogger lines {step, elapsed_seconds, data} or "
        "flat {step, metric: value}; a TensorBoard log directory or event file; an HF Trainer trainer_state.json "
        "or output directory with checkpoint-N/), read its names with the framework's profile (verl, trl, "
        "openrlhf, mindspeed-rl, megatron), apply repro's failure detectors and write the same verdict "
        "({reproduced, signature, step, metrics}) once the failure is seen or the run ends.")
    p.add_argument("metrics_file", metavar="METRICS_FILE", nargs="?", default=os.environ.get("VERL_FILE_LOGGER_PATH"),
                   help="the file or directory to follow, or an s3://bucket/prefix[/file] polled every --poll "
                   "(default: $VERL_FILE_LOGGER_PATH)")
    add_reading_options(p)
    add_arguments(p, FailOnOption, helps={"fail_on": f"the failure to look for: {FAIL_ON_CHOICES}; without it the verdict "
                                               "names the first failure of any kind"})
    add_arguments(p, OutputOptions, only=("termination_log",),
                  helps={"termination_log": "write the verdict JSON here (/dev/termination-log)"})
    p.add_argument("--until-file", metavar="PATH",
                   help="the run has ended once this file exists (the verdict is then written); SIGTERM "
                   "also ends the watch, as Kubernetes stops a native sidecar after the main container")
    p.add_argument("--stop-file", metavar="PATH",
                   help="create this file when the failure is seen, so that the run can be ended")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="give up (an error, no verdict) when the run has not ended by then")
    p.add_argument("--last-step", type=int, metavar="N",
                   help="the run's last step (verl: trainer.total_training_steps): once it is logged the verdict is "
                   "given; a log that shows its own end (TRL's train_runtime, trainer_state.json at max_steps) needs "
                   "no flag")
    p.add_argument("--poll", type=float, default=1.0, metavar="SECONDS",
                   help="how often to read the file (an s3:// location: list the prefix, read the new bytes)")
    p.add_argument("--hold", action="store_true",
                   help="once the verdict is written, stay until SIGTERM (or --until-file): a Kubernetes native "
                   "sidecar that exits is restarted")
    p.add_argument("--ready-file", metavar="PATH",
                   help="create this file once the watch listens for SIGTERM (a sidecar's startupProbe checks "
                   "it, so the main container cannot end before the watch can hear it)")
    add_arguments(p, PlacementOptions, only=("node_rank",), helps={
        "node_rank": "this pod's node rank in a multi-node run; only node 0 has the metrics, so on any other node "
                     "the watch waits for SIGTERM (or --until-file) and writes no verdict"})
    add_storage_args(p, only=("endpoint_url", "region"))
    p.set_defaults(func=run)


def add_reading_options(p) -> None:
    """--format, --profile, --metric: how a run's metrics are read (watch and compare)."""
    p.add_argument("--format", choices=("jsonl", "tensorboard", "trainer-state"),
                   help="the metrics' format (default: detected from the path and its contents)")
    p.add_argument("--profile", metavar="NAME",
                   help="whose metric names: verl, trl, openrlhf, mindspeed-rl, megatron (default: detected "
                   "from the names)")
    p.add_argument("--metric", action="append", metavar="ROLE=NAME",
                   help="read NAME as ROLE (policy_loss, kl, entropy, grad_norm, reward, loss_scale, "
                   "router_logit_max, expert_load, max_activation, ...); repeatable")


def reading_options(args: argparse.Namespace):
    from moe_proxy.metrics.profiles import parse_metric_options, profile_for
    from moe_proxy.metrics.readers import ReadOptions, check_format

    check_format(args.format)
    if args.profile is not None:
        profile_for([], args.profile)  # refused now, not at the first step
    parse_metric_options(args.metric)
    return ReadOptions(args.format, args.profile, tuple(args.metric or ()))


def _wait_for_end(ended, until_file: str | None, poll: float) -> None:
    """Until SIGTERM (`ended`) or the done marker."""
    while not ended.wait(poll):
        if until_file and Path(until_file).exists():
            return


def run(args: argparse.Namespace) -> int:
    from moe_proxy.metrics.watch import sigterm_ends

    with sigterm_ends() as ended:  # first: from here on SIGTERM ends the watch, not the process
        return _run(args, ended)


def _run(args: argparse.Namespace, ended) -> int:
    from moe_proxy.commands._common import store_options
    from moe_proxy.errors import InvalidReproConfig, MoeProxyError
    from moe_proxy.metrics.detect import Signature, Thresholds
    from moe_proxy.metrics.profiles import coverage_lines
    from moe_proxy.metrics.verdict import verdict_lines
    from moe_proxy.metrics.watch import watch
    from moe_proxy.reports import error_report, write_termination_log

    if args.ready_file:
        Path(args.ready_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.ready_file).touch()
    if args.node_rank != 0:
        print(f"node {args.node_rank}: node 0's watcher decides; waiting for the run to end")
        _wait_for_end(ended, args.until_file, args.poll)
        return 0
    try:
        if not args.metrics_file:
            raise InvalidReproConfig("no METRICS_FILE given and $VERL_FILE_LOGGER_PATH is not set")
        fail_on = Signature.parse(args.fail_on) if args.fail_on else None
        if args.last_step is not None and args.last_step < 0:
            raise InvalidReproConfig(f"--last-step {args.last_step}: a step number, 0 or more")
        options = reading_options(args)
        result = watch(args.metrics_file, fail_on=fail_on, thresholds=Thresholds(), until_file=args.until_file,
                       stop_file=args.stop_file, timeout_s=args.timeout, poll_s=args.poll, ended=ended,
                       options=options, last_step=args.last_step, store_options=store_options(args))
    except MoeProxyError as exc:
        if args.termination_log:
            write_termination_log(args.termination_log, error_report(exc))
        raise
    if args.termination_log:
        write_termination_log(args.termination_log, result.report)
    report = result.report
    print("\n".join(verdict_lines(fail_on, report["signature"], report["step"], result.steps, result.failures,
                                  report.get("cannot_show"))))
    print("\n".join(coverage_lines(result.profile, result.names)))
    if args.hold and not result.run_ended:
        _wait_for_end(ended, args.until_file, args.poll)
    return 0
