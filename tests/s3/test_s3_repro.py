"""moe-proxy repro straight from object storage: the checkpoint is copied to a temporary
directory, loaded from there, and the run is recorded as usual."""

import json

import torch

from moe_proxy.cli import main


def test_repro_runs_from_s3(seaweed, s3_ckpt, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint_url)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model; a second thread only thrashes on a busy machine
    try:
        code = main(["repro", s3_ckpt, "--out", str(tmp_path / "run"), "--steps", "1", "--batch-size", "2"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["checkpoint"] == s3_ckpt and summary["steps_completed"] == 1
    assert "moe/router_entropy/layer_1" in json.loads((tmp_path / "run" / "metrics.jsonl").read_text())["data"]


def test_repro_missing_s3_checkpoint_is_one_line(seaweed, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint_url)
    assert main(["repro", "s3://ckpt/no-such-model", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no config.json" in err and "\n" not in err
