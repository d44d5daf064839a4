"""The operator Deployment: settings the operator reads (settings.py names, parsed by the
operator's own from_env), kopf's liveness probe, one replica, and a locked-down pod."""

from __future__ import annotations

import importlib.util
from urllib.parse import urlparse

import pytest
import yaml

from proxymodel_operator import settings as operator_settings
from proxymodel_operator.runtimes import RUNTIMES

from .conftest import CHART, ROOT, one, operator_env, render_objects
from .test_render import VALUE_SETS


def container(objects):
    return one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def test_chart_sets_exactly_the_operators_settings(chart):
    env = operator_env(render_objects(chart))
    chart_settings = {name for name in env if name.startswith("MOEPROXY_")}
    assert chart_settings == set(operator_settings.ALL_ENV), \
        "the chart and operator/proxymodel_operator/settings.py disagree on the MOEPROXY_* names"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_operator_parses_the_rendered_settings(chart, name):
    """The rendered environment, read by the operator's own settings.from_env, gives the
    values the chart was given."""
    values = VALUE_SETS[name]
    merged = chart.merge_values(values)
    settings = operator_settings.from_env(operator_env(render_objects(chart, values)))
    jobs = merged["jobs"]
    assert settings.namespaces == tuple(merged["watchNamespaces"])
    assert settings.cluster_wide == (not merged["watchNamespaces"])
    assert settings.transformer_image == (jobs["transformerImage"] or "ghcr.io/moe-proxy/moe-proxy:0.1.0")
    assert settings.repro_image == (jobs["reproductionImage"] or "ghcr.io/moe-proxy/moe-proxy-ascend:0.1.0")
    assert settings.accelerator == jobs["accelerator"]["resource"]
    assert settings.devices_per_node == jobs["accelerator"]["devicesPerNode"]
    assert settings.device_memory_gb == pytest.approx(jobs["accelerator"]["memoryGB"])
    assert settings.s3_endpoint == jobs["s3"]["endpoint"]
    assert settings.s3_region == jobs["s3"]["region"]
    assert settings.preflight == merged["operator"]["preflight"]
    assert settings.log_format == merged["operator"]["logFormat"]
    assert urlparse(settings.liveness).port == merged["operator"]["livenessPort"]
    assert settings.checkpoint_watch == merged["checkpointWatch"]["enabled"]
    runtimes = merged["runtimes"]  # batch/v1 Jobs always, then each runtime on
    assert settings.runtimes == ("Job", *(r.name for r in RUNTIMES.values() if r.feature and
                                          runtimes[r.feature]["enabled"]))
    assert settings.training_runtime == runtimes["trainJob"]["runtime"]


@pytest.mark.parametrize("port", [8080, 9090])
def test_liveness_probe_targets_kopfs_endpoint(chart, port):
    c = container(render_objects(chart, {"operator": {"livenessPort": port}}))
    url = urlparse(operator_settings.from_env({e["name"]: e["value"] for e in c["env"]
                                              if "value" in e}).liveness)
    probe = c["livenessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports[probe["port"]] == url.port == port
    assert probe["path"] == url.path == "/healthz"
    assert url.hostname == "0.0.0.0"  # reachable by the kubelet, not only on loopback
    assert "readinessProbe" not in c


def test_command_runs_the_operators_entry_point(chart):
    c = container(render_objects(chart))
    assert c["command"] == ["python", "-m", "proxymodel_operator"]
    main = importlib.util.find_spec("proxymodel_operator.__main__")
    assert main is not None and "kopf.run" in open(main.origin).read()


def test_one_replica_replaced_not_rolled(chart):
    """kopf runs standalone (no peering): two operators must never overlap."""
    spec = one(render_objects(chart), "Deployment")["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_pod_is_locked_down(chart, name):
    objects = render_objects(chart, VALUE_SETS[name])
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    psc = pod["securityContext"]
    assert psc["runAsNonRoot"] is True and psc["runAsUser"] > 0 and psc["runAsGroup"] > 0
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "hostNetwork" not in pod and "hostPID" not in pod and "hostIPC" not in pod
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    # The only writable path is an emptyDir on /tmp, bounded.
    assert c["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]
    # Resources: requests always, and a memory limit.
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["resources"]["limits"]["memory"]


def test_values_yaml_documents_every_top_level_key():
    """Every top-level value in values.yaml comes after a comment that explains it."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        if line and not line.startswith((" ", "#")):
            j = i - 1
            while j >= 0 and not lines[j].strip():
                j -= 1
            if j < 0 or not lines[j].startswith("#"):
                undocumented.append(line)
    assert undocumented == []


def test_chart_version_matches_the_project():
    chart_meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{chart_meta["appVersion"]}"' in pyproject
    assert operator_settings.DEFAULT_IMAGE.endswith(":" + chart_meta["appVersion"])
