"""The rollout engine apart from the trainer (issue: rollout/training mismatch): its own weight
copy and numerics, the gap's figures under verl's names, routing replay, rollout IS correction,
GSPO's sequence ratio, fp32 router and LM head, and the knobs' distributed equality.

The model: a tiny Qwen3-MoE with 4 MoE layers whose experts and head are scaled up (x4, x20),
so that its routing and next-token distributions are as peaked as a trained model's; a random
tiny model's near-uniform probabilities hide any gap. Tolerance of matching numerics (the same
model and precision for rollout and trainer): token probabilities within 1e-4 (fp32 incremental
decoding with a KV cache against one full forward; measured 3e-6)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from moe_proxy.cli import main
from moe_proxy.errors import InvalidReproConfig
from moe_proxy.rl.config import Faults, ReproConfig
from moe_proxy.metrics.detect import FailureDetector
from moe_proxy.metrics.readers import read_metrics
from moe_proxy.rl.policy_loss import importance_ratio, rollout_is_weights
from moe_proxy.rl.precision import compute_in_fp32, fp32_modules
from moe_proxy.rl.routers import Router, find_routers
from moe_proxy.rl.routing import RoutingRecorder, RoutingReplay
from moe_proxy.rl.runner import _Loop, run_repro

from .test_distributed import assert_same_metrics

MATCHED = 1e-4
STEPS = dict(steps=2, batch_size=4, group_size=4)


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    from moe_proxy.demo.tiny import make_tiny

    path = tmp_path_factory.mktemp("mismatch") / "qwen3_moe"
    model = make_tiny("qwen3_moe", path, num_hidden_layers=4, mlp_only_layers=[])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.mul_(4)
            if name == "lm_head.weight":
                p.mul_(20)
    model.save_pretrained(path)
    return path


def run(path, out, **settings) -> dict[str, float]:
    return run_repro(str(path), out, ReproConfig(**STEPS | settings)).last_metrics


@pytest.fixture(scope="module")
def runs(peaked, tmp_path_factory):
    """The same two steps with: one model for both (today's default), a separate fp32 copy with
    the eager kernel, a bf16 copy, and the bf16 copy with R3."""
    settings = {"same": {}, "fp32-copy": dict(rollout_precision="fp32", rollout_kernels="eager"),
                "bf16": dict(rollout_precision="bf16"), "bf16-R3": dict(rollout_precision="bf16", routing_replay="R3")}
    return {name: run(peaked, tmp_path_factory.mktemp(name), **s) for name, s in settings.items()}


def test_a_bf16_rollout_shows_the_gap_and_matching_numerics_do_not(runs):
    for name in ("same", "fp32-copy"):  # logged, and near 0
        m = runs[name]
        assert 0 <= m["training/rollout_probs_diff_max"] <= MATCHED, (name, m)
        assert m["moe/routing_mismatch"] == 0 and m["training/rollout_kl"] < 1e-8, (name, m)
        assert m["training/rollout_actor_probs_pearson_corr"] > 1 - 1e-6
    bf16 = runs["bf16"]
    assert bf16["training/rollout_probs_diff_max"] > 100 * MATCHED, bf16
    assert bf16["moe/routing_mismatch"] > 0 and bf16["training/rollout_kl"] > 1e-4
    assert sum(bf16[f"moe/routing_mismatch/layer_{i}"] for i in range(4)) > 0
    assert bf16["training/rollout_probs_diff_mean"] <= bf16["training/rollout_probs_diff_max"]


def test_routing_replay_R3_routes_the_trainer_as_the_rollout_and_narrows_the_gap(runs):
    bf16, r3 = runs["bf16"], runs["bf16-R3"]
    assert r3["moe/routing_mismatch"] == 0 and all(r3[f"moe/routing_mismatch/layer_{i}"] == 0 for i in range(4))
    assert r3["training/rollout_probs_diff_mean"] < bf16["training/rollout_probs_diff_mean"]
    assert r3["training/rollout_kl"] < bf16["training/rollout_kl"]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3",
                                  "glm4_moe", "gpt_oss"])
def test_replay_by_each_routers_rule(arch, tmp_path):
    """Replaying a router's own choice gives its own weights (the rule is the router's); another
    choice changes the output and the gate still gets its gradient."""
    from moe_proxy.demo.tiny import make_tiny

    model = make_tiny(arch, tmp_path / arch)
    routers = find_routers(model)
    recorder = RoutingRecorder(routers)
    replay = RoutingReplay(routers)
    ids = torch.randint(3, 200, (2, 7))
    recorder.start(2)
    with torch.no_grad():
        natural = model(input_ids=ids).logits
    chosen = recorder.stop()
    assert set(chosen) == {r.layer for r in routers} and all(c.shape[:2] == (2, 7) for c in chosen.values())
    replay.use(chosen)
    with torch.no_grad():
        again = model(input_ids=ids).logits
    torch.testing.assert_close(again, natural, rtol=1e-5, atol=1e-5)
    experts = routers[0].module.weight.shape[0]
    replay.use({layer: (idx + 1) % experts for layer, idx in chosen.items()})
    recorder.start(2)
    other = model(input_ids=ids).logits
    assert all(torch.equal(idx, (chosen[layer] + 1) % experts) for layer, idx in recorder.stop().items())
    assert not torch.allclose(other, natural, atol=1e-4)
    other.float().pow(2).mean().backward()
    assert all(r.module.weight.grad is not None and r.module.weight.grad.abs().sum() > 0 for r in routers)
    replay.use(None)


def test_a_router_without_a_known_rule_is_refused_by_name():
    class Gate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4, 8))

    with pytest.raises(InvalidReproConfig, match="cannot replay routing through Gate"):
        RoutingReplay([Router("model.layers.0.mlp.gate", 0, Gate())])


def test_rollout_is_weights_truncate_at_the_threshold_or_mask():
    old = torch.log(torch.tensor([[0.9, 0.5, 0.2, 0.4], [0.3, 0.3, 0.3, 0.3]]))
    rollout = torch.log(torch.tensor([[0.1, 0.5, 0.8, 0.1], [0.3, 0.1, 0.3, 0.3]]))
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0]])
    raw = (old - rollout).exp()  # 9, 1, 0.25, 4 / 1, 3, 1, 1
    w = rollout_is_weights(old, rollout, mask, "token", 2.0, "truncate")
    assert w.max() <= 2.0
    torch.testing.assert_close(w, raw.clamp(max=2.0))
    masked = rollout_is_weights(old, rollout, mask, "token", 2.0, "mask")
    torch.testing.assert_close(masked, torch.where((raw <= 2) & (raw >= 0.5), raw, torch.zeros_like(raw)))
    seq = rollout_is_weights(old, rollout, mask, "sequence", 2.0, "truncate")
    # one weight per answer: the product of its tokens' (9 x 1 x 0.25 x 4 = 9 -> 2; 1 x 3 x 1 = 3 -> 2)
    assert torch.all(seq[0] == seq[0, 0]) and torch.all(seq[1] == seq[1, 0])
    torch.testing.assert_close(seq[:, 0], torch.tensor([2.0, 2.0]))


def test_rollout_is_threshold_is_applied_in_a_run(peaked, tmp_path):
    m = run(peaked, tmp_path, rollout_precision="bf16", rollout_is="token", rollout_is_threshold=1.25)
    assert m["rollout_corr/rollout_is_max"] > 1.25  # raw weights past it ...
    assert m["rollout_corr/rollout_is_applied_max"] <= 1.25  # ... truncated in the loss


@pytest.mark.parametrize("knobs", [
    dict(rollout_precision="bf16", routing_replay="R2", rollout_is="sequence"),
    dict(rollout_precision="bf16", routing_replay="R3", rollout_is="token", rollout_is_mode="mask",
         ratio_level="sequence"),
    dict(rollout_precision="bf16", old_logprobs="rollout"),
    dict(precision="bf16"),
])
def test_one_update_per_step_takes_the_old_log_probs_from_its_own_forward(peaked, tmp_path, monkeypatch, knobs):
    """With one update per step there is no old-log-prob pass (timing_s/old_log_prob 0): the
    update's forward gives the old log-probs, detached, and the trainer's routing. Every metric,
    the gap's figures, the IS weights and R2/R3's routing included, is bitwise that of the same
    run with the separate pass (which runs with more than one update per step)."""
    settings = STEPS | dict(mini_batches=1, lr=1e-3) | knobs
    run_repro(str(peaked), tmp_path / "own", ReproConfig(**settings))
    init = _Loop.__init__

    def with_old_pass(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.old_pass = True
    monkeypatch.setattr(_Loop, "__init__", with_old_pass)
    run_repro(str(peaked), tmp_path / "pass", ReproConfig(**settings))
    own, separate = read_metrics(tmp_path / "own"), read_metrics(tmp_path / "pass")
    timed = ("timing_s/", "perf/time_per_step", "perf/throughput")
    for step in own:
        assert own[step]["timing_s/old_log_prob"] == 0 < separate[step]["timing_s/old_log_prob"]
        a, b = ({k: v for k, v in m[step].items() if not k.startswith(timed)} for m in (own, separate))
        assert a.keys() == b.keys() and [k for k in a if a[k] != b[k] and not (math.isnan(a[k]) and math.isnan(b[k]))] \
            == [], step
    last = own[max(own)]
    assert last["actor/ppo_kl"] == 0 or knobs.get("old_logprobs") == "rollout"  # the ratio is 1 ...
    assert last["actor/grad_norm"] > 0  # ... with the policy's gradient
    if "rollout_precision" in knobs:  # a gap there is, and it is measured
        assert last["training/rollout_kl"] > 0 and last["training/rollout_probs_diff_max"] > 0


def test_the_sequence_ratio_is_one_per_sequence_by_hand(tiny_qwen3):
    from moe_proxy.layerwise.load import load_causal_lm

    model = load_causal_lm(str(tiny_qwen3), dtype=torch.float32)
    ids = torch.randint(3, 200, (3, 9))
    logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1).gather(
        -1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    old = logp.detach() + torch.linspace(-0.3, 0.3, logp.numel()).reshape(logp.shape)
    mask = torch.ones_like(logp)
    mask[1, 5:] = 0  # a shorter answer
    ratio = importance_ratio(logp, old, mask, "sequence")
    for row in range(3):
        n = int(mask[row].sum())
        by_hand = math.exp(sum(float(logp[row, t].detach() - old[row, t]) for t in range(n)) / n)
        assert torch.allclose(ratio[row, :n], torch.full((n,), by_hand), rtol=1e-5)
    token = importance_ratio(logp, old, mask, "token")
    torch.testing.assert_close(token, (logp - old).exp())
    # GSPO's gradient: s_i * grad log pi(y_t), the sequence ratio as a constant
    (ratio * mask).sum().backward()
    assert model.lm_head.weight.grad is not None


def test_fp32_router_under_bf16_autocast_and_nothing_changes_in_fp32(tiny_qwen3, tmp_path):
    from moe_proxy.layerwise.load import load_causal_lm

    model = load_causal_lm(str(tiny_qwen3), dtype=torch.float32)
    routers = find_routers(model)
    seen = []
    routers[0].module.register_forward_hook(lambda _m, _i, out: seen.append(out[0].dtype))
    model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    ids = torch.randint(3, 200, (2, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids)
    assert seen == [torch.bfloat16, torch.bfloat16]
    for module in fp32_modules(model, routers, "fp32", "fp32"):
        compute_in_fp32(module)
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids)
    assert seen == [torch.float32, torch.float32]
    plain = run(tiny_qwen3, tmp_path / "auto")
    fp32 = run(tiny_qwen3, tmp_path / "fp32", router_dtype="fp32", lm_head_dtype="fp32")
    timed = ("timing_s/", "perf/time_per_step", "perf/throughput")
    assert {k: v for k, v in plain.items() if not k.startswith(timed)} == \
           {k: v for k, v in fp32.items() if not k.startswith(timed)}


def test_skip_nonfinite_is_the_default_and_can_be_turned_off(tiny_qwen3, tmp_path):
    poison = Faults(op_module="model.layers.1.mlp.experts", op_step=0, op_mode="nan")
    settings = dict(steps=1, batch_size=2, group_size=2, faults=poison)
    skipped = run_repro(str(tiny_qwen3), tmp_path / "skip", ReproConfig(**settings)).last_metrics
    stepped = run_repro(str(tiny_qwen3), tmp_path / "step", ReproConfig(**settings, skip_nonfinite=False)).last_metrics
    assert skipped["numerics/skipped_steps"] >= 1 and skipped["numerics/params_nonfinite"] == 0
    assert stepped["numerics/skipped_steps"] == 0 and stepped["numerics/params_nonfinite"] > 0


def test_the_mismatch_signature():
    detector = FailureDetector()
    healthy = {"training/rollout_kl": 1e-3, "training/rollout_actor_probs_pearson_corr": 0.999,
               "rollout_corr/rollout_is_ratio_fraction_high": 0.001, "rollout_corr/rollout_is_ratio_fraction_low": 0}
    for step in range(3):
        assert detector.update(step, healthy) == []
    apart = healthy | {"training/rollout_kl": 0.05}
    assert detector.update(3, apart) == []  # patience 2
    assert detector.update(4, apart) == ["mismatch"] and detector.onsets["mismatch"].step == 3
    weights = FailureDetector()
    past = healthy | {"rollout_corr/rollout_is_ratio_fraction_high": 0.2}
    weights.update(0, past)
    assert weights.update(1, past) == ["mismatch"] and "IS weights" in weights.onsets["mismatch"].detail


@pytest.mark.parametrize("argv, fragment", [
    (["--rollout-precision", "fp8"], "invalid choice: 'fp8'"),
    (["--routing-replay", "R4"], "invalid choice: 'R4'"),
    (["--rollout-is-threshold", "0"], "must be above 0"),
    (["--rollout-is", "token", "--old-logprobs", "rollout"], "choose one"),
])
def test_bad_knobs_are_one_line_and_exit_2(tiny_qwen3, tmp_path, capsys, argv, fragment):
    try:
        code = main(["repro", str(tiny_qwen3), "--out", str(tmp_path / "out"), *argv])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("knobs", [
    "--routing-replay R2 --rollout-is sequence",
    "--routing-replay R3 --rollout-is token --ratio-level sequence --router-dtype fp32",
    "--rollout-precision fp32 --rollout-kernels eager --lm-head-dtype fp32 --old-logprobs rollout --adam-eps 1e-6",
    "--mini-batches 1 --routing-replay R2 --rollout-is token",  # no old-log-prob pass: the update's forward
])
def test_two_ranks_give_the_one_process_metrics(tiny_qwen3, tmp_path, knobs):
    """Every knob, with a rollout copy of its own sharded like the policy (an fp32 copy): the
    same metrics on 1 and 2 ranks over 3 steps, within tests/repro/test_distributed.py's
    tolerance (1e-5 relative or 1e-6). The copy is fp32 because the ranks' fp32 weights differ
    in their last bits after an update (reduction order), and a bf16 copy rounds that drift into
    its own last bit on some machines and not others: on a Xeon with AMX-bf16 the first two
    knobs' pg_loss at step 2 differed by 2.7e-3 and 6e-5 relative on 1 and 2 ranks, on the tree
    before these knobs changed too (the bf16 copy's rounding, not the sharding: issue 45 item 5).
    On the peaked model every run drifts (gradients of ~100), with or without the knobs."""
    argv = ["--steps", "3", "--lr", "1e-4", "--batch-size", "4", "--group-size", "4", "--rollout-precision", "fp32",
            *knobs.split(), "--no-progress"]
    runs = {}
    for ranks in (1, 2):
        out = tmp_path / f"w{ranks}"
        assert main(["repro", str(tiny_qwen3), "--out", str(out), "--nproc-per-node", str(ranks), *argv]) == 0
        runs[ranks] = read_metrics(out)
        assert json.loads((out / "summary.json").read_text())["ranks"] == ranks
    assert_same_metrics(runs[1], runs[2], range(3))
    assert "training/rollout_probs_diff_max" in runs[2][0] and "moe/routing_mismatch/layer_1" in runs[2][0]


def test_a_stale_engine_holds_the_policys_weights_of_n_steps_before(peaked):
    """--rollout-staleness 2 (asynchronous RL): at step s the engine's copy is the policy as it was
    at step s - 2, exactly (the starting weights for the first 2 steps)."""
    from transformers import AutoModelForCausalLM

    from moe_proxy.rl.distributed import Comm
    from moe_proxy.rl.rollout import RolloutEngine

    policy = AutoModelForCausalLM.from_pretrained(peaked, dtype=torch.float32)
    probe = "model.layers.0.mlp.gate.weight"
    with torch.no_grad():
        policy.get_parameter(probe).fill_(0.0)  # the starting weights
    engine = RolloutEngine(policy, peaked, ReproConfig(rollout_staleness=2), Comm(), seed=0)
    seen = []
    for step in range(5):
        with torch.no_grad():
            policy.get_parameter(probe).fill_(float(step))  # the policy after `step` steps of updates
        engine.sync()  # what generate() does first at every step
        seen.append(engine.model.get_parameter(probe).unique().tolist())
    assert seen == [[0.0], [0.0], [0.0], [1.0], [2.0]]
    assert len(engine.snapshots) == 3


def test_a_stale_rollout_shows_a_gap_once_the_policy_moves(peaked, tmp_path):
    """One step stale: step 0 samples with the trainer's own weights (no gap), step 1 with step 0's
    while the trainer has made its first updates (a gap); an fp32 copy synced every step has none."""
    base = dict(steps=2, batch_size=4, group_size=4, lr=1e-3, rollout_precision="fp32", rollout_kernels="eager")
    stale = run_repro(str(peaked), tmp_path / "stale", ReproConfig(**base, rollout_staleness=1))
    fresh = run_repro(str(peaked), tmp_path / "fresh", ReproConfig(**base))
    rows = read_metrics(tmp_path / "stale" / "metrics.jsonl")
    assert rows[0]["training/rollout_kl"] < 1e-8 and rows[0]["training/rollout_probs_diff_max"] <= MATCHED
    assert rows[1]["training/rollout_kl"] > 1e-4, rows[1]
    assert stale.last_metrics["training/rollout_probs_diff_max"] > 100 * MATCHED
    assert fresh.last_metrics["training/rollout_kl"] < 1e-8
