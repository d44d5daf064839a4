"""`moe-proxy plan`: parameters, RL-training memory and accelerator count of an original
checkpoint and of its proxy, from config.json alone (no weights are read)."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

from moe_proxy.commands._common import add_device_args, add_storage_args, store_options
from moe_proxy.errors import CorruptCheckpoint, MoeProxyError
from moe_proxy.options import OutputOptions, PruningOptions, add_arguments, add_size_arguments
from moe_proxy.rl.config import ReproConfig
from moe_proxy.sizing import SizingOptions, estimate, format_sizing, rollout_copy, rollout_snapshots
from moe_proxy.step_cost import StepShape

STEP_HELP = {
    "sequences": "rollouts per RL step, all devices together (prompts x group size)",
    "prompt_tokens": "tokens per prompt",
    "response_tokens": "tokens generated per rollout",
    "updates": "optimizer updates per RL step (PPO mini-batches)",
    "mfu": "achieved fraction of peak FLOP/s in compute-bound phases",
    "hbm_efficiency": "achieved fraction of memory bandwidth in memory-bound phases",
}

ROLLOUT_OPTIONS = ("rollout_precision", "rollout_kernels", "rollout_staleness")
ROLLOUT_HELP = {
    "rollout_precision": "the rollout engine's own weight copy in this precision, resident beside the policy (repro "
                         "--rollout-precision)",
    "rollout_kernels": "the rollout engine's own copy with its own experts kernel (repro --rollout-kernels): in "
                       "--precision unless --rollout-precision says otherwise",
    "rollout_staleness": "rollouts N steps stale (repro --rollout-staleness): the rollout copy and N + 1 snapshots "
                         "of the policy's weights beside it",
}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="accelerators needed for RL on the original and on a proxy (reads config.json only)",
        description=__doc__,
    )
    p.add_argument("checkpoint", help="checkpoint directory, its config.json (a local file of any name), or an "
                                      "s3:// prefix")
    # The proxy's size, spelled and checked as build's (one declaration, in PruningOptions).
    add_size_arguments(p, helps={"experts": "routed experts per layer to keep (a number: build --experts auto picks one "
                                    "by its fidelity figure)"})
    add_arguments(p, PruningOptions, only=("top_k",))
    add_device_args(p, "the proxy's device budget: with --keep-ratio, kept experts are raised to 2 x top-k "
                       "when that fits (default budget: the devices the ratio's proxy needs)")
    p.add_argument("--micro-batch-tokens", type=int, default=SizingOptions.micro_batch_tokens,
                   help="tokens per device per micro-batch (sets the activation memory)")
    step = p.add_argument_group("the RL step, for its time by phase (defaults: a typical GRPO step)")
    for name, help_text in STEP_HELP.items():
        default = getattr(StepShape, name)
        step.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default,
                          metavar="N" if isinstance(default, int) else "X",
                          help=f"{help_text} (default {default})")
    step.add_argument("--no-recompute", action="store_true", help="no activation recomputation in training")
    p.add_argument("--no-reference", action="store_true", help="no frozen reference policy (no KL term)")
    # The rollout engine's flags are repro's own (their choices and ranges declared once, in ReproConfig);
    # here they say what the plan counts for them.
    add_arguments(p, ReproConfig, only=ROLLOUT_OPTIONS, helps=ROLLOUT_HELP)
    add_storage_args(p, only=("endpoint_url", "region"))
    add_arguments(p, OutputOptions, only=("json",))
    p.set_defaults(func=run)


def read_config(location: str, store_options: dict | None = None) -> dict:
    """config.json of a checkpoint given as a directory, the file itself, or an s3:// prefix."""
    from pathlib import Path

    from moe_proxy.storage import open_store  # the S3 client only when asked for

    if location.endswith("config.json") or ("://" not in location and Path(location).is_file()):
        location, name = location.rsplit("/", 1) if "/" in location else (".", location)
    else:
        name = "config.json"
    raw = open_store(location, **(store_options or {})).read_bytes(name)
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise CorruptCheckpoint(f"{location}/{name} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise CorruptCheckpoint(f"{location}/{name} is not a JSON object")
    return config


def run(args: argparse.Namespace) -> int:
    if args.experts == "auto":
        raise MoeProxyError("--experts auto: plan sizes one count; build --experts auto --max-kl X picks the "
                            "smallest count that meets a fidelity target")
    config = read_config(args.checkpoint, store_options(args))
    known = {f.name for f in fields(SizingOptions)}
    workload = StepShape(**{k: getattr(args, k) for k in STEP_HELP}, recompute=not args.no_recompute)
    copy = rollout_copy(args.precision, args.rollout_precision, args.rollout_kernels, args.rollout_staleness)
    opts = SizingOptions(**{k: v for k, v in vars(args).items() if k in known and v is not None},
                         reference=not args.no_reference, workload=workload, rollout_copy=copy,
                         rollout_snapshots=rollout_snapshots(args.rollout_staleness))
    result = estimate(config, opts)
    print(json.dumps(result.summary(), indent=2) if args.json else format_sizing(result))
    return 0
