"""RBAC least privilege: what the chart grants is exactly rbac.PERMISSIONS, the one list of
calls the operator makes (its API client refuses anything else), with no wildcard."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import yaml

from proxymodel_operator import rbac
from proxymodel_operator.runtimes import RUNTIMES
from proxymodel_operator.settings import from_env

from ..promised import require
from .conftest import CHART, NAMESPACE, ROOT, by_kind, grants, helm, load_chart, one, operator_env, render_objects

CLUSTER_SCOPED = {("", "namespaces"), ("apiextensions.k8s.io", "customresourcedefinitions")}
SECRET_GET = ("", "secrets", "get")


def _generator():
    spec = importlib.util.spec_from_file_location("generate_rbac", ROOT / "charts" / "generate_rbac.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the chart's defaults: operator.preflight on, checkpointWatch off, the Volcano and Ascend runtimes on
DEFAULT_FEATURES = ("preflight", "volcanoJob", "ascendJob")
RUNTIME_FEATURES = ("volcanoJob", "ascendJob", "rayJob", "trainJob", "jobSet")
ALL_RUNTIMES = {"runtimes": {f: {"enabled": True} for f in RUNTIME_FEATURES}}


def permissions(*features: str) -> set[tuple[str, str, str]]:
    """What rbac.PERMISSIONS grants with these chart features on (default: the chart's
    defaults); a permission that names no feature is always granted."""
    enabled = set(features or DEFAULT_FEATURES)
    return {(r["apiGroup"], r["resource"], v) for r in _generator().rules() for v in r["verbs"]
            if not r["features"] or enabled & set(r["features"])}


def _is_cluster_scoped(grant) -> bool:
    return (grant[0], grant[1].split("/")[0]) in CLUSTER_SCOPED


def test_permissions_are_not_empty_and_have_no_wildcard():
    everything = permissions("preflight", "checkpointWatch", *RUNTIME_FEATURES)
    assert len(everything) > 10 and everything == {(p.api_group, p.resource, v) for p in rbac.PERMISSIONS
                                                   for v in p.verbs}
    assert not any("*" in part for grant in everything for part in grant)


def test_cluster_wide_grants_exactly_the_permissions(chart):
    objects = render_objects(chart)
    role = one(objects, "ClusterRole")
    assert grants(role["rules"]) == permissions()
    assert not by_kind(objects, "Role") and not by_kind(objects, "RoleBinding")
    binding = one(objects, "ClusterRoleBinding")
    deployment = one(objects, "Deployment")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "namespace": NAMESPACE,
                                    "name": deployment["spec"]["template"]["spec"]["serviceAccountName"]}]


def test_no_wildcard_in_any_rule(chart):
    for values in ({}, {"watchNamespaces": ["a", "b"]}, {"checkpointWatch": {"enabled": True}}):
        for obj in render_objects(chart, values):
            for rule in obj.get("rules", []):
                for key in ("apiGroups", "resources", "verbs"):
                    assert "*" not in rule[key], (obj["kind"], rule)


def test_namespaced_mode_grants_per_namespace(chart):
    watched = ["team-a", "team-b"]
    objects = render_objects(chart, {"watchNamespaces": watched})
    cluster = grants(one(objects, "ClusterRole")["rules"])
    # Cluster-wide, only the cluster-scoped reads kopf needs: never Jobs, pods or Secrets.
    assert cluster == {g for g in permissions() if _is_cluster_scoped(g)}
    assert cluster and all(verb in ("list", "watch") for _, _, verb in cluster)
    roles = {r["metadata"]["namespace"]: r for r in by_kind(objects, "Role")}
    bindings = {b["metadata"]["namespace"]: b for b in by_kind(objects, "RoleBinding")}
    assert sorted(roles) == sorted(bindings) == sorted(watched)
    sa = one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    for ns in watched:
        assert grants(roles[ns]["rules"]) == {g for g in permissions() if not _is_cluster_scoped(g)}
        assert bindings[ns]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                           "name": roles[ns]["metadata"]["name"]}
        assert bindings[ns]["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]
    # Together: exactly PERMISSIONS, nothing more.
    assert cluster | grants(roles["team-a"]["rules"]) == permissions()


def test_namespaced_install_reads_secrets_only_in_its_namespaces(chart):
    """The trade docs/operator.md ("Scope") states: by default the ClusterRole may `get` Secrets
    in every namespace; with watchNamespaces only the Role of each listed namespace may, and
    the operator serves those namespaces only."""
    assert SECRET_GET in grants(one(render_objects(chart), "ClusterRole")["rules"])
    watched = ["rl-team-a", "rl-team-b"]
    objects = render_objects(chart, {"watchNamespaces": watched})
    cluster = grants(one(objects, "ClusterRole")["rules"])
    assert not {g for g in cluster if g[1] == "secrets"} and all(_is_cluster_scoped(g) for g in cluster)
    roles = {r["metadata"]["namespace"]: grants(r["rules"]) for r in by_kind(objects, "Role")}
    assert sorted(roles) == watched
    for granted in roles.values():
        assert {g for g in granted if g[1] == "secrets"} == {SECRET_GET}  # get: never list or watch
    env = operator_env(objects)
    assert env["MOEPROXY_NAMESPACES"] == "rl-team-a,rl-team-b"
    assert from_env({k: v for k, v in env.items() if v is not None}).namespaces == tuple(watched)


@pytest.mark.parametrize("values", [{}, {"watchNamespaces": ["team-a"]}], ids=["cluster-wide", "namespaced"])
def test_every_reproduction_runtime_can_be_created(chart, values):
    """The operator can create, follow and delete the workload of each runtime a ProxyModel
    may ask for (batch/v1 Job, Volcano Job, AscendJob)."""
    objects = render_objects(chart, {**values, **ALL_RUNTIMES})
    granted = set().union(*(grants(r["rules"]) for r in objects if r["kind"] in ("Role", "ClusterRole")))
    for runtime in RUNTIMES.values():
        for verb in ("create", "get", "list", "watch", "delete"):
            assert (runtime.resource.group, runtime.resource.plural, verb) in granted, (runtime.name, verb)
    assert from_env(operator_env(objects)).runtimes == tuple(RUNTIMES)  # and the operator serves them


@pytest.mark.parametrize("feature", RUNTIME_FEATURES)
def test_a_runtime_turned_off_gets_no_rbac_and_is_not_served(chart, feature):
    """Only what is used: a runtime's rules come with runtimes.<name>.enabled, and the operator
    (MOEPROXY_RUNTIMES) serves exactly the runtimes on, batch/v1 Jobs always."""
    runtime = next(r for r in RUNTIMES.values() if r.feature == feature)
    key = (runtime.resource.group, runtime.resource.plural)
    for enabled in (True, False):
        objects = render_objects(chart, {"runtimes": {feature: {"enabled": enabled}}})
        granted = {(g, r) for g, r, _ in grants(one(objects, "ClusterRole")["rules"])}
        served = from_env(operator_env(objects)).runtimes
        assert (key in granted) == enabled == (runtime.name in served), (feature, enabled)
        assert served[0] == "Job" and ("batch", "jobs") in granted


def test_secret_get_follows_the_features_that_need_it(chart):
    def secret_grants(values):
        objects = render_objects(chart, values)
        granted = set().union(*(grants(r["rules"]) for r in objects if r["kind"] in ("Role", "ClusterRole")))
        return {g for g in granted if g[1] == "secrets"}, granted

    # Preflight (the default) reads the Secret a ProxyModel names: `get`, never list or watch.
    assert secret_grants({})[0] == {SECRET_GET}
    # Neither preflight nor checkpoint watching: no access to Secrets at all.
    none, granted = secret_grants({"operator": {"preflight": False}})
    assert none == set()
    assert granted == permissions() - {SECRET_GET}
    # Checkpoint watching alone brings back `get` (issue 11), also per namespace.
    assert secret_grants({"operator": {"preflight": False}, "checkpointWatch": {"enabled": True}})[0] == {SECRET_GET}
    objects = render_objects(chart, {"operator": {"preflight": False}, "checkpointWatch": {"enabled": True},
                                     "watchNamespaces": ["team-a"]})
    assert SECRET_GET in grants(one(objects, "Role")["rules"])
    assert SECRET_GET not in grants(one(objects, "ClusterRole")["rules"])


def test_generated_rules_file_is_current():
    generator = _generator()
    assert (CHART / "files" / "rbac-rules.yaml").read_text() == generator.render(), \
        "charts/moe-proxy/files/rbac-rules.yaml is stale: run python charts/generate_rbac.py"
    assert generator.main(["--check"]) == 0


def test_generator_refuses_a_wildcard():
    bad = (rbac.Permission("", "pods", ("*",), "everything"),)
    with pytest.raises(SystemExit, match="wildcard"):
        _generator().rules(bad)


def _chart_copy(tmp_path, rules_text: str):
    copy = tmp_path / "moe-proxy"
    shutil.copytree(CHART, copy, symlinks=False)
    (copy / "files" / "rbac-rules.yaml").write_text(rules_text)
    return load_chart(copy)


def test_chart_refuses_an_unknown_feature(tmp_path):
    rules = yaml.safe_load((CHART / "files" / "rbac-rules.yaml").read_text())
    rules["rules"][0]["features"] = ["telemetry"]
    with _chart_copy(tmp_path, yaml.safe_dump(rules)) as chart:
        with pytest.raises(helm.HelmRenderError, match='unknown feature "telemetry"'):
            chart.render(name="r", namespace="n")


def test_chart_refuses_an_empty_rules_file(tmp_path):
    with _chart_copy(tmp_path, "rules: []\n") as chart:
        with pytest.raises(helm.HelmRenderError, match="generate_rbac.py"):
            chart.render(name="r", namespace="n")


def test_feature_rules_follow_their_values(tmp_path):
    """A rule marked for checkpoint watching only is granted only with checkpointWatch.enabled."""
    rules = yaml.safe_load((CHART / "files" / "rbac-rules.yaml").read_text())
    rules["rules"].append({"apiGroup": "moeproxy.io", "resource": "checkpointwatches",
                           "verbs": ["get", "list", "watch", "patch"], "clusterScoped": False,
                           "features": ["checkpointWatch"], "why": "test"})
    with _chart_copy(tmp_path, yaml.safe_dump(rules)) as chart:
        off = grants(one(render_objects(chart), "ClusterRole")["rules"])
        on = grants(one(render_objects(chart, {"checkpointWatch": {"enabled": True}}), "ClusterRole")["rules"])
    cw = {("moeproxy.io", "checkpointwatches", v) for v in ("get", "list", "watch", "patch")}
    assert off == permissions() and on == permissions(*DEFAULT_FEATURES, "checkpointWatch") | cw


@pytest.mark.parametrize("values", [{}, {"watchNamespaces": ["team-a"]}], ids=["cluster-wide", "namespaced"])
def test_kopf_can_serve_every_registered_handler(chart, values):
    """kopf's own calls bypass the operator's API client: each resource a handler is
    registered for must be listable and watchable, and the ones kopf keeps state on
    (progress annotations, finalizer) patchable."""
    require("kopf", "kopf")
    import proxymodel_operator.handlers  # noqa: F401 - registers the handlers
    from proxymodel_operator import checkpoint_watch, diagnosis

    from ..operator.harness import registry_copy

    def granted_by(values):
        objects = render_objects(chart, values)
        return set().union(*(grants(r["rules"]) for r in objects if r["kind"] in ("Role", "ClusterRole")))

    # the default registry's handlers, the workloads' of the runtimes the chart serves, the watch's timer
    registry = registry_copy(from_env(operator_env(render_objects(chart, values))).runtimes)
    checkpoint_watch.register(30.0, registry)  # as with checkpointWatch.enabled
    diagnosis.register(10.0, registry)  # always
    default, watching = granted_by(values), granted_by({**values, "checkpointWatch": {"enabled": True}})
    stateful = [*registry._changing.get_all_handlers(), *registry._spawning.get_all_handlers()]
    stateless = [*registry._watching.get_all_handlers(), *registry._indexing.get_all_handlers()]
    assert stateful and stateless
    for handler in stateful + stateless:
        selector = handler.selector
        plural = selector.plural or selector.any_name
        granted = watching if plural == "checkpointwatches" else default
        for verb in ("list", "watch") + (("patch",) if handler in stateful else ()):
            assert (selector.group or "", plural, verb) in granted, (selector, verb)
    assert ("", "events", "create") in default  # kopf posts handler failures as Events
