"""A training run's prefix in verl's layout, on disk and on a real SeaweedFS (127.0.0.1),
with every case the listing must tell apart."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from moe_proxy.demo.seaweed import SeaweedFS

from . import synthetic

ACCESS_KEY = "moe-proxy-ckpt-key"
SECRET_KEY = "ckpt-secret-" + secrets.token_hex(12)
BUCKET = "runs"
HF = "actor/huggingface"


def run_tree() -> dict[str, bytes]:
    """{path relative to the run: bytes}. Steps 50..700, one case each (see CASES)."""
    tree: dict[str, bytes] = {}

    def add(prefix: str, content: dict[str, bytes]) -> None:
        tree.update({f"{prefix}/{name}": data for name, data in content.items()})

    add(f"global_step_50/{HF}", synthetic.files(shards=1))  # a single model.safetensors
    add(f"global_step_100/{HF}", synthetic.files())
    add(f"global_step_200/{HF}", synthetic.files())
    missing = synthetic.files()
    del missing["model-00002-of-00002.safetensors"]  # still uploading
    add(f"global_step_300/{HF}", missing)
    truncated = synthetic.files()
    shard = truncated["model-00002-of-00002.safetensors"]
    truncated["model-00002-of-00002.safetensors"] = shard[: len(shard) - 1000]  # a crashed writer
    add(f"global_step_400/{HF}", truncated)
    no_config = synthetic.files()
    del no_config["config.json"]
    add(f"global_step_500/{HF}", no_config)
    add(f"global_step_600/{HF}", synthetic.files(synthetic.DENSE_TINY))  # a dense model
    add(f"global_step_1000/{HF}", synthetic.files())  # sorts after 700 by number, before by text
    # A proxy of step 200, where ProxyModels put it by default, and one with its manifest elsewhere.
    add(f"global_step_200/{HF}-proxies/team-a/run-step-200", synthetic.files(proxy=True))
    # What else a run writes: FSDP shards, logs, a Hydra config that is not a model.
    tree["global_step_100/actor/model_world_size_2_rank_0.pt"] = b"\0" * 4096
    tree["global_step_100/data.pt"] = b"\0" * 512
    tree["logs/metrics.jsonl"] = b'{"step": 1, "data": {}}\n'
    tree["hydra/config.json"] = b'{"trainer": {"total_epochs": 1}}'
    return tree


@pytest.fixture(scope="session")
def tree() -> dict[str, bytes]:
    return run_tree()


@pytest.fixture(scope="session")
def local_run(tmp_path_factory, tree) -> Path:
    root = tmp_path_factory.mktemp("runs") / "run1"
    for name, data in tree.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory) -> SeaweedFS:
    with SeaweedFS(tmp_path_factory.mktemp("seaweedfs"), ACCESS_KEY, SECRET_KEY, buckets=[BUCKET]) as s3:
        yield s3


@pytest.fixture(scope="session")
def s3_run(seaweed, tree) -> str:
    client = seaweed.client()
    for name, data in tree.items():
        client.put_object(Bucket=BUCKET, Key=f"run1/{name}", Body=data)
    return f"s3://{BUCKET}/run1"


@pytest.fixture
def aws_env(monkeypatch, tmp_path, seaweed) -> dict[str, str]:
    """boto3's standard chain sees exactly these credentials: no ~/.aws, no instance metadata."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
           "AWS_EC2_METADATA_DISABLED": "true"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env
