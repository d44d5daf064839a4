"""A proxy's content key (proxy_key): the same for what builds the same proxy, different as soon as
the checkpoint is rewritten or a build option changes; and what a probe does with a
CheckpointWatch's ProxyModel of its key (diagnosis_bisect: reused, or built anew), without a cluster."""

from __future__ import annotations

import json

import pytest

from moe_proxy.checkpoint.listing import Candidate
from proxymodel_operator.diagnosis_bisect import progress, reusable, start
from proxymodel_operator.diagnosis_spec import parse_bisection
from proxymodel_operator.proxy_key import ANNOTATION_CONTENT, LABEL_CONTENT_KEY, content, content_key
from proxymodel_operator.resources import PROXYMODELS
from proxymodel_operator.settings import Settings
from proxymodel_operator.watch_decisions import proxymodel_for
from proxymodel_operator.watch_spec import parse_watch

URI = "s3://runs/grpo/global_step_300"
FILES = {"config.json": 900, "model.safetensors.index.json": 4000, "model-00001-of-00001.safetensors": 10 << 20}
ETAGS = {n: f'"{i}abc"' for i, n in enumerate(FILES)}
BUILD = {"pruning": {"experts": 8}}


def key(spec: dict | None = None, fingerprint: str | None = "f1", **source) -> str:
    spec = {**(spec or BUILD), "source": {"uri": URI, **source}}
    return content_key(content(spec, fingerprint, Settings()))


def test_the_checkpoints_fingerprint_changes_when_a_file_is_rewritten_even_at_the_same_size():
    listed = Candidate("global_step_300", 300, FILES, ETAGS)
    assert listed.fingerprint == Candidate("global_step_300", 300, dict(FILES), dict(ETAGS)).fingerprint
    rewritten = Candidate("global_step_300", 300, FILES, {**ETAGS, "model-00001-of-00001.safetensors": '"new"'})
    grown = Candidate("global_step_300", 300, {**FILES, "extra.bin": 1}, ETAGS)
    assert len({listed.fingerprint, rewritten.fingerprint, grown.fingerprint}) == 3


def test_the_key_is_stable_for_the_same_checkpoint_and_build():
    assert key() == key()
    # what does not change the proxy: where it is written, its pods, its own reproduction, the queue
    assert key() == key({**BUILD, "destination": {"uri": "s3://elsewhere/p/"}, "queueName": "q",
                         "transformer": {"resources": {"limits": {"cpu": "8"}}, "nodeSelector": {"a": "b"}},
                         "reproduction": {"enabled": False, "maxSteps": 3}})
    # a default spelled out is the same build
    assert key() == key({"pruning": {"experts": 8, "method": "cluster", "seed": 0}})
    # fillDead (a probe's) builds the same proxy, or one where the build without it refuses
    assert key() == key({"pruning": {"experts": 8, "fillDead": True}})


@pytest.mark.parametrize("change", [
    {"fingerprint": "f2"},  # the checkpoint rewritten at the same path
    {"fingerprint": None},  # its identity unknown
    {"endpoint": "http://other-s3:9000"},  # another store's bucket of the same name
    {"spec": {"pruning": {"experts": 4}}},
    {"spec": {"pruning": {"experts": 8, "seed": 1}}},
    {"spec": {"pruning": {"experts": 8, "method": "random"}}},
    {"spec": {"pruning": {"keepRatio": 0.5}}},
    {"spec": {"pruning": {"experts": 8, "method": "saliency"}, "calibration": {"dataset": "s3://data/a.jsonl"}}},
    {"spec": {**BUILD, "transformer": {"image": "moe-proxy:other"}}},
])
def test_the_key_changes_with_the_checkpoint_or_a_build_option(change):
    assert key(**change) != key()


def test_calibration_data_and_a_keep_ratios_device_budget_are_in_the_key():
    calibrated = {"pruning": {"experts": 8, "method": "saliency"}, "calibration": {"dataset": "s3://data/a.jsonl"}}
    assert key(calibrated) != key({**calibrated, "calibration": {"dataset": "s3://data/b.jsonl"}})
    ratio = {"pruning": {"keepRatio": 0.5}, "reproduction": {"accelerator": {"devices": 1, "devicesPerNode": 1}}}
    assert key(ratio) != key({**ratio, "reproduction": {"accelerator": {"devices": 2, "devicesPerNode": 2}}})


# --- a probe and the watch's ProxyModel of its checkpoint -------------------------------------------------

SOURCE = {"uri": "s3://runs/grpo", "credentialsSecret": "creds", "region": "us-east-1"}
TEMPLATE = {"spec": {"pruning": {"experts": 4}, "reproduction": {
    "maxSteps": 1, "failOn": {"signature": "overflow"}, "accelerator": {"devices": 1, "devicesPerNode": 1}}}}
STEPS = (100, 200)


def _watch_proxymodel(template: dict, step: int, fingerprint: str, phase: str = "ProxyReady") -> dict:
    """What the CheckpointWatch `grpo` made of a checkpoint, as the probe reads it back."""
    watch = {"apiVersion": "moeproxy.io/v1alpha1", "kind": "CheckpointWatch",
             "metadata": {"name": "grpo", "namespace": "rl", "uid": "w-1"}}
    pm = proxymodel_for(watch, parse_watch({"source": SOURCE, "template": template}), step,
                        f"{SOURCE['uri']}/global_step_{step}", fingerprint, Settings())
    built = {"proxy": {"uri": f"s3://proxies/{pm['metadata']['name']}/", "expertsPerLayer": {"after": 4}}}
    return {**pm, "status": {"phase": phase, **(built if phase == "ProxyReady" else {})}}


