"""Build benchmark where a remote object store sets the pace (issue 17).

SeaweedFS on 127.0.0.1 holds a synthetic DeepSeek-V3-style checkpoint (bench/synthetic.py);
every client reaches it through a PacedRelay (bench/paced_relay.py) that adds a first-byte
latency per request and caps each connection's bandwidth and the pod's aggregate. Builds run
the CLI, `python -m moe_proxy build`, in a fresh process, as a pod would. Measured, per paced
setting LAT_MS,MBPS[,POD_MBPS]:

- build wall time (process start to exit), its CPU seconds and peak RSS (wait4), the relay's
  and the S3 server's CPU seconds, and how busy the machine's cores were: when that nears
  100%, the CPU and not the link set the pace (the CPU busy column);
- the best plain parallel copy of the proxy's bytes through the same kind of relay
  (bench/parallel_copy.py at several concurrencies, the fastest kept), and build/copy;
- downloaded/needed: bytes the relay carried down / (proxy shards + source headers + routers);
- from the relay's request log: start-up (spawn -> first request), planning (first request ->
  the build unpublishing its destination; its requests and router reads), streaming (-> exit) and the
  download rate while streaming, in connections' worth (streams);

then scale-out: W pods, each behind its own relay with the scale-out setting, run
`--workers W --worker i` at once, then `--finalize` (through pod 0): wall, speedup, bytes per
pod, byte-identical manifest to the single build's; and the projection of those per-pod
figures to a 32-expert proxy of DeepSeek-V3 (bench/projection.py).

Run: .venv/bin/python bench/build.py --paced 20,10,80 [--paced 50,10,80 ...] [--size 8]
     .venv/bin/python bench/build.py --quick        (tiny, for the smoke test)
Writes bench/out/paced.json (or under --out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from moe_proxy.checkpoint.reader import SMALL_READ_THREADS
from moe_proxy.demo.seaweed import SeaweedFS
from moe_proxy.storage.inflight import Transfer
from paced_relay import PacedRelay
from projection import PerPod, table
from synthetic import BENCH, KEYS, QUICK, Dims, Facts, generate, read_object, upload

HERE = Path(__file__).resolve().parent
MB = 1e6


@dataclass(frozen=True)
class Pace:
    latency_ms: float
    conn_mbps: float
    pod_mbps: float | None = None

    @classmethod
    def parse(cls, text: str) -> "Pace":
        values = [float(v) for v in text.split(",")]
        if not 2 <= len(values) <= 3:
            raise argparse.ArgumentTypeError(f"expected LAT_MS,MBPS[,POD_MBPS], got {text!r}")
        return cls(*values)

    def relay(self, upstream: str, name: str) -> PacedRelay:
        return PacedRelay(upstream, latency=self.latency_ms / 1000, conn_mbps=self.conn_mbps,
                          pod_mbps=self.pod_mbps, name=name).start()

    def __str__(self) -> str:
        return f"{self.latency_ms:g} ms, {self.conn_mbps:g} MB/s/conn, " + (
            f"{self.pod_mbps:g} MB/s/pod" if self.pod_mbps else "no pod cap")


# ---------------------------------------------------------------- processes and CPU


def spawn(cmd: list[str], log: Path) -> tuple:
    """(process, spawn time, log file, CPU samples)."""
    out = log.open("wb")
    p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    out.close()
    return p, time.monotonic(), log, []


def reap(job: tuple, others: list | None = None) -> dict:
    """Wait for one process: wall seconds from spawn, its CPU seconds and peak RSS (wait4), and
    its CPU seconds over time (sampled every 50 ms; `others`: jobs still running, sampled too)."""
    p, t0, log, samples = job
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        for j in [job] + (others or []):
            try:
                j[3].append((time.monotonic(), process_cpu(j[0].pid)))
            except (FileNotFoundError, ProcessLookupError):
                pass
        time.sleep(0.05)
    p.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.monotonic() - t0
    if p.returncode:
        raise RuntimeError(f"{' '.join(p.args[:6])} ... exited {p.returncode}:\n{log.read_text()[-3000:]}")
    return {"seconds": seconds, "cpu_s": ru.ru_utime + ru.ru_stime, "max_rss": ru.ru_maxrss * 1024,
            "spawned": t0, "cpu_samples": samples}


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a running process (here: the S3 server)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Meter:
    """CPU seconds of the S3 server and of given relays over one measurement."""

    def __init__(self, store_pid: int, relays: list[PacedRelay]):
        self.pid, self.relays = store_pid, relays
        self.store0, self.relay0 = process_cpu(store_pid), sum(r.cpu_seconds() for r in relays)

    def read(self) -> dict:
        return {"store_cpu_s": process_cpu(self.pid) - self.store0,
                "relay_cpu_s": sum(r.cpu_seconds() for r in self.relays) - self.relay0}


# ---------------------------------------------------------------- one build, one copy


def build_cmd(src: str, dst: str, endpoint: str, keep: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "moe_proxy", "build", src, dst, "--experts", str(keep), "--endpoint-url", endpoint,
            "--no-progress", "--overwrite", *extra]


def cpu_at(samples: list[tuple[float, float]], t: float) -> float:
    """The process's CPU seconds at time t, from its samples (the last one before t)."""
    before = [cpu for when, cpu in samples if when <= t]
    return before[-1] if before else 0.0


