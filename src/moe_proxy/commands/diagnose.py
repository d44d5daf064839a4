"""`moe-proxy diagnose PROXY --out DIR --fail-on SIGNATURE [repro options] --candidates LIST`:
run the failing reproduction (the baseline) and the same run with each candidate fix, on
`--seeds` sampling seeds, and say which candidates cure the failure (docs/diagnosis.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moe_proxy.investigate.diagnose import RUN_OPTIONS, AtOnce, Seeds
from moe_proxy.metrics.detect import FailOnOption
from moe_proxy.options import add_arguments, add_pass_through
from moe_proxy.rl.run_options import REPRO_MODELS


def add_repro_pass_through(parser) -> None:
    """Every repro option but those a diagnosis or bisection sets on each run itself, passed to
    each run as written (into the namespace's repro_flags) and checked before anything runs."""
    group = parser.add_argument_group("repro options (the failing run's settings; see moe-proxy repro -h)")
    for model in REPRO_MODELS:
        add_pass_through(group, model, "repro_flags", skip=RUN_OPTIONS)


class _ListCatalogue(argparse.Action):
    """--list: print the catalogue and exit, as --version does (before required arguments are checked)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(catalogue_listing())
        parser.exit()


def catalogue_listing() -> str:
    """Each catalogue entry: its name, what it changes, its repro flags (at repro's defaults) and
    the knob it stands for in the frameworks."""
    from moe_proxy.investigate.catalogue import CATALOGUE
    from moe_proxy.rl.config import ReproConfig

    defaults = ReproConfig()
    lines = [f"candidates (--candidates NAME,...); flags as they apply at repro's defaults (lr {defaults.lr:g}, "
             f"{defaults.steps} steps):"]
    for c in CATALOGUE.values():
        lines += [f"  {c.name:<20} {c.what}", f"  {'':<20} flags: {' '.join(c.changes(defaults))}",
                  f"  {'':<20} knob: {c.knobs}"]
    return "\n".join(lines)


def add_parser(sub) -> None:
    from moe_proxy.commands._common import add_replace_arg
    from moe_proxy.investigate.catalogue import CATALOGUE
    from moe_proxy.metrics.detect import FAIL_ON_CHOICES

    p = sub.add_parser("diagnose", help="which fix cures a reproduced failure: the run again with each candidate",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="catalogue:\n" + "\n".join(f"  {c.name:<13} {c.what}" for c in CATALOGUE.values()))
    p.add_argument("proxy", metavar="PROXY", help="the proxy (or any checkpoint repro runs) directory or s3:// prefix")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="report.json, report.md, matrix.png, curves.png and runs/<variant>/seed-<s>/ (a rerun "
                        "reuses the runs it finds with the same arguments)")
    add_arguments(p, FailOnOption, required=("fail_on",),
                  helps={"fail_on": f"the failure the baseline reproduces: {FAIL_ON_CHOICES}"})
    add_candidate_args(p)
    p.add_argument("--list", action=_ListCatalogue, help="print the catalogue (what each candidate changes) and exit")
    add_arguments(p, Seeds, helps={"seeds": "sampling seeds per variant, from repro's --seed on"})
    add_arguments(p, AtOnce)
    add_replace_arg(p, "diagnosis")
    p.set_defaults(func=run, repro_flags=[])
    add_repro_pass_through(p)


def add_candidate_args(p, default_said: str = "") -> None:
    """--candidates, --candidate, --candidates-file: the candidate fixes (diagnose, triage)."""
    from moe_proxy.investigate.catalogue import CATALOGUE

    p.add_argument("--candidates", metavar="LIST", default="",
                   help=f"catalogue names, comma-separated: {', '.join(CATALOGUE)}{default_said}")
    p.add_argument("--candidate", action="append", default=[], metavar="NAME=FLAGS",
                   help="a custom candidate: repro flags, e.g. 'slow=--lr 1e-6,--warmup-steps 5' (repeatable)")
    p.add_argument("--candidates-file", metavar="FILE",
                   help="custom candidates from YAML or JSON: a list of {name, flags: [...]} or NAME: flags")


def chosen_candidates(args: argparse.Namespace) -> list:
    """The candidates the flags name: catalogue entries, then custom ones, then the file's."""
    from moe_proxy.errors import MoeProxyError
    from moe_proxy.investigate.catalogue import custom, from_file, pick

    names = [n.strip() for n in args.candidates.split(",") if n.strip()]
    out = pick(names) + [custom(text) for text in args.candidate]
    if args.candidates_file:
        path = Path(args.candidates_file)
        try:
            text = path.read_text()
        except OSError as exc:
            raise MoeProxyError(f"--candidates-file {path}: {exc.strerror or exc}") from None
        try:
            data = json.loads(text)
        except ValueError:
            import yaml

            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise MoeProxyError(f"--candidates-file {path}: neither JSON nor YAML ({exc})") from None
        out += from_file(data, str(path))
    return out


def run(args: argparse.Namespace) -> int:
    import sys

    from moe_proxy.commands._common import check_output_dir
    from moe_proxy.errors import BaselineFailed, MoeProxyError
    from moe_proxy.reports import EXIT_NOT_REPRODUCED
    from moe_proxy.investigate.diagnose import diagnose, reused_runs
    from moe_proxy.investigate.processes import signals_interrupt

    if args.parallel < 1:
        raise MoeProxyError(f"--parallel {args.parallel}: at least 1")
    check_output_dir(args.out, "--out")
    try:
        with signals_interrupt():  # Ctrl-C or SIGTERM: the runs stop, a partial report (processes.Interrupted)
            report = diagnose(args.proxy, args.out, args.fail_on, args.repro_flags, chosen_candidates(args),
                              seeds=args.seeds, parallel=args.parallel, replace=args.replace,
                              all_seeds=args.all_seeds)
    except BaselineFailed as exc:
        print(f"moe-proxy diagnose: error: {exc}", file=sys.stderr)
        return 1
    if report.get("stopped"):  # the baseline first: nothing to cure, no candidate ran
        print(f"{report['stopped']}; no candidate was run (exit {EXIT_NOT_REPRODUCED}; report: "
              f"{Path(args.out) / 'report.md'})")
        return EXIT_NOT_REPRODUCED
    width = max(len(n) for n in ["baseline", *report["candidates"]])
    seeds = report["baseline"]["seeds"]
    print(f"{'baseline':<{width}}  " + ", ".join(
        f"seed {s}: {o['signature']} at step {o['step']}" if o["reproduced"] else f"seed {s}: not reproduced"
        for s, o in seeds.items()) + "".join(f"; {f}" for f in report["baseline"]["findings"]))
    for name, c in report["candidates"].items():
        print(f"{name:<{width}}  {c['verdict']}: {c['note']}")
    print(f"fixed by: {', '.join(report['fixed_by']) or 'none'}")
    if report["fixed_with_other_failures"]:
        print(f"fixed, but with other failures: {', '.join(report['fixed_with_other_failures'])}")
    if reused := reused_runs(report):
        print(f"reused (same proxy content, moe-proxy version and flags): {', '.join(reused)}")
    print(f"report: {Path(args.out) / 'report.md'}")
    return 0
