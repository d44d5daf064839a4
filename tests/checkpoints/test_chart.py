"""The chart and the operator process for CheckpointWatch: the CRD ships with the chart, and
checkpointWatch.enabled turns on together the operator's timer (MOEPROXY_CHECKPOINT_WATCH)
and the RBAC it needs; off, the operator neither serves CheckpointWatches nor may."""

from __future__ import annotations

import subprocess
import sys

import pytest

from proxymodel_operator.settings import SettingsError, from_env

from ..chart.conftest import by_kind, grants, load_chart, one, render_objects
from .crd_schema import ROOT

CW_GRANTS = {("moeproxy.io", "checkpointwatches", v) for v in ("get", "list", "watch", "patch")} | \
    {("moeproxy.io", "checkpointwatches/status", v) for v in ("get", "patch")} | \
    {("moeproxy.io", "proxymodels", v) for v in ("create", "delete")} | \
    {("moeproxy.io", "checkpointwatches/finalizers", "update")} | \
    {("moeproxy.io", "diagnoses", v) for v in ("create", "delete")}  # a watched run's incidents (watched_run.py)
SECRET_GET = ("", "secrets", "get")
DIAGNOSIS_TOO = {("moeproxy.io", "proxymodels", "create")}  # a Diagnosis's bisection makes ProxyModels, watch or not


@pytest.fixture(scope="module")
def chart():
    with load_chart() as c:
        yield c


def _env(objects) -> dict[str, str]:
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in container["env"]}


def test_the_chart_ships_the_crd_when_enabled(chart):
    def crds(values):
        return {o["metadata"]["name"]: o for o in by_kind(render_objects(chart, values), "CustomResourceDefinition")}

    on = crds({"checkpointWatch": {"enabled": True}})
    assert on["checkpointwatches.moeproxy.io"]["spec"]["names"]["shortNames"] == ["ckw"]
    assert "checkpointwatches.moeproxy.io" not in crds({})


def test_enabled_grants_and_turns_on_checkpoint_watching(chart):
    off = render_objects(chart)
    on = render_objects(chart, {"checkpointWatch": {"enabled": True}})
    assert _env(off)["MOEPROXY_CHECKPOINT_WATCH"] == "false" and _env(on)["MOEPROXY_CHECKPOINT_WATCH"] == "true"
    granted_off, granted_on = grants(one(off, "ClusterRole")["rules"]), grants(one(on, "ClusterRole")["rules"])
    assert CW_GRANTS & granted_off == DIAGNOSIS_TOO
    assert granted_on - granted_off == CW_GRANTS - DIAGNOSIS_TOO
    # Only `get` on Secrets, with preflight off too; never list or watch.
    alone = render_objects(chart, {"checkpointWatch": {"enabled": True}, "operator": {"preflight": False}})
    secrets = {g for g in grants(one(alone, "ClusterRole")["rules"]) if g[1] == "secrets"}
    assert secrets == {SECRET_GET}


def test_namespaced_mode_grants_it_in_each_namespace(chart):
    objects = render_objects(chart, {"checkpointWatch": {"enabled": True}, "watchNamespaces": ["rl-team"]})
    assert CW_GRANTS | {SECRET_GET} <= grants(one(objects, "Role")["rules"])
    assert not CW_GRANTS & grants(one(objects, "ClusterRole")["rules"])


def test_settings():
    assert from_env({}).checkpoint_watch is False
    assert from_env({"MOEPROXY_CHECKPOINT_WATCH": "true"}).checkpoint_watch is True
    with pytest.raises(SettingsError, match="MOEPROXY_CHECKPOINT_WATCH"):
        from_env({"MOEPROXY_CHECKPOINT_WATCH": "sometimes"})


PROBE = """
import kopf, sys
import proxymodel_operator.__main__ as main
kopf.run = lambda **kwargs: None
assert main.main() == 0
plurals = {h.selector.any_name or h.selector.plural for h in kopf.get_default_registry()._spawning.get_all_handlers()}
print(sorted(p for p in plurals if p))
"""


@pytest.mark.parametrize("enabled, served", [("true", True), ("false", False)])
def test_the_operator_serves_checkpointwatches_only_when_enabled(enabled, served):
    env = {"PATH": "/usr/bin:/bin", "MOEPROXY_CHECKPOINT_WATCH": enabled, "MOEPROXY_LOG_FORMAT": "plain",
           "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'transformer'}"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert ("checkpointwatches" in out.stdout) == served, out.stdout
    # torch never comes with it: the operator's image has none.
    check = subprocess.run([sys.executable, "-c", "import sys; import proxymodel_operator.checkpoint_watch; "
                            "print('torch' in sys.modules)"], env=env, capture_output=True, text=True, timeout=60)
    assert check.stdout.strip() == "False", check.stderr
