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


def test_ranks_read_only_their_shards_from_s3_and_give_the_one_process_metrics(seaweed, s3_ckpt, monkeypatch,
                                                                                tmp_path):
    """Two ranks: neither copies the weights, each reads its rows by range from SeaweedFS."""
    from moe_proxy.metrics.readers import read_metrics
    from tests.repro.test_distributed import assert_same_metrics

    monkeypatch.setenv("AWS_ENDPOINT_URL", seaweed.endpoint_url)
    args = ["--steps", "2", "--batch-size", "2", "--lr", "1e-4"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["repro", s3_ckpt, "--out", str(tmp_path / "one"), *args]) == 0
        assert main(["repro", s3_ckpt, "--out", str(tmp_path / "two"), *args, "--nproc-per-node", "2"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["ranks"] == 2
    assert_same_metrics(read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two"), range(2))
