"""The failure rules on hand-made metric rows."""

import math

from moe_proxy.metrics.detect import FailureDetector, Signature, Thresholds


def feed(detector, rows):
    for step, row in enumerate(rows):
        detector.update(step, row)
    return {name: onset.step for name, onset in detector.onsets.items()}


def test_divergence_onset_is_first_step_of_the_streak():
    rows = [{"actor/grad_norm": g} for g in (1.0, 1.2, 0.8, 1.1, 15.0, 1.0, 12.0, 20.0, 30.0)]
    # step 4 alone is a spike, not a divergence (patience 2); 6-7 is
    assert feed(FailureDetector(), rows) == {"divergence": 6}


def test_no_divergence_during_baseline():
    rows = [{"actor/grad_norm": g} for g in (1.0, 100.0, 100.0)]
    assert feed(FailureDetector(), rows) == {}


def test_overflow_without_and_with_loss_scaling():
    assert feed(FailureDetector(), [{"numerics/grad_overflow": 0}, {"numerics/grad_overflow": 1}]) == {"overflow": 1}
    scaled = [{"numerics/grad_overflow": o, "numerics/loss_scale": 2.0**s} for o, s in
              [(1, 15), (1, 14), (0, 14), (1, 13), (1, 12), (1, 11), (1, 10)]]
    assert feed(FailureDetector(), scaled) == {"overflow": 3}  # 3 skipped in a row from step 3
    collapsed = [{"numerics/grad_overflow": 1, "numerics/loss_scale": 0.5}]
    assert feed(FailureDetector(), collapsed) == {"overflow": 0}


def test_underflow_is_judged_in_half_precision_steps_only():
    """A run's rare exact zeros (2.2e-6 of the elements in the fidelity lab, in fp32 and in fp16
    with loss scaling alike) are cancellations, not a flush: no verdict in either precision. The
    fewest zeros fp16 without loss scaling left there (1.1e-5, lm head in fp32) are one, in fp16
    only."""
    cancelled, flushed = {"numerics/dense_grad_zero_frac": 2.2e-6}, {"numerics/dense_grad_zero_frac": 1.1e-5}
    for half in (0.0, 1.0):
        assert feed(FailureDetector(), [cancelled | {"numerics/half_precision": half}]) == {}
    assert feed(FailureDetector(), [flushed | {"numerics/half_precision": 0.0}]) == {}
    assert feed(FailureDetector(), [flushed | {"numerics/half_precision": 1.0}]) == {"underflow": 0}


def test_nan_is_not_also_an_overflow():
    rows = [{"actor/pg_loss": math.nan, "numerics/grad_overflow": 1}]
    assert feed(FailureDetector(), rows) == {"nan": 0}


def test_collapse_needs_more_experts_than_top_k():
    row = {"moe/load_max_share": 0.95, "moe/load_uniform_share": 0.25}
    healthy = {"moe/load_max_share": 0.3, "moe/load_uniform_share": 0.25}
    assert feed(FailureDetector(), [healthy] * 3 + [row, healthy, row, row]) == {"collapse": 5}
    trivial = {"moe/load_max_share": 1.0, "moe/load_uniform_share": 1.0}  # keep <= top-k: always 1
    assert feed(FailureDetector(), [trivial]) == {}


def test_user_threshold_with_patience():
    sig = Signature.parse("actor/grad_norm>5:2")
    rows = [{"actor/grad_norm": g} for g in (6.0, 1.0, 6.0, 7.0)]
    assert feed(FailureDetector(Thresholds(divergence_factor=1e9), extra=[sig]), rows) == {sig.name: 2}


def test_collapse_from_the_start_is_not_a_failure():
    rows = [{"moe/load_max_share": 0.95, "moe/load_uniform_share": 0.25}] * 5
    assert feed(FailureDetector(), rows) == {}


