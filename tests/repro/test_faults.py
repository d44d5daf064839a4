"""Each injected fault is detected, with the right signature, at the step it was injected;
the same run without the fault shows no failure."""

import pytest

from moe_proxy.rl.config import Faults, ReproConfig
from moe_proxy.rl.runner import run_repro
from moe_proxy.metrics.readers import read_metrics

K = 4  # the injection step: after the detector's 3 baseline steps

CASES = {
    "lr spike": (Faults(lr_spike_step=K, lr_spike_factor=10_000), "divergence"),
    "router logit scale": (Faults(router_scale_step=K, router_scale_factor=30), "divergence"),
    "faulty op, scale": (Faults(op_module="model.layers.0.mlp", op_step=K, op_value=1e4), "divergence"),
    "faulty op, nan": (Faults(op_module="model.layers.1.mlp", op_step=K, op_mode="nan"), "nan"),
    "fp16 without loss scaling": (Faults(fp16_no_scaling_step=K), "underflow"),
}


@pytest.fixture(scope="module")
def clean_run(tiny_qwen3, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    return run_repro(str(tiny_qwen3), out, ReproConfig(steps=K + 3, lr=1e-4)), out


def test_control_run_has_no_failure(clean_run):
    result, _ = clean_run
    assert result.failures == {} and result.steps_completed == K + 3


@pytest.mark.parametrize("case", CASES)
def test_fault_detected_at_injection_step(tiny_qwen3, tmp_path, clean_run, case):
    faults, signature = CASES[case]
    result = run_repro(str(tiny_qwen3), tmp_path, ReproConfig(steps=K + 3, lr=1e-4, faults=faults))
    assert result.signature == signature, result.failures
    assert result.step == K
    # before the fault the run is the control run, step for step
    rows, control = read_metrics(tmp_path), read_metrics(clean_run[1])
    for step in range(K):
        assert rows[step]["actor/pg_loss"] == control[step]["actor/pg_loss"]


def test_fp16_with_dynamic_loss_scaling_does_not_underflow(tiny_qwen3, tmp_path):
    result = run_repro(str(tiny_qwen3), tmp_path, ReproConfig(steps=K + 1, lr=1e-4, precision="fp16"))
    assert "underflow" not in result.failures
    assert max(m["numerics/dense_grad_zero_frac"] for m in read_metrics(tmp_path).values()) == 0


def test_nan_run_stops_early(tiny_qwen3, tmp_path):
    faults = Faults(op_module="model.layers.1.mlp", op_step=1, op_mode="nan")
    result = run_repro(str(tiny_qwen3), tmp_path, ReproConfig(steps=6, faults=faults))
    assert result.steps_completed == 2 and result.signature == "nan"
