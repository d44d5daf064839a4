"""moe_proxy.probes: forward hooks in the user's framework give repro's MoE and numerics
metrics, the same figures as repro's own taps on the same forward pass; the Trainer callback
puts them into the Trainer's logs and log_history."""

from __future__ import annotations

import math
import types

import pytest
import torch

from moe_proxy import probes
from moe_proxy.demo.tiny import make_tiny
from moe_proxy.metrics.detect import FailureDetector
from moe_proxy.metrics.metrics_io import read_jsonl
from moe_proxy.rl.routers import RouterTap, moe_metrics
from moe_proxy.rl.runner import ActivationWatch

from .trl_grpo import char_tokenizer

ARCHS = ("qwen3_moe", "deepseek_v3", "mixtral")


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    return request.param, tmp_path_factory.mktemp("probes") / request.param


def _model(tiny):
    model_type, path = tiny
    return make_tiny(model_type, path)


def _batch(model, rows=3, tokens=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (rows, tokens), generator=g)
    mask = torch.ones(rows, tokens, dtype=torch.long)
    mask[0, :4] = 0  # left padding in one row: those positions are not counted
    return ids, mask


def test_probes_equal_repro_metrics_on_a_forward_pass(tiny):
    model = _model(tiny)
    top_k = model.config.num_experts_per_tok
    tap, watch = RouterTap(model, top_k), ActivationWatch(model)
    probe = probes.attach(model)
    ids, mask = _batch(model)
    tap.start(mask)
    watch.start()
    model(input_ids=ids, attention_mask=mask)
    tap.stop()
    watch.stop()
    ours = probe.step()
    comm = types.SimpleNamespace(max=lambda v: v, sum=lambda v: v)
    theirs = {**tap.metrics(), **watch.metrics(comm)}
    moe_keys = [k for k in theirs if k.startswith("moe/")]
    # besides the tap's and the watch's: the runner's weight check, over the weights as they are
    assert moe_keys and set(theirs) | {"numerics/params_nonfinite", "numerics/half_precision"} == set(ours)
    assert ours["numerics/params_nonfinite"] == 0 and ours["numerics/half_precision"] == 0  # fp32
    for key in theirs:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key
    experts = tap.routers[0].module.weight.shape[0]
    assert ours["moe/load_uniform_share"] == pytest.approx(top_k / experts)
    # Shares of the top_k slots per token: the busiest expert has at least the uniform share,
    # the idlest at most; entropy of a softmax over E experts lies in [0, log E].
    assert ours["moe/load_min_share"] <= ours["moe/load_uniform_share"] <= ours["moe/load_max_share"] <= 1.0
    uniform = ours["moe/load_uniform_share"]
    for key in (k for k in ours if k.startswith("moe/load_max_share/layer_")):
        excess = ours[key.replace("max_share", "max_excess")]
        assert 0.0 <= excess <= 1.0 and excess == pytest.approx((ours[key] - uniform) / (1 - uniform))
    for key in (k for k in ours if k.startswith("moe/router_entropy/")):
        assert 0.0 <= ours[key] <= math.log(experts) + 1e-6
    assert math.isfinite(ours["numerics/max_activation"]) and ours["numerics/max_activation"] > 0
    assert ours["numerics/nonfinite_activations"] == 0
    probe.detach()


def test_a_step_sums_its_forward_passes_and_detach_removes_the_hooks(tiny):
    model = _model(tiny)
    probe = probes.attach(model)
    (a, mask_a), (b, mask_b) = _batch(model, seed=1), _batch(model, seed=3)
    model(input_ids=torch.cat([a, b]), attention_mask=torch.cat([mask_a, mask_b]))
    together = probe.step()  # both batches' tokens in one pass
    model(input_ids=b, attention_mask=mask_b)
    last = probe.step()
    model(input_ids=a, attention_mask=mask_a)
    model(input_ids=b, attention_mask=mask_b)
    two = probe.step()
    # Two passes over different tokens: the figures of one pass over all of them (loads and
    # entropies summed, maxima maxed), not those of the last pass alone.
    assert set(two) == set(together)
    for key in together:
        assert two[key] == pytest.approx(together[key], rel=1e-5, abs=1e-6), key
    assert any(two[k] != pytest.approx(last[k], rel=1e-3) for k in together if k.startswith("moe/"))
    with torch.no_grad():  # generation / reference passes: not counted by default
        model(input_ids=a, attention_mask=mask_a)
    assert probe.step() == {}
    probe.detach()
    model(input_ids=a, attention_mask=mask_a)
    assert probe.step() == {}


