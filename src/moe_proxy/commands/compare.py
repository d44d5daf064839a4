"""`moe-proxy compare RUN_A RUN_B [...] --out REPORT_DIR`: does a proxy track the original?"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "compare", help="compare training dynamics of runs (the first is the reference)",
        description="Align runs by step; per metric report Pearson/Spearman correlation and normalised "
        "error against the first run, and each run's failure onsets. Writes report.json, report.md "
        "and curves.png into REPORT_DIR.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories (or metrics.jsonl files); first = reference")
    p.add_argument("--out", required=True, metavar="REPORT_DIR",
                   help="directory for report.json, report.md and curves.png")
    p.add_argument("--metrics", help="comma-separated metrics to compare (default: all common ones)")
    p.add_argument("--names", help="comma-separated labels for the runs (default: directory names)")
    p.add_argument("--permutations", type=int, default=100, metavar="N",
                   help="shuffled-step control: each run's median Pearson with its steps in N random orders "
                   "(chance level, and p = share scoring at least the actual); 0 turns it off")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moe_proxy.commands._common import check_output_dir
    from moe_proxy.repro.compare import compare_runs, load_run, write_report
    from moe_proxy.errors import MalformedMetrics

    names = args.names.split(",") if args.names else [None] * len(args.runs)
    if len(names) != len(args.runs):
        raise MalformedMetrics(f"--names gives {len(names)} labels for {len(args.runs)} runs")
    check_output_dir(args.out, "--out")
    runs = [load_run(path, name) for path, name in zip(args.runs, names)]
    if args.permutations < 0:
        raise MalformedMetrics(f"--permutations {args.permutations}: must be 0 or more")
    results = compare_runs(runs, args.metrics.split(",") if args.metrics else None, permutations=args.permutations)
    out = write_report(runs, results, args.out)
    for c in results[1:]:
        chance = (f" (shuffled steps: {c.shuffled.mean:.3f}, p={c.shuffled.p_value:.3f})"
                  if c.shuffled and c.shuffled.mean is not None and c.shuffled.p_value is not None else "")
        print(f"{c.run}: {c.verdict}; median Pearson "
              f"{c.median_pearson if c.median_pearson is None else round(c.median_pearson, 3)}{chance}")
    print(f"report: {out}/report.md")
    return 0
