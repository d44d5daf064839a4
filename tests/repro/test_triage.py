"""triage (#43 items 4 and 6, #45 item 3): the loop in one command on a planted run: 3 tiny
Qwen3-MoE checkpoints (steps 10, 20, 30) whose last 2 carry a dense MLP past fp16's range, and
the run's metrics log overflowing from step 25. Triage bisects the checkpoints up to step 25 to
step 20, diagnoses on that probe's proxy, writes one report with the cost; a second call runs
nothing; a clean log, or a failure before any checkpoint, builds nothing; one checkpoint before
the failure is probed alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_proxy.cli import main
from moe_proxy.demo.run import write_log
from moe_proxy.investigate.catalogue import FOR_SIGNATURE, FOR_THRESHOLD
from moe_proxy.investigate.triage import candidates_for, detect, suggestion_table

from .test_bisect import planted_run

ARGS = ["--fail-on", "overflow", "--experts", "4", "--steps", "1", "--precision", "fp16", "--seeds", "1"]
CANDIDATES = ["--candidates", "bf16,lower-lr"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """verl's layout, checkpoints at steps 10, 20, 30; 20 and 30 overflow fp16."""
    return planted_run(tmp_path_factory.mktemp("triage"), (10, 20, 30), (20, 30))


@pytest.fixture(scope="module")
def triaged(run, tmp_path_factory):
    """One triage of the planted run, its log overflowing from step 25: (out, exit code, stdout)."""
    log = write_log(run.parent / "metrics.jsonl", 40, 25)
    out = tmp_path_factory.mktemp("triaged") / "t"
    code = main(["triage", str(log), str(run), "--out", str(out), *ARGS, *CANDIDATES])
    return out, code, log


def test_triage_finds_the_first_bad_checkpoint_and_its_fixes(triaged, run):
    out, code, _ = triaged
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["state"] == "diagnosed" and report["failing_step"] == 25 and report["signature"] == "overflow"
    assert report["first_bad"] == {"step": 20, "uri": str(run / "global_step_20" / "actor" / "huggingface"),
                                   "index": 2, "of": 2}  # step 30, after the failure, is not bisected
    bisection = json.loads(Path(report["bisect_report"]).read_text())
    assert bisection["checkpoints"] == [10, 20] and bisection["boundary"].startswith("confirmed: step 10")
    diagnosis = json.loads(Path(report["diagnose_report"]).read_text())
    assert report["fixed_by"] == diagnosis["fixed_by"]  # the diagnosis's own verdicts, on the probe's proxy
    assert diagnosis["proxy"] == str(out / "bisect" / "probes" / "step-20" / "proxy")
    assert "bf16" in report["fixed_by"] and report["verdicts"]["lower-lr"]["verdict"] == "reproduced"
    cost = report["cost"]
    assert (cost["builds"], cost["probes"], cost["probe_runs"], cost["candidate_runs"]) == (2, 2, 2, 3)
    assert cost["rl_steps"] >= 3 and cost["device_hours"] > 0 and cost["original_steps"] > 0
    # one cost rule (sizing.run_device_hours): bisect's report and triage's price the same probes alike,
    # each run by the steps it completed, at the fp16 it ran at
    assert bisection["cost"]["precision"] == "fp16" and cost["probe_device_hours"] == bisection["cost"]["device_hours"]
    completed = [o["steps_completed"] for p in bisection["probes"] for o in p["seeds"].values()]
    assert bisection["cost"]["device_hours"] == pytest.approx(sum(completed) * cost["proxy_device_hours_per_step"])
    assert cost["device_hours"] == pytest.approx(cost["rl_steps"] * cost["proxy_device_hours_per_step"])  # fp16, bf16
    md = (out / "report.md").read_text()
    assert md.startswith("# Triage") and "fails from checkpoint 2 of 2 (step 20); fixed by bf16; not by lower-lr" in md
    assert {"original.png", "matrix.png", "curves.png"} <= {p.name for p in out.iterdir()}


def test_a_second_call_runs_nothing(triaged, run, capsys):
    out, _, log = triaged
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*.json") if p.name not in ("report.json",)}
    assert main(["triage", str(log), str(run), "--out", str(out), *ARGS, *CANDIDATES]) == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*.json") if p.name not in ("report.json",)} == stamps
    cost = json.loads((out / "report.json").read_text())["cost"]
    assert cost["reused"] == {"probes": 2, "runs": 5}
    assert "fixed by bf16" in capsys.readouterr().out


def nan_log(path: Path, last_step: int, nan_from: int) -> Path:
    """write_log's run, but its forward pass never overflows: the loss is NaN from `nan_from` on."""
    rows = [json.loads(line) for line in write_log(path, last_step, nan_from).read_text().splitlines()]
    for row in rows:
        row["data"]["numerics/nonfinite_activations"] = 0
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_a_nan_before_the_failure_asked_for_is_the_failure(tmp_path):
    """One rule with the operator's watched run (metrics.incident.RunWatcher): a NaN is never a
    clean log. A NaN first is the failure the loop investigates, and it says so; the failure asked
    for, when it comes first, stays the answer."""
    found = detect(str(nan_log(tmp_path / "nan.jsonl", 40, 25)), "overflow")
    assert (found.signature, found.failing_step, found.asked) == ("nan", 25, "overflow")
    assert found.what() == "nan (no overflow before it)" and found.also_seen == {}
    found = detect(str(write_log(tmp_path / "overflow.jsonl", 40, 25)), "overflow")  # overflow and NaN at 25
    assert (found.signature, found.failing_step, found.also_seen) == ("overflow", 25, {"nan": 25})
    assert not found.instead


