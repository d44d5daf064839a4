"""`moe-proxy watch`: follows a growing metrics file, same detectors and verdict as repro."""

import json
import signal
import subprocess
import sys
import threading
import time

from moe_proxy.cli import main


def verl_line(step, **data):
    return json.dumps({"step": step, "elapsed_seconds": 1.5 * step, "data": data}) + "\n"


def test_verl_file_with_nan_at_step_3_as_it_grows(tmp_path, capsys):
    metrics, log, stop = tmp_path / "metrics.jsonl", tmp_path / "termination-log", tmp_path / "stop"

    def framework():  # writes one step at a time, as verl's FileLogger does
        for step in range(1, 7):
            with metrics.open("a") as f:
                f.write(verl_line(step, **{"actor/pg_loss": float("nan") if step >= 3 else 0.1,
                                           "actor/grad_norm": 1.0, "critic/rewards/mean": 0.5}))
            time.sleep(0.05)

    writer = threading.Thread(target=framework)
    writer.start()
    code = main(["watch", str(metrics), "--fail-on", "nan", "--termination-log", str(log), "--stop-file", str(stop),
                 "--poll", "0.02", "--timeout", "60"])
    writer.join()
    assert code == 0
    assert capsys.readouterr().out.splitlines()[0] == "nan at step 3 (reproduced)"
    report = json.loads(log.read_text())
    assert report.pop("steps_completed") == 3  # steps 1..3 read when it stopped
    assert report.pop("last_step") == 3  # what the operator reports should the framework crash after it
    assert report.pop("stopped") == "reproduced nan"  # as repro's verdict says why it stopped
    # the cost columns' metrics step by step (the operator's Diagnosis reads them)
    assert report.pop("series") == {"first": 1, "stride": 1, "reward": [0.5, 0.5, 0.5], "loss": [0.1, 0.1, None]}
    assert report == {"reproduced": True, "signature": "nan", "step": 3,
                      "metrics": {"actor/pg_loss": None, "actor/grad_norm": 1.0, "critic/rewards/mean": 0.5}}
    assert stop.exists()


def test_flat_file_until_the_done_marker(tmp_path, capsys):
    metrics, log, done = tmp_path / "m.jsonl", tmp_path / "log", tmp_path / "done"
    metrics.write_text("".join(json.dumps({"step": s, "actor/grad_norm": 1.0 + s / 10}) + "\n" for s in range(5)))
    done.touch()
    assert main(["watch", str(metrics), "--fail-on", "divergence", "--until-file", str(done),
                 "--termination-log", str(log), "--poll", "0.01"]) == 0
    assert "no failure in 5 steps (divergence not reproduced)" in capsys.readouterr().out
    assert json.loads(log.read_text())["reproduced"] is False


