"""`moe-proxy build SRC DST`: build a proxy checkpoint."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from moe_proxy.errors import MoeProxyError
from moe_proxy.options import OutputOptions, PruningOptions, add_arguments, add_size_arguments, from_args
from moe_proxy.commands._common import (add_device_args, add_storage_args, check_output_dir, device_options,
                                        store_options)


def add_parser(sub) -> None:
    p = sub.add_parser("build", help="build a proxy checkpoint (fewer routed experts per MoE layer)",
                       description=__doc__)
    p.add_argument("src", help="source checkpoint directory or s3://bucket/prefix")
    p.add_argument("dst", help="destination directory or s3://bucket/prefix")
    add_size_arguments(p)
    add_arguments(p, PruningOptions, only=("method", "features", "clustering", "top_k", "pins", "seed"))
    usage = p.add_argument_group("usage-aware selection (statistics from moe-proxy calibrate)")
    add_arguments(usage, PruningOptions, only=("calibration", "keep_super", "fill_dead", "super_range_share",
                                               "super_outlier", "representative", "heal", "reconstruct", "merge"))
    auto = p.add_argument_group("--experts auto (fidelity-driven count; measured on the calibration tokens)")
    add_arguments(auto, PruningOptions, only=("max_kl",))
    auto.add_argument("--max-experts", type=int, metavar="N", help="largest count to try")
    add_device_args(auto, "the proxy's device budget: only counts whose proxy fits are tried (the planner's "
                          "memory model, as in moe-proxy plan)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier moe-proxy proxy at DST, deleting only the files it lists (any other "
                        "non-empty DST, and any DST overlapping SRC, is refused)")
    add_arguments(p, OutputOptions, only=("json", "no_progress"), helps={"json": "print the manifest as JSON"})
    scale = p.add_argument_group("scale-out (a Kubernetes Indexed Job: --worker $(JOB_COMPLETION_INDEX))")
    scale.add_argument("--workers", type=int, default=1, metavar="W", help="number of workers sharing the build")
    scale.add_argument("--worker", type=int, metavar="I", help="write only worker I's shards (0-based)")
    scale.add_argument("--fit", action="store_true",
                       help="before the W workers of a build that fits tensors (reconstruct, heal, merge): select "
                            "and fit once, so the workers and finalize read the fits instead of fitting again")
    scale.add_argument("--finalize", action="store_true",
                       help="after all W workers: check their shards, write config, index and manifest")
    add_arguments(p, OutputOptions, only=("termination_log",),
                  helps={"termination_log": "write a short JSON result here (Kubernetes: /dev/termination-log)"})
    add_storage_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moe_proxy.pruning import build  # torch and scikit-learn load only when a build runs
    from moe_proxy.reports import build_report, error_report, worker_report, write_termination_log
    from moe_proxy.sizing import SizingOptions

    options = from_args(PruningOptions, args)
    if sum((args.worker is not None, args.finalize, args.fit)) > 1:
        raise MoeProxyError("--fit, --worker and --finalize are separate steps: fit once, run the workers, then "
                            "finalize once")

    def report(payload: dict) -> None:
        if args.termination_log:
            write_termination_log(args.termination_log, payload)

    how = dict(overwrite=args.overwrite, progress=not args.no_progress, store_options=store_options(args),
               sizing=SizingOptions(**device_options(args)))
    try:
        check_output_dir(args.dst, "DST")
        if args.fit:  # the step before a scale-out's workers: selected and fitted, nothing written but the fits
            fits = build.fit_for_workers(args.src, args.dst, options, workers=args.workers, **how)
        elif args.worker is not None:  # a worker's share only: no manifest yet
            share = build.build_share(args.src, args.dst, options, worker=args.worker, workers=args.workers, **how)
        elif args.finalize:
            manifest = build.finalize_build(args.src, args.dst, options, workers=args.workers, **how)
        else:
            manifest = build.build_proxy(args.src, args.dst, options, max_experts=args.max_experts, **how)
    except MoeProxyError as exc:
        report(error_report(exc))
        raise
    if args.fit:
        report({"fits": fits, "workers": args.workers})
        print(json.dumps({"fits": fits, "workers": args.workers}) if args.json else
              f"fitted once for the {args.workers} workers: {fits}" if fits else
              "nothing to fit (no reconstruct, heal or merge): run the workers")
        return 0
    if args.worker is not None:
        report(worker_report(args.worker, args.workers, len(share.files)))
        print(json.dumps({"worker": share.worker, "workers": share.workers,
                          "files": {f: asdict(w) for f, w in share.files.items()}}, indent=2) if args.json else
              f"worker {args.worker} of {args.workers}: wrote {len(share.files)} shard(s); "
              f"run --finalize once all workers are done")
        return 0
    report(build_report(manifest, args.dst, manifest.sha256))
    print(json.dumps(manifest, indent=2) if args.json else summary(manifest))
    return 0


def summary(m: dict) -> str:
    from moe_proxy.pruning.fidelity import figure_lines
    from moe_proxy.checkpoint.summary import human

    e, p, b = m["experts"], m["params"], m["bytes"]
    lines = [
        f"proxy of {m['source']['uri']} ({m['source']['architecture']})",
        f"  experts per MoE layer  {e['before']} -> {e['after']}   top-k {e['top_k_before']} -> {e['top_k_after']}",
        f"  parameters total       {human(p['total_before'])} -> {human(p['total_after'])}"
        f"  ({p['total_after'] / p['total_before']:.1%})",
        f"  parameters active      {human(p['active_before'])} -> {human(p['active_after'])}",
        f"  shard bytes            {human(b['before'], 'B')} -> {human(b['after'], 'B')}"
        f"  ({b['after'] / b['before']:.1%})",
        "  kept experts per layer:",
    ]
    for prefix, layer in m["layers"].items():
        sizes = ",".join(map(str, layer["cluster_sizes"]))
        usage = (f"  gate mass kept {layer['gate_mass_kept']:.1%}  super {layer['super']}  dead {len(layer['dead'])}"
                 if "gate_mass_kept" in layer else "")  # calibrated builds
        lines.append(f"    {prefix:<36} {layer['kept']}  cluster sizes [{sizes}]{usage}")
        if (r := layer.get("reconstruct")) is not None:  # --reconstruct
            lines.append(f"    {'':<36} reconstructed: held-out error {r['error_before']['held_out']:.4g} -> "
                         f"{r['error_after']['held_out']:.4g}" + ("" if r["fitted"] else " (plain kept)"))
    lines += figure_lines(m.get("fidelity"))
    lines += [f"  note: {n}" for n in m.get("notes", [])]
    return "\n".join(lines)
