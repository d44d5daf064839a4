"""`make demo`'s S3 half runs end to end with nothing configured: it starts its own SeaweedFS,
builds and verifies through s3://, reports the bytes downloaded, and stops the server."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def test_demo_s3_flow(local_ckpt, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # as on a fresh machine
    code = ("import sys; from pathlib import Path; from moe_proxy.demo import s3 as demo_s3; "
            f"sys.exit(0 if demo_s3.run(Path({str(local_ckpt)!r}), Path({str(tmp_path / 'weed')!r}), experts=8) else 1)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: s3://models/proxy" in r.stdout
    downloaded = re.search(r"bytes downloaded .* of the .* checkpoint \((\d+\.\d)%\)", r.stdout)
    assert downloaded and float(downloaded.group(1)) < 25, r.stdout  # 64 -> 8 experts
    assert "SeaweedFS stopped" in r.stdout
