"""The planner against hand computations and against transformers' own parameter counts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dataclasses import replace

from moe_proxy.errors import InvalidExpertCount, InvalidOptions, NotMoE, UnsupportedArchitecture
from moe_proxy.checkpoint.params import config_params, moe_layer_indices
from moe_proxy.demo.published import DEEPSEEK_V3
from moe_proxy.sizing import GB, SizingOptions, format_sizing, estimate

# A tiny Qwen3-MoE: H=64, vocab 256, 2 layers (layer 0 dense), 4 heads of 16, 2 KV heads,
# 8 experts of width 32, top-2, untied embeddings.
QWEN3 = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
    "num_experts_per_tok": 2, "mlp_only_layers": [0], "decoder_sparse_step": 1,
    "tie_word_embeddings": False,
}


def test_qwen3_params_by_hand():
    embed = 2 * 256 * 64  # embed_tokens + lm_head = 32768
    attention = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 2 * 16  # q, k, v, o, q_norm, k_norm = 12320
    norms = 2 * 64
    dense_mlp = 3 * 64 * 96  # 18432
    router = 8 * 64  # 512
    expert = 3 * 64 * 32  # 6144
    total = embed + 64 + 2 * (attention + norms) + dense_mlp + router + 8 * expert
    active = total - 6 * expert  # top-2 of 8
    params = config_params(QWEN3)
    assert (params.total, params.active) == (total, active) == (125824, 88960)
    # The proxy with 4 experts: 4 router rows and 4 experts fewer.
    assert config_params(QWEN3, experts=4).total == total - 4 * expert - 4 * 64


@pytest.mark.parametrize("model_type, extra", [
    ("qwen3_moe", dict(num_experts=8, moe_intermediate_size=32, mlp_only_layers=[0])),
    ("mixtral", dict(num_local_experts=8)),
    ("qwen2_moe", dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       mlp_only_layers=[0])),
    ("deepseek_v3", dict(n_routed_experts=8, moe_intermediate_size=32, first_k_dense_replace=1, n_group=2,
                         topk_group=1, q_lora_rank=16, kv_lora_rank=32, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1)),
    ("olmoe", dict(num_experts=8)),
    ("gpt_oss", dict(num_local_experts=8)),
    ("glm4_moe", dict(n_routed_experts=8, moe_intermediate_size=32, first_k_dense_replace=1,
                      n_shared_experts=1)),
])
def test_params_match_what_transformers_stores(model_type, extra):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, num_experts_per_tok=2, tie_word_embeddings=False,
        **extra)
    model = transformers.AutoModelForCausalLM.from_config(config)
    stored = sum(t.numel() for t in model.state_dict().values())
    assert config_params(json.loads(config.to_json_string())).total == stored


def test_deepseek_v3_full_size_is_671b_with_37b_active():
    config = DEEPSEEK_V3
    params = config_params(config)
    assert round(params.total / 1e9) == 671 and round(params.active / 1e9) == 38  # 37.55B
    p = estimate(config, SizingOptions(experts=32))
    assert p.moe_layers == 58
    assert p.proxy.devices < p.original.devices
    assert p.original.devices % 8 == 0 and p.proxy.devices % 8 == 0


def test_memory_and_devices_by_hand():
    # 1 GB devices, no reserve, full utilisation, 1 device per node: devices = ceil(static / room).
    opts = SizingOptions(experts=4, device_memory_gb=0.001, devices_per_node=1, micro_batch_tokens=1,
                       utilization=1.0, reserve_gb=0.0)
    p = estimate(QWEN3, opts)
    o = p.original
    assert o.memory.weights == o.memory.gradients == o.memory.reference == 125824 * 2
    assert o.memory.optimizer == 125824 * 12
    assert o.memory.static == 125824 * 18  # 2 + 2 + 12 + 2 bytes per parameter
    # Activations per token: layer inputs 2*64*2 + one layer 34*64 + routed 2*3*32*2 bytes.
    per_token = 2 * 64 * 2 + 34 * 64 + 2 * 3 * 32 * 2
    assert o.memory.activations_per_device == per_token == 2816
    room = 0.001 * GB - per_token
    assert o.devices == -(-125824 * 18 // room)  # ceil = 3
    assert o.devices == 3
    proxy_total = 125824 - 4 * 6144 - 4 * 64
    assert p.proxy.params.total == proxy_total
    assert p.proxy.devices == -(-proxy_total * 18 // room) == 2
    assert p.device_reduction == pytest.approx(1 / 3)
    # fp32: 4 + 4 + 8 + 4 bytes per parameter.
    assert estimate(QWEN3, SizingOptions(experts=4, precision="fp32")).original.memory.static == 125824 * 20


def test_whole_nodes():
    p = estimate(QWEN3, SizingOptions(experts=4, devices_per_node=8))
    assert (p.original.devices, p.original.nodes) == (8, 1)


def test_keep_ratio_and_grouped_routing():
    v3 = {"model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
          "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "n_routed_experts": 64,
          "num_experts_per_tok": 4, "first_k_dense_replace": 1, "n_group": 8, "topk_group": 2}
    assert moe_layer_indices(v3) == [1, 2]
    assert estimate(v3, SizingOptions(keep_ratio=0.25)).proxy.experts_per_layer == 16
    with pytest.raises(InvalidExpertCount, match="8 groups.*valid values: 16, 24"):
        estimate(v3, SizingOptions(experts=12))
    with pytest.raises(InvalidExpertCount, match="64 routed experts"):
        estimate(v3, SizingOptions(experts=80))


def test_bad_input_is_refused_clearly():
    with pytest.raises(NotMoE):
        estimate({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64}, SizingOptions(experts=2))
    with pytest.raises(UnsupportedArchitecture):
        estimate({"model_type": "jamba", "num_experts": 16}, SizingOptions(experts=2))
    with pytest.raises(InvalidExpertCount, match="top-k 5"):
        estimate(QWEN3, SizingOptions(experts=4, top_k=5))
    with pytest.raises(InvalidOptions, match="exactly one"):
        estimate(QWEN3, SizingOptions())
    with pytest.raises(InvalidExpertCount, match="does not fit"):
        estimate(QWEN3, SizingOptions(experts=4, device_memory_gb=1, micro_batch_tokens=10**9))


def test_format_and_summary():
    p = estimate(QWEN3, SizingOptions(experts=4))
    text = format_sizing(p)
    assert "Qwen3-MoE" in text and "125,824" in text and "devices saved" in text
    summary = json.loads(json.dumps(p.summary()))
    assert summary["original"]["params"]["total"] == 125824
    assert summary["proxy"]["experts_per_layer"] == 4


def test_plan_command(tmp_path, capsys):
    from moe_proxy.commands import plan as plan_command
    import argparse

    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    parser = argparse.ArgumentParser()
    plan_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", str(tmp_path), "--experts", "4", "--json"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["original"]["params"]["total"] == 125824 and out["proxy"]["experts_per_layer"] == 4


def test_planner_and_operator_never_import_torch():
    code = ("import sys, moe_proxy.sizing, moe_proxy.commands.plan, proxymodel_operator.handlers, proxymodel_operator.__main__; "
            "bad = [m for m in ('torch', 'safetensors', 'sklearn') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# Devices that hold the QWEN3 proxy with 2 kept experts on one device but 4 only on two:
# static bytes 88,576 x 18 vs 100,992 x 18 per device room of 1.7 MB - 2,816 bytes of activations.
TIGHT = dict(device_memory_gb=0.0017, devices_per_node=1, micro_batch_tokens=1, utilization=1.0, reserve_gb=0.0)


def test_keep_ratio_prefers_twice_top_k_when_the_devices_allow():
    p = estimate(QWEN3, SizingOptions(keep_ratio=0.25))  # 2 of 8 experts = top-k
    assert p.proxy.experts_per_layer == 4 and p.proxy.top_k == 2
    assert p.proxy.devices == estimate(QWEN3, SizingOptions(experts=2)).proxy.devices
    assert len(p.notes) == 1 and "raised from 2 (keep ratio 0.25) to 4" in p.notes[0]
    # Already 2 x top-k or more: nothing to say.
    assert estimate(QWEN3, SizingOptions(keep_ratio=0.5)).notes == ()


def test_keep_ratio_stays_and_says_why_when_the_budget_is_too_small():
    p = estimate(QWEN3, SizingOptions(keep_ratio=0.25, **TIGHT))
    assert (p.proxy.experts_per_layer, p.proxy.devices) == (2, 1)
    (note,) = p.notes
    assert "stay 2" in note and "would need 2 devices, over the 1 devices that 2 experts need" in note
    assert "routing collapse cannot show" in note
    # An explicit budget that holds the larger proxy lets the planner raise it.
    raised = estimate(QWEN3, SizingOptions(keep_ratio=0.25, max_devices=2, **TIGHT))
    assert (raised.proxy.experts_per_layer, raised.proxy.devices) == (4, 2)
    assert "within the device budget of 2" in raised.notes[0]


def test_explicit_expert_count_is_kept_with_a_warning():
    p = estimate(QWEN3, SizingOptions(experts=2))
    assert p.proxy.experts_per_layer == 2
    assert "kept as given" in p.notes[0] and "<= top-k (2)" in p.notes[0]
    assert estimate(QWEN3, SizingOptions(experts=3)).notes == ()  # more than top-k: routing is a choice


def test_twice_top_k_respects_routing_groups_and_never_keeps_everything():
    v3 = {"model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
          "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "n_routed_experts": 16,
          "num_experts_per_tok": 4, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1}
    assert estimate(v3, SizingOptions(keep_ratio=0.25)).proxy.experts_per_layer == 8  # 2 groups x 4
    top4 = {**QWEN3, "num_experts_per_tok": 4}  # 2 x top-k = all 8 experts: the most short of all
    p = estimate(top4, SizingOptions(keep_ratio=0.25))
    assert p.proxy.experts_per_layer == 7 and "would keep every expert" in p.notes[0]


def test_plan_command_shows_the_decision(tmp_path, capsys):
    from moe_proxy.commands import plan as plan_command
    import argparse

    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    parser = argparse.ArgumentParser()
    plan_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["plan", str(tmp_path), "--keep-ratio", "0.25"])
    assert args.func(args) == 0
    assert "note: kept experts raised from 2 (keep ratio 0.25) to 4" in capsys.readouterr().out
    args = parser.parse_args(["plan", str(tmp_path), "--keep-ratio", "0.25", "--json", "--max-devices", "8"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["proxy"]["experts_per_layer"] == 4 and "within the device budget of 8" in out["notes"][0]


def test_mtp_layers_are_said_and_tiny_memory_has_units_that_fit(tmp_path, capsys):
    """A DeepSeek-V3 with an MTP layer: inspect counts it apart from the decoder's MoE layers,
    plan says it is not counted, and a tiny model's memory rows are not "0.0 GiB" (#32 item 11)."""
    from moe_proxy.cli import main
    from moe_proxy.demo.tiny import make_tiny

    make_tiny("deepseek_v3", tmp_path / "m", mtp=True, num_hidden_layers=4)
    assert main(["inspect", str(tmp_path / "m")]) == 0
    assert "layers         4: 1 dense, 3 MoE; plus 1 MTP layer (MoE, layer 4), pruned alike" in capsys.readouterr().out
    assert main(["plan", str(tmp_path / "m"), "--keep-ratio", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "note: 1 MTP layer (num_nextn_predict_layers) not counted" in out
    weights = next(line for line in out.splitlines() if line.strip().startswith("weights"))
    assert "0.0 GiB" not in out and weights.split()[-1] in ("KiB", "MiB"), weights


def test_a_separate_rollout_copy_is_counted():
    """repro's --rollout-precision / --rollout-kernels keep a second copy of the weights for the
    rollout engine: the plan counts it (in its own precision), and it can take more devices."""
    opts = SizingOptions(experts=4, device_memory_gb=0.0009, devices_per_node=1, micro_batch_tokens=1,
                         utilization=1.0, reserve_gb=0.0)
    without = estimate(QWEN3, opts)
    copy = estimate(QWEN3, replace(opts, rollout_copy="fp32"))
    assert without.original.memory.rollout == 0
    assert copy.original.memory.rollout == 125824 * 4  # fp32 beside the bf16 policy
    assert copy.original.memory.static == without.original.memory.static + 125824 * 4
    room = 0.0009 * GB - 2816  # the device less one token's activations (test_memory_and_devices_by_hand)
    assert without.original.devices == -(-125824 * 18 // room) == 3
    assert copy.original.devices == -(-125824 * 22 // room) == 4
    assert copy.summary()["rollout_copy"] == "fp32" and "rollout copy (fp32)" in format_sizing(copy)
    assert "rollout copy" not in format_sizing(without)
    with pytest.raises(InvalidOptions, match="rollout copy precision 'int4'"):
        estimate(QWEN3, replace(opts, rollout_copy="int4"))


def test_the_plan_command_and_the_operator_pass_the_rollout_copy(tmp_path, capsys):
    from moe_proxy.cli import main
    from proxymodel_operator.preflight import plan_for
    from proxymodel_operator.settings import Settings
    from proxymodel_operator.spec import parse

    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    assert main(["plan", str(tmp_path), "--experts", "4", "--rollout-kernels", "grouped", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rollout_copy"] == "bf16"  # the training precision's copy
    spec = {"source": {"uri": "s3://runs/ckpt", "credentialsSecret": "c"}, "output": {"uri": "s3://runs/proxy"},
            "pruning": {"experts": 4}, "reproduction": {"rolloutPrecision": "fp32"}}
    assert plan_for(QWEN3, parse(spec, "ns", "pm", Settings()), Settings()).rollout_copy == "fp32"


def test_a_stale_rollout_counts_its_copy_and_snapshots(tmp_path, capsys):
    """repro --rollout-staleness N syncs its rollout copy from N + 1 snapshots of the policy's weights
    (rollout.RolloutEngine.sync): the plan, the CLI's and the operator's, counts the copy and them."""
    from moe_proxy.cli import main
    from proxymodel_operator.preflight import plan_for
    from proxymodel_operator.settings import Settings
    from proxymodel_operator.spec import parse

    opts = SizingOptions(experts=4, device_memory_gb=0.0009, devices_per_node=1, micro_batch_tokens=1,
                         utilization=1.0, reserve_gb=0.0)
    stale = estimate(QWEN3, replace(opts, rollout_copy="bf16", rollout_snapshots=3))
    assert stale.original.memory.rollout == 125824 * 2 + 3 * 125824 * 2  # the bf16 copy and 3 bf16 snapshots
    assert "rollout copy (bf16) + 3 snapshots" in format_sizing(stale)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    assert main(["plan", str(tmp_path), "--experts", "4", "--rollout-staleness", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rollout_copy"] == "bf16" and summary["rollout_snapshots"] == 3
    with pytest.raises(SystemExit) as exit_:  # repro's declared range, checked by argparse
        main(["plan", str(tmp_path), "--experts", "4", "--rollout-staleness", "-1"])
    assert exit_.value.code == 2
    assert "argument --rollout-staleness: -1: must be at least 0" in capsys.readouterr().err
    spec = {"source": {"uri": "s3://runs/ckpt", "credentialsSecret": "c"}, "output": {"uri": "s3://runs/proxy"},
            "pruning": {"experts": 4}, "reproduction": {"rolloutStaleness": 1}}
    plan = plan_for(QWEN3, parse(spec, "ns", "pm", Settings()), Settings())
    assert plan.rollout_copy == "bf16" and plan.rollout_snapshots == 2
