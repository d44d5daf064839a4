"""`python charts/render.py`: the chart rendered without a cluster or a helm binary, as the docs
tell a user to (docs/operator.md), gives what tests/chart renders; and Chart.yaml's icon is a
file of the repository."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET

import yaml

from .conftest import CHART, ROOT, by_kind, grants, render_objects

SCRIPT = ROOT / "charts" / "render.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


def objects(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def test_render_command_gives_what_the_chart_renders(chart):
    result = run("-f", str(CHART / "ci" / "namespaced-values.yaml"), "--set", "operator.preflight=false",
                 "--set", "jobs.accelerator.devicesPerNode=16")
    assert result.returncode == 0, result.stderr
    values = yaml.safe_load((CHART / "ci" / "namespaced-values.yaml").read_text())
    values = {**values, "operator": {**values.get("operator", {}), "preflight": False},
              "jobs": {**values.get("jobs", {}), "accelerator": {**values.get("jobs", {}).get("accelerator", {}),
                                                                  "devicesPerNode": 16}}}
    expected = render_objects(chart, values)
    assert sorted(map(repr, objects(result.stdout))) == sorted(map(repr, expected))
    assert result.stdout.startswith("---\n# Source: moe-proxy/templates/")
    # --set on top of -f: without preflight, no Role reads Secrets
    assert by_kind(objects(result.stdout), "Role")
    for role in by_kind(objects(result.stdout), "Role"):
        assert not {g for g in grants(role["rules"]) if g[1] == "secrets"}


def test_render_command_show_only_namespace_and_name():
    result = run("--set", "watchNamespaces={team-a,team-b}", "-s", "templates/rbac.yaml", "-n", "ml", "--name", "mp")
    assert result.returncode == 0, result.stderr
    rendered = objects(result.stdout)
    assert sorted(o["kind"] for o in rendered) == ["ClusterRole", "ClusterRoleBinding", "Role", "Role",
                                                   "RoleBinding", "RoleBinding"]
    assert {o["metadata"]["namespace"] for o in by_kind(rendered, "Role")} == {"team-a", "team-b"}
    assert by_kind(rendered, "RoleBinding")[0]["subjects"][0]["namespace"] == "ml"
    assert by_kind(rendered, "ClusterRole")[0]["metadata"]["name"] == "mp-moe-proxy"


def test_render_command_refuses_bad_values_in_one_line():
    result = run("--set", "jobs.accelerator.devicesPerNode=0")
    assert result.returncode == 1 and result.stdout == ""
    assert "render.py: values don't meet the specifications" in result.stderr
    assert "devicesPerNode" in result.stderr and "Traceback" not in result.stderr
    missing = run("-s", "templates/nope.yaml")
    assert missing.returncode == 1 and "no template moe-proxy/templates/nope.yaml" in missing.stderr


def test_the_docs_give_the_render_command():
    docs = (ROOT / "docs" / "operator.md").read_text()
    assert "python charts/render.py" in docs and "pip install helm-python-sdk" in docs


def test_chart_icon_is_a_small_svg_of_the_repository():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    prefix = "https://raw.githubusercontent.com/moe-proxy/moe-proxy/main/"
    assert chart["icon"].startswith(prefix)
    icon = ROOT / chart["icon"].removeprefix(prefix)
    assert icon.is_file() and icon.stat().st_size < 4096
    assert ET.parse(icon).getroot().tag == "{http://www.w3.org/2000/svg}svg"
