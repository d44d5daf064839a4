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


def _diagnose_until(tiny, out: Path, extra: list[str], started: Path, sig: int) -> tuple[int, str]:
    """Start a diagnosis, send `sig` once the run writing `started` has begun (its imports take
    seconds: it is running, not done), and return its exit status and stderr, checking that it
    stopped within seconds and that no run's process outlived it."""
    diagnosis = subprocess.Popen(
        [sys.executable, "-m", "moe_proxy", "diagnose", str(tiny), "--out", str(out), "--fail-on", "divergence",
         "--steps", "200", "--lr", "0.1", *extra],  # the baseline diverges at step 1; lr / 10 runs on
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        _wait_for(started, 120)
        time.sleep(0.2)
        diagnosis.send_signal(sig)
        sent = time.monotonic()
        _, err = diagnosis.communicate(timeout=30)
    finally:
        if diagnosis.poll() is None:
            diagnosis.kill()
    took = time.monotonic() - sent
    assert took < 10, f"took {took:.1f} s to stop"
    assert not _processes_under(out), "a run's process outlived the diagnosis"
    return diagnosis.returncode, err


def test_ctrl_c_during_the_baseline(tiny_qwen3, tmp_path):
    out = tmp_path / "d"
    code, err = _diagnose_until(tiny_qwen3, out, ["--candidates", "lower-lr", "--seeds", "2"],
                                out / "runs" / "baseline" / "seed-1" / "repro.log", signal.SIGINT)
    assert code == 130, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("moe-proxy diagnose: interrupted by SIGINT: stopped baseline seed 1; 2 run(s) not "
                           "started; 1 finished run(s) kept; partial report: "), err
    # kept: the finished run's record; the stopped one has none; the candidate never started
    assert json.loads((out / "runs" / "baseline" / "seed-0" / "diagnose-run.json").read_text())["returncode"] == 0
    assert not (out / "runs" / "baseline" / "seed-1" / "diagnose-run.json").exists()
    assert not (out / "runs" / "lower-lr").exists()
    report = json.loads((out / "report.json").read_text())
    assert report["interrupted"] == {"signal": "SIGINT", "stopped": ["baseline seed 1"],
                                     "not_started": ["lower-lr seed 0", "lower-lr seed 1"], "finished_runs": 1}
    assert report["runs"]["baseline"]["0"]["reproduced"] is True  # no baseline to judge against yet
    assert "stopped baseline seed 1" in (out / "report.md").read_text()


def test_sigterm_during_the_candidates(tiny_qwen3, tmp_path):
    out = tmp_path / "d"
    code, err = _diagnose_until(tiny_qwen3, out, ["--candidates", "lower-lr,fp32", "--seeds", "1"],
                                out / "runs" / "lower-lr" / "seed-0" / "repro.log", signal.SIGTERM)
    assert code == 143, err
    assert "interrupted by SIGTERM: stopped lower-lr seed 0; 1 run(s) not started" in err, err
    assert not (out / "runs" / "fp32").exists() and not (out / "runs" / "lower-lr" / "seed-0" / "diagnose-run.json").exists()
    # the partial report judges what finished: the baseline, no candidate
    report = json.loads((out / "report.json").read_text())
    assert report["baseline"]["seeds"]["0"]["reproduced"] is True and report["candidates"] == {}
    assert report["interrupted"] == {"signal": "SIGTERM", "stopped": ["lower-lr seed 0"], "not_started": ["fp32 seed 0"],
                                     "finished_runs": 1}
    assert "**Interrupted (SIGTERM)**: stopped lower-lr seed 0" in (out / "report.md").read_text()


ONE_AT_A_TIME = """
import sys
from pathlib import Path
from moe_proxy.investigate.processes import run_recorded, signals_interrupt, stop_children

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
