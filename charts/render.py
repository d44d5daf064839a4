#!/usr/bin/env python3
"""Render the moe-proxy chart to Kubernetes YAML without a cluster or a helm binary.

It runs Helm's own template engine (helm-python-sdk, Helm v4 through its C library; install
it with `pip install helm-python-sdk`), the same one tests/chart renders the chart with, and
prints what `helm template` prints: every rendered object, values checked against
values.schema.json first. (Helm's loader notes on stderr that files/crds is a link to crds/.)

    python charts/render.py                                      # the chart's defaults
    python charts/render.py -f charts/moe-proxy/ci/namespaced-values.yaml
    python charts/render.py --set 'watchNamespaces={team-a,team-b}' --show-only templates/rbac.yaml
    python charts/render.py -n ml-platform --name mp -f my-values.yaml > moe-proxy.yaml

`-f` and `--set` may repeat; later ones win, `--set` over `-f`, as with helm.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

CHART = Path(__file__).resolve().parent / "moe-proxy"


def merged(base: dict, over: dict) -> dict:
    """`over` on top of `base`, maps merged key by key (as helm layers -f and --set)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def render(values: dict | None = None, *, name: str = "moe-proxy", namespace: str = "moe-proxy",
           chart: Path = CHART, show_only: tuple[str, ...] = ()) -> str:
    """The chart's manifests as one YAML stream, each with the `# Source:` line helm prints."""
    import helm_python as helm

    helm.disable_logging()
    with helm.Chart.load(str(chart)) as loaded:
        manifests = loaded.render(values or None, name=name, namespace=namespace, is_install=True)
    prefix = f"{chart.name}/"
    wanted = {path if path.startswith(prefix) else prefix + path for path in show_only}
    missing = wanted - set(manifests)
    if missing:
        raise SystemExit(f"render.py: no template {', '.join(sorted(missing))} in {chart}")
    out = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt") or (wanted and path not in wanted):
            continue
        for doc in re.split(r"(?m)^---[ \t]*$", text):
            if doc.strip():
                out.append(f"---\n# Source: {path}\n{doc.strip()}\n")
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-f", "--values", action="append", default=[], metavar="FILE",
                        help="a values file (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a value, in helm's --set syntax (repeatable)")
    parser.add_argument("-n", "--namespace", default="moe-proxy", help="the release namespace (default moe-proxy)")
    parser.add_argument("--name", default="moe-proxy", help="the release name (default moe-proxy)")
    parser.add_argument("--chart", type=Path, default=CHART, help="the chart folder (default: charts/moe-proxy)")
    parser.add_argument("-s", "--show-only", action="append", default=[], metavar="TEMPLATE",
                        help="only this template, e.g. templates/rbac.yaml (repeatable)")
    args = parser.parse_args(argv)
    try:
        import helm_python as helm
    except ImportError:
        print("render.py needs helm-python-sdk: pip install helm-python-sdk", file=sys.stderr)
        return 2
    values: dict = {}
    try:
        for path in args.values:
            values = merged(values, helm.values_from_yaml(Path(path).read_text()) or {})
        for expression in args.set:
            values = merged(values, helm.parse_set_string(expression))
        sys.stdout.write(render(values, name=args.name, namespace=args.namespace, chart=args.chart,
                                show_only=tuple(args.show_only)))
    except (OSError, helm.HelmError) as exc:
        print(f"render.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
