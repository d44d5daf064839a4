"""A real SeaweedFS on 127.0.0.1 for the whole session, a hermetic AWS environment for every
test (credentials only from the variables set here), and a tiny checkpoint uploaded once."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from moe_proxy.demo.seaweed import SeaweedFS
from moe_proxy.demo.tiny import make_tiny

from .helpers import ACCESS_KEY, SECRET_KEY


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory) -> SeaweedFS:
    with SeaweedFS(tmp_path_factory.mktemp("seaweedfs"), ACCESS_KEY, SECRET_KEY, buckets=["ckpt", "proxy"]) as s3:
        yield s3


@pytest.fixture(autouse=True)
def aws_env(monkeypatch, tmp_path, seaweed) -> None:
    """boto3's standard chain sees exactly these credentials: no ~/.aws, no instance metadata."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def prefix() -> str:
    """A fresh key prefix, so tests never see each other's objects."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def local_ckpt(tmp_path_factory) -> Path:
    """Qwen3-MoE, 2 MoE layers x 64 experts, fp32, 2 shards of ~6.5 MB: keeping 8 experts is an
    87.5% pruning; keeping 56 leaves shards over one 5 MiB part (multipart uploads)."""
    path = tmp_path_factory.mktemp("ckpt") / "qwen3"
    make_tiny("qwen3_moe", path, max_shard_size="7MB", hidden_size=128, intermediate_size=256,
              moe_intermediate_size=64, num_experts=64, mlp_only_layers=[])
    return path


@pytest.fixture(scope="session")
def s3_ckpt(seaweed, local_ckpt) -> str:
    """The checkpoint uploaded to s3://ckpt/qwen3 (with boto3 directly, not moe-proxy)."""
    client = seaweed.client()
    for f in sorted(local_ckpt.iterdir()):
        client.upload_file(str(f), "ckpt", f"qwen3/{f.name}")
    return "s3://ckpt/qwen3"
