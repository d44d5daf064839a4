"""The formats `watch` and `compare` read (readers.py) and the name profiles (profiles.py), on
files the real writers produce: torch's SummaryWriter with TRL's names as transformers'
TensorBoardCallback writes them (train/<name>), transformers' own TrainerState.save_to_json,
and verl's FileLogger lines with orjson's null for NaN."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest

from moe_proxy.cli import main
from moe_proxy.errors import InvalidReproConfig, MalformedMetrics
from moe_proxy.metrics.compare import load_run
from moe_proxy.metrics.profiles import coverage, profile_for
from moe_proxy.metrics.readers import ReadOptions, RunFollower, detect_format, read_run, reading
from moe_proxy.metrics.watch import watch

STEPS = range(1, 9)  # the Trainer's global_step starts at 1
STEP_S = 0.5  # a live run's step: watch has that long to read a step and stop the run


def trl_row(step: int) -> dict[str, float]:
    """A GRPO step as TRL logs it: the KL jumps from 3e-5 to 4.3 at step 2 (learning rate 1.0)."""
    return {"loss": 0.01 * step, "grad_norm": 0.5 + 0.01 * step, "learning_rate": 1.0,
            "kl": 3e-5 if step < 2 else 4.3, "entropy": 1.2 - 0.01 * step, "reward": 0.1 * step}


def write_tensorboard(directory, steps=STEPS):
    """transformers' TensorBoardCallback: rewrite_logs prefixes train/, then add_scalar per value."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(directory))
    for step in steps:
        for key, value in trl_row(step).items():
            writer.add_scalar(f"train/{key}", value, step)
    writer.close()


def write_trainer_state(path, steps=STEPS):
    from transformers.trainer_callback import TrainerState

    state = TrainerState(global_step=max(steps), max_steps=max(steps))
    state.log_history = [{**trl_row(s), "epoch": s / 8, "step": s} for s in steps]
    state.log_history.append({"step": max(steps), "epoch": 1.0, "train_runtime": 3.2, "train_loss": 0.05,
                              "total_flos": 0.0})
    path.parent.mkdir(parents=True, exist_ok=True)
    state.save_to_json(str(path))


def write_jsonl(path, steps=STEPS):
    path.write_text("".join(json.dumps({"step": s, **trl_row(s)}) + "\n" for s in steps))


@pytest.fixture(scope="module")
def trl_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl")
    write_tensorboard(root / "out" / "runs" / "Dec05_00-00-00_host")
    write_trainer_state(root / "out" / "checkpoint-4" / "trainer_state.json", range(1, 5))
    write_trainer_state(root / "out" / "checkpoint-8" / "trainer_state.json")
    write_jsonl(root / "metrics.jsonl")
    return {"tensorboard": root / "out" / "runs", "event-file": next((root / "out" / "runs").rglob("events.out.*")),
            "trainer-state": root / "out", "state-file": root / "out" / "checkpoint-8" / "trainer_state.json",
            "jsonl": root / "metrics.jsonl"}


def test_formats_are_detected(trl_runs):
    assert detect_format(trl_runs["tensorboard"]) == "tensorboard"
    assert detect_format(trl_runs["event-file"]) == "tensorboard"
    assert detect_format(trl_runs["trainer-state"]) == "trainer-state"
    assert detect_format(trl_runs["state-file"]) == "trainer-state"
    assert detect_format(trl_runs["jsonl"]) == "jsonl"


@pytest.mark.parametrize("source", ["tensorboard", "event-file", "trainer-state", "state-file", "jsonl"])
def test_the_same_run_reads_the_same_from_every_format(trl_runs, source):
    rows, profile = read_run(trl_runs[source])
    assert profile.name == "trl" and profile.detected
    assert sorted(rows) == list(STEPS)
    assert rows[2]["actor/kl_loss"] == pytest.approx(4.3) and rows[1]["actor/kl_loss"] == pytest.approx(3e-5)
    assert rows[3]["actor/pg_loss"] == pytest.approx(0.03) and rows[3]["actor/grad_norm"] == pytest.approx(0.53)
    assert rows[5]["critic/rewards/mean"] == pytest.approx(0.5)
    assert load_run(trl_runs[source]).onsets == {"divergence": 2}


