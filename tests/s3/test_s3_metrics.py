"""Following a training run's metrics on S3 (issue 43, item 1), against the real SeaweedFS.

The run's writer is played as S3 sees one: S3 has no append, so each step re-uploads the whole
growing object (verl's metrics.jsonl, a TensorBoard event file), a restarted run adds an event
file, and trainer_state.json is rewritten whole under checkpoint-N/. The follower must give each
step once, read only the bytes past what it has read (counted by the store), wait for a partial
line or record, and refuse what cannot be a growing run (a shrunk object, a missing step)."""

from __future__ import annotations

import json
import math

import pytest

from moe_proxy.cli import main
from moe_proxy.errors import AccessDenied, MalformedMetrics, MetricsShrank, ObjectNotFound
from moe_proxy.metrics.incident import RunFailure, RunWatcher
from moe_proxy.metrics.readers import RunFollower, detect_format, read_run

from .helpers import ACCESS_KEY, SECRET_KEY


def verl_line(step: int) -> bytes:
    """verl's FileLogger line; orjson writes the NaN of step 4's loss as null."""
    data = {"actor/pg_loss": None if step == 4 else 0.1 * step, "actor/grad_norm": 0.5, "actor/kl_loss": 1e-3,
            "critic/rewards/mean": 0.1 * step}
    return (json.dumps({"step": step, "elapsed_seconds": step, "data": data}) + "\n").encode()


def trl_row(step: int) -> dict[str, float]:
    return {"loss": 0.01 * step, "grad_norm": 0.5, "learning_rate": 1e-6, "kl": 3e-5 if step < 4 else 4.3,
            "entropy": 1.0, "reward": 0.1 * step}


@pytest.fixture
def s3(seaweed, prefix):
    """(client, base URI, store options)."""
    return seaweed.client(), f"s3://ckpt/{prefix}", {"endpoint_url": seaweed.endpoint_url}


def put(client, uri: str, data: bytes) -> None:
    bucket, _, key = uri[len("s3://"):].partition("/")
    client.put_object(Bucket=bucket, Key=key, Body=data)


def downloaded(follower: RunFollower) -> int:
    return follower.source.bytes_downloaded


@pytest.mark.parametrize("where", ["prefix", "object"])
def test_jsonl_each_step_once_reading_only_the_new_bytes(s3, where):
    client, run, options = s3
    follower = RunFollower(run if where == "prefix" else f"{run}/metrics.jsonl", store_options=options)
    assert follower.rows() == [] and follower.source.kind is None  # nothing written yet: wait
    content = b""
    for step in range(1, 7):
        line = verl_line(step)
        put(client, f"{run}/metrics.jsonl", content + line[:10])  # a line half uploaded: not yet a step
        assert follower.rows() == []
        content += line
        put(client, f"{run}/metrics.jsonl", content)  # the whole object again, one line longer
        rows = follower.rows()
        assert [s for s, _ in rows] == [step] and follower.profile.name == "verl"
        assert math.isnan(rows[0][1]["actor/pg_loss"]) == (step == 4)
    assert follower.rows() == [] and follower.rows(final=True) == []
    # every byte read once: the prefix is listed, not read; the object read from its offset on
    # (a .jsonl object's format is told from its name: no read for detection either)
    assert downloaded(follower) == len(content)


def test_a_shrunk_object_and_a_missing_step_are_refused(s3):
    client, run, options = s3
    put(client, f"{run}/metrics.jsonl", verl_line(1) + verl_line(2))
    follower = RunFollower(run, store_options=options)
    assert [s for s, _ in follower.rows(final=True)] == [1, 2]
    put(client, f"{run}/metrics.jsonl", verl_line(1))  # replaced by a shorter one
    with pytest.raises(MetricsShrank, match=r"metrics\.jsonl: the file shrank from \d+ to \d+ bytes"):
        follower.rows()
    put(client, f"{run}/flat/metrics.jsonl", b'{"data": {"actor/pg_loss": 0.1}}\n')
    with pytest.raises(MalformedMetrics, match=r"/flat/metrics\.jsonl:1: missing or non-integer \"step\""):
        read_run(f"{run}/flat", store_options=options)