def test_not_json_lines_is_a_clear_error(tmp_path, capsys):
    metrics, log = tmp_path / "train.log", tmp_path / "log"
    metrics.write_text("step 1: loss 0.3\n")
    assert main(["watch", str(metrics), "--termination-log", str(log), "--poll", "0.01", "--timeout", "10"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"moe-proxy watch: error: {metrics}: not a metrics file of a known format; readable formats: "
                          "jsonl (") and "tensorboard (" in err and "trainer-state (" in err and "\n" not in err
    assert json.loads(log.read_text())["error"] == "MalformedMetrics"
    # as JSON lines (--format), the line itself is refused
    assert main(["watch", str(metrics), "--format", "jsonl", "--poll", "0.01", "--timeout", "10"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"moe-proxy watch: error: {metrics}:1: not JSON (Expecting value); each line must be one JSON object"


def test_timeout_without_an_end_is_an_error_not_a_verdict(tmp_path, capsys):
    log = tmp_path / "log"
    assert main(["watch", str(tmp_path / "never.jsonl"), "--timeout", "0.2", "--poll", "0.05",
                 "--termination-log", str(log)]) == 2
    assert "the file never appeared" in capsys.readouterr().err
    assert json.loads(log.read_text())["error"] == "WatchTimeout"


def test_watch_never_imports_torch(tmp_path):
    metrics, done = tmp_path / "m.jsonl", tmp_path / "done"
    metrics.write_text(verl_line(1, **{"actor/pg_loss": 0.1}))
    done.touch()
    code = ("import sys; from moe_proxy.cli import main; "
            f"rc = main(['watch', {str(metrics)!r}, '--until-file', {str(done)!r}, '--poll', '0.01']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def _sidecar(tmp_path, *args):
    """`moe-proxy watch` as its own process, as a native sidecar runs it; returns once its ready
    file says SIGTERM ends the watch instead of the process (what the startupProbe checks)."""
    ready = tmp_path / "ready"
    process = subprocess.Popen([sys.executable, "-m", "moe_proxy.cli", "watch", *args, "--ready-file", str(ready),
                                "--hold", "--poll", "60"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
        time.sleep(0.02)
    return process


def test_sigterm_right_after_start_reads_the_whole_file_and_gives_the_verdict(tmp_path):
    """The framework ended (its file complete) before the watch's first poll came round: the
    SIGTERM that follows wakes it, it reads the rest, writes the verdict and exits 0."""
    metrics, log = tmp_path / "m.jsonl", tmp_path / "log"
    process = _sidecar(tmp_path, str(metrics), "--fail-on", "nan", "--termination-log", str(log))
    metrics.write_text("".join(verl_line(s, **{"actor/pg_loss": float("nan") if s == 3 else 0.1}) for s in (1, 2, 3, 4)))
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=30)  # not the 60 s poll: SIGTERM wakes it
    assert process.returncode == 0, output
    assert "nan at step 3 (reproduced)" in output
    verdict = json.loads(log.read_text())
    assert (verdict["signature"], verdict["step"]) == ("nan", 3)


def test_another_nodes_watch_ends_cleanly_on_sigterm_with_no_verdict(tmp_path):
    log = tmp_path / "log"
    process = _sidecar(tmp_path, str(tmp_path / "m.jsonl"), "--node-rank", "1", "--termination-log", str(log))
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=30)
    assert process.returncode == 0, output
    assert not log.exists()


def test_a_failure_not_asked_for_is_named_with_its_step_not_contradicted():
    """`--fail-on collapse` on a run that diverged: the verdict says collapse was not reproduced
    and names the divergence with its step, instead of "no failure" after "divergence detected"."""
    from moe_proxy.metrics.detect import Signature
    from moe_proxy.metrics.verdict import verdict_lines

    failures = {"divergence": {"step": 3, "detail": "grad_norm 40x its median"}}
    lines = verdict_lines(Signature.parse("collapse"), None, None, 6, failures)
    assert lines == ["collapse not reproduced in 6 steps", "  divergence seen at step 3 (not the failure asked for)"]
    assert verdict_lines(None, "divergence", 3, 6, failures) == ["divergence at step 3"]
    assert verdict_lines(Signature.parse("nan"), None, None, 6, {}) == ["no failure in 6 steps (nan not reproduced)"]
    nan_first = verdict_lines(Signature.parse("collapse"), None, None, 4, {**failures, "nan": {"step": 4}})
    assert nan_first == ["failed on nan at step 4 (no collapse before it)",
                         "  divergence seen at step 3 (not the failure asked for)"]


def test_a_nan_before_the_failure_asked_for_is_never_a_clean_run(tmp_path):
    """metrics.incident's rule: `--fail-on overflow` on a run whose loss turns NaN at step 3 stops
    there, and its termination message says why; a Diagnosis reading it (the operator's
    finished_row, the CLI's judge_probe) finds a run cut short, inconclusive, not one that ran clean."""
    from moe_proxy.investigate.bisect import judge_probe
    from moe_proxy.metrics.detect import Signature
    from moe_proxy.metrics.watch import watch
    from proxymodel_operator.diagnosis_rows import finished_row, seed_run
    from proxymodel_operator.outcome import SUCCEEDED, Outcome

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(verl_line(s, **{"actor/pg_loss": float("nan") if s >= 3 else 0.1}) for s in range(1, 7)))
    report = watch(metrics, fail_on=Signature.parse("overflow"), last_step=6, timeout_s=30, poll_s=0.01).report
    assert (report["reproduced"], report["steps_completed"], report["also_seen"]) == (False, 3, {"nan": 3})
    assert report["stopped"].startswith("loss or weights are NaN")
    row = finished_row({}, Outcome(SUCCEEDED, report=report), steps=6)
    reproduced, note = judge_probe({0: seed_run(row)})
    assert reproduced is None and note == "seed 0: stopped after 3 steps by nan at step 3"


def test_each_figure_is_shown_with_its_own_step(tmp_path, capsys, caplog):
    """Divergence needs 2 steps in a row: it begins at step 5 and is known at step 6. The log
    says both; the termination message pairs step 5 with step 5's metrics (#32 item 8)."""
    import logging

    metrics, log, done = tmp_path / "m.jsonl", tmp_path / "log", tmp_path / "done"
    norms = [1.0, 1.1, 0.9, 1.0, 1.05, 300.0, 900.0, 1.0]
    metrics.write_text("".join(json.dumps({"step": s, "actor/grad_norm": g, "critic/rewards/mean": s / 10}) + "\n"
                               for s, g in enumerate(norms)))
    done.touch()
    caplog.set_level(logging.INFO)
    assert main(["watch", str(metrics), "--fail-on", "divergence", "--until-file", str(done),
                 "--termination-log", str(log), "--poll", "0.01"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "divergence at step 5 (reproduced)"
    [line] = [r.getMessage() for r in caplog.records if "divergence detected" in r.getMessage()]
    assert line.startswith("step 5: divergence detected (at step 6: ") and "900" in line, line
    report = json.loads(log.read_text())
    assert (report["step"], report["metrics"]) == (5, {"actor/grad_norm": 300.0, "critic/rewards/mean": 0.5})
