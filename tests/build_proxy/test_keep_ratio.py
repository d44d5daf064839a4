"""`--keep-ratio` means one count for `plan` and `build` (sizing.estimate's rule: the ratio
rounded to whole routing groups, raised to 2 x top-k where the device budget holds it), and
a build that rounds or raises says so in its notes (#32 item 5)."""

from __future__ import annotations

import json

import pytest

from moe_proxy.pruning import build_proxy
from moe_proxy.cli import main
from moe_proxy.demo.tiny import make_tiny
from moe_proxy.sizing import SizingOptions, estimate


@pytest.fixture(scope="module")
def qwen16(tmp_path_factory):
    """Qwen3-MoE, 16 experts, top-4: the issue's case."""
    path = tmp_path_factory.mktemp("ratio") / "qwen16"
    make_tiny("qwen3_moe", path, num_experts=16, num_experts_per_tok=4)
    return path


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    path = tmp_path_factory.mktemp("ratio") / "dsv3"
    make_tiny("deepseek_v3", path, n_routed_experts=16, n_group=4, topk_group=2)
    return path


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_plan_and_build_keep_the_same_count_and_the_build_says_why(qwen16, tmp_path, capsys):
    planned = estimate(_config(qwen16), SizingOptions(keep_ratio=0.125))
    assert planned.proxy.experts_per_layer == 8  # 2 raised to 2 x top-k
    m = build_proxy(str(qwen16), str(tmp_path / "p"), keep_ratio=0.125)
    assert (m["experts"]["after"], m["experts"]["top_k_after"]) == (8, 4)
    assert any("raised from 2 (keep ratio 0.125) to 8" in n for n in m["notes"]), m["notes"]
    # The CLI's plan says the same number.
    assert main(["plan", str(qwen16), "--keep-ratio", "0.125", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["proxy"]["experts_per_layer"] == 8


def _tight(config: dict) -> SizingOptions:
    """A device so small that 2 experts fit on one and 8 do not."""
    base = dict(devices_per_node=1, micro_batch_tokens=1, utilization=1.0, reserve_gb=0.0)
    for gb in (2.0 ** -e for e in range(0, 40)):
        try:
            two, eight = (estimate(config, SizingOptions(experts=n, device_memory_gb=gb, **base)).proxy.devices
                          for n in (2, 8))
        except Exception:  # noqa: BLE001 - too small for one micro-batch: the previous size was the last
            break
        if two == 1 < eight:
            return SizingOptions(keep_ratio=0.125, device_memory_gb=gb, **base)
    raise AssertionError("no device size separates 2 from 8 experts")


def test_a_device_budget_that_cannot_hold_the_raise_keeps_the_ratio_in_both(qwen16, tmp_path):
    tight = _tight(_config(qwen16))
    planned = estimate(_config(qwen16), tight)
    assert planned.proxy.experts_per_layer == 2 and "stay 2" in planned.notes[0]
    built = build_proxy(str(qwen16), str(tmp_path / "p"), keep_ratio=0.125, sizing=tight)
    assert built["experts"]["after"] == 2 and any("stay 2" in n for n in built["notes"]), built["notes"]


def test_rounding_to_routing_groups_and_keeping_everything_are_said(dsv3, tmp_path):
    m = build_proxy(str(dsv3), str(tmp_path / "small"), keep_ratio=0.01)
    assert m["experts"]["after"] == 8 and m["experts"]["n_group"] == 4
    assert "keep ratio 0.01 of 16 experts is 0.16: 8 kept (the same number in each of the 4 routing groups, " \
        "at least 2)" in m["notes"]
    full = build_proxy(str(dsv3), str(tmp_path / "full"), keep_ratio=1)
    assert full["experts"]["after"] == 16
    assert any("keeps all 16 experts" in n for n in full["notes"]), full["notes"]
