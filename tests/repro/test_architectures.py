"""repro runs on every architecture the builder supports, and finds each one's routers."""

import pytest

from moe_proxy.rl.config import ReproConfig
from moe_proxy.rl.runner import run_repro
from moe_proxy.metrics.readers import read_metrics
from moe_proxy.demo.tiny import TINY, make_tiny

# MoE layers of the tiny checkpoints: some start with a dense layer 0.
MOE_LAYERS = {"gpt_oss": [0, 1], "mixtral": [0, 1], "olmoe": [0, 1]}


@pytest.mark.parametrize("arch", sorted(TINY))
def test_repro_step_on_each_architecture(arch, tmp_path):
    make_tiny(arch, tmp_path / "ckpt")
    run_repro(str(tmp_path / "ckpt"), tmp_path / "run", ReproConfig(steps=1, batch_size=2, mini_batches=1))
    metrics = read_metrics(tmp_path / "run")[0]
    layers = sorted(int(k.rsplit("_", 1)[1]) for k in metrics if k.startswith("moe/router_entropy/layer_"))
    assert layers == MOE_LAYERS.get(arch, [1])
    assert metrics["moe/load_uniform_share"] == 0.25  # top-2 of 8
    assert metrics["actor/grad_norm"] > 0
