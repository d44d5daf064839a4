"""Arguments several subcommands share."""

from __future__ import annotations

import argparse
from pathlib import Path

from moe_proxy.errors import DestinationExists

# The planner's device options (sizing.SizingOptions fields) that `plan` and `build --experts auto` share.
DEVICE_OPTIONS = ("precision", "accelerator", "device_memory_gb", "devices_per_node", "max_devices")


def add_storage_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("object storage (s3:// locations)")
    g.add_argument("--endpoint-url", help="S3-compatible endpoint (MinIO, Ceph RGW, OBS); default $AWS_ENDPOINT_URL")
    g.add_argument("--region", help="region; default from the standard AWS configuration chain")
    # Concurrency sized to the store, memory bounded (storage/inflight.py has the rule).
    g.add_argument("--streams", type=int, metavar="N",
                   help="requests in flight each way (reads, uploads); default: the in-flight budget / 2 / read part. "
                        "To fill a link of R MB/s at r MB/s per connection and latency L s: R/r + R*L/part")
    g.add_argument("--max-inflight-mb", type=float, metavar="MB",
                   help="bytes held by reads and uploads in flight, together; default: half of one MoE layer's "
                        "routed experts (64 MiB to 1 GiB), which keeps memory under 1.5 x one layer + 512 MiB")
    g.add_argument("--read-part-mb", type=float, metavar="MB",
                   help="bytes per ranged read, at most (default 8; smaller when --streams would not fit the budget)")


def store_options(args: argparse.Namespace) -> dict:
    pairs = (("endpoint_url", args.endpoint_url), ("region", args.region), ("streams", getattr(args, "streams", None)),
             ("max_inflight_mb", getattr(args, "max_inflight_mb", None)),
             ("read_part_mb", getattr(args, "read_part_mb", None)))
    return {k: v for k, v in pairs if v}


def add_device_args(p: argparse.ArgumentParser, max_devices_help: str) -> None:
    from moe_proxy.sizing import ACCELERATORS, BYTES_PER_PARAM

    p.add_argument("--precision", choices=sorted(BYTES_PER_PARAM), default="bf16",
                   help="the policy's weights and gradients in training (Adam's states are fp32 either way)")
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
