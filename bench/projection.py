"""Expected time, bytes and memory per pod for a large build, worked out from per-pod figures
measured by the paced benchmark. Pure arithmetic: nothing here runs a build.

The model of one pod's build (what the measurements show the build does today):

    time = startup + planning + max(network, CPU)

- startup: process start to its first request (interpreter; torch and scikit-learn too before
  they were loaded while the headers come down);
- planning: small requests (existence, size, header of every shard, config, index), each
  paying the first-byte latency, `plan_parallel` at a time (1: sequential, as before issue 17;
  16 since), plus the router reads (every pod plans on its own, so every pod reads every
  router, `router_reads` times per layer: 1 since issue 17); or, where longer, the planning's
  CPU (loading torch and scikit-learn, clustering) at the measured CPU seconds per MoE layer;
- finalize (pods > 1 only): the measured finalize job (it takes the workers' plan: start-up
  without torch, headers, config, index, manifest) plus its requests at this latency;
- network: the pod's share of the proxy down and the same up (full duplex, in parallel), at
  `streams` x the per-connection bandwidth, at most the pod's link;
- CPU: build CPU seconds per GB moved, as measured (one core's worth: the conservative case).

Shards are split whole over pods (balanced by bytes), so a pod gets ceil(shards / pods) shards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MiB, GB = 1 << 20, 1e9


@dataclass(frozen=True)
class Model:
    name: str
    bytes: float  # all shards
    shards: int
    moe_layers: int  # layers that hold routed experts (MTP included)
    experts: int
    keep: int
    expert_bytes: int  # one routed expert: its three projections (and their scales)
    router_bytes: int  # one MoE layer's router weight and correction bias

    @property
    def proxy_bytes(self) -> float:
        return self.bytes - self.moe_layers * (self.experts - self.keep) * self.expert_bytes

    @property
    def rss_target(self) -> float:
        """The build's memory target: 1.5 x one MoE layer's experts + 512 MiB."""
        return 1.5 * self.experts * self.expert_bytes + 512 * MiB


# DeepSeek-V3 (671B): 688.6 GB in 129 shards (as in issue 17). Hidden 7168, expert width 2048,
# 256 routed experts in 58 MoE layers (61 layers, the first 3 dense) plus the MTP layer's 256.
# Experts are fp8 (1 byte) with fp32 block scales of 128 x 128. Router weight 256 x 7168
# (bf16), correction bias 256 (fp32).
DEEPSEEK_V3_32 = Model(
    name="DeepSeek-V3, 32 of 256 experts kept", bytes=688.6e9, shards=129, moe_layers=59, experts=256, keep=32,
    expert_bytes=3 * (7168 * 2048 + math.ceil(7168 / 128) * math.ceil(2048 / 128) * 4),
    router_bytes=256 * 7168 * 2 + 256 * 4,
)


@dataclass(frozen=True)
class PerPod:
    """One pod's build, measured through a paced relay."""
    startup_s: float  # process start -> first request
    small_requests_per_shard: float  # planning requests other than router reads, per source shard
    router_reads: float  # router reads per MoE layer (identity, features, output)
    streams: float  # measured download rate while streaming / per-connection cap
    cpu_s_per_gb: float  # build CPU seconds per GB downloaded while streaming
    rss: float  # peak RSS, bytes (flat in checkpoint size: the read/upload window)
    latency_s: float  # first-byte latency the planning figures were taken at
    plan_parallel: int = 1  # planning requests in flight at once
    inflight: float | None = None  # the measured build's in-flight byte budget (None: fixed read-ahead)
    plan_cpu_s_per_layer: float = 0.0  # planning CPU seconds (imports, clustering) per MoE layer
    finalize_s: float = 0.0  # a scale-out's finalize job, measured (0: not measured, left out)


