"""bisect --parallel P (#45 item 1): P probes a round, side by side. The search cuts the range
left in P + 1 parts a round (`next_round`), steps around inconclusive probes as one at a time
does, and finds the same first bad checkpoint; P = 1 is today's order. On the planted run of 8
checkpoints (tests/repro/test_bisect.py: steps 60, 70, 80 overflow fp16), P = 3 finds step 60 in
2 search rounds where one at a time takes 3."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest

from moe_proxy.cli import main
from moe_proxy.investigate import bisect as bisect_module
from moe_proxy.investigate.bisect import Probe, ProbeSettings, next_probe, next_round, probe_slots, search

from .test_bisect import ARGS, _Ckpt, _probing, run  # noqa: F401 - the planted run of 8 checkpoints


def _search(n, bad_from, parallel, good_given=False, unjudged=frozenset()):
    rounds: list = []

    def test(i):
        return Probe(f"ckpt-{i}", i, None if i in unjudged else i >= bad_from, None, None)
    first, probes = search([_Ckpt(i) for i in range(n)], test, good_given, parallel, rounds=rounds)
    return first, probes, rounds


@pytest.mark.parametrize("n", [2, 3, 8, 9, 17, 33, 64])
@pytest.mark.parametrize("parallel", [2, 3, 4])
def test_p_probes_a_round_find_the_same_first_bad_as_one_at_a_time(n, parallel):
    for bad_from in [*range(n), n + 5]:  # every boundary, and none bad
        for good_given in (False, True):
            if good_given and bad_from == 0:
                continue  # --good says the first is clean
            one, _, one_rounds = _search(n, bad_from, 1, good_given)
            first, probes, rounds = _search(n, bad_from, parallel, good_given)
            assert first == one, (n, bad_from, parallel, rounds)
            assert all(len(r) <= parallel for _, r in rounds)
            assert len({i for i, _ in probes}) == len(probes)  # no checkpoint probed twice
            searching = sum(kind == "search" for kind, _ in rounds)
            assert searching <= math.ceil(math.log(n, parallel + 1)) + 1
            assert len(rounds) <= len(one_rounds)


def test_one_at_a_time_is_next_probe_itself():
    for n, bad_from in [(8, 5), (17, 9), (64, 33), (8, 0)]:
        _, probes, rounds = _search(n, bad_from, 1)
        results, order = {}, []
        while (step := next_probe(n, results, False)).probe is not None:
            order.append(step.probe)
            results[step.probe] = step.probe >= bad_from
        assert [i for i, _ in probes] == order == [r[0] for _, r in rounds]


def test_nine_checkpoints_take_two_search_rounds_at_p3_three_one_at_a_time():
    for n in (8, 9):
        one = _search(n, 5, 1)[2]
        three = _search(n, 5, 3)[2]
        # the last is probed first: the search proper cuts the n - 1 before it
        assert sum(k == "search" for k, _ in one) == 3 == math.ceil(math.log2(n - 1))
        assert sum(k == "search" for k, _ in three) == 2 == math.ceil(math.log(n - 1, 4))
    assert _search(8, 5, 3)[2] == [("last", [7]), ("search", [1, 3, 5]), ("search", [4, 6])]
    assert _search(8, 5, 1)[2] == [("last", [7]), ("search", [3]), ("search", [5]), ("search", [4]),
                                   ("boundary", [6])]


def test_inconclusive_probes_are_stepped_around_a_round_at_a_time():
    """A probe that cannot be judged is never picked again; the cuts fall on the untried ones."""
    for unjudged in ({3}, {4}, {1, 3}, {3, 4}):
        one, _, _ = _search(8, 5, 1, unjudged=frozenset(unjudged))
        first, probes, rounds = _search(8, 5, 3, unjudged=frozenset(unjudged))
        assert first == one == 5 and len({i for i, _ in probes}) == len(probes), rounds
    assert next_round(8, {7: True, 1: False, 3: None, 5: True}, False, 3).probes == (2, 4, 6)


def test_a_clean_last_checkpoint_ends_it_after_one_probe_at_any_p():
    assert next_round(8, {}, False, 3).probes == (7,)
    assert next_round(8, {7: False}, False, 3).probes == () and next_round(8, {7: False}, False, 3).first_bad is None


def test_a_round_runs_its_probes_side_by_side_each_with_its_share_of_threads(monkeypatch, tmp_path):
    ckpts = [_Ckpt(i) for i in range(8)]
    at_once, now, lock, envs = [0], [0], threading.Lock(), []

    def fake_probe(c, out, s, env=None):
        envs.append(env)
        with lock:
            now[0] += 1
            at_once[0] = max(at_once[0], now[0])
        time.sleep(0.3)
        with lock:
            now[0] -= 1
        return _probing(5)(c.step)
    monkeypatch.setattr(bisect_module, "sources", lambda *a, **k: ckpts)
    monkeypatch.setattr(bisect_module, "probe_plan", lambda *a, **k: None)
    monkeypatch.setattr(bisect_module, "probe", fake_probe)
    monkeypatch.setattr(bisect_module.os, "cpu_count", lambda: 6)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    report = bisect_module.bisect("run", tmp_path, ProbeSettings("nan", [], [], []), parallel=3)
    assert report["first_bad"]["step"] == 5 and report["monotone"] and report["parallel"] == 3
    assert at_once[0] == 3 and {e["OMP_NUM_THREADS"] for e in envs if e} == {"2"}
    assert report["rounds"] == 3 and report["search_rounds"] == 2
    assert report["round_list"][1] == {"round": 2, "kind": "search", "steps": [1, 3, 5]}
    assert "3 round(s) of probes (2 search round(s)), 6 probe(s)" in (tmp_path / "report.md").read_text()


def test_parallel_0_is_bad_usage_and_runs_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bisect", str(tmp_path), "--out", str(tmp_path / "b"), *ARGS, "--parallel", "0"])
    assert stop.value.code == 2 and "--parallel: 0: must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    with pytest.raises(bisect_module.MoeProxyError, match="--parallel 0: at least 1"):
        bisect_module.bisect(str(tmp_path), tmp_path / "b", ProbeSettings("nan", [], [], []), parallel=0)


def test_slots_share_the_cpu_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(bisect_module.os, "cpu_count", lambda: 16)
    settings = ProbeSettings("overflow", [], [], ["--steps", "1"])
    assert probe_slots(settings, 1) == [{}]
    assert probe_slots(settings, 3) == [{"OMP_NUM_THREADS": "5"}] * 3


def test_the_planted_run_at_p3_finds_step_60_in_two_search_rounds(run, tmp_path, capsys):  # noqa: F811
    """The real thing: probes build and run side by side. One at a time (test_bisect.py's run of
    the same checkpoints) takes 3 search rounds: 40, 60, 50."""
    out = tmp_path / "b3"
    assert main(["bisect", str(run), "--out", str(out), *ARGS, "--parallel", "3"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["first_bad"] == {"checkpoint": str(run / "global_step_60" / "actor" / "huggingface"), "step": 60}
    assert report["boundary"] == "confirmed: step 50, the checkpoint before, ran clean" and report["monotone"]
    assert [r["steps"] for r in report["round_list"]] == [[80], [20, 40, 60], [50, 70]]
    assert report["search_rounds"] == 2 and report["rounds"] == 3
    cost = report["cost"]
    steps = [o["steps_completed"] for p in report["probes"] for o in p["seeds"].values()]  # what each run completed
    assert cost["probes"] == 6 and (cost["runs"], cost["steps"]) == (6, sum(steps))
    assert cost["device_hours"] == pytest.approx(sum(steps) * cost["device_hours_per_step"])
    assert "3 round(s) of probes (2 search round(s)), 6 probe(s), at most 3 at a time" in printed


def test_an_interrupt_during_a_round_stops_every_probe_of_it(tmp_path):
    """SIGINT while a round's two probes build side by side: exit 130 within seconds, both named,
    neither keeps a record (a rerun makes them again), the finished probe kept."""
    import os
    import signal
    import subprocess
    import sys

    from .test_bisect import planted_run

    run = planted_run(tmp_path, (10, 20, 30, 40, 50), (50,))
    out = tmp_path / "b"
    child = subprocess.Popen([sys.executable, "-m", "moe_proxy", "bisect", str(run), "--out", str(out), *ARGS,
                              "--parallel", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 180
    logs = [out / "probes" / f"step-{s}" / "build.log" for s in (20, 30)]  # round 2: 4 untried cut in 3 parts
    while not all(log.exists() for log in logs):
        assert child.poll() is None and time.monotonic() < deadline, child.communicate()
        time.sleep(0.2)
    sent = time.monotonic()
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=30)
    assert child.returncode == 130 and time.monotonic() - sent < 10, err
    assert "interrupted by SIGINT during probes of steps" in err and "partial report" in err, err
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "interrupted" and [p["step"] for p in report["probes"]] == [50]
    assert not any((out / "probes" / f"step-{s}" / "build.bisect-run.json").exists() for s in (20, 30))