def phases(relay: PacedRelay, run: dict, router_weight: int) -> dict:
    """Start-up (spawn -> first request), planning (-> unpublish) and streaming (-> exit),
    from the relay's request log (entries since the spawn) and the process's CPU samples."""
    spawned, end = run["spawned"], run["spawned"] + run["seconds"]
    log = [e for e in relay.stats.log if spawned <= e[0] <= end]
    first = log[0][0]
    # Planning ends where the build unpublishes the destination (DELETE of its manifest, the last
    # step before writing), else at its first upload.
    marks = [e for e in log if e[1] == "DELETE"] or [e for e in log if e[1] in ("PUT", "POST")]
    stream_from = marks[0][0] if marks else end
    planning = [e for e in log if e[0] < stream_from]
    streaming_down = sum(e[3] for e in log if e[0] >= stream_from)
    stream_s = max(end - stream_from, 1e-9)
    cpu_stream = run["cpu_s"] - cpu_at(run["cpu_samples"], stream_from)
    return {"startup_s": first - spawned, "planning_s": stream_from - first, "stream_s": stream_s,
            "startup_cpu_s": cpu_at(run["cpu_samples"], first), "stream_cpu_s": cpu_stream,
            "planning_cpu_s": cpu_at(run["cpu_samples"], stream_from) - cpu_at(run["cpu_samples"], first),
            "planning_requests": len(planning),
            "router_reads": sum(1 for e in planning if e[3] >= 0.9 * router_weight),
            "stream_down": streaming_down, "stream_down_mbps": streaming_down / stream_s / MB,
            # planning's requests: [ms since the first, method, bytes up, bytes down]
            "planning_log": [[round(1000 * (e[0] - first), 1), *e[1:]] for e in planning]}


def measure_build(seaweed: SeaweedFS, pace: Pace, src: str, dst: str, d: Dims, work: Path,
                  streams: int | None = None) -> dict:
    relay = pace.relay(seaweed.endpoint_url, "build")
    try:
        meter = Meter(seaweed.process.pid, [relay])
        extra = ["--streams", str(streams)] if streams else []
        r = reap(spawn(build_cmd(src, dst, relay.endpoint_url, d.keep, *extra), work / "build.log"))
        r |= meter.read() | phases(relay, r, d.experts * d.hidden * 4)
        r |= {"down": relay.stats.bytes_down, "up": relay.stats.bytes_up, "requests": relay.stats.requests,
              "in_flight": relay.stats.busy_s / r["seconds"]}
    finally:
        relay.close()
    return r


def measure_copy(seaweed: SeaweedFS, pace: Pace, src: str, dst: str, n: int, work: Path) -> dict:
    relay = pace.relay(seaweed.endpoint_url, "copy")
    try:
        meter = Meter(seaweed.process.pid, [relay])
        r = reap(spawn([sys.executable, str(HERE / "parallel_copy.py"), relay.endpoint_url, src, dst, str(n)],
                       work / "copy.log"))
        r |= meter.read() | {"concurrency": n, "down": relay.stats.bytes_down}
    finally:
        relay.close()
    return r


def busy(r: dict, wall: float) -> float:
    """Share of the machine's cores the build (or copy), the relays and the S3 server used."""
    return (r["cpu_s"] + r["relay_cpu_s"] + r["store_cpu_s"]) / (wall * os.cpu_count())


# ---------------------------------------------------------------- the benchmark


