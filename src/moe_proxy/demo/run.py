"""A training run's checkpoints for the demo and the tests, without training: copies of one
checkpoint in verl's layout (`<run>/global_step_<N>/actor/huggingface/`), in which a massive
activation grows (a dense MLP's down_proj scaled by a factor per step, as super weights grow
over training). A factor of 1e6 puts that MLP's output beyond fp16's range: `repro --precision
fp16 --fail-on overflow` reproduces from those checkpoints on, which `bisect` then finds."""

from __future__ import annotations

import json
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
