"""diagnose's verdicts never hide a failure (issue 41 §1): another failure or an early stop on any
seed makes a cure `fixed-but`, counted apart from `fixed`; a candidate that changes nothing is
`no-change`; a candidate is judged on its own steps; the baseline runs first and a baseline that
does not reproduce stops the diagnosis (exit 3, no candidate run); costs over a stated window
that is never empty, time per step with its spread. The rules on SeedRuns, then real runs of a
tiny model through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_proxy.cli import main
from moe_proxy.investigate.catalogue import CATALOGUE
from moe_proxy.rl.config import ReproConfig
from moe_proxy.metrics.detect import FailureDetector, Onset, Signature
from moe_proxy.investigate.diagnose import (BASELINE, Diagnosis, SeedRun, Variant, changed_settings, cost_of, judge,
                                      repro_config, verdict, write_report)
from moe_proxy.metrics.verdict import verdict_report

STEPS = 6


def failed(step: int) -> SeedRun:
    """A run that hit the divergence asked for at `step` (and stopped there)."""
    return SeedRun(True, "divergence", step, step + 1, "reproduced divergence")


def clean(steps: int = STEPS, stopped: str = "completed", **others: int) -> SeedRun:
    """A run without the divergence, `steps` completed, with other failures at their onsets."""
    return SeedRun(False, None, None, steps, stopped, others)


@pytest.mark.parametrize("baseline, candidate, expected, note", [
    # the docs' walk-through: lower-lr cures the divergence, both seeds collapse at step 3
    ({0: failed(1), 1: failed(3)}, {0: clean(collapse=3), 1: clean(collapse=3)}, "fixed-but",
     "collapse at step 3 on seeds 0, 1 (no divergence on seeds 0, 1)"),
    # symmetric over seeds: a NaN stop on seed 1, where the baseline ran clean, is reported
    ({0: failed(1), 1: clean()}, {0: clean(), 1: clean(3, "loss or weights are NaN", nan=2)}, "fixed-but",
     "nan at step 2 on seed 1; seed 1 stopped after 3 of 6 steps (no divergence on seed 0)"),
    # an early stop with no failure named says why it stopped
    ({0: failed(1)}, {0: clean(4, "error: killed")}, "fixed-but",
     "seed 0 stopped after 4 of 6 steps (error: killed) (no divergence on seed 0)"),
    # the failure came back on one seed; another failure on the other is said too
    ({0: failed(1), 1: failed(3)}, {0: failed(2), 1: clean(collapse=4)}, "reproduced",
     "delayed: seed 0 step 2; also collapse at step 4 on seed 1"),
    # stopped by NaN before the baseline's onset: nothing cured, what stopped it named
    ({0: failed(3)}, {0: clean(2, "loss or weights are NaN", nan=1)}, "inconclusive",
     "seed 0 did not get past the baseline's onset at step 3; nan at step 1 on seed 0; seed 0 stopped after 2 of 6 "
     "steps"),
    ({0: failed(1), 1: failed(3)}, {0: clean(), 1: clean()}, "fixed", "ran all 6 steps on seeds 0, 1"),
])
def test_a_cure_with_another_failure_on_any_seed_is_fixed_but(baseline, candidate, expected, note):
    assert verdict(baseline, candidate, STEPS) == (expected, note)


def test_a_candidate_that_changes_nothing_is_no_change_not_reproduced():
    base = {0: failed(1), 1: failed(3)}
    assert verdict(base, {0: failed(1), 1: failed(3)}, STEPS, changed=False) == (
        "no-change", "changes none of the baseline's settings; its runs end as the baseline's (seed 0 step 1, "
        "seed 1 step 3)")
    name, note = verdict(base, {0: failed(1), 1: clean()}, STEPS, changed=False)
    assert name == "no-change" and "differ from the baseline's on seed 1: the runs are not deterministic" in note


def test_changes_that_leave_every_steps_learning_rate_as_it_was_are_none(tiny_qwen3):
    base = repro_config(["--steps", "6", "--lr", "0.05"])

    def changes(*flags: str) -> dict:
        return changed_settings(base, repro_config(["--steps", "6", "--lr", "0.05", *flags]))

    assert changes("--warmup-steps", "1") == {}  # step 0 at the full rate: the baseline again
    assert changes("--warmup-steps", "2") == {"warmup_steps": 2}
    assert changes("--lr-schedule", "cosine") == {"lr_schedule": "cosine"}
    assert changes("--steps", "8", "--warmup-steps", "1") == {"steps": 8}


@pytest.mark.parametrize("steps", [1, 2, 3, 6, 8, 20])
def test_every_catalogue_entry_changes_the_run_at_every_step_count(tiny_qwen3, steps):
    """Against a baseline each entry has something to change in (grad-clip and skip-nonfinite are
    repro's defaults, fp32 too; aux-loss-off needs an aux loss), at 1 to 20 steps: warmup too."""
    base_flags = ["--steps", str(steps), "--lr", "1e-4", "--grad-clip", "0", "--no-skip-nonfinite", "--precision",
                  "fp16", "--loss-scaling", "none", "--router-aux-coef", "1e-2"]
    base = repro_config(base_flags)
    for fix in CATALOGUE.values():
        config = repro_config([*base_flags, *fix.changes(base)])
        assert changed_settings(base, config), (fix.name, steps, fix.changes(base))


def _diagnosis(tmp_path: Path, *variants: Variant, steps: int = STEPS) -> Diagnosis:
    return Diagnosis("proxy", tmp_path, "divergence", ["--steps", str(steps)], [0, 1], ReproConfig(steps=steps),
                     [Variant(BASELINE, [], "the failing run", steps=steps), *variants])


def test_fixed_but_is_counted_apart_from_fixed_and_shown_in_the_report(tmp_path):
    d = _diagnosis(tmp_path, Variant("lower-lr", ["--lr", "0.005"], changes={"lr": 0.005}, steps=STEPS),
                   Variant("fp32", ["--precision", "fp32"], changes={"precision": "fp32"}, steps=STEPS))
    results = {BASELINE: {0: failed(1), 1: failed(3)}, "lower-lr": {0: clean(collapse=3), 1: clean(collapse=3)},
               "fp32": {0: clean(), 1: clean()}}
    report = judge(d, results)
    assert report["fixed_by"] == ["fp32"] and report["fixed_with_other_failures"] == ["lower-lr"]
    assert report["candidates"]["lower-lr"]["seeds"]["0"]["also_seen"] == {"collapse": 3}
    write_report(d, report)
    md = (tmp_path / "report.md").read_text()
    assert "Fixed by: fp32. Fixed, but with another failure or an early stop: lower-lr." in md
    assert "| lower-lr | **fixed-but** collapse at step 3 on seeds 0, 1 (no divergence on seeds 0, 1) | " \
           "collapse step 3 | collapse step 3 |" in md


def test_a_clean_baseline_stops_the_report_only_where_no_candidate_ran(tmp_path):
    d = _diagnosis(tmp_path, Variant("fp32", ["--precision", "fp32"], changes={"precision": "fp32"}, steps=STEPS))
    base = {BASELINE: {0: clean(), 1: clean(collapse=2)}}
    stopped = judge(d, base)
    assert stopped["stopped"] == ("the baseline did not reproduce divergence on any seed (0, 1) in 6 steps: nothing "
                                  "to cure")
    assert stopped["candidates"]["fp32"]["verdict"] == "not-run"
    assert stopped["baseline"]["findings"] == ["collapse at step 2 on seed 1"]
    ran = judge(d, base | {"fp32": {0: clean(), 1: clean()}})  # the fidelity lab's baseline_first=False
    assert "stopped" not in ran and ran["candidates"]["fp32"]["verdict"] == "inconclusive"


def test_a_candidate_is_judged_on_its_own_steps(tmp_path):
    shorter = Variant("short", ["--steps", "4"], changes={"steps": 4}, steps=4)
    longer = Variant("long", ["--steps", "10"], changes={"steps": 10}, steps=10)
    d = _diagnosis(tmp_path, shorter, longer)
    report = judge(d, {BASELINE: {0: failed(1), 1: failed(3)}, "short": {0: clean(4), 1: clean(4)},
                       "long": {0: clean(10), 1: clean(10)}})
    assert (report["candidates"]["short"]["verdict"], report["candidates"]["short"]["note"]) == \
        ("fixed", "ran all 4 steps on seeds 0, 1")
    assert report["candidates"]["long"]["note"] == "ran all 10 steps on seeds 0, 1"
    # too few of its own steps to pass the baseline's onset: no cure seen
    assert verdict({0: failed(3)}, {0: clean(2)}, 2) == (
        "inconclusive", "seed 0 did not get past the baseline's onset at step 3 in its 2 steps")


def _metrics(reward: list[float], loss: list[float], time: list[float]) -> dict[int, dict[str, float]]:
    return {s: {"critic/rewards/mean": r, "actor/pg_loss": l, "perf/time_per_step": t}
            for s, (r, l, t) in enumerate(zip(reward, loss, time))}


def test_costs_cover_a_stated_window_that_is_never_empty_and_time_has_its_spread(tmp_path):
    runs = [_metrics([0.5, 0.1, 0.2], [2.0, 1.0, 1.0], [1.0, 3.0, 2.0])]
    at_zero = cost_of(runs, (0, 0))  # a baseline that fails at step 0: step 0 itself, not "+0 over nothing"
    assert (at_zero["reward_mean"], at_zero["loss_mean"]) == (0.5, 2.0)
    assert (at_zero["window_first"], at_zero["window_last"]) == (0, 0)
    assert (at_zero["time_per_step_s"], at_zero["time_per_step_sd"]) == (2.0, 1.0)
    assert cost_of(runs, (0, 0), timed=False)["time_per_step_s"] is None

    d = _diagnosis(tmp_path, Variant("fp32", ["--precision", "fp32"], changes={"precision": "fp32"}, steps=3),
                   steps=3)
    for variant, rows in ((BASELINE, runs[0]), ("fp32", _metrics([0.3, 0.3, 0.3], [1.0, 1.0, 1.0], [2.0] * 3))):
        for seed in d.seeds:
            d.run_dir(variant, seed).mkdir(parents=True)
            (d.run_dir(variant, seed) / "metrics.jsonl").write_text(
                "".join(json.dumps({"step": s, **row}) + "\n" for s, row in rows.items()))
    results = {BASELINE: {0: failed(0), 1: failed(0)}, "fp32": {0: clean(3), 1: clean(3)}}
    report = judge(d, results)
    assert report["cost_window"] == "steps 0-0 (up to the baseline's first onset)"
    assert report["candidates"]["fp32"]["cost"]["reward_vs_baseline"] == pytest.approx(0.3 - 0.5)
    write_report(d, report)
    md = (tmp_path / "report.md").read_text()
    assert "Reward and loss are means over steps 0-0 (up to the baseline's first onset)" in md
    assert "| 2 ± 0.89 s |" in md  # the baseline's 1, 3, 2 s on each seed
    shared = judge(d, results, parallel=2)  # runs that shared the machine time each other: left out
    assert shared["baseline"]["cost"]["time_per_step_s"] is None
    assert shared["time_left_out"] == "2 runs at a time shared the machine"


def test_the_termination_message_carries_the_other_failures_seen():
    detector = FailureDetector()
    detector.onsets["collapse"] = Onset(3, "one expert takes every token")
    rows = {s: {"actor/pg_loss": 0.1} for s in range(6)}
    message = verdict_report(detector, Signature.parse("divergence"), rows, "completed")
    assert (message["reproduced"], message["also_seen"], message["steps_completed"]) == (False, {"collapse": 3}, 6)


# --- real runs through the CLI --------------------------------------------------------------

BASE = ["--steps", "4", "--lr", "0.1"]  # diverges at step 1 on the tiny model; lr / 10 does not


def test_a_cure_that_brings_a_nan_reads_fixed_but_in_stdout_report_and_matrix(tiny_qwen3, tmp_path, capsys):
    out = tmp_path / "d"
    # lr / 10 cures the divergence; a broken kernel from step 2 brings a NaN (and stops the run)
    nan = "cure-nan=--lr 0.01,--fault-op model.layers.1.mlp@2,--fault-op-mode nan"
    assert main(["diagnose", str(tiny_qwen3), "--out", str(out), "--fail-on", "divergence", *BASE,
                 "--candidates", "lower-lr", "--candidate", nan, "--seeds", "1"]) == 0
    printed = capsys.readouterr().out
    assert "cure-nan  fixed-but: nan at step 2 on seed 0; seed 0 stopped after 3 of 4 steps (no divergence on seed 0)" \
        in printed
    assert "fixed by: lower-lr\nfixed, but with other failures: cure-nan\n" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["fixed_by"] == ["lower-lr"] and report["fixed_with_other_failures"] == ["cure-nan"]
    assert "| cure-nan | **fixed-but** nan at step 2 on seed 0" in (out / "report.md").read_text()
    import matplotlib.image

    pixels = matplotlib.image.imread(out / "matrix.png")[..., :3]
    amber = (abs(pixels - [1.0, 0.573, 0.198]) < 0.02).all(axis=-1)  # the "other failure" cell (alpha 0.85)
    assert amber.sum() > 1000


def test_a_baseline_that_does_not_reproduce_stops_before_any_candidate(tiny_qwen3, tmp_path, capsys):
    out = tmp_path / "d"
    code = main(["diagnose", str(tiny_qwen3), "--out", str(out), "--fail-on", "divergence", "--steps", "2",
                 "--lr", "1e-5", "--candidates", "lower-lr,fp32", "--seeds", "1"])
    printed = capsys.readouterr().out.strip()
    assert code == 3
    assert printed == (f"the baseline did not reproduce divergence on any seed (0) in 2 steps: nothing to cure; no "
                       f"candidate was run (exit 3; report: {out / 'report.md'})")
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["baseline"]
    report = json.loads((out / "report.json").read_text())
    assert {c["verdict"] for c in report["candidates"].values()} == {"not-run"}
    assert "**Stopped: the baseline did not reproduce divergence" in (out / "report.md").read_text()
