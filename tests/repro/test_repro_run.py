"""repro on a tiny real checkpoint: metrics and summary files, determinism, the operator's flags."""

import json

import pytest

from moe_proxy.cli import main
from moe_proxy.errors import InvalidReproConfig
from moe_proxy.rl.config import ReproConfig
from moe_proxy.metrics.detect import Signature
from moe_proxy.rl.runner import run_repro
from moe_proxy.metrics.readers import read_metrics

VERL_NAMES = ["actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl", "actor/kl_loss",
              "actor/pg_clipfrac", "actor/lr", "critic/rewards/mean", "critic/score/mean", "response_length/mean",
              "timing_s/gen", "perf/time_per_step"]
MOE_NAMES = ["moe/router_entropy/layer_1", "moe/load_max_share/layer_1", "moe/load_max_excess/layer_1",
             "moe/load_min_share/layer_1", "moe/router_logit_max/layer_1", "numerics/max_activation",
             "numerics/max_logit", "numerics/grad_norm/layer_0", "numerics/grad_norm/layer_1", "numerics/nonfinite_grads",
             "numerics/loss_scale_backoffs"]


def test_repro_writes_metrics_and_summary(tiny_qwen3, tmp_path):
    result = run_repro(str(tiny_qwen3), tmp_path, ReproConfig(steps=3, lr=1e-4))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]  # verl FileLogger lines
    rows = read_metrics(tmp_path)
    for name in VERL_NAMES + MOE_NAMES:
        assert name in rows[2], name
    assert 0 <= rows[0]["critic/rewards/mean"] <= 1
    assert rows[0]["actor/grad_norm"] > 0
    # layer 0 of the tiny Qwen3-MoE is dense: no router metrics for it
    assert "moe/router_entropy/layer_0" not in rows[0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps_completed"] == 3 and summary["failures"] == {} and summary["device"] == "cpu"
    assert summary["config"]["lr"] == 1e-4
    assert result.steps_completed == 3 and not result.reproduced


def test_same_seed_same_run_other_seed_differs(tiny_qwen3, tmp_path):
    runs = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        run_repro(str(tiny_qwen3), tmp_path / name, ReproConfig(steps=2, seed=seed, lr=1e-4))
        runs[name] = {s: {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/"))}
                      for s, m in read_metrics(tmp_path / name).items()}
    assert runs["a"] == runs["b"]
    assert runs["a"] != runs["c"]


def test_bf16_and_fp16_with_loss_scaling_run(tiny_qwen3, tmp_path):
    run_repro(str(tiny_qwen3), tmp_path / "bf16", ReproConfig(steps=2, precision="bf16"))
    fp16 = run_repro(str(tiny_qwen3), tmp_path / "fp16", ReproConfig(steps=2, precision="fp16"))
    rows = read_metrics(tmp_path / "fp16")
    assert rows[1]["numerics/loss_scale"] > 1  # dynamic scaling on, and logged
    assert "numerics/loss_scale" not in read_metrics(tmp_path / "bf16")[0]
    assert fp16.failures == {}


def test_cli_fail_on_threshold_stops_and_writes_termination_log(tiny_qwen3, tmp_path, capsys):
    log = tmp_path / "termination-log"
    code = main(["repro", str(tiny_qwen3), "--out", str(tmp_path / "run"), "--steps", "6",
                 "--fail-on", "actor/grad_norm>0:2", "--termination-log", str(log)])
    assert code == 0
    assert "reproduced" in capsys.readouterr().out
    text = log.read_text()
    assert len(text.encode()) < 4096
    message = json.loads(text)  # strict JSON: no NaN tokens
    assert message["reproduced"] is True
    assert message["signature"] == "actor/grad_norm>0:2" and message["step"] == 0
    assert message["metrics"]["actor/grad_norm"] > 0
    # it stopped as soon as the signature held for 2 steps
    assert list(read_metrics(tmp_path / "run")) == [0, 1]


def test_cli_not_reproduced_is_reported(tiny_qwen3, tmp_path):
    log = tmp_path / "log.json"
    main(["repro", str(tiny_qwen3), "--out", str(tmp_path / "run"), "--steps", "2", "--lr", "1e-4",
          "--fail-on", "nan", "--termination-log", str(log)])
    report = json.loads(log.read_text())
    series = report.pop("series")  # each step's reward, loss and time, for a Diagnosis's cost (verdict.cost_series)
    assert series["stride"] == 1 and len(series["reward"]) == len(series["time"]) == 2
    assert report | {"metrics": None} == {
        "reproduced": False, "signature": None, "step": None, "metrics": None,
        "steps_completed": 2, "stopped": "completed"}  # all it was asked to run: a clean run, not a cut-short one


@pytest.mark.parametrize("bad", ["grad_norm", "actor/grad_norm>", "actor/grad_norm>x", "actor/grad_norm>1:0"])
def test_bad_fail_on_is_one_clear_line(tiny_qwen3, tmp_path, capsys, bad):
    assert main(["repro", str(tiny_qwen3), "--out", str(tmp_path), "--fail-on", bad]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moe-proxy repro: error: --fail-on") and "\n" not in err


def test_bad_inputs(tiny_qwen3, tmp_path, capsys):
    assert main(["repro", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["repro", str(tiny_qwen3), "--out", str(tmp_path / "o"), "--fault-op", "model.nope@3"]) == 2
    assert "not in the model" in capsys.readouterr().err
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())  # says why the run ended
    assert summary["stopped"].startswith("error: InvalidReproConfig") and summary["steps_completed"] == 0
    with pytest.raises(InvalidReproConfig):
        ReproConfig(group_size=1)
    assert main(["repro", str(tiny_qwen3), "--out", str(tmp_path / "o"), "--device", "npu"]) == 2
    assert "torch_npu is not installed" in capsys.readouterr().err


def test_signature_parsing():
    sig = Signature.parse("actor/grad_norm>1e3:3")
    assert (sig.metric, sig.op, sig.value, sig.patience) == ("actor/grad_norm", ">", 1000.0, 3)
    assert Signature.parse("overflow").metric is None


def test_learning_rate_schedule_and_spike():
    from moe_proxy.rl.config import Faults

    cosine = ReproConfig(steps=10, lr=1.0, lr_schedule="cosine", warmup_steps=2,
                         faults=Faults(lr_spike_step=6, lr_spike_factor=50))
    assert [cosine.lr_at(s) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert cosine.lr_at(6) == pytest.approx(50 * 0.5)  # half-way through the cosine, times the spike
    assert cosine.lr_at(7) < cosine.lr_at(5) < 1.0
    assert ReproConfig(steps=4, lr=1.0, lr_schedule="linear").lr_at(2) == 0.5
    assert ReproConfig(faults=Faults(fp16_no_scaling_step=3)).precision_at(2) == ("fp32", False)
    assert ReproConfig(faults=Faults(fp16_no_scaling_step=3)).precision_at(3) == ("fp16", False)
    assert ReproConfig(precision="fp16").precision_at(0) == ("fp16", True)


def test_an_mtp_layer_is_said_once_not_reported_tensor_by_tensor(tmp_path):
    """DeepSeek-V3's MTP layer has no module in transformers' model: repro says once that it is
    left out, instead of transformers' load report listing its tensors as UNEXPECTED for the
    policy and again for the reference (#32 item 11)."""
    import subprocess
    import sys

    from moe_proxy.demo.tiny import make_tiny

    make_tiny("deepseek_v3", tmp_path / "m", mtp=True, num_hidden_layers=2)
    run = subprocess.run([sys.executable, "-m", "moe_proxy", "repro", str(tmp_path / "m"), "--out", str(tmp_path / "r"),
                          "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout + run.stderr
    assert out.count("MTP layer 2 left out of the model") == 1 and "UNEXPECTED" not in out, out[-2000:]
