"""The followers on a mounted volume read as they do on S3 (metrics/sources.py: one code path
for both; tests/s3/test_s3_metrics.py has the S3 side): only the bytes past what was read, a
partial line or TensorBoard record waits, a shrunk file is refused, trainer_state.json is read
again only when rewritten; and the operator's RunWatcher (metrics/incident.py) tick by tick."""

from __future__ import annotations

import json

import pytest

from moe_proxy.errors import InvalidReproConfig, MalformedMetrics, MetricsShrank
from moe_proxy.metrics.incident import RunFailure, RunWatcher
from moe_proxy.metrics.readers import RunFollower


def line(step: int, grad_norm: float = 0.5, loss: float | None = 0.1) -> bytes:
    return (json.dumps({"step": step, "data": {"actor/pg_loss": loss, "actor/grad_norm": grad_norm,
                                               "actor/kl_loss": 1e-3}}) + "\n").encode()


def counting(follower: RunFollower) -> list[int]:
    """The bytes each read of the follower's source returned."""
    reads, read = [], follower.source.read

    def counted(*args):
        data = read(*args)
        reads.append(len(data or b""))
        return data
    follower.source.read = counted
    return reads


def test_only_new_bytes_are_read_and_a_shrunk_file_is_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    follower = RunFollower(path)
    reads = counting(follower)
    assert follower.rows() == [] and follower.source.kind is None
    content = b""
    for step in range(1, 5):
        content += line(step)
        path.write_bytes(content[:-3])  # the line being written: not a step yet
        assert follower.rows() == []
        path.write_bytes(content)
        assert [s for s, _ in follower.rows()] == [step]
    assert sum(reads) == len(content)
    path.write_bytes(line(1))
    with pytest.raises(MetricsShrank, match=r"metrics\.jsonl: the file shrank from \d+ to \d+ bytes"):
        follower.rows()


def test_a_partial_event_record_waits_and_a_truncated_file_is_refused_at_the_end(tmp_path):
    from tensorboard.summary import Writer

    writer = Writer(str(tmp_path / "w"))
    for step in (1, 2, 3):
        writer.add_scalar("train/loss", 0.1 * step, step)
        writer.add_scalar("train/grad_norm", 0.5, step)
    writer.close()
    data = next((tmp_path / "w").iterdir()).read_bytes()
    events = tmp_path / "runs" / "events.out.tfevents.1.host"
    events.parent.mkdir()
    follower = RunFollower(tmp_path / "runs")
    reads, given = counting(follower), []
    for cut in (5, 40, len(data) // 2, len(data) - 3):
        events.write_bytes(data[:cut])
        given += [s for s, _ in follower.rows()]
    assert given == [1, 2] and follower.rows() == []
    with pytest.raises(MalformedMetrics, match=r"truncated or corrupt event file \(whole records end at byte"):
        follower.rows(final=True)
    assert sum(reads) == len(data) - 3


def test_trainer_state_is_read_again_only_when_rewritten(tmp_path):
    state = tmp_path / "checkpoint-2" / "trainer_state.json"
    state.parent.mkdir()
    history = [{"loss": 0.1, "grad_norm": 0.5, "step": s} for s in (1, 2)]
    state.write_text(json.dumps({"global_step": 2, "max_steps": 4, "log_history": history})[:-9])
    follower = RunFollower(tmp_path)
    reads = counting(follower)
    assert follower.rows() == []  # being rewritten: read again at the next poll
    state.write_text(json.dumps({"global_step": 2, "max_steps": 4, "log_history": history}))
    assert [s for s, _ in follower.rows()] == [1, 2]
    assert follower.rows() == [] and len(reads) == 2  # not rewritten since: not read
    history += [{"loss": 0.1, "grad_norm": 0.5, "step": s} for s in (3, 4)]
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text(
        json.dumps({"global_step": 4, "max_steps": 4, "log_history": history}))
    assert [s for s, _ in follower.rows()] == [3, 4] and "max_steps 4" in follower.finished


def test_the_watcher_names_the_first_failure_asked_for_and_keeps_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    watcher = RunWatcher(path, fail_on=["actor/grad_norm>100:2"], last_step=6)
    assert watcher.poll() is None and watcher.last_step is None and watcher.finished is None
    path.write_bytes(line(1) + line(2, 150.0) + line(2, 150.0))  # a step logged twice counts once
    assert watcher.poll() is None and watcher.last_step == 2
    with path.open("ab") as f:
        f.write(line(3, 200.0) + line(4, loss=None))
    failure = watcher.poll()
    assert failure == RunFailure(2, "actor/grad_norm>100:2", failure.reason, seen=3)
    assert failure.reason == "step 2: actor/grad_norm>100:2 detected (at step 3: actor/grad_norm=200.0)"
    with path.open("ab") as f:
        f.write(line(5) + line(6))
    assert watcher.poll() is failure and watcher.last_step == 6 and watcher.finished == "step 6 logged (--last-step)"
    # without fail_on any failure counts; a NaN always does
    anything = RunWatcher(path)
    assert anything.poll() == RunFailure(4, "nan", anything.failure.reason, seen=4)
    with pytest.raises(InvalidReproConfig, match="--fail-on 'garbage'"):
        RunWatcher(path, fail_on=["garbage"])


def test_the_watcher_past_a_step_and_the_steps_after_a_detection(tmp_path):
    """after_step: the steps up to it are read, not judged (a resumed run's next incident);
    still_failing_after: the per-step test, without its patience, on each step after the detection."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(line(1, loss=None) + b"".join(line(s, 150.0 if s in (3, 4, 5) else 0.5) for s in range(2, 7)))
    watcher = RunWatcher(path, fail_on=["actor/grad_norm>100:2"], after_step=1)
    failure = watcher.poll()  # the NaN at 1 is before after_step
    assert (failure.step, failure.signature, failure.seen, watcher.last_step) == (3, "actor/grad_norm>100:2", 4, 6)
    assert watcher.still_failing_after(failure) == [True, False]
    with path.open("ab") as f:
        f.write(line(7, 300.0))
    assert watcher.poll() is failure and watcher.still_failing_after(failure) == [True, False, True]
    assert watcher.detector.holds("actor/grad_norm>100:2", {"actor/grad_norm": 101.0})
    assert not watcher.detector.holds("collapse", {"actor/grad_norm": 101.0})


def test_an_overflow_and_a_nan_at_one_step_is_the_overflow(tmp_path):
    """A half-precision forward overflow makes the loss NaN too: the watcher names the cause (the
    order of detect.SIGNATURES), not the alphabet's first."""
    path = tmp_path / "metrics.jsonl"
    row = {"actor/pg_loss": float("nan"), "numerics/half_precision": 1, "numerics/nonfinite_activations": 7}
    path.write_text(json.dumps({"step": 1, "data": {"actor/pg_loss": 0.1}}) + "\n"
                    + json.dumps({"step": 2, "data": row}) + "\n" + json.dumps({"step": 3, "data": row}) + "\n")
    failure = RunWatcher(path).poll()
    assert (failure.step, failure.signature) == (2, "overflow"), failure
