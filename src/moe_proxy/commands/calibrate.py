"""`moe-proxy calibrate SRC --out STATS [--experts N]`: per-expert usage statistics (routing
mass, saliency, output magnitude) on calibration tokens, computed one decoder layer at a time,
for `moe-proxy build --calibration STATS`. With --experts N they are sequential, made for the
proxy `build --experts N` makes by default; without, one pass over the original (any count)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from moe_proxy.commands._common import add_storage_args, check_output_dir, store_options
from moe_proxy.errors import MoeProxyError
from moe_proxy.options import (SELECTION, OutputOptions, PruningOptions, TokenOptions, add_arguments, flag,
                               from_args)


# Said after one-pass statistics made without --one-pass: the better statistics for a deep proxy.
DEEPER = ("  one-pass statistics, usable for any count; for a deep proxy pass the build's --experts N here: "
          "sequential statistics made for that proxy, which with the build's reconstruction made the fidelity "
          "lab's best proxies (docs/fidelity.md)")


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate", help="expert usage statistics on calibration tokens (layer by layer)",
                       description=__doc__)
    p.add_argument("src", help="source checkpoint directory or s3://bucket/prefix")
    p.add_argument("--out", required=True, metavar="STATS", help="statistics directory or s3://bucket/prefix")
    add_arguments(p, TokenOptions)
    seq = p.add_argument_group(
        "proxy-aware (sequential) statistics, for one proxy",
        "With --experts N, each MoE layer is scored behind the proxy's already-pruned earlier layers and its "
        "experts selected right after (the build then reconstructs them by default; what that buys and costs: "
        "docs/fidelity.md). "
        "Builds must ask for the same proxy.")
    add_arguments(seq, PruningOptions, only=("experts",), helps={
        "experts": "routed experts the proxy keeps (the build's --experts N): sequential statistics for it"})
    seq.add_argument("--sequential", action="store_true", help="(implied by --experts; still accepted)")
    seq.add_argument("--one-pass", action="store_true",
                     help="one pass over the original instead: statistics usable for any expert count (and for "
                          "build --experts auto), without --experts")
    add_arguments(seq, PruningOptions, only=SELECTION, helps={
        name: f"with --experts: the build's {flag(name)}" for name in SELECTION} | {
        "keep_super": "with --experts: the build's --no-keep-super"})
    add_arguments(p, OutputOptions, only=("json", "no_progress"), helps={"json": "print the summary as JSON"})
    add_storage_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    target = None
    if args.one_pass and (args.sequential or args.experts is not None):
        raise MoeProxyError("--one-pass makes statistics for any expert count: drop --sequential/--experts, or drop "
                            "--one-pass for sequential statistics made for the proxy of --experts N")
    if args.experts == "auto":
        raise MoeProxyError("--experts auto tries several counts, and sequential statistics hold for one: give the "
                            "count, or --one-pass statistics for build --experts auto")
    if args.experts is not None:  # sequential statistics for that proxy (--sequential is implied)
        target = from_args(PruningOptions, args, seed=0)
    elif args.sequential:
        raise MoeProxyError("--sequential needs --experts N: the statistics are made for that proxy")
    tokens = from_args(TokenOptions, args)
    check_output_dir(args.out, "--out")
    from moe_proxy.calibrate.statistics import calibrate  # torch loads only when it runs, once the options hold

    summary = calibrate(args.src, args.out, **asdict(tokens), progress=not args.no_progress,
                        store_options=store_options(args), sequential=target)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(text(summary) + ("\n" + DEEPER if target is None and not args.one_pass else ""))
    return 0


def text(s: dict) -> str:
    t = s["tokens"]
    lines = [
        f"calibration of {s['source']['uri']} ({s['source']['architecture']})"
        + ("  [up to date: reused]" if s.get("up_to_date") else ""),
        f"  tokens  {t['samples']} x {t['seq_len']}: {t['origin']}",
        f"  mode    {s.get('mode', 'one-pass')}"
        + (f" (made for {' '.join(f'{k}={v}' for k, v in s['made_for'].items())})" if "made_for" in s else ""),
        f"  {'layer':<36} {'dead':>5} {'super experts':<16} load imbalance",
    ]
    for prefix, layer in s["layers"].items():
        lines.append(f"  {prefix:<36} {len(layer['dead']):>5} {str(layer['super']):<16} {layer['load_imbalance']:.2f}"
                     + (f"  kept {layer['kept']}" if "kept" in layer else ""))
    lines += [f"  skipped {p}: {why}" for p, why in s.get("skipped", {}).items()]
    return "\n".join(lines)
