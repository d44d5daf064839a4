"""`watch` on a log whose writer has finished gives its verdict at once (issue 41, section 6).

A finished log used to be followed forever (or to --timeout, exit 2, no verdict) unless a done
marker or SIGTERM came. The end is in the log itself: transformers' Trainer logs its speed
metrics (`train_runtime`, TensorBoard `train/train_runtime`) once, when train() ends; a
trainer_state.json whose global_step has reached max_steps was saved at the last step; verl
writes no end, so its last step (trainer.total_training_steps) is given as --last-step. Files
written by the real writers (torch's SummaryWriter as transformers' TensorBoardCallback calls it,
TrainerState.save_to_json, verl FileLogger lines); a log that does not show its end still waits.
"""

from __future__ import annotations

import json
import time

import pytest

from moe_proxy.cli import main

STEPS = range(1, 6)
END = {"train_runtime": 3.2, "train_samples_per_second": 10.0, "train_loss": 0.05}  # Trainer.train()'s last log


def row(step: int) -> dict[str, float]:
    return {"loss": 0.02 * step, "grad_norm": 0.5, "learning_rate": 1e-6, "kl": 1e-4, "entropy": 1.0,
            "reward": 0.1 * step}


def tensorboard(root, ended: bool):
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(root / "runs" / "Dec05_00-00-00_host"))
    for step in STEPS:
        for key, value in {**row(step), **(END if ended and step == max(STEPS) else {})}.items():
            writer.add_scalar(f"train/{key}", value, step)
    writer.flush()  # the writer is left open, as a running Trainer's is
    return root / "runs", []


def trainer_state(root, ended: bool):
    from transformers.trainer_callback import TrainerState

    state = TrainerState(global_step=max(STEPS), max_steps=max(STEPS) if ended else 100)
    state.log_history = [{**row(s), "step": s} for s in STEPS]
    (root / "checkpoint-5").mkdir()
    state.save_to_json(str(root / "checkpoint-5" / "trainer_state.json"))
    return root, []


def verl(root, ended: bool):
    path = root / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "elapsed_seconds": s, "data": row(s)}) + "\n" for s in STEPS))
    return path, ["--last-step", str(max(STEPS))] if ended else []


WRITERS = {"tensorboard": tensorboard, "trainer-state": trainer_state, "verl": verl}


@pytest.mark.parametrize("writer", WRITERS)
def test_a_finished_log_gives_its_verdict_at_once_one_that_does_not_show_its_end_waits(tmp_path, capsys, writer):
    (tmp_path / "open").mkdir(), (tmp_path / "done").mkdir()
    path, flags = WRITERS[writer](tmp_path / "open", ended=False)
    assert main(["watch", str(path), *flags, "--poll", "0.05", "--timeout", "0.3"]) == 2
    held = writer == "tensorboard"  # its newest step waits for a later one, or the end
    assert f"no end of the run within 0.3s ({len(STEPS) - held} steps seen" in capsys.readouterr().err

    path, flags = WRITERS[writer](tmp_path / "done", ended=True)
    started = time.monotonic()
    assert main(["watch", str(path), *flags, "--poll", "0.05", "--timeout", "5"]) == 0
    assert time.monotonic() - started < 4
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"no failure in {len(STEPS)} steps", out


def test_a_trainer_log_with_its_end_in_json_lines_and_a_bad_last_step(tmp_path, capsys):
    """train_runtime ends any format that carries it; --last-step must be a step number."""
    path = tmp_path / "trl.jsonl"
    path.write_text("".join(json.dumps({"step": s, **row(s), **(END if s == 5 else {})}) + "\n" for s in STEPS))
    assert main(["watch", str(path), "--poll", "0.05", "--timeout", "5"]) == 0
    assert capsys.readouterr().out.startswith("no failure in 5 steps")
    assert main(["watch", str(path), "--last-step", "-1", "--timeout", "5"]) == 2
    assert capsys.readouterr().err.strip() == "moe-proxy watch: error: --last-step -1: a step number, 0 or more"
