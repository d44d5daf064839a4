"""Arguments several subcommands share."""

from __future__ import annotations

import argparse


def add_storage_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("object storage (s3:// locations)")
    g.add_argument("--endpoint-url", help="S3-compatible endpoint (MinIO, Ceph RGW, OBS); default $AWS_ENDPOINT_URL")
    g.add_argument("--region", help="region; default from the standard AWS configuration chain")


def store_options(args: argparse.Namespace) -> dict:
    return {k: v for k, v in (("endpoint_url", args.endpoint_url), ("region", args.region)) if v}
