"""bench/loop_fidelity.py's floor: the original's triage again on other seeds, counted against its
first seeds like any build; and the sharp-head plant, an lr hinge that leaves the checkpoint's
function as it was."""

from __future__ import annotations

import torch

from .conftest import load_bench_module

lf = load_bench_module("loop_fidelity")


def report(first_bad, fixed_by, verdicts):
    return {"state": "diagnosed", "signature": "overflow", "fixed_by": fixed_by,
            "first_bad": None if first_bad is None else {"step": first_bad},
            "verdicts": {n: {"verdict": v} for n, v in verdicts.items()}}


TRUTH = report(20, ["bf16", "fp32"], {"bf16": "fixed", "fp32": "fixed", "lower-lr": "reproduced"})


def cells(**reports):
    out = {"original": {"report": TRUTH}} | {b: {"report": r} for b, r in reports.items()}
    for c in out.values():
        c["agreement"] = lf.agreement(TRUTH, c["report"])
    return out


def test_floor_seed_sets_do_not_overlap_the_originals():
    assert lf.floor_builds(2, seeds=1) == {"original-seed1": 1, "original-seed2": 2}
    assert lf.floor_builds(2, seeds=2) == {"original-seed2": 2, "original-seed4": 4}  # seeds 0-1, 2-3, 4-5
    assert lf.floor_builds(0, seeds=2) == {}


def test_floor_summary_counts_the_original_on_other_seeds_and_each_build():
    result = {
        "dense-fp16": cells(**{"default-0.5": TRUTH, "random-0.5": {"error": "build failed"},
                               "original-seed1": TRUTH,
                               "original-seed2": report(10, ["bf16", "fp32"], {"bf16": "fixed", "fp32": "fixed",
                                                                              "lower-lr": "reproduced"})}),
        "sharp-head": cells(**{"default-0.5": report(20, ["bf16"], {"bf16": "fixed", "fp32": "reproduced",
                                                                     "lower-lr": "reproduced"}),
                               "random-0.5": TRUTH, "original-seed1": TRUTH}),
        "super-fp16": cells(**{"default-0.5": TRUTH}),  # no floor cells: not counted
    }
    summary = lf.floor_summary(result)
    assert list(summary["scenarios"]) == ["dense-fp16", "sharp-head"]
    assert summary["scenarios"]["dense-fp16"] == {"default-0.5": (1, 1), "random-0.5": (0, 1), "floor": (1, 2)}
    assert summary["total"] == {"default-0.5": (1, 2), "random-0.5": (1, 2), "floor": (2, 3)}
    table = lf.floor_table(result, summary)
    assert "| dense-fp16 (`overflow`) | 20; bf16, fp32 | 1/2 | agrees | error: build failed |" in table
    assert "| sharp-head (`overflow`) | 20; bf16, fp32 | 1/1 | fixed by bf16 | agrees |" in table
    assert table.endswith("| **2/3 (67%)** | **1/2 (50%)** | **1/2 (50%)** |")


def test_sharp_head_plant_keeps_the_logits(tmp_path):
    from moe_proxy.demo.tiny import make_tiny

    model = make_tiny("qwen3_moe", tmp_path / "base")
    planted = tmp_path / "planted"
    lf.planted_run(tmp_path / "base", planted, (10, 20), 20, "sharp-head", 1, 0)
    import transformers

    ids = torch.arange(32).reshape(2, 16)
    sharp = transformers.AutoModelForCausalLM.from_pretrained(planted / "global_step_20/actor/huggingface").eval()
    clean = transformers.AutoModelForCausalLM.from_pretrained(planted / "global_step_10/actor/huggingface").eval()
    with torch.no_grad():
        want = model(ids).logits
        torch.testing.assert_close(clean(ids).logits, want)
        torch.testing.assert_close(sharp(ids).logits, want, rtol=1e-4, atol=1e-5)
    # the head's weights are 1e4 times smaller, so an Adam step (about lr a weight) moves the logits 1e4 times as far
    ratio = model.lm_head.weight.abs().mean() / sharp.lm_head.weight.abs().mean()
    assert torch.isclose(ratio, torch.tensor(1e4), rtol=1e-3)
