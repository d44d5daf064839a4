"""Issue 41 §5: Ctrl-C (SIGINT) and SIGTERM stop `moe-proxy diagnose` within seconds, a real
process sent the signal while a run is going: the running run's process is gone, queued runs
never start, the run that finished is kept (its record, reused by the next run), a partial
report is written, and the message names what was interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _processes_under(path: Path) -> list[int]:
    """Processes whose command line names `path` (this test's own directory: no one else's)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if str(path).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_diagnosis_and_keeps_what_finished(tiny_qwen3, tmp_path, sig):
    out = tmp_path / "d"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    diagnosis = subprocess.Popen(
        [sys.executable, "-m", "moe_proxy", "diagnose", str(tiny_qwen3), "--out", str(out), "--fail-on", "divergence",
         "--steps", "200", "--lr", "0.1", "--candidates", "lower-lr", "--seeds", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        # seed 0 diverges at step 1 and ends; seed 1 starts (seconds of imports) and the signal comes
        _wait_for(out / "runs" / "baseline" / "seed-0" / "diagnose-run.json", 120)
        _wait_for(out / "runs" / "baseline" / "seed-1" / "repro.log", 30)
        time.sleep(0.2)
        diagnosis.send_signal(sig)
        sent = time.monotonic()
        _, err = diagnosis.communicate(timeout=30)
    finally:
        if diagnosis.poll() is None:
            diagnosis.kill()
    took = time.monotonic() - sent
    assert took < 10, f"took {took:.1f} s to stop"
    assert diagnosis.returncode == 128 + sig, err
    name = signal.Signals(sig).name
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"moe-proxy diagnose: interrupted by {name}: stopped baseline seed 1;"), err
    assert "2 run(s) not started" in line and "1 finished run(s) kept" in line
    assert not _processes_under(out), "a run's process outlived the diagnosis"
    # kept: the finished run's record; the stopped one has none; the candidate never started
    assert json.loads((out / "runs" / "baseline" / "seed-0" / "diagnose-run.json").read_text())["returncode"] == 0
    assert not (out / "runs" / "baseline" / "seed-1" / "diagnose-run.json").exists()
    assert not (out / "runs" / "lower-lr").exists()
    report = json.loads((out / "report.json").read_text())
    assert report["interrupted"] == {"signal": name, "stopped": ["baseline seed 1"],
                                     "not_started": ["lower-lr seed 0", "lower-lr seed 1"], "finished_runs": 1}
    assert report["runs"]["baseline"]["0"]["reproduced"] is True
    assert "stopped baseline seed 1" in (out / "report.md").read_text()


ONE_AT_A_TIME = """
import sys
from pathlib import Path
from moe_proxy.repro.processes import run_recorded, signals_interrupt, stop_children

out = Path(sys.argv[1])
with signals_interrupt():
    try:  # a moe-proxy command that runs until its timeout: watch a file that never comes
        run_recorded(["watch", str(out / "never.jsonl"), "--timeout", "120"], out, "rec.json", "run.log")
    except KeyboardInterrupt:
        print("interrupted by", stop_children())
        sys.exit(3)
"""


def test_a_run_made_one_at_a_time_is_stopped_too(tmp_path):
    """What bisect gets: run_recorded in the main thread, SIGTERM: its child is stopped, no record."""
    caller = subprocess.Popen([sys.executable, "-c", ONE_AT_A_TIME, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        _wait_for(tmp_path / "run.log", 30)
        time.sleep(0.5)
        caller.send_signal(signal.SIGTERM)
        printed, _ = caller.communicate(timeout=15)
    finally:
        if caller.poll() is None:
            caller.kill()
    assert caller.returncode == 3 and printed.strip() == f"interrupted by {int(signal.SIGTERM)}"
    assert not _processes_under(tmp_path / "never.jsonl") and not (tmp_path / "rec.json").exists()
