"""Arguments several subcommands share."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from moe_proxy.errors import DestinationExists
from moe_proxy.options import StoreOptions, add_arguments, from_args, options_of

# The planner's device options (sizing.SizingOptions fields) that `plan` and `build --experts auto` share.
DEVICE_OPTIONS = ("precision", "accelerator", "device_memory_gb", "devices_per_node", "max_devices")


def add_storage_args(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    add_arguments(p.add_argument_group("object storage (s3:// locations)"), StoreOptions, only=only)


def store_options(args: argparse.Namespace) -> dict:
    """The storage flags given, as storage.open_store's keyword arguments."""
    return from_args(StoreOptions, args).given()


def add_listing_args(p: argparse.ArgumentParser) -> None:
    """Which directories under a prefix are a run's checkpoints (checkpoints, bisect)."""
    p.add_argument("--pattern", metavar="GLOB",
                   help="checkpoint directories relative to the prefix, e.g. 'global_step_*/actor/huggingface' "
                        "(* stays within one path segment, ** spans any); default: every directory with a config.json")
    p.add_argument("--step-regex", metavar="RE", type=regex,
                   help="the step in a directory's relative path: the first group (or the match) of RE; "
                        "default: the path's last integer")


def regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"not a regular expression: {exc}") from None
    return text


def add_device_args(p: argparse.ArgumentParser, max_devices_help: str) -> None:
    from moe_proxy.rl.config import ReproConfig
    from moe_proxy.sizing import ACCELERATORS

    # The training precision the devices are sized for: a ProxyModel's reproduction default (bf16
    # on accelerators), not repro's CPU default (fp32); one option, declared in ReproConfig.
    precision = next(opt for name, opt, _ in options_of(ReproConfig) if name == "precision")
    add_arguments(p, ReproConfig, only=("precision",), defaults={"precision": precision.crd_default},
                  helps={"precision": "the policy's weights and gradients in training (Adam's states are fp32 "
                                      "either way; default: a ProxyModel's spec.reproduction.precision)"})
    p.add_argument("--accelerator", default="huawei.com/Ascend910",
                   help=f"resource name; known: {', '.join(ACCELERATORS)}")
    p.add_argument("--device-memory-gb", type=float, help="memory per device (default: the accelerator's)")
    p.add_argument("--devices-per-node", type=int, default=8,
                   help="devices on one node: runs are sized in whole nodes")
    p.add_argument("--max-devices", type=int, help=max_devices_help)


def device_options(args: argparse.Namespace) -> dict:
    """The device options given, as sizing.SizingOptions keyword arguments."""
    return {k: getattr(args, k) for k in DEVICE_OPTIONS if getattr(args, k, None) is not None}


def add_replace_arg(p: argparse.ArgumentParser, what: str) -> None:
    """--replace, for a command whose --out holds one piece of work (processes.claim_out)."""
    p.add_argument("--replace", action="store_true",
                   help=f"--out holds another {what} (other settings): delete it and start again (without this: "
                        "refused, exit 2; the same settings resume)")


def check_output_dir(location: str, what: str) -> None:
    """Refuse, before any work, a local output directory that is a file or lies under one
    (the write at the end would fail). s3:// prefixes have no such case."""
    if "://" in location:
        return
    path = Path(location).expanduser()
    for there in (path, *path.parents):
        if there.exists():  # the nearest existing one must be a directory
            if not there.is_dir():
                where = "is a file" if there == path else f"is under {there}, a file"
                raise DestinationExists(f"{what} {location} {where}: it must be a directory (new or existing)")
            return