def tb_records(steps, start: int = 0) -> bytes:
    """An event file as tensorboard's own Writer writes it (TRL's train/ names)."""
    import tempfile
    from pathlib import Path

    from tensorboard.summary import Writer

    with tempfile.TemporaryDirectory() as tmp:
        writer = Writer(tmp)
        for step in steps:
            for key, value in trl_row(step).items():
                writer.add_scalar(f"train/{key}", value, step)
        writer.close()
        return next(Path(tmp).iterdir()).read_bytes()


def test_tensorboard_two_event_files_grown_piece_by_piece(s3):
    """A run that restarts writes a second event file; each grows by re-uploads cut anywhere,
    mid-record included: the newest step waits for a later one (or the end)."""
    client, run, options = s3
    first, second = tb_records(range(1, 5)), tb_records(range(5, 9))
    follower = RunFollower(f"{run}/runs", store_options=options)
    given = []
    for name, data in (("events.out.tfevents.1000.host", first), ("events.out.tfevents.2000.host", second)):
        for cut in (37, len(data) // 2 + 3, len(data) - 5, len(data)):
            put(client, f"{run}/runs/{name}", data[:cut])
            given += [s for s, _ in follower.rows()]
    given += [s for s, row in follower.rows(final=True)]
    assert given == list(range(1, 9)) and follower.profile.name == "trl"
    assert downloaded(follower) == len(first) + len(second)
    rows, profile = read_run(f"{run}/runs", store_options=options)
    assert sorted(rows) == list(range(1, 9)) and rows[4]["actor/kl_loss"] == pytest.approx(4.3)
    assert detect_format(f"{run}/runs/events.out.tfevents.2000.host", options) == "tensorboard"


def test_a_truncated_event_file_waits_and_is_reported_at_the_end(s3):
    client, run, options = s3
    data = tb_records(range(1, 4))
    put(client, f"{run}/events.out.tfevents.1.host", data[:-7])
    follower = RunFollower(run, store_options=options)
    # step 3's last value is cut off: steps 1 and 2 are given, step 3 waits for the rest
    assert [s for s, _ in follower.rows()] == [1, 2]
    assert follower.rows() == []
    with pytest.raises(MalformedMetrics, match=r"events\.out\.tfevents\.1\.host: truncated or corrupt event file "
                                               r"\(whole records end at byte \d+ of \d+\)"):
        follower.rows(final=True)
    with pytest.raises(MalformedMetrics, match="truncated or corrupt event file"):
        read_run(run, store_options=options)


def state(steps, max_steps: int) -> bytes:
    log = [{**trl_row(s), "step": s, "epoch": s / 8} for s in steps]
    return json.dumps({"global_step": max(steps), "max_steps": max_steps, "log_history": log}, indent=2).encode()


def test_trainer_state_read_again_only_when_rewritten(s3):
    client, run, options = s3
    follower = RunFollower(run, store_options=options)
    put(client, f"{run}/checkpoint-2/trainer_state.json", state(range(1, 3), 6))
    put(client, f"{run}/checkpoint-2/model.safetensors", b"x" * 1000)  # listed, never read
    assert [s for s, _ in follower.rows()] == [1, 2] and follower.format == "trainer-state"
    read = downloaded(follower)
    put(client, f"{run}/checkpoint-2/trainer_state.json", state(range(1, 3), 6))  # the same bytes again
    assert follower.rows() == [] and downloaded(follower) == read  # same ETag: not read again
    put(client, f"{run}/checkpoint-4/trainer_state.json", state(range(1, 5), 6))
    assert [s for s, _ in follower.rows()] == [3, 4] and not follower.finished
    put(client, f"{run}/checkpoint-6/trainer_state.json", state(range(1, 7), 6))
    assert [s for s, _ in follower.rows()] == [5, 6] and "max_steps 6" in follower.finished


def test_missing_bucket_denied_access_and_an_empty_prefix(s3, seaweed, monkeypatch):
    client, run, options = s3
    with pytest.raises(ObjectNotFound, match="bucket 'no-such-bucket' does not exist"):
        RunFollower("s3://no-such-bucket/run", store_options=options).rows()
    with pytest.raises(MalformedMetrics, match="no such file or directory, or an empty one"):
        read_run(run, store_options=options)
    assert RunFollower(run, store_options=options).rows() == []  # a follower waits for the run to start
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAUNKNOWNKEY000000")
    with pytest.raises(AccessDenied, match="does not know this access key") as info:
        read_run(run, store_options=options)
    assert "AKIAUNKNOWNKEY" not in str(info.value) and SECRET_KEY not in str(info.value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    with pytest.raises(AccessDenied, match="secret key does not match") as info:
        RunFollower(run, store_options=options).rows()
    assert "wrong-secret" not in str(info.value) and SECRET_KEY not in str(info.value)


def test_watch_on_s3_gives_the_verdict_of_the_local_copy(s3, tmp_path, capsys):
    client, run, options = s3
    content = b"".join(verl_line(s) for s in range(1, 7))
    put(client, f"{run}/metrics.jsonl", content)
    (tmp_path / "metrics.jsonl").write_bytes(content)
    verdicts = []
    for where in (str(tmp_path / "metrics.jsonl"), run):
        log = tmp_path / f"log-{len(verdicts)}"
        assert main(["watch", where, "--last-step", "6", "--poll", "0.05", "--timeout", "20", "--termination-log",
                     str(log), "--endpoint-url", options["endpoint_url"]]) == 0
        verdicts.append((capsys.readouterr().out, json.loads(log.read_text())))
    assert verdicts[0] == verdicts[1] and verdicts[0][0].startswith("nan at step 4")


def test_the_watcher_gives_the_first_failure_tick_by_tick(s3):
    client, run, options = s3
    watcher = RunWatcher(run, fail_on=["divergence"], store_options=options, last_step=6)
    assert watcher.poll() is None and watcher.last_step is None
    content = b""
    for step in range(1, 4):
        content += verl_line(step)
        put(client, f"{run}/metrics.jsonl", content)
        assert watcher.poll() is None and watcher.last_step == step
    content += verl_line(4)
    put(client, f"{run}/metrics.jsonl", content)
    failure = watcher.poll()
    assert failure == RunFailure(4, "nan", failure.reason, seen=4) and failure.reason.startswith("step 4: nan detected")
    content += verl_line(5) + verl_line(6)
    put(client, f"{run}/metrics.jsonl", content)
    assert watcher.poll() is failure and watcher.last_step == 6 and "step 6 logged" in watcher.finished


def test_bytes_come_from_the_version_listed(s3):
    """A ranged read carries If-Match on the listed ETag: an object replaced since the listing is
    not read (None: the next poll lists it again), rather than mixing two versions' bytes."""
    from moe_proxy.metrics.sources import open_source

    client, run, options = s3
    put(client, f"{run}/metrics.jsonl", verl_line(1))
    source = open_source(f"{run}/metrics.jsonl", options)
    entry = source.list()["metrics.jsonl"]
    assert source.read("metrics.jsonl", 0, entry.size, entry.version) == verl_line(1)
    put(client, f"{run}/metrics.jsonl", verl_line(2))  # the same size, other bytes
    assert source.read("metrics.jsonl", 0, entry.size, entry.version) is None


def test_watch_on_a_missing_bucket_or_with_a_wrong_secret_is_one_line(s3, tmp_path, capsys, monkeypatch):
    client, run, options = s3
    log = tmp_path / "log"
    assert main(["watch", "s3://no-such-bucket/run", "--endpoint-url", options["endpoint_url"], "--timeout", "5",
                 "--termination-log", str(log)]) == 2
    err = capsys.readouterr().err
    assert err == (f"moe-proxy watch: error: s3://no-such-bucket/run: bucket 'no-such-bucket' does not exist at "
                   f"{options['endpoint_url']}\n"), err
    assert json.loads(log.read_text())["error"] == "ObjectNotFound"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-value")
    assert main(["watch", run, "--endpoint-url", options["endpoint_url"], "--timeout", "5",
                 "--termination-log", str(log)]) == 2
    err = capsys.readouterr().err
    assert "secret key does not match" in err and err.count("\n") == 1
    for text in (err, log.read_text()):
        assert "wrong-secret" not in text and SECRET_KEY not in text and ACCESS_KEY not in text