def project(m: PerPod, model: Model, pods: int, conn_mbps: float = 100, link_gbit: float = 25,
            latency_s: float | None = None, streams: float | None = None, part: int = 64 * MiB,
            upload_part: int = 16 * MiB, budget_part: int = 8 * MiB) -> dict:
    """One row. `streams` overrides the measured concurrency (e.g. sized to fill the link); memory
    then grows by a read part and an upload part per stream above the measured ones."""
    latency = m.latency_s if latency_s is None else latency_s
    conn, link = conn_mbps * 1e6, link_gbit * 1e9 / 8
    k = m.streams if streams is None else streams
    share = math.ceil(model.shards / pods) / model.shards  # whole shards per pod
    up = share * model.proxy_bytes
    routers = m.router_reads * model.moe_layers * model.router_bytes  # every pod plans on its own
    down = up + routers
    plan_requests = m.small_requests_per_shard * model.shards + m.router_reads * model.moe_layers
    parallel = min(m.plan_parallel, model.shards)
    requests = plan_requests * latency / parallel + routers / (conn * parallel)
    fixed = m.startup_s + max(requests, m.plan_cpu_s_per_layer * model.moe_layers)
    if pods > 1 and m.finalize_s:  # then the finalize job, once: its own start-up, and the headers again
        fixed += m.finalize_s + m.small_requests_per_shard * model.shards * latency / parallel
    rate = min(k * conn, link)
    network = up / rate  # the share comes down and goes up at the same time
    cpu = m.cpu_s_per_gb * down / GB
    total = fixed + max(network, cpu)
    limits = {"per-pod fixed cost (start-up, planning, finalize)": fixed,
              f"link ({link_gbit:g} Gbit/s)" if rate == link else f"connections in flight ({k:.1f} x {conn_mbps:g} MB/s)":
                  network,
              "CPU (one core)": cpu}
    if m.inflight is None:  # a fixed read-ahead: memory grows by a part each way per extra stream
        rss = m.rss + max(0.0, k - m.streams) * (part + upload_part)
    else:  # k streams each way need a budget of k parts each way (storage/inflight.py: 8 MiB parts)
        rss = m.rss + max(0.0, 2 * k * budget_part - m.inflight)
    return {"pods": pods, "shards_per_pod": math.ceil(model.shards / pods), "down_gb": down / GB, "up_gb": up / GB,
            "fixed_s": fixed, "network_s": network, "cpu_s": cpu, "total_s": total, "streams": k,
            "limit": max(limits, key=limits.get), "rss_gb": rss / GB, "rss_target_gb": model.rss_target / GB}


def table(m: PerPod, model: Model = DEEPSEEK_V3_32, pods=(1, 8, 16), conn_mbps: float = 100,
          link_gbit: float = 25, latency_s: float | None = None) -> str:
    """Markdown: as built (measured concurrency), then with concurrency sized to fill the link."""
    fill = math.ceil(link_gbit * 1e9 / 8 / (conn_mbps * 1e6))
    lines = [f"{model.name}: {model.bytes / GB:.1f} GB in {model.shards} shards -> proxy "
             f"{model.proxy_bytes / GB:.1f} GB; {conn_mbps:g} MB/s per connection, {link_gbit:g} Gbit/s per pod, "
             f"first byte {1000 * (m.latency_s if latency_s is None else latency_s):g} ms",
             "| concurrency | pods | shards/pod | GB down/pod | GB up/pod | fixed s | network s | CPU s (one core) "
             "| cores to keep pace with the network | total min | per-pod RSS GB (target) | limited by |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    built = (f"as built ({m.streams:.1f} streams)", None)
    if m.inflight is not None:  # concurrency from the budget: the build's default rule for this model
        from moe_proxy.storage.inflight import Transfer

        k = Transfer().sized(model.experts * model.expert_bytes).streams
        built = (f"default rule ({k} streams)", k)
    for label, streams in (built, (f"sized to the link ({fill})", fill)):
        for p in pods:
            r = project(m, model, p, conn_mbps, link_gbit, latency_s, streams)
            lines.append(f"| {label} | {p} | {r['shards_per_pod']} | {r['down_gb']:.1f} | {r['up_gb']:.1f} | "
                         f"{r['fixed_s']:.0f} | {r['network_s']:.0f} | {r['cpu_s']:.0f} | {r['cpu_s'] / r['network_s']:.1f} | "
                         f"{r['total_s'] / 60:.1f} | "
                         f"{r['rss_gb']:.1f} ({r['rss_target_gb']:.1f}) | {r['limit']} |")
    return "\n".join(lines)
