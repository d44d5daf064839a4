"""The CheckpointWatch CRD: the examples are valid, bad watches are rejected by the schema
alone, and a template together with a checkpoint makes a valid ProxyModel."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from .crd_schema import ROOT, errors, load_crd, openapi

EXAMPLES = sorted((ROOT / "examples").glob("checkpointwatch-*.yaml"))


@pytest.fixture(scope="module")
def crd() -> dict:
    return load_crd("checkpointwatches.moeproxy.io")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_crd_basics(crd):
    spec = crd["spec"]
    assert (spec["group"], spec["scope"], spec["names"]["kind"], spec["names"]["shortNames"]) == \
        ("moeproxy.io", "Namespaced", "CheckpointWatch", ["ckw"])
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Last Step"] == ".status.lastSeenStep" and columns["Proxies"] == ".status.proxies"
    assert columns["Age"] == ".metadata.creationTimestamp"
    # kopf's own records survive the structural schema's pruning.
    assert openapi(crd)["properties"]["status"]["properties"]["kopf"]["x-kubernetes-preserve-unknown-fields"]


def test_the_crd_is_a_valid_kubernetes_object(crd):
    import kubernetes_validate

    kubernetes_validate.validate(crd, "1.31.0", strict=True)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_are_valid(crd, path):
    assert errors(crd, load(path)) == []


def test_there_is_a_verl_example():
    assert any(load(p)["spec"].get("pattern") == "global_step_*/actor/huggingface" for p in EXAMPLES)


def _bad(change) -> dict:
    obj = load(ROOT / "examples" / "checkpointwatch-verl.yaml")
    change(obj["spec"])
    return obj


BAD = {
    "no source": (lambda s: s.pop("source"), "'source' is a required property"),
    "poll every 5s": (lambda s: s.update(pollInterval=5), "5 is less than the minimum of 30"),
    "negative keepLast": (lambda s: s.update(keepLast=-1), "-1 is less than the minimum of 1"),
    "keepLast 0": (lambda s: s.update(keepLast=0), "0 is less than the minimum of 1"),
    "maxConcurrent 0": (lambda s: s.update(maxConcurrent=0), "less than the minimum of 1"),
    "negative startAfterStep": (lambda s: s.update(startAfterStep=-5), "less than the minimum of 0"),
    "every 0": (lambda s: s.update(every=0), "less than the minimum of 1"),
    "not s3": (lambda s: s["source"].update(uri="/mnt/ckpt"), "does not match"),
    "endpoint without scheme": (lambda s: s["source"].update(endpoint="minio:9000"), "does not match"),
    "no template": (lambda s: s.pop("template"), "'template' is a required property"),
    "template without pruning": (lambda s: s["template"]["spec"].pop("pruning"), "'pruning' is a required property"),
    "source in the template": (lambda s: s["template"]["spec"].update(source={"uri": "s3://a/b"}),
                               "the ProxyModels' source is this watch's spec.source"),
    "typo": (lambda s: s.update(keeplast=3), "Additional properties are not allowed ('keeplast'"),
    "string pollInterval": (lambda s: s.update(pollInterval="60"), "is not of type 'integer'"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_watches_are_rejected(crd, name):
    change, message = BAD[name]
    found = errors(crd, _bad(change))
    assert any(message in e for e in found), found


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_template_makes_a_valid_proxymodel(path):
    """The ProxyModel a watch makes of its template and a checkpoint passes the ProxyModel CRD."""
    from proxymodel_operator.watch_decisions import proxymodel_for
    from proxymodel_operator.watch_spec import parse_watch

    watch = load(path)
    watch["metadata"].setdefault("uid", "0000-1111")
    pxm = proxymodel_for(watch, parse_watch(watch["spec"]), step=300,
                         uri=f"{watch['spec']['source']['uri']}/global_step_300/actor/huggingface")
    assert errors(load_crd("proxymodels.moeproxy.io"), pxm) == []
    assert pxm["spec"]["source"]["uri"].endswith("/global_step_300/actor/huggingface")


def test_a_schema_error_is_caught_by_the_checker(crd):
    """The checker itself can fail: a copy of the CRD with the pollInterval minimum removed
    accepts what the real one rejects."""
    loose = copy.deepcopy(crd)
    del openapi(loose)["properties"]["spec"]["properties"]["pollInterval"]["minimum"]
    obj = _bad(lambda s: s.update(pollInterval=5))
    assert errors(loose, obj) == [] and errors(crd, obj) != []


def test_kubectl_get_pxm_shows_the_source_step():
    """`kubectl get pxm` prints the step label a watch puts on its ProxyModels."""
    from proxymodel_operator.watch_decisions import LABEL_STEP

    columns = {c["name"]: c for c in openapi_columns(load_crd("proxymodels.moeproxy.io"))}
    assert columns["Step"]["jsonPath"] == ".metadata.labels." + LABEL_STEP.replace(".", "\\.")
    assert columns["Step"].get("priority", 0) == 0


def openapi_columns(crd: dict) -> list[dict]:
    (version,) = crd["spec"]["versions"]
    return version["additionalPrinterColumns"]