@pytest.mark.parametrize("source", ["tensorboard", "trainer-state", "jsonl"])
def test_watch_gives_divergence_at_step_2(trl_runs, source, tmp_path, capsys):
    done = tmp_path / "done"
    done.touch()
    assert main(["watch", str(trl_runs[source]), "--fail-on", "divergence", "--until-file", str(done),
                 "--poll", "0.01", "--timeout", "20", "--termination-log", str(tmp_path / "log")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "divergence at step 2 (reproduced)"
    assert out[1] == ("metrics: trl names (detected); roles found: policy_loss, kl, entropy, grad_norm, reward, "
                      "learning_rate")
    assert any(line.startswith("  collapse: cannot be judged from this run's metrics (no per-expert load")
               for line in out)
    assert any(line.startswith("  mismatch: cannot be judged") for line in out)  # no rollout/trainer gap logged
    assert any(line.startswith("  overflow: cannot be judged") for line in out)
    assert json.loads((tmp_path / "log").read_text())["signature"] == "divergence"


def test_compare_gives_the_same_verdict_for_every_format(trl_runs, tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["compare", str(trl_runs["jsonl"]), str(trl_runs["tensorboard"]), str(trl_runs["trainer-state"]),
                 "--names", "jsonl,tb,state", "--out", str(out), "--permutations", "0"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert [c["onsets"] for c in report["comparisons"]] == [{"divergence": 2}] * 3
    assert [c["median_pearson"] for c in report["comparisons"]] == [pytest.approx(1.0)] * 3
    assert [m["profile"] for m in report["metrics"]] == ["trl"] * 3
    assert "collapse" in report["metrics"][1]["not_judged"] and "kl" in report["metrics"][1]["roles"]
    assert "## Metrics read" in (out / "report.md").read_text()
    assert "collapse: cannot be judged" in capsys.readouterr().out


def test_verl_file_logger_null_is_nan(tmp_path, capsys):
    """verl's FileLogger serialises with orjson, which writes NaN and Infinity as null."""
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "data": {"actor/pg_loss": None if s == 3 else 0.1, "actor/grad_norm": 1.0,
                                  "actor/kl_loss": 0.001, "critic/rewards/mean": 0.5, "val/name": "x"}}
             for s in range(1, 6)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows, profile = read_run(path)
    assert profile.name == "verl" and math.isnan(rows[3]["actor/pg_loss"]) and "val/name" not in rows[3]
    done = tmp_path / "done"
    done.touch()
    assert main(["watch", str(path), "--until-file", str(done), "--poll", "0.01", "--timeout", "20"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "nan at step 3"


def test_tensor_summaries_are_read(tmp_path):
    """new_style scalars are tensor summaries (as TensorFlow 2 and torch's new_style write them)."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path))
    for step in STEPS:
        for key, value in trl_row(step).items():
            writer.add_scalar(f"train/{key}", value, step, new_style=True)
    writer.close()
    rows, profile = read_run(tmp_path)
    assert profile.name == "trl" and rows[2]["actor/kl_loss"] == pytest.approx(4.3)
    assert load_run(tmp_path).onsets == {"divergence": 2}


def test_watch_follows_a_growing_event_file(tmp_path):
    """The newest step is held back until a later one arrives (its values may still be coming)."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path / "runs"))
    follower = RunFollower(tmp_path / "runs")
    assert follower.rows() == []  # no event file yet
    for step in (1, 2):
        for key, value in trl_row(step).items():
            writer.add_scalar(f"train/{key}", value, step)
    writer.flush()
    first = follower.rows()
    assert [s for s, _ in first] == [1] and follower.profile.name == "trl"
    for key, value in trl_row(3).items():
        writer.add_scalar(f"train/{key}", value, 3)
    writer.flush()
    assert [s for s, _ in follower.rows()] == [2]
    writer.close()
    last = follower.rows(final=True)
    assert [s for s, _ in last] == [3] and last[0][1]["actor/kl_loss"] == pytest.approx(4.3)


def test_watch_stops_a_live_tensorboard_run_at_the_divergence(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tmp_path / "runs"))
    stop, written = tmp_path / "stop", []

    def train():  # a step takes STEP_S, and the trainer stops as soon as the stop file is there
        for step in STEPS:
            for key, value in trl_row(step).items():
                writer.add_scalar(f"train/{key}", value, step)
            writer.flush()
            written.append(step)
            deadline = time.monotonic() + STEP_S
            while time.monotonic() < deadline and not stop.exists():
                time.sleep(0.01)
            if stop.exists():
                break
        writer.close()

    thread = threading.Thread(target=train)
    thread.start()
    from moe_proxy.metrics.detect import Signature
    result = watch(tmp_path / "runs", fail_on=Signature.parse("divergence"), stop_file=stop, poll_s=0.02,
                   timeout_s=20)
    thread.join()
    assert result.report["signature"] == "divergence" and result.report["step"] == 2 and stop.exists()
    # Step 2 is read once step 3 follows it: the run stopped there (a step or more later on a
    # slow machine), not after all 8, which take 8 x STEP_S.
    assert 3 <= written[-1] < STEPS[-1], written


@pytest.mark.parametrize("names, profile", [
    ({"train/loss", "train/grad_norm", "train/kl"}, "trl"),
    ({"loss", "grad_norm", "learning_rate"}, "trl"),
    ({"train/policy_loss", "train/kl", "train/reward", "train/actor_lr"}, "openrlhf"),
    ({"train/actor/pg_loss", "train/actor/kl_loss", "train/grad_norm"}, "mindspeed-rl"),
    ({"lm loss", "grad-norm", "loss-scale", "learning-rate"}, "megatron"),
    ({"actor/pg_loss", "actor/grad_norm"}, "verl"),
    ({"something/else"}, "verl"),
])
def test_profile_is_detected_from_the_names(names, profile):
    assert profile_for(names).name == profile


def test_megatron_names_reach_the_overflow_detector():
    p = profile_for({"lm loss", "grad-norm", "loss-scale"})
    row = p.rename({"lm loss": 2.0, "grad-norm": 1.0, "loss-scale": 0.5, "moe/load_max_share": 0.3})
    assert row == {"actor/pg_loss": 2.0, "actor/grad_norm": 1.0, "numerics/loss_scale": 0.5,
                   "moe/load_max_share": 0.3}
    found, missing = coverage(set(row))
    assert "loss_scale" in found and "expert_load" in found and set(missing) == {"underflow", "mismatch"}


def test_profile_and_metric_options(trl_runs, tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s, "my_kl": 3e-5 if s < 4 else 9.0, "loss": 0.1}) + "\n"
                            for s in range(1, 8)))
    rows, profile = read_run(path, ReadOptions(metrics=("kl=my_kl",)))
    assert rows[4]["actor/kl_loss"] == 9.0 and profile.name == "trl"
    with reading(ReadOptions(profile="megatron")):  # asked for: TRL's names are not renamed
        assert "actor/pg_loss" not in load_run(path).rows[1]
    with pytest.raises(InvalidReproConfig, match="--profile 'nope': no such profile; one of verl, trl"):
        read_run(path, ReadOptions(profile="nope"))
    with pytest.raises(InvalidReproConfig, match="--metric 'kl:x'"):
        read_run(path, ReadOptions(metrics=("kl:x",)))


def test_bad_event_files_are_refused(tmp_path, trl_runs):
    empty = tmp_path / "empty" / "events.out.tfevents.1.host"
    empty.parent.mkdir()
    empty.touch()
    with pytest.raises(MalformedMetrics, match="empty event file"):
        read_run(empty.parent)
    data = trl_runs["event-file"].read_bytes()
    cut = tmp_path / "events.out.tfevents.2.host"
    cut.write_bytes(data[:-7])
    with pytest.raises(MalformedMetrics, match="truncated or corrupt event file"):
        read_run(cut)
    with pytest.raises(MalformedMetrics, match="readable formats: jsonl"):
        other = tmp_path / "notes.txt"
        other.write_text("step 1: loss 0.3\n")
        read_run(other)


def test_an_unreadable_directory_is_one_line(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    def denied(self, pattern):
        raise PermissionError(13, "Permission denied")

    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "x").touch()
    monkeypatch.setattr(Path, "rglob", denied)
    with pytest.raises(MalformedMetrics, match="cannot read .*Permission denied"):
        read_run(tmp_path / "runs")
    # as `watch` reports it: one line on stderr, exit 2, no traceback
    assert main(["watch", str(tmp_path / "runs"), "--timeout", "5", "--poll", "0.01"]) == 2
    err = capsys.readouterr().err
    assert err == f"moe-proxy watch: error: {tmp_path / 'runs'}: cannot read the directory (Permission denied)\n", err


def test_compare_without_matplotlib_is_one_line(trl_runs, tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["compare", str(trl_runs["jsonl"]), str(trl_runs["tensorboard"]), "--out", str(tmp_path / "r"),
                 "--permutations", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moe-proxy compare: error: compare draws its plots with matplotlib") and "\n" not in err
    assert not (tmp_path / "r").exists()
