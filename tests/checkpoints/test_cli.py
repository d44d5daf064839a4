"""`moe-proxy checkpoints` on disk and on SeaweedFS (a real S3 server on 127.0.0.1): the same
answers from both, sorted by step, and the bytes it downloads stay at headers and JSON."""

from __future__ import annotations

import json

from moe_proxy.checkpoint.listing import CountingStore, list_checkpoints
from moe_proxy.cli import main
from moe_proxy.storage.s3 import S3Store
from moe_proxy.storage import LocalStore

from .conftest import BUCKET, HF, SECRET_KEY

VERL = "global_step_*/actor/huggingface"


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["checkpoints", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _portable(entries: list[dict], root: str) -> list[dict]:
    """Entries with the location prefix cut off, to compare local and S3 answers."""
    return [{**e, "uri": e["uri"].removeprefix(root)} for e in entries]


def test_json_sorted_with_reasons(capsys, local_run):
    code, out, _ = run_cli(capsys, str(local_run), "--pattern", VERL, "--json")
    assert code == 0
    entries = json.loads(out)
    assert [e["step"] for e in entries] == [50, 100, 200, 300, 400, 500, 600, 1000]
    for e in entries:
        assert isinstance(e["step"], int) and isinstance(e["complete"], bool) and e["uri"].startswith(str(local_run))
        assert ("reason" in e) == (not e["complete"] or not e["source"])
    assert [e["step"] for e in entries if e["source"]] == [50, 100, 200, 1000]


def test_text_table(capsys, local_run):
    code, out, _ = run_cli(capsys, str(local_run), "--pattern", VERL)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["STEP", "COMPLETE", "KIND", "ARCHITECTURE", "SIZE"]
    row = {line.split()[0]: line for line in lines[1:]}
    assert row["300"].split()[1] == "no" and "model-00002-of-00002.safetensors" in row["300"]
    assert row["100"].split()[1:4] == ["yes", "moe", "Qwen3-MoE"]


def test_before_a_failing_step(capsys, local_run):
    code, out, _ = run_cli(capsys, str(local_run), "--pattern", VERL, "--before", "450")
    assert (code, out.strip()) == (0, f"{local_run}/global_step_200/{HF}")
    code, out, err = run_cli(capsys, str(local_run), "--pattern", VERL, "--before", "50")
    assert code == 1 and out == "" and "no complete source checkpoint before step 50" in err


def test_s3_answers_like_local_and_reads_only_metadata(capsys, aws_env, seaweed, s3_run, local_run):
    code, out, _ = run_cli(capsys, s3_run, "--pattern", VERL, "--json", "--endpoint-url", seaweed.endpoint_url)
    assert code == 0
    on_s3 = json.loads(out)
    local = [c.to_json() for c in list_checkpoints(str(local_run), pattern=VERL)]
    assert _portable(on_s3, s3_run) == _portable(local, str(local_run))

    # Bytes downloaded, counted by the S3 store itself: exactly what the local listing reads
    # (JSON files and headers), a small fraction of the run.
    store = S3Store(s3_run, endpoint_url=seaweed.endpoint_url)
    list_checkpoints(store, pattern=VERL)
    counted = CountingStore(LocalStore(local_run))
    list_checkpoints(counted, pattern=VERL)
    total = sum(p.stat().st_size for p in local_run.rglob("*") if p.is_file())
    assert store.bytes_downloaded == counted.bytes_read
    assert store.bytes_downloaded < total / 50


def test_s3_default_discovery_and_step_regex(capsys, aws_env, seaweed, s3_run):
    code, out, _ = run_cli(capsys, s3_run, "--json", "--step-regex", r"global_step_(\d+)",
                           "--endpoint-url", seaweed.endpoint_url)
    assert code == 0
    entries = json.loads(out)
    kinds = {e["path"]: e["kind"] for e in entries}
    assert kinds[f"global_step_200/{HF}-proxies/team-a/run-step-200"] == "proxy"
    assert kinds["hydra"] == "unknown"
    assert [e["step"] for e in entries if e["source"]] == [50, 100, 200, 1000]


def test_s3_errors_are_one_clear_line(capsys, aws_env, seaweed, s3_run, monkeypatch):
    code, _, err = run_cli(capsys, f"s3://no-such-bucket/run1", "--endpoint-url", seaweed.endpoint_url)
    assert code == 2 and "no-such-bucket" in err
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-" + SECRET_KEY)
    code, _, err = run_cli(capsys, s3_run, "--endpoint-url", seaweed.endpoint_url)
    assert code == 2 and "signature" in err.lower() and SECRET_KEY not in err
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    code, _, err = run_cli(capsys, f"s3://{BUCKET}/run1", "--endpoint-url", "http://127.0.0.1:9")
    assert code == 2 and "did not answer" in err


def test_a_bad_step_regex_is_a_usage_error(capsys, local_run):
    import pytest

    with pytest.raises(SystemExit) as exit_:
        main(["checkpoints", str(local_run), "--step-regex", "step_("])
    assert exit_.value.code == 2 and "not a regular expression" in capsys.readouterr().err