def _first_round(found: list[dict]):
    """A bisection of the run's two checkpoints (probed last first: step 200), its first round."""
    listed = [{"step": s, "uri": f"{SOURCE['uri']}/global_step_{s}", "fingerprint": f"f{s}"} for s in STEPS]
    raw = {"source": SOURCE, "template": TEMPLATE}
    body = {"apiVersion": "moeproxy.io/v1alpha1", "kind": "Diagnosis",
            "metadata": {"name": "grpo-incident-250", "namespace": "rl", "generation": 1, "uid": "d-1"},
            "spec": {"checkpoints": {"watch": "grpo"}}}
    body["status"] = start({}, parse_bisection(body["spec"]), raw, listed, 1).status
    return progress(json.loads(json.dumps(body)), None, {}, Settings(), children={}, found=reusable(found))


def test_a_probe_reuses_the_watchs_proxymodel_of_its_key_and_creates_none():
    theirs = _watch_proxymodel(TEMPLATE, 200, "f200")
    assert theirs["metadata"]["labels"][LABEL_CONTENT_KEY] and json.loads(
        theirs["metadata"]["annotations"][ANNOTATION_CONTENT])["checkpoint"]["files"] == "f200"
    decision = _first_round([theirs, _watch_proxymodel(TEMPLATE, 100, "f100")])
    probe = decision.status["probes"][0]
    assert (probe["step"], probe["proxyModel"], probe["reused"]) == (200, "grpo-step-200", "grpo-step-200")
    assert decision.create == []
    assert [(r, "reuses ProxyModel grpo-step-200 of CheckpointWatch grpo" in m) for _, r, m in decision.events] == [
        ("ProbeReused", True)]


@pytest.mark.parametrize("theirs", [
    _watch_proxymodel({"spec": {**TEMPLATE["spec"], "pruning": {"experts": 4, "seed": 7}}}, 200, "f200"),  # build
    _watch_proxymodel(TEMPLATE, 200, "f200-before-the-rewrite"),  # the checkpoint since rewritten
    _watch_proxymodel(TEMPLATE, 200, "f200", phase="Failed"),  # failed before its proxy was built
], ids=["another-build-option", "checkpoint-rewritten", "failed"])
def test_a_probe_builds_its_own_where_the_watchs_differs_or_failed(theirs):
    decision = _first_round([theirs])
    probe = decision.status["probes"][0]
    assert (probe["proxyModel"], probe.get("reused")) == ("grpo-incident-250-step-200", None)
    assert [(r.plural, m["metadata"]["name"]) for r, m in decision.create] == [
        (PROXYMODELS.plural, "grpo-incident-250-step-200")]
    assert decision.create[0][1]["metadata"]["labels"][LABEL_CONTENT_KEY] != theirs["metadata"]["labels"][
        LABEL_CONTENT_KEY] or theirs["status"]["phase"] == "Failed"
    # the probe's own build keeps dead experts where a collapsed router leaves too few alive (the CLI's probes too)
    assert decision.create[0][1]["spec"]["pruning"] == {**TEMPLATE["spec"]["pruning"], "fillDead": True}


def test_a_reused_proxymodel_that_fails_before_its_proxy_is_built_gives_way_to_the_probes_own():
    building = _watch_proxymodel(TEMPLATE, 200, "f200", phase="Transforming")
    first = _first_round([building])
    assert first.status["probes"][0]["reused"] == "grpo-step-200" and first.create == []
    body = {"apiVersion": "moeproxy.io/v1alpha1", "kind": "Diagnosis",
            "metadata": {"name": "grpo-incident-250", "namespace": "rl", "generation": 1, "uid": "d-1"},
            "spec": {"checkpoints": {"watch": "grpo"}}}
    listed = [{"step": s, "uri": f"{SOURCE['uri']}/global_step_{s}", "fingerprint": f"f{s}"} for s in STEPS]
    body["status"] = {**start({}, parse_bisection(body["spec"]), {"source": SOURCE, "template": TEMPLATE}, listed,
                              1).status, **first.status}
    failed = {**building, "status": {"phase": "Failed", "message": "OOMKilled"}}
    second = progress(json.loads(json.dumps(body)), None, {}, Settings(), children={"grpo-step-200": failed})
    probe = second.status["probes"][0]
    assert (probe["proxyModel"], probe["reused"], probe["phase"]) == ("grpo-incident-250-step-200", None, "Building")
    assert [m["metadata"]["name"] for _, m in second.create] == ["grpo-incident-250-step-200"]
    assert [r for _, r, _ in second.events] == ["ReusedProxyModelLost"]


def test_a_spec_the_proxymodel_will_refuse_gets_no_key():
    watch = {"apiVersion": "moeproxy.io/v1alpha1", "kind": "CheckpointWatch",
             "metadata": {"name": "grpo", "namespace": "rl", "uid": "w-1"}}
    w = parse_watch({"source": SOURCE, "template": TEMPLATE})
    pm = proxymodel_for(watch, w, 300, "not-s3://anywhere", "f300", Settings())  # a source no ProxyModel takes
    assert LABEL_CONTENT_KEY not in pm["metadata"]["labels"] and reusable([pm]) == {}