def test_the_probes_judge_the_nan_the_loop_investigates(run, tmp_path, monkeypatch, capsys):
    """A NaN first: bisect's probes run `repro --fail-on nan` (a probe that stops at the NaN
    reproduces, rather than being inconclusive about an overflow that cannot come after it), and
    the answer says the overflow was not seen before it. bisect itself is replaced here: what is
    checked is what triage hands it."""
    import moe_proxy.investigate.triage as loop

    given = []
    monkeypatch.setattr(loop, "bisect", lambda prefix, out, settings, **_: given.append(settings) or {
        "first_bad": None, "boundary": "the last checkpoint does not reproduce", "probes": [], "builds": 0})
    log = nan_log(tmp_path / "metrics.jsonl", 40, 25)
    assert main(["triage", str(log), str(run), "--out", str(tmp_path / "t"), *ARGS]) == 3
    assert [s.fail_on for s in given] == ["nan"]
    report = json.loads((tmp_path / "t" / "report.json").read_text())
    assert (report["asked"], report["signature"], report["state"]) == ("overflow", "nan", "not-reproduced")
    said = "failed on nan at step 25 of the original (no overflow before it), but no checkpoint's proxy reproduces"
    assert report["answer"].startswith(said) and said in capsys.readouterr().out
    assert "skip-nonfinite" in report["candidates"]  # the catalogue's for nan


@pytest.mark.parametrize("fails_from, state, said", [
    (None, "no-failure", "no overflow in the 40 steps logged (to step 40)"),
    (5, "before-first-checkpoint", "the failure, overflow, began at step 5, before any complete checkpoint"),
    ("nan 5", "before-first-checkpoint",
     "the failure, nan (no overflow before it), began at step 5, before any complete checkpoint"),
])
def test_nothing_to_bisect_builds_nothing(run, tmp_path, capsys, fails_from, state, said):
    if fails_from == "nan 5":  # a NaN and no overflow: the loop goes on with the NaN
        log, fails_from = nan_log(tmp_path / "metrics.jsonl", 40, 5), 5
    else:
        log = write_log(tmp_path / "metrics.jsonl", 40, fails_from)
    out = tmp_path / "t"
    assert main(["triage", str(log), str(run), "--out", str(out), *ARGS]) == 3
    report = json.loads((out / "report.json").read_text())
    assert report["state"] == state and said in report["answer"] and said in capsys.readouterr().out
    assert report["failing_step"] == fails_from and report["first_bad"] is None
    assert not (out / "bisect").exists() and not (out / "diagnose").exists()
    assert (out / "original.png").is_file()


def test_a_log_that_cannot_show_the_failure_says_so(run, tmp_path, capsys):
    """A log with neither an activation check, a loss scale nor skipped steps cannot show an
    overflow: "no overflow" says so (what it could not judge), and nothing is built."""
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "data": {"actor/pg_loss": 0.5}}) + "\n" for s in range(1, 9)))
    assert main(["triage", str(log), str(run), "--out", str(tmp_path / "t"), *ARGS]) == 3
    assert "(it cannot be judged from this log: no loss scale, skipped-step count or activation check" in \
        capsys.readouterr().out
    assert not (tmp_path / "t" / "bisect").exists()


def test_one_checkpoint_before_the_failure_is_probed_alone(tmp_path):
    """Step 20 is the only checkpoint before a failure at step 25: nothing to search; its probe
    says it carries the failure, and the diagnosis follows."""
    run = planted_run(tmp_path, (20, 30), (20, 30))
    log = write_log(tmp_path / "metrics.jsonl", 30, 25)
    out = tmp_path / "t"
    argv = ["triage", str(log), str(run), "--out", str(out), *ARGS, "--candidates", "bf16"]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["first_bad"]["step"] == 20 and report["fixed_by"] == ["bf16"]
    assert report["boundary"] == "the first checkpoint listed already reproduces: the failure began at or before it"
    assert report["cost"]["builds"] == 1 and report["cost"]["probes"] == 1
    assert main(argv) == 0  # the probe and the runs are reused
    assert json.loads((out / "report.json").read_text())["cost"]["reused"] == {"probes": 1, "runs": 3}


def test_bad_input_is_one_line_and_builds_nothing(run, tmp_path, capsys):
    log = write_log(tmp_path / "metrics.jsonl", 40, 25)
    out = tmp_path / "t"
    assert main(["triage", str(log), str(run), "--out", str(out), *ARGS, "--candidates", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moe-proxy triage: error: unknown candidate 'nope'") and "\n" not in err
    assert not out.exists()


def test_the_candidates_come_from_the_catalogue_for_the_signature():
    """The catalogue's for the signature, but those that change nothing against the baseline: fp16
    scales the loss dynamically by default, and repro clips at 1.0 already."""
    chosen, why = candidates_for("overflow", None, ["--precision", "fp16"])
    assert [c.name for c in chosen] == [s.name for s in FOR_SIGNATURE["overflow"]
                                        if s.name not in ("loss-scaling", "grad-clip")]
    assert why["bf16"] == next(s.why for s in FOR_SIGNATURE["overflow"] if s.name == "bf16")
    assert why["grad-clip"].startswith("left out: --grad-clip 1.0 changes none")
    chosen, _ = candidates_for("actor/grad_norm>100:3", None, [])  # repro's default: fp32, clipped at 1.0
    assert [c.name for c in chosen] == [s.name for s in FOR_THRESHOLD if s.name not in ("grad-clip", "fp32")]
    given, why = candidates_for("overflow", chosen[:1])
    assert given == chosen[:1] and why == {chosen[0].name: "given"}


def test_the_docs_show_the_catalogues_table():
    assert suggestion_table() in (Path(__file__).resolve().parents[2] / "docs" / "triage.md").read_text()
