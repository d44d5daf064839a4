"""triage reads the original's metrics where the run writes them (issue 43 item 4): a verl log on
S3 (SeaweedFS), its checkpoints local. The failure comes before the first checkpoint, so the loop
stops after the detection: nothing is built, and the report gives the step read from S3."""

from __future__ import annotations

import json

from moe_proxy.cli import main
from moe_proxy.demo.run import checkpoint_dir, write_log


def test_the_failing_step_is_read_from_s3(seaweed, prefix, local_ckpt, tmp_path, capsys):
    run = tmp_path / "run"
    for step in (10, 20):
        checkpoint_dir(run, step).mkdir(parents=True)
        for f in ("config.json",):
            (checkpoint_dir(run, step) / f).write_bytes((local_ckpt / f).read_bytes())
    log = write_log(tmp_path / "metrics.jsonl", 12, 5)
    seaweed.client().upload_file(str(log), "ckpt", f"{prefix}/metrics.jsonl")
    out = tmp_path / "t"
    assert main(["triage", f"s3://ckpt/{prefix}/metrics.jsonl", str(run), "--out", str(out), "--fail-on", "overflow",
                 "--experts", "8", "--endpoint-url", seaweed.endpoint_url]) == 3
    report = json.loads((out / "report.json").read_text())
    assert report["failing_step"] == 5 and report["state"] == "before-first-checkpoint"
    assert "before any complete checkpoint" in capsys.readouterr().out and not (out / "bisect").exists()