def run(args) -> int:
    d = QUICK if args.quick else BENCH
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="paced-", dir=out))
    os.environ.update(AWS_ACCESS_KEY_ID=KEYS[0], AWS_SECRET_ACCESS_KEY=KEYS[1], AWS_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true")
    tag = ("quick-" if args.quick else "") + f"{args.size:g}gb"
    ckpt = generate(out / f"ckpt-{tag}", args.size, d)
    facts = Facts.of(ckpt, d)
    run_id = f"{os.getpid()}-{int(time.time())}"
    rows, copies = [], []
    with SeaweedFS(work / "seaweedfs", *KEYS, buckets=["bench"]) as s3:
        client = s3.client()
        src = f"s3://bench/src-{tag}"
        upload(client, ckpt, "bench", f"src-{tag}")
        single = None
        for i, (pace, streams) in enumerate((p, n) for p in args.paced for n in args.streams):
            dst = f"s3://bench/{run_id}/paced-{i}"
            b = measure_build(s3, pace, src, dst, d, work, streams)
            manifest = read_object(client, "bench", f"{run_id}/paced-{i}/proxy-manifest.json")
            single = single or manifest
            proxy_bytes = json.loads(manifest)["bytes"]["after"]
            needed = proxy_bytes + facts.headers + facts.routers
            if streams == args.streams[0]:  # the best copy, once per pace
                tried = [measure_copy(s3, pace, dst, f"s3://bench/{run_id}/copy-{i}-{n}", n, work)
                         for n in args.copy_concurrency]
                c = min(tried, key=lambda x: x["seconds"])
                copies.append({"pace": str(pace), "tried": [{k: t[k] for k in ("concurrency", "seconds", "cpu_s",
                                                                              "max_rss")} for t in tried]})
            wall_busy = busy(b, b["seconds"])
            rows.append({
                "latency_ms": pace.latency_ms, "conn_mbps": pace.conn_mbps, "pod_mbps": pace.pod_mbps,
                "streams_option": streams or "default", "identical": manifest == single,
                "proxy_gb": proxy_bytes / 1e9, "build_s": b["seconds"], "build_mbps": needed / b["seconds"] / MB,
                "build_cpu_s": b["cpu_s"], "relay_cpu_s": b["relay_cpu_s"], "store_cpu_s": b["store_cpu_s"],
                "cpu_busy": wall_busy, "copy_s": c["seconds"], "copy_n": c["concurrency"], "copy_cpu_s": c["cpu_s"],
                "copy_busy": busy(c, c["seconds"]), "build_over_copy": b["seconds"] / c["seconds"],
                "peak_rss": b["max_rss"], "rss_target": d.rss_target, "downloaded": b["down"], "uploaded": b["up"],
                "needed": needed, "down_over_needed": b["down"] / needed, "requests": b["requests"],
                **{k: b[k] for k in ("startup_s", "planning_s", "stream_s", "planning_requests", "router_reads",
                                     "stream_down", "stream_down_mbps", "in_flight", "startup_cpu_s",
                                     "stream_cpu_s", "planning_cpu_s", "planning_log")},
            })
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "planning_log"}), flush=True)

        scale = []
        for w in args.workers:
            dst_key = f"{run_id}/scale-{w}"
            relays = [args.scale.relay(s3.endpoint_url, f"pod{i}") for i in range(w)]
            try:
                meter = Meter(s3.process.pid, relays)
                relay_cpu0 = [r.cpu_seconds() for r in relays]
                t0 = time.monotonic()
                jobs = [spawn(build_cmd(src, f"s3://bench/{dst_key}", relays[i].endpoint_url, d.keep,
                                        "--workers", str(w), "--worker", str(i)), work / f"worker-{w}-{i}.log")
                        for i in range(w)]
                workers = [reap(j, jobs[i + 1:]) for i, j in enumerate(jobs)]
                fin = reap(spawn(build_cmd(src, f"s3://bench/{dst_key}", relays[0].endpoint_url, d.keep,
                                           "--workers", str(w), "--finalize"), work / f"finalize-{w}.log"))
                seconds = time.monotonic() - t0
                cpu = meter.read()
                relay_cpu = [r.cpu_seconds() - c for r, c in zip(relays, relay_cpu0)]
                router_weight = d.experts * d.hidden * 4
                pods = [phases(r, x, router_weight) for r, x in zip(relays, workers)]
                scale.append({
                    "pods": w, "seconds": seconds, "workers_s": [round(x["seconds"], 2) for x in workers],
                    "finalize_s": fin["seconds"], "finalize": phases(relays[0], fin, router_weight),
                    "phases": pods,
                    "down_mb": [round(r.stats.bytes_down / MB, 1) for r in relays],
                    # How full each pod's link was while its worker ran (down: the larger way),
                    # and how busy each relay's own thread was: a relay near 100% would be the limit.
                    "link_busy": [r.stats.bytes_down / (args.scale.pod_mbps * MB * x["seconds"])
                                  if args.scale.pod_mbps else None for r, x in zip(relays, workers)],
                    "relay_busy": [c / x["seconds"] for c, x in zip(relay_cpu, workers)],
                    "worker_cpu_s": [round(x["cpu_s"], 1) for x in workers], "finalize_cpu_s": fin["cpu_s"],
                    "up_mb": [round(r.stats.bytes_up / MB, 1) for r in relays],
                    "build_cpu_s": sum(x["cpu_s"] for x in workers) + fin["cpu_s"], **cpu,
                    "peak_rss": max(x["max_rss"] for x in workers),
                    "identical": read_object(client, "bench", f"{dst_key}/proxy-manifest.json") == single,
                })
            finally:
                for r in relays:
                    r.close()
            scale[-1]["cpu_busy"] = (scale[-1]["build_cpu_s"] + scale[-1]["relay_cpu_s"]
                                     + scale[-1]["store_cpu_s"]) / (seconds * os.cpu_count())
            print(json.dumps({k: v for k, v in scale[-1].items() if k not in ("phases", "finalize")}), flush=True)

    shutil.rmtree(work / "seaweedfs", ignore_errors=True)  # the bucket's data; the logs stay in `work`
    for s in scale:
        s["speedup"] = scale[0]["seconds"] / s["seconds"]
    first = rows[0]
    per_pod = PerPod(
        startup_s=first["startup_s"],
        small_requests_per_shard=(first["planning_requests"] - first["router_reads"]) / facts.shards,
        router_reads=first["router_reads"] / facts.moe_layers,
        streams=first["stream_down_mbps"] / first["conn_mbps"],
        cpu_s_per_gb=first["stream_cpu_s"] / (first["stream_down"] / 1e9),
        rss=first["peak_rss"], latency_s=first["latency_ms"] / 1000, plan_parallel=SMALL_READ_THREADS,
        inflight=Transfer(streams=first["streams_option"] if first["streams_option"] != "default" else None)
        .sized(d.layer_expert_bytes).max_inflight,
        plan_cpu_s_per_layer=first["planning_cpu_s"] / facts.moe_layers,
        finalize_s=max((s["finalize_s"] for s in scale if s["pods"] > 1), default=0.0))
    projection = table(per_pod)
    (out / "paced.json").write_text(json.dumps({
        "checkpoint": {"gb": facts.bytes / 1e9, "shards": facts.shards, "moe_layers": facts.moe_layers,
                       "dims": "quick" if args.quick else "bench"},
        "paced": rows, "copies": copies, "scale_out": scale, "scale_pace": str(args.scale),
        "per_pod": per_pod.__dict__, "projection": projection, "cpus": os.cpu_count()}, indent=2))
    print_tables(facts, rows, copies, scale, args.scale, per_pod, projection)
    return 0


