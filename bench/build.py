"""Build benchmark: is a proxy build I/O-bound, in flat memory, and does it scale out?

Generates real-format synthetic DeepSeek-V3-style checkpoints (grouped routing, a dense
first layer, shared experts, bf16 experts, fp32 routers and correction biases; random
weights) of about 1, 2, 4 and 8 GB, uploads them to a local SeaweedFS (S3 on 127.0.0.1),
then measures in one run, per size:

- build wall time, spawn to exit (router features, 64 -> 8 experts) versus the time to simply copy the
  proxy's bytes (download + upload through the same S3 client, with the same 4-part read-ahead
  overlapping download and upload): the transformation overhead; CPU seconds of both;
- bytes downloaded / checkpoint bytes, for router features and for weight features, and
  against the target (proxy bytes + headers + router tensors);
- peak RSS of the build process (a fresh process per build);
- wall time of W = 1, 2, 4 worker processes plus finalize (largest size).

Prints a table and writes bench/out/build.json.
Usage: .venv/bin/python bench/build.py [--sizes 1,2,4,8] [--workers 1,2,4] [--out bench/out]

With `--paced LAT_MS,MBPS[,POD_MBPS]` (repeatable) the build runs through paced relays that
stand for a remote object store and each pod's link instead (bench/paced_build.py: latency,
per-connection and per-pod bandwidth, scale-out over pods, a DeepSeek-V3 projection);
`--quick` does that on a tiny checkpoint in well under a minute (tests/bench/test_bench_smoke.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from moe_proxy.demo.seaweed import SeaweedFS
from synthetic import BENCH, GB, KEYS, QUICK, Facts, generate, read_object, upload


# Each measurement runs in a fresh process, so peak RSS is the build's own.
CHILD = r"""
import json, resource, sys
from moe_proxy.pruning.build import build_proxy, build_share, finalize_build
from moe_proxy.storage import open_store
a = json.loads(sys.argv[1])
opts = {"endpoint_url": a["endpoint"]}
src, dst = open_store(a["src"], **opts), open_store(a["dst"], **opts)
if a["mode"] == "copy":  # the baseline: the proxy's bytes through the same client, nothing else,
    # with the build's own overlap of download and upload (4 reads of 64 MB ahead of the writer)
    from concurrent.futures import ThreadPoolExecutor
    from moe_proxy.checkpoint.reads import part_readers, read_ahead
    with ThreadPoolExecutor(4) as pool:
        for name in src.list():
            w, size = dst.writer(name), src.size(name)
            for piece in read_ahead(part_readers(src, name, [(0, size)], 64 << 20), pool):
                w.write(piece)
            w.commit()
else:
    kw = {k: a[k] for k in ("worker", "workers") if k in a}
    step = build_share if "worker" in a else finalize_build if a.get("finalize_only") else build_proxy
    step(src, dst, experts=a["experts"], features=a["features"], overwrite=True, **kw)
u = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"downloaded": src.bytes_downloaded, "max_rss": u.ru_maxrss * 1024}))  # time: child()
"""


def child(**args) -> dict:
    """Run one measurement in a fresh process. Seconds and CPU seconds are the whole process's,
    spawn to exit, as a user pays them: the build imports torch and scikit-learn inside
    `build_proxy` (overlapping its header reads), the copy never does."""
    cpu0, t = children_cpu(), time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True)
    seconds, cpu = time.perf_counter() - t, children_cpu() - cpu0
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1]) | {"seconds": seconds, "cpu_s": cpu}


def children_cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_CHILDREN)  # reaped children only: one measurement at a time
    return u.ru_utime + u.ru_stime


def main() -> int:
    if {"--paced", "--quick"} & {a.split("=")[0] for a in sys.argv[1:]}:  # through paced relays: paced_build.py
        from paced_build import main as paced_main
        return paced_main(sys.argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,2,4,8", help="checkpoint sizes in GB")
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--smoke", action="store_true", help="tiny layers (synthetic.QUICK) so that a run takes "
                    "seconds, for tests/bench/test_bench_quick.py; its figures mean nothing")
    args = ap.parse_args()
    d = QUICK if args.smoke else BENCH
    KEEP = d.keep
    out = Path(args.out)
    sizes = [float(s) for s in args.sizes.split(",")]
    os.environ.update(AWS_ACCESS_KEY_ID=KEYS[0], AWS_SECRET_ACCESS_KEY=KEYS[1], AWS_REGION="us-east-1")
    rows = []
    with SeaweedFS(out / "seaweedfs", *KEYS, buckets=["bench"]) as s3:
        ep = s3.endpoint_url
        for gb in sizes:
            ckpt = generate(out / f"ckpt-{gb:g}gb{'-smoke' if args.smoke else ''}", gb, d)
            src = f"s3://bench/src-{gb:g}gb"
            upload(s3.client(), ckpt, "bench", f"src-{gb:g}gb")
            facts = Facts.of(ckpt, d)
            ckpt_bytes, n_moe = facts.bytes, facts.moe_layers

            # Build and copy alternate, twice each; the faster of each pair counts (the machine is shared).
            builds, copies = [], []
            for rep in range(2):  # fresh destinations: a rebuild into the same one is a no-op
                builds.append(child(mode="build", src=src, dst=f"s3://bench/proxy-{gb:g}gb-{rep}", endpoint=ep,
                                    experts=KEEP, features="router"))
                copies.append(child(mode="copy", src=f"s3://bench/proxy-{gb:g}gb-{rep}",
                                    dst=f"s3://bench/copy-{gb:g}gb-{rep}", endpoint=ep))
            r = min(builds, key=lambda x: x["seconds"]) | {"max_rss": max(b["max_rss"] for b in builds)}
            c = min(copies, key=lambda x: x["seconds"])
            manifest = json.loads(read_object(s3.client(), "bench", f"proxy-{gb:g}gb-0/proxy-manifest.json"))
            proxy_bytes = manifest["bytes"]["after"]
            w = child(mode="build", src=src, dst=f"s3://bench/wproxy-{gb:g}gb", endpoint=ep, experts=KEEP,
                      features="weights")
            rows.append({
                "size_gb": round(ckpt_bytes / GB, 2), "moe_layers": n_moe, "proxy_gb": round(proxy_bytes / GB, 3),
                "build_s": round(r["seconds"], 2), "copy_s": round(c["seconds"], 2),
                "overhead": round(r["seconds"] / c["seconds"], 2),
                "build_cpu_s": round(r["cpu_s"], 2), "copy_cpu_s": round(c["cpu_s"], 2),
                "downloaded_router": r["downloaded"], "downloaded_weights": w["downloaded"],
                "download_ratio_router": round(r["downloaded"] / ckpt_bytes, 3),
                "download_vs_target": round(r["downloaded"] / (proxy_bytes + facts.headers + facts.routers), 3),
                "download_ratio_weights": round(w["downloaded"] / ckpt_bytes, 3),
                "weights_build_s": round(w["seconds"], 2),
                "peak_rss_mb": round(r["max_rss"] / 2**20), "rss_target_mb": round(d.rss_target / 2**20),
            })
            print(rows[-1], flush=True)

        scale = []
        gb = sizes[-1]
        for workers in [int(x) for x in args.workers.split(",")]:
            dst = f"s3://bench/scale-{workers}-{gb:g}gb"
            t = time.perf_counter()
            procs = [subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(dict(
                mode="build", src=f"s3://bench/src-{gb:g}gb", dst=dst, endpoint=ep, experts=KEEP, features="router",
                worker=i, workers=workers))], stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(workers)]
            for p in procs:
                if p.wait():
                    raise RuntimeError(p.stderr.read().decode()[-3000:])
            child(mode="build", src=f"s3://bench/src-{gb:g}gb", dst=dst, endpoint=ep, experts=KEEP, features="router",
                  workers=workers, finalize_only=True)
            seconds = time.perf_counter() - t
            same = (read_object(s3.client(), "bench", f"scale-{workers}-{gb:g}gb/proxy-manifest.json")
                    == read_object(s3.client(), "bench", f"proxy-{gb:g}gb-0/proxy-manifest.json"))
            scale.append({"workers": workers, "seconds": round(seconds, 2), "manifest_identical_to_single": same})
            print(scale[-1], flush=True)

    shutil.rmtree(out / "seaweedfs", ignore_errors=True)  # the bucket's data (GBs per run); the tables stay
    for s in scale:
        s["speedup"] = round(scale[0]["seconds"] / s["seconds"], 2)
    out.mkdir(parents=True, exist_ok=True)
    (out / "build.json").write_text(json.dumps({"sizes": rows, "scale_out": scale}, indent=2))
    print("\n| checkpoint GB | MoE layers | proxy GB | build s | copy s | build/copy | CPU s build/copy "
          "| downloaded/ckpt (router) | downloaded/target | downloaded/ckpt (weights) | peak RSS MB | RSS target MB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size_gb']} | {r['moe_layers']} | {r['proxy_gb']} | {r['build_s']} | {r['copy_s']} | "
              f"{r['overhead']} | {r['build_cpu_s']}/{r['copy_cpu_s']} | {r['download_ratio_router']} | "
              f"{r['download_vs_target']} | "
              f"{r['download_ratio_weights']} | {r['peak_rss_mb']} | {r['rss_target_mb']} |")
    print(f"\nscale-out on the {sizes[-1]:g} GB checkpoint ({os.cpu_count()} CPUs):")
    print("| workers | seconds | speedup | manifest identical to single build |")
    print("|---|---|---|---|")
    for s in scale:
        print(f"| {s['workers']} | {s['seconds']} | {s['speedup']} | {s['manifest_identical_to_single']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
