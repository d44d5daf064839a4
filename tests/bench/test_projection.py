"""The DeepSeek-V3 projection is arithmetic: check it against figures worked out by hand."""

from __future__ import annotations

import pytest

from .conftest import load_bench_module

projection = load_bench_module("projection")
V3 = projection.DEEPSEEK_V3_32
POD = projection.PerPod(startup_s=3.0, small_requests_per_shard=4, router_reads=3, streams=4, cpu_s_per_gb=5.0,
                        rss=0.9e9, latency_s=0.03)


def test_deepseek_v3_facts():
    assert V3.expert_bytes == 3 * (7168 * 2048 + 56 * 16 * 4)  # fp8 weights + fp32 128x128 block scales
    # 59 layers x 224 dropped experts x 44.05 MB leave 106.4 GB of 688.6.
    assert V3.proxy_bytes / 1e9 == pytest.approx(106.4, abs=0.1)
    assert V3.rss_target / 1e9 == pytest.approx(1.5 * 256 * V3.expert_bytes / 1e9 + 0.537, abs=0.01)


def test_a_row_by_hand():
    r = projection.project(POD, V3, pods=16, conn_mbps=100, link_gbit=25)
    assert r["shards_per_pod"] == 9  # 129 shards over 16 pods, whole shards
    share = 9 / 129 * V3.proxy_bytes
    routers = 3 * 59 * V3.router_bytes  # every pod reads every router, three times
    assert r["up_gb"] == pytest.approx(share / 1e9)
    assert r["down_gb"] == pytest.approx((share + routers) / 1e9)
    assert r["fixed_s"] == pytest.approx(3.0 + (4 * 129 + 3 * 59) * 0.03 + routers / 100e6)
    assert r["network_s"] == pytest.approx(share / 400e6)  # 4 streams x 100 MB/s, under the 3125 MB/s link
    assert r["cpu_s"] == pytest.approx(5.0 * (share + routers) / 1e9)
    assert r["limit"] == "CPU (one core)" and r["total_s"] == pytest.approx(r["fixed_s"] + r["cpu_s"])


def test_sized_to_the_link_the_link_limits_and_memory_grows_per_stream():
    fast = projection.PerPod(**{**POD.__dict__, "cpu_s_per_gb": 0.1})
    r = projection.project(fast, V3, pods=1, streams=32)
    assert r["limit"] == "link (25 Gbit/s)"
    assert r["network_s"] == pytest.approx(V3.proxy_bytes / 3125e6)
    assert r["rss_gb"] == pytest.approx((0.9e9 + 28 * 80 * 2**20) / 1e9)
    assert r["rss_gb"] < r["rss_target_gb"]
    assert "| sized to the link (32) | 8 |" in projection.table(fast)


def test_parallel_planning_and_memory_from_the_inflight_budget():
    """Since issue 17: planning requests 16 at a time, and memory = the measured peak plus the
    budget k streams each way need (k parts each way) beyond the measured build's budget."""
    pod = projection.PerPod(**{**POD.__dict__, "plan_parallel": 16, "inflight": 200e6})
    r = projection.project(pod, V3, pods=1, streams=32)
    routers = 3 * 59 * V3.router_bytes
    assert r["fixed_s"] == pytest.approx(3.0 + (4 * 129 + 3 * 59) * 0.03 / 16 + routers / (100e6 * 16))
    assert r["rss_gb"] == pytest.approx((0.9e9 + 2 * 32 * 8 * 2**20 - 200e6) / 1e9)
    assert "| default rule (64 streams) | 1 |" in projection.table(pod)


def test_planning_cpu_and_the_finalize_job_count_in_the_fixed_cost():
    """Planning takes the longer of its requests and its CPU (torch and scikit-learn load while
    the headers come down; clustering) per MoE layer; a scale-out adds its finalize job once."""
    pod = projection.PerPod(**{**POD.__dict__, "plan_parallel": 16, "plan_cpu_s_per_layer": 0.5, "finalize_s": 4.0})
    one, many = projection.project(pod, V3, pods=1), projection.project(pod, V3, pods=8)
    assert one["fixed_s"] == pytest.approx(3.0 + 0.5 * 59)  # CPU, not the 1.4 s of requests, is the longer
    assert many["fixed_s"] == pytest.approx(3.0 + 0.5 * 59 + 4.0 + 4 * 129 * 0.03 / 16)
    light = projection.PerPod(**{**pod.__dict__, "plan_cpu_s_per_layer": 0.0})
    assert projection.project(light, V3, pods=1)["fixed_s"] == pytest.approx(
        3.0 + (4 * 129 + 3 * 59) * 0.03 / 16 + 3 * 59 * V3.router_bytes / (100e6 * 16))
