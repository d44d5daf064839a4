"""`moe-proxy repro CKPT --out RUN_DIR`: RL steps on a checkpoint, metrics and failure onsets;
over several ranks and nodes with `--nproc-per-node` / `--nnodes`, or as one rank of torchrun."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from moe_proxy.metrics.detect import Signature, Thresholds
from moe_proxy.rl.run_options import add_repro_arguments, settings_from_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "repro", help="run GRPO-style RL steps on a checkpoint and record training dynamics",
        description="Run RL post-training steps (GRPO on a built-in arithmetic task, KL to a frozen "
        "reference) on an original or proxy checkpoint. Writes RUN_DIR/metrics.jsonl (verl's "
        "{step, data} lines) and RUN_DIR/summary.json (first step of each failure).")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or s3:// prefix")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="directory for metrics.jsonl and summary.json")
    add_repro_arguments(p)  # every other flag, declared once in moe_proxy.rl.run_options
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    if args.no_progress:  # read by huggingface_hub when transformers loads (here, or in each rank)
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    settings, fail_on = _checked(args)  # before torch loads: a mistake costs no torch import

    from moe_proxy.rl.distributed import DEFAULT_TIMEOUT_S, RankFailed, launched
    common = dict(device=args.device, termination_log=args.termination_log, prompts=args.prompts,
                  timeout_s=args.dist_timeout or DEFAULT_TIMEOUT_S, rank_fault=settings.rank_fault)
    if (args.nproc_per_node or args.nnodes > 1) and not launched():
        return _launch(args, settings.config, fail_on, common)

    from moe_proxy.rl.runner import run_repro  # torch and transformers load only when a run starts

    try:
        result = run_repro(args.checkpoint, args.out, settings.config, fail_on=fail_on, thresholds=Thresholds(),
                           **common)
    except RankFailed as exc:
        print(f"moe-proxy repro: error: {exc}", file=sys.stderr)
        return 1
    if launched() and int(os.environ["RANK"]) != 0:
        return 0
    _print_verdict(args, fail_on, result.signature, result.step, result.steps_completed, result.failures,
                   result.cannot_show)
    return 0


def _checked(args: argparse.Namespace):
    """The run's settings and its --fail-on. Bad arguments and a checkpoint that cannot run are
    refused before a run starts, writing nothing but the termination log; all but the device
    and rank-fault checks before torch loads."""
    from moe_proxy.commands._common import check_output_dir
    from moe_proxy.errors import MoeProxyError
    from moe_proxy.reports import error_report, write_termination_log
    from moe_proxy.rl.source import check_source

    try:
        settings = settings_from_args(args)
        fail_on = Signature.parse(args.fail_on) if args.fail_on else None
        check_output_dir(args.out, "--out")
        check_source(args.checkpoint)
        if args.device:  # whether this torch has the device asked for
            from moe_proxy.rl.device import pick_device

            pick_device(args.device)
    except MoeProxyError as exc:
        if args.termination_log:
            write_termination_log(args.termination_log, error_report(exc))
        raise
    return settings, fail_on


def _launch(args: argparse.Namespace, config, fail_on, common: dict) -> int:
    """Start this node's ranks (torch.distributed.run) and wait for them; node 0 prints the verdict."""
    import json
    import sys

    from moe_proxy.reports import error_report, write_termination_log
    from moe_proxy.rl.device import pick_device
    from moe_proxy.rl.distributed import RankFailed, check_local_ranks
    from moe_proxy.rl.launch import launch

    nproc = args.nproc_per_node or 1
    check_local_ranks(pick_device(args.device).type, nproc)
    if args.prompts:  # bad data is refused here, before any rank starts
        from moe_proxy.rl.task import load_prompts

        load_prompts(args.prompts)
    try:
        launch(args.checkpoint, args.out, config, nproc_per_node=nproc, nnodes=args.nnodes, node_rank=args.node_rank,
               master_addr=args.master_addr, master_port=args.master_port, fail_on=args.fail_on, **common)
    except RankFailed as exc:
        if args.termination_log:  # this node's pod fails with the reason, not a verdict
            write_termination_log(args.termination_log, error_report(exc))
        print(f"moe-proxy repro: error: {exc}", file=sys.stderr)
        return 1
    if args.node_rank != 0:  # rank 0 (node 0) holds the verdict
        print(f"node {args.node_rank}: all {nproc} ranks finished")
        return 0
    summary = json.loads((Path(args.out) / "summary.json").read_text())
    first = summary["first_failure"] or {}
    _print_verdict(args, fail_on, first.get("signature"), first.get("step"), summary["steps_completed"],
                   summary.get("failures") or {}, summary.get("cannot_show"))
    return 0


def _print_verdict(args, fail_on, signature: str | None, step: int | None, steps: int, failures: dict,
                   cannot_show: dict[str, str] | None = None) -> None:
    from moe_proxy.metrics.verdict import verdict_lines

    print("\n".join(verdict_lines(fail_on, signature, step, steps, failures, cannot_show)))
    print(f"metrics: {args.out}/metrics.jsonl  summary: {args.out}/summary.json")
