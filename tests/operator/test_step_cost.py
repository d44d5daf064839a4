"""The RL step's cost by phase (moe_proxy.step_cost), by hand and on the real models' configs."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import pytest

from moe_proxy.errors import InvalidExpertCount, InvalidOptions
from moe_proxy.sizing import SizingOptions, estimate, model_shape
from moe_proxy.step_cost import Accelerator, Phases, StepShape, phases, touched_experts
from moe_proxy.checkpoint.params import config_params
from moe_proxy.demo.published import DEEPSEEK_V3, QWEN3_235B, QWEN3_30B
from proxymodel_operator.status import plan_summary

from .test_planner import QWEN3

ONE = Accelerator("test", 1e6, 1.0, 1.0)  # 1 TFLOP/s, 1 TB/s, no links: one device
EXACT = StepShape(sequences=4, prompt_tokens=8, response_tokens=6, updates=2, recompute=False, mfu=1.0,
                 hbm_efficiency=1.0)


def test_touched_experts_goes_from_top_k_to_all():
    assert touched_experts(64, 4, 1) == pytest.approx(4)
    assert touched_experts(64, 4, 10_000) == pytest.approx(64)
    assert 4 < touched_experts(64, 4, 8) < 8 * 4  # overlaps: fewer than batch x k


def test_shape_of_the_tiny_qwen3_by_hand():
    params = config_params(QWEN3)
    m = model_shape(QWEN3, params, 8, 2, 1, "fp32")
    assert m.expert_params == 3 * 64 * 32 + 64  # an expert's projections and its router row
    assert m.attention_width == 4 * (16 + 16) and m.kv_elements == 2 * 2 * 16  # 4 heads; k and v of 2 KV heads
    assert (m.bytes_per_param, m.optimizer_bytes, m.layers, m.moe_layers) == (4, 8, 2, 1)


def test_phases_by_hand_on_one_device():
    m = model_shape(QWEN3, config_params(QWEN3), 8, 2, 1, "fp32")
    p = phases(m, EXACT, ONE, devices=1, per_node=1, usable_bytes=1e12)
    attention = 2 * 2 * 128  # 2 layers x 2 x attention width, per token per context token
    prefill = 4 * (2 * 88960 * 8 + attention * 8 ** 2 / 2)
    assert p.rollout_prefill == pytest.approx(prefill / 1e12)
    full = 4 * (2 * 88960 * 14 + attention * 14 ** 2 / 2)
    assert p.old_log_prob == p.reference == pytest.approx(full / 1e12)
    assert p.train == pytest.approx(3 * full / 1e12)
    # one update per step: the old log-probs come from the update's own forward, no pass of their own
    once = phases(m, replace(EXACT, updates=1), ONE, devices=1, per_node=1, usable_bytes=1e12)
    assert once.old_log_prob == 0 and once.reference == p.reference and once.train == p.train
    # decode: 6 steps, each reading the non-expert weights, the experts 4 rows touch, the KV cache
    backbone = 125824 - 8 * m.expert_params
    read = 4 * (backbone + touched_experts(8, 2, 4) * m.expert_params) + 4 * (8 + 3) * 2 * 64 * 4
    flops = 4 * (2 * 88960 + attention * (8 + 3))
    assert p.rollout_decode == pytest.approx(6 * max(read / 1e12, flops / 1e12))
    assert p.optimizer == pytest.approx(2 * 125824 * (3 * 4 + 2 * 8) / 1e12)  # read w, g, m, v; write w, m, v
    assert p.weight_sync == p.all_to_all == 0  # one device: nothing moves
    assert p.total == pytest.approx(sum(seconds for _, seconds in p.items()))
    assert phases(m, replace(EXACT, recompute=True), ONE, 1, 1, 1e12).train == pytest.approx(4 * full / 1e12)
    assert phases(m, replace(EXACT, reference=False), ONE, 1, 1, 1e12).reference == 0


def test_links_cost_only_across_devices_and_nodes():
    m = model_shape(QWEN3, config_params(QWEN3), 8, 2, 1, "bf16")
    linked = replace(ONE, intra_gbps=100.0, inter_gbps=10.0)
    p = phases(m, EXACT, linked, devices=16, per_node=8, usable_bytes=1e12)
    # 8 experts on 8 of the 16 devices, one node: 7/8 of the traffic leaves a device, none the node
    volume = 5 * 4 * 14 * 1 * 2 * 2 * 64 * 2 / 16  # passes x tokens x layers x 2k x H x bytes / devices
    assert p.all_to_all == pytest.approx(volume * (1 - 1 / 8) / 100e9)
    # a rollout replica is one device (the weights fit): it receives all weights, half from the other node
    assert p.weight_sync == pytest.approx(125824 * 2 * (0.5 / 100e9 + 0.5 / 10e9))


def test_expert_parallel_spans_nodes_only_when_experts_outnumber_a_node():
    m = model_shape(QWEN3, config_params(QWEN3), 8, 2, 1, "bf16")
    linked = replace(ONE, intra_gbps=100.0, inter_gbps=10.0)
    wide = replace(m, experts=32)  # 32 experts over 16 devices: 2 nodes
    p = phases(wide, EXACT, linked, devices=16, per_node=8, usable_bytes=1e12)
    volume = 5 * 4 * 14 * 1 * 2 * 2 * 64 * 2 / 16
    assert p.all_to_all == pytest.approx(volume * (0.5 / 10e9 + (0.5 - 1 / 16) / 100e9))


def test_deepseek_v3_proxy_saves_where_total_parameters_cost():
    p = estimate(DEEPSEEK_V3, SizingOptions(keep_ratio=0.125))
    table = p.phase_table()
    for phase in ("rollout_prefill", "old_log_prob", "reference", "train"):  # active parameters: about the same
        assert 0.99 < table[phase]["ratio"] < 1.0
    for phase in ("rollout_decode", "optimizer", "weight_sync"):  # total parameters: far less
        assert table[phase]["ratio"] < 0.3, phase
    assert table["total"]["ratio"] == pytest.approx(p.device_hours_ratio) and p.device_hours_ratio < 0.6
    assert table["total"]["original"] == pytest.approx(sum(table[f]["original"] for f in table if f != "total"))


# Total and active parameters, in billions, as their model cards publish them.
PUBLISHED = {"v3": (DEEPSEEK_V3, 671, 37), "235b": (QWEN3_235B, 235, 22), "30b": (QWEN3_30B, 30.5, 3.3)}


def test_published_configs_have_their_published_sizes():
    """Totals within 0.2% of the published ones; active within 2%, above the cards' rounding to
    two figures and their conventions on embeddings (this count: 37.6, 22.2, 3.35), below one
    routed expert per token too many or too few (7%, 8% and 7% of these models' active sizes)."""
    for name, (config, total, active) in PUBLISHED.items():
        p = config_params(config)
        assert p.total / 1e9 == pytest.approx(total, rel=0.002), name
        assert p.active / 1e9 == pytest.approx(active, rel=0.02), name


def test_qwen3_30b_proxy_on_one_node_sends_no_expert_traffic_between_nodes():
    ascend = estimate(QWEN3_30B, SizingOptions(keep_ratio=0.125))
    assert ascend.proxy.devices == 8 and ascend.original.devices == 16
    no_inter = estimate(QWEN3_30B, SizingOptions(keep_ratio=0.125, accelerator="H100"))
    assert no_inter.proxy.phases.all_to_all < ascend.proxy.phases.all_to_all  # H100's NVLink is faster
    # H200 differs from H100 only in memory and bandwidth: decode (memory-bound) is faster
    h200 = estimate(QWEN3_30B, SizingOptions(keep_ratio=0.125, accelerator="H200"))
    assert h200.original.phases.rollout_decode < no_inter.original.phases.rollout_decode


def test_plan_command_prints_and_carries_every_phase(tmp_path, capsys):
    from moe_proxy.commands import plan as plan_command

    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    parser = argparse.ArgumentParser()
    plan_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", str(tmp_path), "--keep-ratio", "0.125", "--sequences", "64",
                              "--response-tokens", "512", "--no-recompute", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    names = [name for name, _ in Phases(*[0.0] * 8).items()]
    assert list(out["device_hours_per_step"]) == [*names, "total"]
    assert set(out["original"]["phases"]) == set(names)
    assert (out["workload"]["sequences"], out["workload"]["response_tokens"], out["workload"]["recompute"]) == (
        64, 512, False)
    assert out["device_hours_ratio"] == pytest.approx(out["device_hours_per_step"]["total"]["ratio"], abs=1e-4)
    args = parser.parse_args(["plan", str(tmp_path), "--keep-ratio", "0.125"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "rollout decode" in text and "all to all" in text and "proxy/original" in text
    assert "512 sequences of 512 prompt + 1536 response tokens" in text  # the defaults, stated


def test_a_step_that_cannot_be_timed_is_refused():
    for bad in (dict(sequences=0), dict(mfu=0.0), dict(hbm_efficiency=1.5), dict(updates=-1)):
        with pytest.raises(InvalidOptions, match="RL step"):
            estimate(QWEN3, SizingOptions(experts=4, workload=StepShape(**bad)))


def test_operator_status_plan_has_device_hours_by_phase():
    plan = estimate(DEEPSEEK_V3, SizingOptions(keep_ratio=0.125))
    status = plan_summary(plan)["deviceHoursPerStep"]
    assert list(status) == ["rolloutPrefill", "rolloutDecode", "oldLogProb", "reference", "train", "optimizer",
                            "weightSync", "allToAll", "total"]
    assert float(status["total"]["ratio"]) == pytest.approx(plan.device_hours_ratio, abs=1e-3)
    assert math.isclose(float(status["rolloutDecode"]["original"]), plan.phase_table()["rollout_decode"]["original"],
                        rel_tol=1e-3)


def test_a_run_costs_the_steps_it_completed_at_the_precision_it_ran_at():
    """sizing.run_device_hours, the one rule of bisect's, triage's and a Diagnosis's probe costs:
    plan's per-step figure at the run's precision (fp32 moves twice bf16's bytes: dearer) x the
    steps completed (a run stopped at step 3 of 10 costs 3)."""
    from moe_proxy.sizing import run_device_hours

    bf16, fp32 = (estimate(QWEN3_30B, SizingOptions(keep_ratio=0.25, precision=p)).proxy.device_hours_per_step
                  for p in ("bf16", "fp32"))
    assert run_device_hours(bf16, 3) == pytest.approx(3 * bf16) and run_device_hours(bf16, 0) == 0
    assert run_device_hours(fp32, 3) > run_device_hours(bf16, 3)
    for per_step, steps, said in ((bf16, -1, "steps completed -1"), (bf16, 2.5, "steps completed 2.5"),
                                  (math.nan, 1, "device-hours per step nan")):
        with pytest.raises(InvalidOptions, match=said):
            run_device_hours(per_step, steps)


# --- the operator's plan prices a run at each precision (a Diagnosis's candidate may change it) --------

BF16_PROXYMODEL = {"source": {"uri": "s3://runs/ckpt", "credentialsSecret": "c"}, "output": {"uri": "s3://runs/proxy"},
                   "pruning": {"keepRatio": 0.125}, "reproduction": {"precision": "bf16"}}


def _bf16_plan():
    """A bf16 ProxyModel's spec, its plan (keep ratio: the kept experts are the planner's choice)
    and its per-step prices by precision, as the operator's preflight makes them."""
    from proxymodel_operator.preflight import plan_for, precision_prices
    from proxymodel_operator.settings import Settings
    from proxymodel_operator.spec import parse

    parsed = parse(BF16_PROXYMODEL, "ns", "pm", Settings())
    plan = plan_for(QWEN3_30B, parsed, Settings())
    return parsed, plan, precision_prices(QWEN3_30B, parsed, Settings(), plan)


def _at(parsed, plan, precision: str) -> float:
    """sizing.estimate of the proxy's step at `precision`, the main plan's kept experts given."""
    from proxymodel_operator.preflight import plan_options
    from proxymodel_operator.settings import Settings

    options = replace(plan_options(parsed, Settings()), precision=precision, experts=plan.proxy.experts_per_layer,
                      keep_ratio=None)
    return estimate(QWEN3_30B, options).proxy.device_hours_per_step


def test_the_operator_plan_prices_the_proxy_step_at_each_precision():
    from proxymodel_operator.pipeline import accepted

    parsed, plan, prices = _bf16_plan()
    summary = plan_summary(plan, prices=prices)
    by_precision = summary["proxyDeviceHoursPerStep"]
    assert plan.precision == "bf16" and list(by_precision) == ["bf16", "fp16", "fp32"]
    for precision, per_step in by_precision.items():
        assert per_step == f"{_at(parsed, plan, precision):.4g}"
    assert by_precision["bf16"] == summary["deviceHoursPerStep"]["total"]["proxy"]
    assert float(by_precision["fp32"]) > float(by_precision["bf16"])  # fp32 moves twice the bytes
    assert "proxyDeviceHoursPerStep" not in plan_summary(plan)  # no prices given: the plan as before
    patch, _ = accepted({}, BF16_PROXYMODEL, 1, parsed, plan, prices)  # the validate step's status
    assert patch["plan"]["proxyDeviceHoursPerStep"] == by_precision


def test_a_run_at_another_precision_is_priced_by_the_plan_for_it():
    """diagnosis_rows.run_hours: a candidate's fp32 run on a bf16 ProxyModel costs the fp32 step
    (sizing.run_device_hours of plan's fp32 figure) x the steps it completed."""
    from moe_proxy.sizing import run_device_hours
    from proxymodel_operator.diagnosis_rows import plan_price, run_hours

    parsed, plan, prices = _bf16_plan()
    price = plan_price({"status": {"plan": plan_summary(plan, prices=prices)}})
    fp32 = float(run_hours(price, 7, "fp32"))
    assert fp32 == pytest.approx(run_device_hours(_at(parsed, plan, "fp32"), 7), rel=1e-3)
    assert fp32 > float(run_hours(price, 7, "bf16")) and run_hours(price, 7, "bf16") == run_hours(price, 7)
    assert run_hours(price, 7, "int8") is None  # a precision the plan did not price


def test_an_older_plan_without_prices_by_precision_leaves_another_precision_unpriced():
    from proxymodel_operator.diagnosis_rows import plan_price, run_hours

    _, plan, _ = _bf16_plan()
    price = plan_price({"status": {"plan": plan_summary(plan)}})  # an older operator's status.plan
    assert set(price) == {"deviceHoursPerStep", "precision"}
    assert run_hours(price, 7, "fp32") is None and run_hours(price, 7, "fp16") is None
    assert float(run_hours(price, 7, "bf16")) == pytest.approx(7 * plan.proxy.device_hours_per_step, rel=1e-3)
