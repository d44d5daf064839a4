"""TRL runs judged by `watch` and `compare` from the TensorBoard events TRL writes (#28 item 5).

TRL 1.16's GRPOTrainer trains a tiny Qwen3-MoE (8 experts) and its moe-proxy proxy (4 experts)
on CPU with `report_to="tensorboard"` and moe_proxy.probes.MoEProbeCallback
(`tests/repro/trl_grpo.py`, the script the operator's end-to-end test runs as its framework):

- learning rate 1.0 blows the KL to the reference up at step 2 (0 at step 1, then above 4;
  measured): `watch` and `compare` both say `divergence` at step 2, for the original and the
  proxy, and compare writes its report and plot;
- a NaN in the router's gradient before the update of step 2: TRL drops NaN from its own
  metrics and transformers' logging_nan_inf_filter hides a NaN loss, and the next step's
  sampling crashes on NaN probabilities before any of them is logged, so only the probes'
  weight check (numerics/params_nonfinite, after the update) shows it: `watch` says `nan` at
  step 2.
"""

from __future__ import annotations

import json

import pytest

from .trl_grpo import train

pytestmark = pytest.mark.slow
STEPS = 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny Qwen3-MoE and its proxy at 4 experts."""
    from moe_proxy.pruning import build_proxy
    from moe_proxy.demo.tiny import make_tiny

    root = tmp_path_factory.mktemp("trl")
    make_tiny("qwen3_moe", root / "original")
    build_proxy(str(root / "original"), str(root / "proxy"), experts=4)
    return root


def _run(monkeypatch, model, out, **kwargs):
    """A TRL run of `model` whose TensorBoard events go to out/tb; returns out/tb."""
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(out / "tb"))
    train(str(model), str(out / "run"), steps=STEPS, **kwargs)
    return out / "tb"


def _watch(capsys, tb) -> list[str]:
    from moe_proxy.cli import main

    capsys.readouterr()
    assert main(["watch", str(tb), "--until-file", str(tb), "--poll", "0.05", "--timeout", "60"]) == 0
    return capsys.readouterr().out.splitlines()


def test_a_learning_rate_that_blows_the_kl_up_is_divergence_at_its_step_in_watch_and_compare(
        checkpoints, tmp_path, monkeypatch, capsys):
    from moe_proxy.cli import main

    runs = {name: _run(monkeypatch, checkpoints / name, tmp_path / name, lr=1.0) for name in ("original", "proxy")}
    for name, tb in runs.items():
        out = _watch(capsys, tb)
        assert out[0] == "divergence at step 2", (name, out)
        assert "trl names (detected)" in out[1] and "kl" in out[1] and "expert_load" in out[1]

    report = tmp_path / "report"
    assert main(["compare", str(runs["original"]), str(runs["proxy"]), "--out", str(report),
                 "--names", "original,proxy", "--permutations", "0"]) == 0
    results = json.loads((report / "report.json").read_text())
    onsets = {c["run"]: c["onsets"] for c in results["comparisons"]}
    assert onsets == {"original": {"divergence": 2}, "proxy": {"divergence": 2}}, onsets
    assert [m["profile"] for m in results["metrics"]] == ["trl", "trl"]
    assert (report / "curves.png").stat().st_size > 0 and "divergence (2)" in (report / "report.md").read_text()


def test_a_run_gone_non_finite_is_nan_though_trl_hides_it_and_the_run_crashes(checkpoints, tmp_path, monkeypatch,
                                                                             capsys):
    with pytest.raises(RuntimeError, match="probability tensor contains"):  # step 3's sampling
        _run(monkeypatch, checkpoints / "proxy", tmp_path, nan_at=2)
    from moe_proxy.metrics.readers import read_run

    rows, _ = read_run(tmp_path / "tb")
    assert sorted(rows) == [1, 2]  # the crash came before step 3 logged anything
    assert all(v == v for row in rows.values() for v in row.values())  # no NaN among the logged values
    assert [rows[s]["numerics/params_nonfinite"] for s in (1, 2)] == [0.0, 1.0]
    assert _watch(capsys, tmp_path / "tb")[0] == "nan at step 2"
