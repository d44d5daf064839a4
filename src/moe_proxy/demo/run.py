"""A training run's checkpoints for the demo and the tests, without training: copies of one
checkpoint in verl's layout (`<run>/global_step_<N>/actor/huggingface/`), in which a massive
activation grows (a dense MLP's down_proj scaled by a factor per step, as super weights grow
over training). A factor of 1e6 puts that MLP's output beyond fp16's range: `repro --precision
fp16 --fail-on overflow` reproduces from those checkpoints on, which `bisect` then finds.

`write_log` writes the same run's metrics as verl's FileLogger would (one line a step, fp16): the
massive activation grows step by step and overflows fp16 from the step given on, which `triage`
detects before it bisects the checkpoints."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

DENSE_DOWN_PROJ = "model.layers.0.mlp.down_proj.weight"  # layer 0 is dense in the tiny MoE models
OVERFLOWS = 1e6  # the factor that takes the MLP's output beyond fp16's range


def checkpoint_dir(run: Path, step: int) -> Path:
    return run / f"global_step_{step}" / "actor" / "huggingface"


def write_run(original: Path, run: Path, growth: dict[int, float]) -> Path:
    """One checkpoint per step of `growth` (step -> factor on the dense down_proj) under `run`."""
    for step, factor in sorted(growth.items()):
        target = checkpoint_dir(run, step)
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(original, target)
        if factor != 1:
            scale(target, DENSE_DOWN_PROJ, factor)
    return run


def scale(checkpoint: Path, name: str, factor: float) -> None:
    """Multiply tensor `name` of `checkpoint` by `factor`, in the shard that holds it."""
    from safetensors.torch import load_file, save_file

    index = checkpoint / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"][name] if index.exists() else "model.safetensors"
    tensors = load_file(checkpoint / shard)
    tensors[name] = tensors[name] * factor
    save_file(tensors, checkpoint / shard, metadata={"format": "pt"})


def write_log(path: Path, last_step: int, overflow_from: int | None) -> Path:
    """The run's metrics, one verl FileLogger line per step 1..last_step, in fp16: the dense MLP's
    largest activation grows 3% a step, and from `overflow_from` on (None: never) the forward pass
    holds values past fp16's range (numerics/nonfinite_activations), the loss and grad norm NaN."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, last_step + 1):
        broken = overflow_from is not None and step >= overflow_from
        data = {"actor/pg_loss": None if broken else 0.5 - 0.002 * step, "actor/entropy": 2.0 - 0.004 * step,
                "actor/grad_norm": None if broken else 1.0 + 0.05 * math.sin(step),
                "critic/rewards/mean": 0.2 + 0.003 * step, "moe/load_max_share": 0.3,
                "numerics/max_activation": 1000.0 * 1.03 ** step, "numerics/half_precision": 1,
                "numerics/nonfinite_activations": 96 if broken else 0}
        lines.append(json.dumps({"step": step, "elapsed_seconds": 30.0 * step, "data": data}))
    path.write_text("\n".join(lines) + "\n")
    return path