def test_collapse_is_judged_layer_by_layer():
    """A 12.5% proxy of a top-4 model (8 experts): its last layer puts one expert in every token's
    top-4 from step 0, the busiest-layer figure is 1 throughout, and layer 0's collapse at step 4
    must still be found (judging the busiest layer only found none: docs/fidelity.md, issue 29)."""
    def row(layer0):
        return {"moe/load_max_share/layer_0": layer0, "moe/load_max_share/layer_1": 1.0,
                "moe/load_max_share": 1.0, "moe/load_uniform_share": 0.5}

    rows = [row(s) for s in (0.75, 0.8, 0.78, 0.8, 0.93, 0.96, 0.97)]
    detector = FailureDetector()
    assert feed(detector, rows) == {"collapse": 4}
    assert "layer 0's" in detector.onsets["collapse"].detail
    assert feed(FailureDetector(), [row(0.8)] * 7) == {}  # layer 1, at 1 from the start, is not a collapse


def routed(layer_shares, experts, top_k=2):
    """A row as the probes write it: per layer the busiest expert's raw share and its excess over
    uniform routing (routers.load_max_excess), and the busiest layer's."""
    uniform = top_k / experts
    row = {"moe/load_uniform_share": uniform, "moe/load_max_share": max(layer_shares),
           "moe/load_max_excess": (max(layer_shares) - uniform) / (1 - uniform)}
    for layer, share in enumerate(layer_shares):
        row[f"moe/load_max_share/layer_{layer}"] = share
        row[f"moe/load_max_excess/layer_{layer}"] = (share - uniform) / (1 - uniform)
    return row


def test_collapse_reads_the_scale_free_share_a_4_of_32_proxy_included():
    """Top-2 over 4 kept experts gives each 0.5 of the tokens when routing is even: a clean proxy
    whose routing narrows from 0.8 to 0.92 is 0.84 of the way to collapse, not past the 0.9 bar;
    the raw share alone (what the rule read before, and reads still for logs without the excess)
    called it a collapse. One expert in 0.97 of the tokens' top-2 (0.94 of the way) is one."""
    clean = [routed([s, 0.6], experts=4) for s in (0.8, 0.8, 0.8, 0.92, 0.92, 0.92)]
    assert feed(FailureDetector(), clean) == {}
    raw_only = [{k: v for k, v in row.items() if "excess" not in k} for row in clean]
    assert feed(FailureDetector(), raw_only) == {"collapse": 3}
    collapsed = clean[:3] + [routed([0.97, 0.6], experts=4)] * 2
    detector = FailureDetector()
    assert feed(detector, collapsed) == {"collapse": 3}
    assert "layer 0's busiest expert is 0.94 of the way" in detector.onsets["collapse"].detail
    # the original (32 experts) at the same raw share is as far from uniform: judged alike
    assert feed(FailureDetector(), [routed([0.8], 32)] * 3 + [routed([0.97], 32)] * 2) == {"collapse": 3}


def test_a_model_with_experts_at_most_top_k_says_collapse_cannot_show():
    from moe_proxy.metrics.verdict import verdict_lines

    trivial = {"moe/load_max_share": 1.0, "moe/load_max_share/layer_1": 1.0, "moe/load_uniform_share": 1.0}
    threshold = Signature.parse("moe/load_max_share>0.6")
    detector = FailureDetector(extra=[threshold])
    assert feed(detector, [trivial] * 4) == {threshold.name: 0}  # a raw threshold fires on it, meaning nothing
    assert set(detector.cannot_show) == {"collapse", threshold.name}
    lines = verdict_lines(Signature.parse("collapse"), None, None, 4, {}, detector.cannot_show)
    assert lines[0] == "no failure in 4 steps (collapse not reproduced)"
    assert lines[1].startswith("  collapse cannot show in this run: experts <= top-k")
    healthy = FailureDetector()
    feed(healthy, [routed([0.6], experts=8)] * 4)
    assert healthy.cannot_show == {}
