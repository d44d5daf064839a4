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
    p.add_argument("--out", required=True, metavar="REPORT_DIR")
    p.add_argument("--metrics", help="comma-separated metrics to compare (default: all common ones)")
    p.add_argument("--names", help="comma-separated labels for the runs (default: directory names)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..compare import compare_runs, load_run, write_report
    from ..errors import MalformedMetrics

    names = args.names.split(",") if args.names else [None] * len(args.runs)
    if len(names) != len(args.runs):
        raise MalformedMetrics(f"--names gives {len(names)} labels for {len(args.runs)} runs")
    runs = [load_run(path, name) for path, name in zip(args.runs, names)]
    results = compare_runs(runs, args.metrics.split(",") if args.metrics else None)
    out = write_report(runs, results, args.out)
    for c in results[1:]:
        print(f"{c.run}: {c.verdict}; median Pearson {c.median_pearson if c.median_pearson is None else round(c.median_pearson, 3)}")
    print(f"report: {out}/report.md")
    return 0