def test_a_planted_router_preference_raises_load_max_share(tiny):
    model = _model(tiny)
    probe = probes.attach(model)
    ids, mask = _batch(model, seed=2)
    model(input_ids=ids, attention_mask=mask)
    before = probe.step()
    # Plant expert 0's row along the mean router input: most tokens now pick it.
    inputs = {}
    hooks = [r.module.register_forward_pre_hook(lambda m, a, r=r: inputs.setdefault(r.layer, a[0].detach()))
             for r in probe.routers]
    model(input_ids=ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    probe.step()
    with torch.no_grad():
        for r in probe.routers:
            x = inputs[r.layer].reshape(-1, inputs[r.layer].shape[-1]).mean(0)
            r.module.weight[0] += 100 * x / x.norm()
    model(input_ids=ids, attention_mask=mask)
    after = probe.step()
    assert after["moe/load_max_share"] > before["moe/load_max_share"]
    assert after["moe/load_max_share"] >= 2 * after["moe/load_uniform_share"]
    assert after["moe/load_max_excess"] > max(0.5, before["moe/load_max_excess"])
    assert after["moe/router_logit_max"] > before["moe/router_logit_max"]
    probe.detach()


def test_a_non_finite_activation_is_counted_and_max_activation_is_inf(tiny):
    model = _model(tiny)
    probe = probes.attach(model)
    ids, mask = _batch(model, seed=3)
    with torch.no_grad():
        model.get_input_embeddings().weight[ids[1, 5]] = math.inf  # one token's embedding overflows
    model(input_ids=ids, attention_mask=mask)
    metrics = probe.step()
    probe.detach()
    assert metrics["numerics/nonfinite_activations"] > 0
    assert metrics["numerics/max_activation"] == math.inf
    assert metrics["numerics/params_nonfinite"] == 1  # the embedding: one tensor holds the inf


def test_in_half_precision_a_non_finite_activation_is_the_detectors_overflow(tiny):
    from moe_proxy.metrics.detect import FailureDetector

    found = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = _model(tiny).to(dtype)
        ids, mask = _batch(model, seed=3)
        with torch.no_grad():
            model.get_input_embeddings().weight[ids[1, 5]] = math.inf
        with probes.attach(model) as probe:
            model(input_ids=ids, attention_mask=mask)
            metrics = probe.step()
        assert metrics["numerics/half_precision"] == float(dtype == torch.bfloat16)
        found[dtype] = FailureDetector().update(0, metrics)
    # fp32: a broken op's NaN, judged by the loss or the weight check (here the inf weight), never an overflow
    assert found == {torch.float32: ["nan"], torch.bfloat16: ["nan", "overflow"]}


def test_jsonl_writer_lines_are_read_by_watch_readers(tmp_path, tiny):
    model = _model(tiny)
    path = tmp_path / "probes.jsonl"
    probe = probes.attach(model, jsonl=path)
    ids, mask = _batch(model)
    for step in (1, 2):
        model(input_ids=ids, attention_mask=mask)
        probe.step(step)
    probe.detach()
    rows = read_jsonl(path)
    assert sorted(rows) == [1, 2]
    assert rows[2]["moe/load_uniform_share"] == pytest.approx(0.25)
    assert "moe/load_max_share/layer_1" in rows[1]


def test_load_max_excess_runs_from_uniform_routing_to_collapse():
    def layer(share):
        return {"router_entropy": 1.0, "load_max_share": share, "load_min_share": 0.0, "router_logit_max": 1.0}

    # 4 experts under top-2 (a 12.5% proxy of a 32-expert original): uniform routing gives each 0.5
    out = moe_metrics({0: layer(0.5), 1: layer(1.0), 2: layer(0.75)}, 2 / 4)
    assert [out[f"moe/load_max_excess/layer_{i}"] for i in range(3)] == [0.0, 1.0, 0.5]
    assert out["moe/load_max_excess"] == 1.0  # the busiest layer's
    # the original's 32 experts: the same busiest-expert share is further from uniform
    assert moe_metrics({0: layer(0.75)}, 2 / 32)["moe/load_max_excess"] == pytest.approx((0.75 - 1 / 16) / (15 / 16))
    # experts <= top-k: every token uses every expert, no collapse can show and none is written
    assert not [k for k in moe_metrics({0: layer(1.0)}, 2 / 2) if "excess" in k]


def test_no_load_excess_where_every_token_uses_every_expert(tmp_path):
    model = make_tiny("qwen3_moe", tmp_path, num_experts=2)  # top-2 of 2
    probe = probes.attach(model)
    model(*_batch(model))
    row = probe.step()
    assert row["moe/load_uniform_share"] == 1.0 and row["moe/load_max_share"] == pytest.approx(1.0)
    assert not [k for k in row if k.startswith("moe/load_max_excess")]
    detector = FailureDetector()
    for step in range(6):
        detector.update(step, row)
    assert detector.onsets == {} and "every token uses every expert" in detector.cannot_show["collapse"]


def test_aggregate_means_sums_counts_and_maxes_magnitudes():
    steps = [{"moe/load_max_share": 0.5, "numerics/nonfinite_activations": 0.0, "numerics/max_activation": 3.0},
             {"moe/load_max_share": 0.7, "numerics/nonfinite_activations": 2.0, "numerics/max_activation": math.inf}]
    out = probes.aggregate(steps)
    assert out == {"moe/load_max_share": pytest.approx(0.6), "numerics/nonfinite_activations": 2.0,
                   "numerics/max_activation": math.inf}


def test_trainer_callback_writes_moe_keys_into_logs_and_log_history(tmp_path):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model = make_tiny("qwen3_moe", tmp_path / "model")
    seen = []

    class ProbeLogsSeen(TrainerCallback):  # stands in for a reporter (TensorBoard) before ours
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
            for ids in torch.randint(0, model.config.vocab_size, (16, 16), generator=g)]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], max_steps=4,
                             logging_steps=2, per_device_train_batch_size=2, save_strategy="no",
                             learning_rate=1e-3, disable_tqdm=True)
    callback = probes.MoEProbeCallback()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ProbeLogsSeen(), callback])
    trainer.train()
    logged = [row for row in trainer.state.log_history if "moe/load_max_share" in row]
    assert [row["step"] for row in logged] == [2, 4]
    for row in logged:
        assert row["moe/load_uniform_share"] == pytest.approx(0.25)
        assert "moe/load_max_share/layer_1" in row and "moe/router_entropy/mean" in row
        assert math.isfinite(row["numerics/max_activation"]) and row["numerics/nonfinite_activations"] == 0
        assert "loss" in row  # beside the Trainer's own
    assert sum("moe/load_max_share" in logs for logs in seen) == 2  # the reporters saw them too
    assert callback.probes is None  # detached at the end of training


