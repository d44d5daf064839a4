"""`moe-proxy repro CKPT --out RUN_DIR`: RL steps on a checkpoint, metrics and failure onsets;
over several ranks and nodes with `--nproc-per-node` / `--nnodes`, or as one rank of torchrun."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from moe_proxy.options import add_arguments, from_args
from moe_proxy.rl.config import OP_FAULT_MODES, Faults, RankFault, ReproConfig
from moe_proxy.metrics.detect import FAIL_ON_CHOICES, Signature, Thresholds


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "repro", help="run GRPO-style RL steps on a checkpoint and record training dynamics",
        description="Run RL post-training steps (GRPO on a built-in arithmetic task, KL to a frozen "
        "reference) on an original or proxy checkpoint. Writes RUN_DIR/metrics.jsonl (verl's "
        "{step, data} lines) and RUN_DIR/summary.json (first step of each failure).")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory or s3:// prefix")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="directory for metrics.jsonl and summary.json")
    add_arguments(p, ReproConfig, only=("steps", "seed"))
    p.add_argument("--device", help="cpu, cuda, npu, ... (default: NPU, else CUDA, else CPU)")
    p.add_argument("--fail-on", metavar="SIGNATURE",
                   help=f"stop once this failure is seen: {FAIL_ON_CHOICES} (e.g. actor/grad_norm>100:3)")
    p.add_argument("--termination-log", metavar="PATH",
                   help="also write {reproduced, signature, step, metrics} JSON here (Kubernetes' "
                   "/dev/termination-log)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (transformers' weight loading; the launched ranks inherit it)")
    p.add_argument("--prompts", metavar="FILE",
                   help="verl RL data (parquet or JSON lines, local or s3://): each row's chat `prompt` and "
                   "`reward_model.ground_truth`, answers scored by exact match (default: the built-in "
                   "arithmetic task)")

    d = p.add_argument_group("distributed (one run over all ranks; policy and reference sharded with FSDP2)")
    d.add_argument("--nproc-per-node", type=int, metavar="P",
                   help="start P ranks on this node (one per device; any number on the CPU) through "
                   "torch.distributed.run. Under torchrun (RANK/WORLD_SIZE set) the process joins that job instead")
    d.add_argument("--nnodes", type=int, default=1, metavar="N", help="nodes in the run (default 1)")
    d.add_argument("--node-rank", type=int, default=0, metavar="R", help="this node's rank, 0..N-1")
    d.add_argument("--master-addr", metavar="A", help="node 0's address (required with --nnodes > 1)")
    d.add_argument("--master-port", type=int, default=29500, metavar="Q",
                   help="node 0's rendezvous port (with --master-addr)")
    d.add_argument("--dist-timeout", type=float, metavar="SECONDS",
                   help="a collective waiting longer ends the run, naming the rank that is missing (default 600)")

    rl = p.add_argument_group("RL settings (a ProxyModel's spec.reproduction fields)")
    add_arguments(rl, ReproConfig, skip=("steps", "seed"))

    f = p.add_argument_group("fault injection (off by default)")
    f.add_argument("--fault-fp16-no-scaling", type=int, metavar="STEP", help="fp16 without loss scaling from STEP")
    f.add_argument("--fault-lr-spike", metavar="STEP[:FACTOR]", help="multiply the lr of STEP (default x100)")
    f.add_argument("--fault-router-scale", metavar="STEP[:FACTOR]", help="scale router logits from STEP (default x10)")
    f.add_argument("--fault-op", metavar="MODULE@STEP", help="perturb MODULE's output from STEP, e.g. model.layers.1.mlp@5")
    f.add_argument("--fault-op-mode", choices=OP_FAULT_MODES, default="scale",
                   help="scale: output x value; noise: + value x N(0, std(output)); nan: one element made NaN")
    f.add_argument("--fault-op-value", type=float, default=100.0, help="factor (scale) or relative std (noise)")
    f.add_argument("--fault-rank-exit", metavar="RANK@STEP", help="kill rank RANK (SIGKILL) when STEP starts")
    f.add_argument("--fault-rank-hang", metavar="RANK@STEP", help="rank RANK stops answering when STEP starts")
    p.set_defaults(func=run)


def _step_factor(text: str | None, default: float, flag: str) -> tuple[int | None, float]:
    if text is None:
        return None, default
    step, _, factor = text.partition(":")
    try:
        return int(step), float(factor) if factor else default
    except ValueError:
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected STEP or STEP:FACTOR") from None


def config_from_args(args: argparse.Namespace) -> ReproConfig:
    lr_step, lr_factor = _step_factor(args.fault_lr_spike, 100.0, "--fault-lr-spike")
    router_step, router_factor = _step_factor(args.fault_router_scale, 10.0, "--fault-router-scale")
    op_module, op_step = None, None
    if args.fault_op:
        op_module, _, step = args.fault_op.rpartition("@")
        if not op_module or not step.isdigit():
            raise argparse.ArgumentTypeError(f"--fault-op {args.fault_op!r}: expected MODULE@STEP")
        op_step = int(step)
    faults = Faults(fp16_no_scaling_step=args.fault_fp16_no_scaling, lr_spike_step=lr_step,
                    lr_spike_factor=lr_factor, router_scale_step=router_step, router_scale_factor=router_factor,
                    op_module=op_module, op_step=op_step, op_mode=args.fault_op_mode, op_value=args.fault_op_value)
    return from_args(ReproConfig, args, faults=faults)


def run(args: argparse.Namespace) -> int:
    import json
    import sys

    from moe_proxy.commands._common import check_output_dir
    from moe_proxy.errors import InvalidReproConfig, MoeProxyError
    from moe_proxy.reports import error_report, write_termination_log
    from moe_proxy.rl.source import check_source

    if args.no_progress:  # read by huggingface_hub when transformers loads (here, or in each rank)
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    # Bad arguments and a checkpoint that cannot run are refused before a run starts, writing
    # nothing; all but the device and rank-fault checks before torch loads.
    try:
        try:
            config = config_from_args(args)
        except argparse.ArgumentTypeError as exc:
            raise InvalidReproConfig(str(exc)) from None
        if args.nproc_per_node is not None and args.nproc_per_node < 1:
            raise InvalidReproConfig(f"--nproc-per-node {args.nproc_per_node}: at least 1 rank per node")
        if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
            raise InvalidReproConfig(f"--nnodes {args.nnodes} --node-rank {args.node_rank}: the node rank must be "
                                     f"in 0..{args.nnodes - 1}")
        fail_on = Signature.parse(args.fail_on) if args.fail_on else None
        if args.fault_rank_exit and args.fault_rank_hang:
            raise InvalidReproConfig("--fault-rank-exit and --fault-rank-hang: one rank fault at a time")
        rank_fault = (RankFault.parse(args.fault_rank_exit, "exit") if args.fault_rank_exit else
                      RankFault.parse(args.fault_rank_hang, "hang") if args.fault_rank_hang else None)
        check_output_dir(args.out, "--out")
        check_source(args.checkpoint)
        if args.device:  # whether this torch has the device asked for
            from moe_proxy.rl.device import pick_device

            pick_device(args.device)
    except MoeProxyError as exc:
        if args.termination_log:
            write_termination_log(args.termination_log, error_report(exc))
        raise

    from moe_proxy.rl.distributed import DEFAULT_TIMEOUT_S, RankFailed, launched
    common = dict(device=args.device, termination_log=args.termination_log, prompts=args.prompts,
                  timeout_s=args.dist_timeout or DEFAULT_TIMEOUT_S, rank_fault=rank_fault)
    if (args.nproc_per_node or args.nnodes > 1) and not launched():
        from moe_proxy.rl.device import pick_device
        from moe_proxy.rl.distributed import check_local_ranks
        from moe_proxy.rl.launch import launch

        nproc = args.nproc_per_node or 1
        check_local_ranks(pick_device(args.device).type, nproc)
        if args.prompts:  # bad data is refused here, before any rank starts
            from moe_proxy.rl.task import load_prompts

            load_prompts(args.prompts)
        try:
            launch(args.checkpoint, args.out, config, nproc_per_node=nproc, nnodes=args.nnodes,
                   node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                   fail_on=args.fail_on, **common)
        except RankFailed as exc:
            if args.termination_log:  # this node's pod fails with the reason, not a verdict
                write_termination_log(args.termination_log, error_report(exc))
            print(f"moe-proxy repro: error: {exc}", file=sys.stderr)
            return 1
        if args.node_rank != 0:  # rank 0 (node 0) holds the verdict
            print(f"node {args.node_rank}: all {nproc} ranks finished")
            return 0
        summary = json.loads((Path(args.out) / "summary.json").read_text())
        signature, step = (summary["first_failure"] or {}).get("signature"), (summary["first_failure"] or {}).get("step")
        _print_verdict(args, fail_on, signature, step, summary["steps_completed"], summary.get("failures") or {})
        return 0

    from moe_proxy.rl.runner import run_repro  # torch and transformers load only when a run starts

    try:
        result = run_repro(args.checkpoint, args.out, config, fail_on=fail_on, thresholds=Thresholds(), **common)
    except RankFailed as exc:
        print(f"moe-proxy repro: error: {exc}", file=sys.stderr)
        return 1
    if launched() and int(os.environ["RANK"]) != 0:
        return 0
    _print_verdict(args, fail_on, result.signature, result.step, result.steps_completed, result.failures)
    return 0


def _print_verdict(args, fail_on, signature: str | None, step: int | None, steps: int, failures: dict) -> None:
    from moe_proxy.metrics.verdict import verdict_lines

    print("\n".join(verdict_lines(fail_on, signature, step, steps, failures)))
    print(f"metrics: {args.out}/metrics.jsonl  summary: {args.out}/summary.json")
