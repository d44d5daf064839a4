"""Clear errors, never a credential value: missing bucket or key, wrong or missing credentials,
too little permission, an endpoint that does not answer; and the standard credential chain."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moe_proxy.checkpoint.reader import open_checkpoint
from moe_proxy.errors import AccessDenied, CorruptCheckpoint, EndpointUnreachable, ObjectNotFound
from moe_proxy.demo.seaweed import SeaweedFS, free_ports
from moe_proxy.storage import open_store, write_bytes
from .helpers import ACCESS_KEY, SECRET_KEY


def opts(seaweed, **more) -> dict:
    return {"endpoint_url": seaweed.endpoint_url, **more}


def test_missing_bucket(seaweed):
    with pytest.raises(ObjectNotFound, match="bucket 'no-such-bucket' does not exist"):
        open_checkpoint("s3://no-such-bucket/model", **opts(seaweed))
    with pytest.raises(ObjectNotFound, match="bucket 'no-such-bucket' does not exist"):
        open_store("s3://no-such-bucket/model", **opts(seaweed)).list()


def test_missing_objects(seaweed, s3_ckpt, prefix):
    with pytest.raises(CorruptCheckpoint, match=f"s3://ckpt/{prefix}: no config.json"):
        open_checkpoint(f"s3://ckpt/{prefix}", **opts(seaweed))
    store = open_store(s3_ckpt, **opts(seaweed))
    for read in (lambda: store.size("nope.safetensors"), lambda: store.read_range("nope.safetensors", 0, 8),
                 lambda: store.read_bytes("nope.json")):
        with pytest.raises(ObjectNotFound, match=r"s3://ckpt/qwen3/nope\.\w+: no such object"):
            read()


def test_shard_named_in_index_but_missing(seaweed, s3_ckpt, prefix):
    client = seaweed.client()
    for name in ("config.json", "model.safetensors.index.json"):
        client.copy_object(Bucket="ckpt", Key=f"{prefix}/{name}", CopySource={"Bucket": "ckpt", "Key": f"qwen3/{name}"})
    with pytest.raises(CorruptCheckpoint, match="missing: model-00001-of-00002.safetensors"):
        open_checkpoint(f"s3://ckpt/{prefix}", **opts(seaweed))


def assert_no_secret(text: str) -> None:
    assert SECRET_KEY not in text and ACCESS_KEY not in text and "wrong-secret" not in text


def test_wrong_secret(seaweed, s3_ckpt, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    with pytest.raises(AccessDenied, match="secret key does not match") as info:
        open_checkpoint(s3_ckpt, **opts(seaweed))
    assert "credentials from: env" in str(info.value)
    assert_no_secret(str(info.value))


def test_unknown_access_key(seaweed, s3_ckpt, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
    with pytest.raises(AccessDenied, match="does not know this access key") as info:
        open_store(s3_ckpt, **opts(seaweed)).read_bytes("config.json")
    assert "AKIAUNKNOWNKEY" not in str(info.value)


def test_no_credentials(seaweed, s3_ckpt, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(AccessDenied, match="no usable AWS credentials"):
        open_store(s3_ckpt, **opts(seaweed)).read_bytes("config.json")


def test_read_only_identity_cannot_write(seaweed, prefix, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", SeaweedFS.READONLY[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SeaweedFS.READONLY[1])
    store = open_store(f"s3://proxy/{prefix}", **opts(seaweed))
    with pytest.raises(AccessDenied, match="access denied for put_object"):
        write_bytes(store, "config.json", b"{}")


def test_unreachable_endpoint(s3_ckpt):
    (port,) = free_ports(1)  # nothing listens there
    with pytest.raises(EndpointUnreachable, match=f"127.0.0.1:{port} did not answer .* after 2 attempts"):
        open_checkpoint(s3_ckpt, endpoint_url=f"http://127.0.0.1:{port}", max_attempts=2)


def test_profile_from_shared_credentials_file_and_endpoint_from_env(seaweed, s3_ckpt, monkeypatch, tmp_path):
    """The standard chain: AWS_PROFILE in a shared credentials file; AWS_ENDPOINT_URL (which
    also switches to path-style addressing)."""
    creds = tmp_path / "credentials"
    creds.write_text(f"[ci]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_PROFILE", "ci")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint_url)
    ckpt = open_checkpoint(s3_ckpt)
    assert ckpt.config["model_type"] == "qwen3_moe"
    assert ckpt.store.client.meta.config.s3["addressing_style"] == "path"


def test_endpoint_from_the_shared_config_file(seaweed, s3_ckpt, monkeypatch, tmp_path):
    config = tmp_path / "config"
    config.write_text(f"[default]\nendpoint_url = {seaweed.endpoint_url}\nregion = us-east-1\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    ckpt = open_checkpoint(s3_ckpt)
    assert ckpt.store.client.meta.endpoint_url == seaweed.endpoint_url
    assert ckpt.store.client.meta.config.s3["addressing_style"] == "path"


def test_aws_itself_keeps_botocore_addressing():
    store = open_store("s3://some-bucket/model", region="eu-west-1")  # no request is made
    assert store.client.meta.endpoint_url.endswith(".amazonaws.com")
    assert not (store.client.meta.config.s3 or {}).get("addressing_style")


def test_cli_error_is_one_clear_line_without_credentials(seaweed, s3_ckpt, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    r = subprocess.run([sys.executable, "-m", "moe_proxy", "-v", "inspect", s3_ckpt, "--endpoint-url",
                        seaweed.endpoint_url], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "error:" in r.stderr and "secret key does not match" in r.stderr
    assert "Traceback" not in r.stderr
    assert_no_secret(r.stdout + r.stderr)  # not even in -v debug logging