def test_trl_grpo_with_the_callback_reaches_tensorboard_and_watch(tmp_path, monkeypatch, capsys):
    """TRL's GRPOTrainer trains a tiny Qwen3-MoE 3 steps on CPU with the callback and
    report_to="tensorboard"; `moe-proxy watch` reads the moe/ and numerics/ roles from the
    event files and finds no failure."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from moe_proxy.cli import main

    model = make_tiny("qwen3_moe", tmp_path / "model")
    model.config.pad_token_id = model.generation_config.pad_token_id = 0
    model.config.eos_token_id = model.generation_config.eos_token_id = 1
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    args = GRPOConfig(output_dir=str(tmp_path / "run"), use_cpu=True, report_to="tensorboard", max_steps=3,
                      logging_steps=1, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                      learning_rate=1e-3, save_strategy="no", disable_tqdm=True, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                          args=args, train_dataset=Dataset.from_dict({"prompt": ["abc", "hello", "xyz", "moe"] * 4}),
                          processing_class=char_tokenizer(), callbacks=[probes.MoEProbeCallback()])
    trainer.train()
    assert [row["step"] for row in trainer.state.log_history if "moe/load_max_share/layer_1" in row] == [1, 2, 3]
    done = tmp_path / "done"
    done.touch()
    # transformers' TensorBoardCallback writes them as train/moe/... and train/numerics/...: read
    # under every profile as moe-proxy's own names
    roles = ("expert_load", "router_logit_max", "max_activation", "nonfinite_activations")
    capsys.readouterr()
    assert main(["watch", str(tmp_path / "tb"), "--until-file", str(done), "--poll", "0.05", "--timeout", "60"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "no failure in 3 steps"
    found = next(line for line in out.splitlines() if "roles found" in line)
    assert all(role in found for role in roles), out
    assert "collapse: cannot be judged" not in out


def test_the_activation_watch_reads_the_largest_magnitude_and_counts_what_is_not_finite():
    """ActivationWatch's figures, of each decoder layer's output: the largest finite magnitude and
    the count of values that are not; one pass (the extremes) where everything is finite."""
    watch = ActivationWatch(torch.nn.Module())
    finite = torch.randn(4, 7, 16)
    finite[1, 2, 3] = -9.5  # the largest magnitude, negative
    broken = torch.randn(4, 7, 16)
    broken[0, 0, 0], broken[2, 1, 5], broken[3, 3, 3] = math.inf, math.nan, -7.25
    watch.start()
    watch._hook(None, (), (finite,))
    assert (watch.max_abs, watch.nonfinite) == (9.5, 0)
    watch._hook(None, (), broken)
    watch.stop()
    watch._hook(None, (), torch.full((2, 2), 100.0))  # not recording: ignored
    assert (watch.max_abs, watch.nonfinite) == (9.5, 2)
    watch.start()
    watch._hook(None, (), (broken,))
    assert watch.max_abs == broken[torch.isfinite(broken)].abs().max().item() == 7.25
    assert watch.metrics(types.SimpleNamespace(max=lambda v: v, sum=lambda v: v)) == {
        "numerics/max_activation": math.inf, "numerics/nonfinite_activations": 2.0}
