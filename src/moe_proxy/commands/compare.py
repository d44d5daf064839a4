"""`moe-proxy compare RUN_A RUN_B [...] --out REPORT_DIR`: does a proxy track the original?"""

from __future__ import annotations

import argparse
import importlib.util

from moe_proxy.commands.watch import add_reading_options


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "compare", help="compare training dynamics of runs (the first is the reference)",
        description="Align runs by step; per metric report Pearson/Spearman correlation and normalised "
        "error against the first run, and each run's failure onsets. Writes report.json, report.md "
        "and curves.png into REPORT_DIR.")
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="run directories or files: metrics.jsonl, a TensorBoard log directory or event file, an HF "
                   "Trainer trainer_state.json or output directory; first = reference")
    p.add_argument("--out", required=True, metavar="REPORT_DIR",
                   help="directory for report.json, report.md and curves.png")
    p.add_argument("--metrics", help="comma-separated metrics to compare (default: all common ones)")
    p.add_argument("--names", metavar="A,B,...",
                   help="comma-separated labels for the runs, one each, all distinct (default: each run's shortest "
                   "path suffix that no other run's path ends with, e.g. orig/runs/DATE_HOST and proxy/runs/DATE_HOST)")
    p.add_argument("--permutations", type=int, default=100, metavar="N",
                   help="shuffled-step control: each run's median Pearson with its steps in N random orders "
                   "(chance level, and p = share scoring at least the actual); 0 turns it off")
    add_reading_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moe_proxy.commands._common import check_output_dir
    from moe_proxy.commands.watch import reading_options
    from moe_proxy.metrics.compare import compare_runs, load_run, run_labels, write_report
    from moe_proxy.metrics.readers import read_run, reading
    from moe_proxy.metrics.profiles import coverage_lines
    from moe_proxy.errors import MalformedMetrics

    names = args.names.split(",") if args.names else run_labels(args.runs)
    if len(names) != len(args.runs):
        raise MalformedMetrics(f"--names gives {len(names)} labels for {len(args.runs)} runs")
    if empty := [i for i, n in enumerate(names, start=1) if not n.strip()]:
        raise MalformedMetrics(f"--names: the label of run {empty[0]} is empty")
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise MalformedMetrics(f"--names: {twice[0]!r} labels {names.count(twice[0])} runs; each run needs its own")
    check_output_dir(args.out, "--out")
    options = reading_options(args)
    with reading(options):
        runs = [load_run(path, name) for path, name in zip(args.runs, names)]
        profiles = [read_run(path)[1] for path in args.runs]
    if args.permutations < 0:
        raise MalformedMetrics(f"--permutations {args.permutations}: must be 0 or more")
    results = compare_runs(runs, args.metrics.split(",") if args.metrics else None, permutations=args.permutations)
    if importlib.util.find_spec("matplotlib") is None:
        raise MalformedMetrics("compare draws its plots with matplotlib, which is not installed: "
                               "pip install 'moe-proxy[plots]' (or matplotlib)")
    out = write_report(runs, results, args.out)
    add_coverage(out, runs, profiles)
    for c in results[1:]:
        chance = (f" (shuffled steps: {c.shuffled.mean:.3f}, p={c.shuffled.p_value:.3f})"
                  if c.shuffled and c.shuffled.mean is not None and c.shuffled.p_value is not None else "")
        print(f"{c.run}: {c.verdict}; median Pearson "
              f"{c.median_pearson if c.median_pearson is None else round(c.median_pearson, 3)}{chance}")
    for r, profile in zip(runs, profiles):
        print(f"{r.name}: " + "\n".join(coverage_lines(profile, set().union(*r.rows.values()))))
    print(f"report: {out}/report.md")
    return 0


def add_coverage(out, runs, profiles) -> None:
    """report.json's `metrics` and a report.md section: per run, the profile its names were read
    with, the roles found and the signatures its metrics cannot judge (not "no failure")."""
    import json

    from moe_proxy.metrics.profiles import coverage

    entries = []
    for r, profile in zip(runs, profiles):
        found, missing = coverage(set().union(*r.rows.values()))
        entries.append({"run": r.name, "profile": profile.name, "roles": found, "not_judged": missing})
    report = json.loads((out / "report.json").read_text())
    report["metrics"] = entries
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["", "## Metrics read", "", "| run | names | roles found | cannot be judged |", "|---|---|---|---|"]
    for e in entries:
        judged = "; ".join(f"{k} ({v})" for k, v in e["not_judged"].items()) or "-"
        lines.append(f"| {e['run']} | {e['profile']} | {', '.join(e['roles']) or 'none'} | {judged} |")
    with (out / "report.md").open("a") as f:
        f.write("\n".join(lines) + "\n")