def print_tables(facts: Facts, rows, copies, scale, scale_pace: Pace, per_pod: PerPod, projection: str) -> None:
    print(f"\ncheckpoint {facts.bytes / 1e9:.3g} GB, {facts.shards} shards, {facts.moe_layers} MoE layers; "
          f"{os.cpu_count()} CPUs; CPU busy = (build + relay + S3 server CPU s) / (wall x CPUs)")
    print("\n| latency ms | MB/s per conn | MB/s per pod | --streams | build s | needed MB/s | CPU s build/relay/S3 "
          "| CPU busy | best copy s (N) | copy CPU s | build/copy | peak RSS MB (target) | downloaded/needed "
          "| start-up s | planning s (requests) | streams | requests in flight | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['latency_ms']:g} | {r['conn_mbps']:g} | {r['pod_mbps'] or '-'} | {r['streams_option']} | "
              f"{r['build_s']:.2f} | "
              f"{r['build_mbps']:.1f} | {r['build_cpu_s']:.1f}/{r['relay_cpu_s']:.1f}/{r['store_cpu_s']:.1f} | "
              f"{r['cpu_busy']:.0%} | {r['copy_s']:.2f} ({r['copy_n']}) | {r['copy_cpu_s']:.1f} | "
              f"{r['build_over_copy']:.2f} | {r['peak_rss'] / 2**20:.0f} ({r['rss_target'] / 2**20:.0f}) | "
              f"{r['down_over_needed']:.3f} | {r['startup_s']:.2f} | {r['planning_s']:.2f} "
              f"({r['planning_requests']}) | {r['stream_down_mbps'] / r['conn_mbps']:.1f} | {r['in_flight']:.1f} | "
              f"{'yes' if r['identical'] else 'NO'} |")
    print("\nparallel copy of the proxy's bytes, by concurrency (seconds, CPU s):")
    for c in copies:
        print(f"  {c['pace']}: " + ", ".join(f"N={t['concurrency']}: {t['seconds']:.2f} s ({t['cpu_s']:.1f})"
                                            for t in c["tried"]))
    print(f"\nscale-out, each pod behind its own relay ({scale_pace}); workers at once, then finalize:")
    print("| pods | seconds | speedup | speedup / pods | worker s | worker CPU s | pod 0 start-up/planning/streaming s "
          "| finalize s (start-up/planning; CPU s) | MB down per pod (max/mean) | MB up per pod | link busy per pod "
          "| relay busy per pod | CPU s (all) | CPU busy | identical to single build |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in scale:
        p0, f = s["phases"][0], s["finalize"]
        print(f"| {s['pods']} | {s['seconds']:.2f} | {s['speedup']:.2f} | {s['speedup'] / s['pods']:.2f} | "
              f"{'/'.join(f'{x:g}' for x in s['workers_s'])} | {'/'.join(f'{x:g}' for x in s['worker_cpu_s'])} | "
              f"{p0['startup_s']:.1f}/{p0['planning_s']:.1f}/{p0['stream_s']:.1f} | "
              f"{s['finalize_s']:.2f} ({f['startup_s']:.1f}/{f['planning_s']:.1f}; {s['finalize_cpu_s']:.1f}) | "
              f"{'/'.join(f'{x:g}' for x in s['down_mb'])} "
              f"({max(s['down_mb']) / (sum(s['down_mb']) / len(s['down_mb'])):.2f}) | "
              f"{'/'.join(f'{x:g}' for x in s['up_mb'])} | "
              f"{'/'.join(f'{x:.0%}' for x in s['link_busy']) if s['link_busy'][0] is not None else '-'} | "
              f"{'/'.join(f'{x:.0%}' for x in s['relay_busy'])} | "
              f"{s['build_cpu_s'] + s['relay_cpu_s'] + s['store_cpu_s']:.1f} | {s['cpu_busy']:.0%} | "
              f"{'yes' if s['identical'] else 'NO'} |")
    print(f"\nper-pod figures (first paced row): start-up {per_pod.startup_s:.2f} s "
          f"({rows[0]['startup_cpu_s']:.1f} CPU s); "
          f"{per_pod.small_requests_per_shard:.1f} planning requests per shard + {per_pod.router_reads:.1f} router "
          f"reads per MoE layer; planning {rows[0]['planning_cpu_s']:.1f} CPU s "
          f"({per_pod.plan_cpu_s_per_layer:.2f} per MoE layer); finalize {per_pod.finalize_s:.1f} s; "
          f"{per_pod.streams:.1f} streams; {per_pod.cpu_s_per_gb:.1f} CPU s per GB downloaded "
          f"while streaming; "
          f"peak RSS {per_pod.rss / 2**20:.0f} MB")
    print("\nprojection (arithmetic on the per-pod figures, bench/projection.py):")
    print(projection)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--paced", type=Pace.parse, action="append", metavar="LAT_MS,MBPS[,POD_MBPS]",
                    help="a paced setting: first-byte latency, per-connection and per-pod bandwidth (repeatable)")
    ap.add_argument("--scale", type=Pace.parse, metavar="LAT_MS,MBPS[,POD_MBPS]",
                    help="setting for scale-out (default 20,10,5: a pod link of 5 MB/s, a quarter of what the "
                         "build's streams could fill, so the link and not the 2-core machine's CPU limits W = 4 pods)")
    ap.add_argument("--size", type=float, help="checkpoint GB (default 8)")
    ap.add_argument("--workers", help="pods for scale-out (default 1,2,4)")
    ap.add_argument("--copy-concurrency", help="parallel copy concurrencies to try (default 4,8,16,32)")
    ap.add_argument("--streams", help="build --streams settings to run per pace, 0 = the default rule (default 0)")
    ap.add_argument("--quick", action="store_true", help="tiny checkpoint and fast pacing: checks the bench runs")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args(argv)
    quick = args.quick
    args.paced = args.paced or [Pace(5, 4, 16)] if quick else args.paced or [Pace(20, 10, 80), Pace(50, 10, 80),
                                                                             Pace(20, 25, 100)]
    args.scale = args.scale or (Pace(5, 2, 4) if quick else Pace(20, 10, 5))
    args.size = args.size or (0.012 if quick else 8)
    args.workers = [int(x) for x in (args.workers or ("1,2" if quick else "1,2,4")).split(",")]
    args.copy_concurrency = [int(x) for x in (args.copy_concurrency or ("2,8" if quick else "4,8,16,32")).split(",")]
    args.streams = [int(x) or None for x in (args.streams or "0").split(",")]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
