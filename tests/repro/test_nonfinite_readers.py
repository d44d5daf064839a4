"""A non-finite grad norm is a finding, the same from every reader (issue 41, section 6).

The same TRL run (a NaN or inf `grad_norm` at step 2, every other value finite, as transformers'
Trainer logs a step whose gradients broke while its loss did not) written four ways by the
writers themselves: TensorBoard events by torch's SummaryWriter under transformers'
`train/<name>` tags (scalars) and by tensorboard's own Writer (tensor summaries), an HF
`trainer_state.json` by TrainerState.save_to_json, and verl FileLogger lines (orjson writes NaN
and inf as null). `watch` and `compare` used to call all
three clean: the detector read a grad norm only as a divergence magnitude, which must be finite.
"""

from __future__ import annotations

import json
import math

import pytest

from moe_proxy.cli import main
from moe_proxy.metrics.detect import FailureDetector

STEPS = range(1, 7)


def row(step: int, bad: float) -> dict[str, float]:
    return {"loss": 0.02 * step, "grad_norm": bad if step == 2 else 0.4 + 0.01 * step, "learning_rate": 1e-6,
            "kl": 1e-4 * step, "entropy": 1.1 - 0.01 * step, "reward": 0.1 * step}


def write_all(root, bad: float) -> dict:
    from torch.utils.tensorboard import SummaryWriter
    from transformers.trainer_callback import TrainerState

    writer = SummaryWriter(log_dir=str(root / "tb" / "runs" / "Dec05_00-00-00_host"))
    for s in STEPS:
        for key, value in row(s, bad).items():
            writer.add_scalar(f"train/{key}", value, s)
    writer.close()
    from tensorboard.summary import Writer

    writer = Writer(str(root / "tb-tensors"))
    for s in STEPS:
        for key, value in row(s, bad).items():
            writer.add_scalar(f"train/{key}", value, s)
    writer.close()
    state = TrainerState(global_step=max(STEPS), max_steps=max(STEPS))
    state.log_history = [{**row(s, bad), "step": s} for s in STEPS]
    (root / "state").mkdir()
    state.save_to_json(str(root / "state" / "trainer_state.json"))
    null = {s: {k: (None if not math.isfinite(v) else v) for k, v in row(s, bad).items()} for s in STEPS}
    (root / "verl.jsonl").write_text("".join(json.dumps({"step": s, "data": null[s]}) + "\n" for s in STEPS))
    return {"tensorboard": root / "tb", "tensor-summaries": root / "tb-tensors", "trainer-state": root / "state" / "trainer_state.json",
            "jsonl": root / "verl.jsonl"}


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_every_reader_gives_the_same_verdict(tmp_path, capsys, bad):
    runs = write_all(tmp_path, bad)
    for fmt, path in runs.items():
        capsys.readouterr()
        assert main(["watch", str(path), "--until-file", str(path), "--poll", "0.01", "--timeout", "30"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0] == "overflow at step 2", (fmt, out)
        assert "trl names (detected)" in out[1], (fmt, out)

    report = tmp_path / "report"
    assert main(["compare", *map(str, runs.values()), "--names", ",".join(runs), "--out", str(report),
                 "--permutations", "0"]) == 0
    onsets = {c["run"]: c["onsets"] for c in json.loads((report / "report.json").read_text())["comparisons"]}
    assert onsets == {fmt: {"overflow": 2} for fmt in runs}


def feed(rows: list[dict[str, float]]) -> dict[str, int]:
    detector = FailureDetector()
    for step, metrics in enumerate(rows):
        detector.update(step, metrics)
    return {name: onset.step for name, onset in detector.onsets.items()}


def test_with_loss_scaling_a_non_finite_grad_norm_is_a_skipped_step_not_at_once():
    """Megatron logs its loss scale and a grad norm, no skip count: one non-finite norm while the
    scale settles is normal; three in a row are an overflow from the first of them."""
    def megatron(norm: float) -> dict[str, float]:
        return {"actor/pg_loss": 1.0, "actor/grad_norm": norm, "numerics/loss_scale": 2.0**16}

    assert feed([megatron(1.0), megatron(math.inf), megatron(1.0), megatron(1.0)]) == {}
    assert feed([megatron(1.0), megatron(math.inf), megatron(math.nan), megatron(math.inf)]) == {"overflow": 1}
    # a NaN loss is the nan it always was, not also an overflow
    assert feed([{"actor/pg_loss": math.nan, "actor/grad_norm": math.nan}]) == {"nan": 0}
