"""The chart rendered by Helm's engine with default and non-default values: helm lint is
clean, every object is valid for the pinned Kubernetes versions, and each value set shows
up where it should."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from .conftest import (CHART, CRDS, KUBE_VERSIONS, NAMESPACE, RELEASE, by_kind, grants, helm, one, operator_env,
                       render_objects)

DIGEST = "sha256:" + "ab" * 32

VALUE_SETS: dict[str, dict] = {
    "default": {},
    "namespaced": {"watchNamespaces": ["team-a", "team-b", "rl-infra"]},
    "custom-images": {
        "image": {"repository": "registry.example.com/ml/moe-proxy-operator", "tag": "1.2.3",
                  "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "jobs": {"transformerImage": "registry.example.com/ml/moe-proxy:1.2.3",
                 "reproductionImage": f"registry.example.com/ml/moe-proxy-ascend@{DIGEST}"},
    },
    "image-digest": {"image": {"digest": DIGEST}},
    # Reproductions as Volcano gangs on Ascend nodes of 16 NPUs, proxies in an on-prem S3.
    "ascend-volcano": {
        "jobs": {"accelerator": {"resource": "huawei.com/npu", "devicesPerNode": 16, "memoryGB": 64},
                 "s3": {"endpoint": "http://minio.storage.svc:9000", "region": "cn-southwest-2"}},
        "operator": {"logFormat": "plain", "livenessPort": 9090},
    },
    "gpu": {"jobs": {"accelerator": {"resource": "nvidia.com/gpu", "devicesPerNode": 8, "memoryGB": 80.5}}},
    "resources": {
        "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"cpu": 2, "memory": "1Gi"}},
        "nodeSelector": {"node-role.kubernetes.io/control-plane": ""},
        "tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists",
                         "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64", "arm64"]}]}]}}},
        "priorityClassName": "system-cluster-critical",
        "podAnnotations": {"prometheus.io/scrape": "false"},
        "podLabels": {"team": "ml-platform"},
        "podSecurityContext": {"runAsUser": 1001, "runAsGroup": 1001, "fsGroup": 1001},
    },
    "existing-serviceaccount": {"serviceAccount": {"create": False, "name": "platform-operator"},
                                "rbac": {"create": False}, "crds": {"install": False}},
    "checkpoint-watch": {"checkpointWatch": {"enabled": True}, "operator": {"preflight": False},
                         "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/moe"}}},
    "extra-env": {"operator": {"extraEnv": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"},
                                            {"name": "NO_PROXY", "value": "10.0.0.0/8,.svc"}]}},
}
# The example values files platform teams start from (chart-testing's ci/ convention).
for _path in sorted((CHART / "ci").glob("*-values.yaml")):
    VALUE_SETS[f"ci/{_path.name}"] = yaml.safe_load(_path.read_text())


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request, chart):
    return request.param, VALUE_SETS[request.param], render_objects(chart, VALUE_SETS[request.param])


def test_every_object_is_valid_kubernetes(rendered):
    name, _, objects = rendered
    assert objects
    for version in KUBE_VERSIONS:
        for obj in objects:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"[{name}] {obj['kind']} {obj['metadata']['name']} invalid for {version}: {exc.message}")


def test_namespaced_objects_are_in_the_release_namespace(rendered):
    _, values, objects = rendered
    watched = set(values.get("watchNamespaces", []))
    for obj in objects:
        if obj["kind"] in ("ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"):
            assert "namespace" not in obj["metadata"]
        elif obj["kind"] in ("Role", "RoleBinding"):
            assert obj["metadata"]["namespace"] in watched
        else:
            assert obj["metadata"]["namespace"] == NAMESPACE, obj["kind"]


def test_no_duplicate_objects(rendered):
    _, _, objects = rendered
    keys = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_is_clean(name):
    report = helm.lint(str(CHART), VALUE_SETS[name], strict=True, namespace=NAMESPACE, kube_version="v1.31.0")
    assert report["errors"] == [] and report["messages"] == [], report


def test_example_values_files_are_tested():
    assert {"ci/namespaced-values.yaml", "ci/ascend-volcano-values.yaml", "ci/gpu-values.yaml",
            "ci/checkpoint-watch-values.yaml"} <= set(VALUE_SETS)


def test_default_render(chart):
    objects = render_objects(chart)
    kinds = [o["kind"] for o in objects if o["kind"] != "CustomResourceDefinition"]
    assert sorted(kinds) == ["ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount"]
    crds = {c["spec"]["names"]["kind"] for c in by_kind(objects, "CustomResourceDefinition")}
    in_repo = {yaml.safe_load(p.read_text())["spec"]["names"]["kind"] for p in CRDS.glob("*.yaml")}
    assert "ProxyModel" in crds
    assert crds == in_repo - {"CheckpointWatch"}  # checkpointWatch.enabled is false by default
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == one(objects, "ServiceAccount")["metadata"]["name"] == RELEASE
    assert pod["containers"][0]["image"] == "ghcr.io/moe-proxy/operator:0.1.0"
    # No metrics: the operator exposes none, so neither a Service nor a ServiceMonitor.
    assert not by_kind(objects, "Service") and not by_kind(objects, "ServiceMonitor")


def test_custom_images(chart):
    objects = render_objects(chart, VALUE_SETS["custom-images"])
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "registry.example.com/ml/moe-proxy-operator:1.2.3"
    assert pod["containers"][0]["imagePullPolicy"] == "Always"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    env = operator_env(objects)
    assert env["MOEPROXY_TRANSFORMER_IMAGE"] == "registry.example.com/ml/moe-proxy:1.2.3"
    assert env["MOEPROXY_REPRO_IMAGE"] == f"registry.example.com/ml/moe-proxy-ascend@{DIGEST}"


def test_image_digest_wins_over_tag(chart):
    objects = render_objects(chart, {"image": {"tag": "9.9.9", "digest": DIGEST}})
    image = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"ghcr.io/moe-proxy/operator@{DIGEST}"


def test_resources_and_scheduling(chart):
    values = VALUE_SETS["resources"]
    objects = render_objects(chart, values)
    template = one(objects, "Deployment")["spec"]["template"]
    pod = template["spec"]
    assert pod["containers"][0]["resources"] == values["resources"]
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        assert pod[key] == values[key]
    assert template["metadata"]["annotations"] == values["podAnnotations"]
    assert template["metadata"]["labels"]["team"] == "ml-platform"
    assert pod["securityContext"]["runAsUser"] == 1001 and pod["securityContext"]["runAsGroup"] == 1001


def test_pod_labels_cannot_break_the_selector(chart):
    objects = render_objects(chart, {"podLabels": {"team": "x"}})
    deployment = one(objects, "Deployment")
    selector = deployment["spec"]["selector"]["matchLabels"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()


def test_existing_serviceaccount_without_rbac_or_crds(chart):
    objects = render_objects(chart, VALUE_SETS["existing-serviceaccount"])
    assert sorted(o["kind"] for o in objects) == ["Deployment"]
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "platform-operator"


def test_existing_serviceaccount_needs_a_name(chart):
    with pytest.raises(helm.HelmRenderError, match="serviceAccount.name is required"):
        render_objects(chart, {"serviceAccount": {"create": False}})


def test_serviceaccount_annotations_for_workload_identity(chart):
    objects = render_objects(chart, VALUE_SETS["checkpoint-watch"])
    sa = one(objects, "ServiceAccount")
    assert sa["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/moe"}


def test_extra_env_is_appended(chart):
    env = operator_env(render_objects(chart, VALUE_SETS["extra-env"]))
    assert env["HTTPS_PROXY"] == "http://proxy:3128" and env["NO_PROXY"] == "10.0.0.0/8,.svc"


def test_release_name_shapes_object_names(chart):
    objects = render_objects(chart, name="platform", namespace="ops")
    names = {o["kind"]: o["metadata"]["name"] for o in objects if o["kind"] != "CustomResourceDefinition"}
    assert set(names.values()) == {"platform-moe-proxy"}
    binding = one(objects, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "platform-moe-proxy", "namespace": "ops"}]


def test_volcano_reproductions_on_ascend(chart):
    """The platform of the ascend-volcano value set: the operator defaults reproductions to
    16-NPU nodes and an on-prem S3, and may run them as Volcano gangs (or AscendJobs) and read
    their pods' failure reasons."""
    objects = render_objects(chart, VALUE_SETS["ascend-volcano"])
    env = operator_env(objects)
    assert (env["MOEPROXY_ACCELERATOR"], env["MOEPROXY_DEVICES_PER_NODE"]) == ("huawei.com/npu", "16")
    assert env["MOEPROXY_S3_ENDPOINT"] == "http://minio.storage.svc:9000"
    granted = grants(one(objects, "ClusterRole")["rules"])
    for group, resource in (("batch.volcano.sh", "jobs"), ("mindxdl.gitee.com", "ascendjobs")):
        assert {(group, resource, v) for v in ("create", "get", "list", "watch", "delete")} <= granted
    assert {("", "pods", v) for v in ("get", "list", "watch")} <= granted
    assert not any(r == "pods" and v in ("create", "delete", "patch") for _, r, v in granted)


def test_notes_warn_when_the_default_reproduction_image_cannot_use_the_accelerator(chart):
    def notes(values):
        return chart.render(values, name=RELEASE, namespace=NAMESPACE)["moe-proxy/templates/NOTES.txt"]

    assert "WARNING" not in notes({})
    gpu = notes(VALUE_SETS["gpu"])
    assert "WARNING" in gpu and "nvidia.com/gpu" in gpu and "jobs.reproductionImage" in gpu
    assert "WARNING" not in notes({**VALUE_SETS["gpu"], "jobs": {**VALUE_SETS["gpu"]["jobs"],
                                                                 "reproductionImage": "registry.local/rl:cuda"}})
    assert "use AWS S3" in notes({}) and "use AWS S3" not in notes(VALUE_SETS["ascend-volcano"])
    assert "the namespaces team-a, team-b, rl-infra" in notes(VALUE_SETS["namespaced"])
