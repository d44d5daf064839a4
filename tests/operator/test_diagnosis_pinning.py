"""A Diagnosis pins its baseline when its runs start: the ProxyModel's uid, reproduction settings
(structured ones as digests), the rest of its spec (digests) and its proxy (URI, manifest sha256)
are in status.proxyModel. A
ProxyModel edited or rebuilt mid-way starts no more runs (the runs of two baselines are never
mixed): a Warning Event and the BaselineChanged condition say what changed, the runs already
running are followed to their end, then the Diagnosis fails. Through kopf and the API emulator
(an edit of the ProxyModel's spec, which restarts its own pipeline), and by the decisions alone
for a proxy rebuilt at the same URI and the cases that must not stop a Diagnosis."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

from proxymodel_operator.diagnosis_matrix import decide
from proxymodel_operator.resources import DIAGNOSES, JOBS, PROXYMODELS
from proxymodel_operator.settings import Settings

from .diagnoses import diagnosis_status, with_diagnoses
from .harness import ACCESS_KEY, SECRET_KEY, eventually, proxymodel, tiny_report

NS = "team-pin"
TICK = 0.3
REPRODUCTION = {"runtime": "Job", "maxSteps": 4, "lr": 0.1, "precision": "fp32", "failOn": {"signature": "divergence"},
                "accelerator": {"devices": 1, "devicesPerNode": 1}}


@pytest.fixture()
def registry():
    return with_diagnoses(TICK)


def _status(cluster, name: str) -> dict:
    return diagnosis_status(cluster, NS, name)


def _condition(status: dict, kind: str) -> dict:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


async def _finish(cluster, job: dict, reproduced: bool, step: int | None = None) -> None:
    """The run's pod ended with this verdict (what the kubelet would write)."""
    report = {"reproduced": reproduced, "signature": "divergence" if reproduced else None, "step": step,
              "steps_completed": (step + 1) if reproduced else 4, "metrics": {}}
    await cluster.finish_pod(NS, job, "reproduction", 0, json.dumps(report))
    await cluster.job_condition(NS, job["metadata"]["name"], "Complete")


async def test_a_proxymodel_edited_mid_way_starts_no_more_runs_and_says_what_changed(cluster, operator):
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    await cluster.create(PROXYMODELS, NS, proxymodel("pm", reproduction=REPRODUCTION))
    transformer = await eventually(lambda: cluster.get(JOBS, NS, "pm-transform-g1"), 30, "transformer Job")
    await cluster.finish_pod(NS, transformer, "transformer", 0, tiny_report("/nowhere/proxy"))
    await cluster.job_condition(NS, "pm-transform-g1", "Complete")
    await eventually(lambda: cluster.status(NS, "pm").get("phase") == "Reproducing", 30, "the proxy built")
    await cluster.create(DIAGNOSES, NS, {"metadata": {"name": "dx"}, "spec": {
        "proxyModel": "pm", "seeds": 1, "parallelism": 1, "candidates": ["lower-lr", "z-loss"]}})
    baseline = await eventually(lambda: cluster.get(JOBS, NS, "dx-baseline-s0"), 20, "the baseline run")

    # pinned: what the runs are made from
    pm = cluster.get(PROXYMODELS, NS, "pm")
    pinned = _status(cluster, "dx")["proxyModel"]
    assert (pinned["name"], pinned["uid"], pinned["uri"], pinned["manifestSha256"]) == (
        "pm", pm["metadata"]["uid"], "/nowhere/proxy", "ab" * 32)
    settings = pm["spec"]["reproduction"]
    assert pinned["reproduction"] == {**settings, "failOn": pinned["reproduction"]["failOn"],
                                      "accelerator": pinned["reproduction"]["accelerator"]}
    assert pinned["reproduction"]["lr"] == 0.1 and pinned["reproduction"]["failOn"].startswith("sha256:")
    assert sorted(pinned["specDigests"]) == ["pruning", "source"]

    # the team edits the ProxyModel while the baseline runs: its pipeline starts over (a new proxy)
    await cluster.patch_spec(PROXYMODELS, NS, "pm", {"reproduction": {"lr": 0.2}})
    said = await eventually(lambda: _condition(_status(cluster, "dx"), "Running").get("reason") == "BaselineChanged"
                            and _status(cluster, "dx"), 20, "the change said")
    assert "spec.reproduction.lr: 0.1 -> 0.2" in said["baselineChanged"] and said["phase"] == "Running"
    assert "waiting for the 1 running to finish" in said["message"]

    await _finish(cluster, baseline, True, 1)
    await eventually(lambda: _status(cluster, "dx").get("phase") == "Failed", 20, "the diagnosis stopped")
    await asyncio.sleep(5 * TICK)  # later ticks start nothing, and kopf's Event queue drains
    status = _status(cluster, "dx")
    failed = _condition(status, "Failed")
    assert (failed["status"], failed["reason"]) == ("True", "BaselineChanged")
    assert "ProxyModel pm changed after the runs started" in failed["message"]
    assert "create another Diagnosis" in status["message"]
    assert status["baseline"]["verdict"] == "reproduced"  # the run of the pinned baseline is judged
    assert [r["phase"] for c in status["candidates"] for r in c["runs"]] == ["Pending", "Pending"]
    assert sorted(n for n in cluster.names(JOBS, NS) if n.startswith("dx-")) == ["dx-baseline-s0"]
    assert cluster.event_reasons(NS, "dx").count("BaselineChanged") == 1


# --- by the decisions alone ------------------------------------------------------------------------


def _proxymodel(**status) -> dict:
    body = proxymodel("pm", reproduction=REPRODUCTION)
    body["metadata"].update(namespace=NS, uid="uid-1", generation=1)
    body["status"] = {"phase": "Reproducing", "proxy": {"uri": "s3://ckpt/proxies/pm/", "manifestSha256": "ab" * 32,
                                                        "expertsPerLayer": {"after": 4, "topK": 2}}, **status}
    return body


def _started(pm: dict) -> dict:
    """A Diagnosis of `pm` as its first tick left it (the baseline's run recorded and created)."""
    body = {"metadata": {"name": "dx", "namespace": NS, "generation": 1},
            "spec": {"proxyModel": "pm", "seeds": 1, "candidates": ["lower-lr"]}, "status": {}}
    first = decide(body, pm, {}, Settings())
    assert [m["metadata"]["name"] for _, m in first.create] == ["dx-baseline-s0"]
    body["status"] = json.loads(json.dumps(first.status))
    return body


def test_a_proxy_rebuilt_at_the_same_uri_starts_no_run_even_one_recorded_but_never_created():
    pm = _proxymodel()
    body = _started(pm)
    rebuilt = copy.deepcopy(pm)
    rebuilt["status"]["proxy"]["manifestSha256"] = "cd" * 32
    # the operator stopped before creating the baseline's workload: it is not created from the new proxy
    decision = decide(body, rebuilt, {}, Settings())
    assert decision.create == []
    s = decision.status
    assert s["baselineChanged"] == f"proxy rebuilt: manifest sha256 {'ab' * 6} -> {'cd' * 6}"
    assert (s["phase"], _condition(s, "Failed")["reason"]) == ("Failed", "BaselineChanged")
    assert s["baseline"]["runs"][0]["phase"] == "Pending"
    assert [(kind, reason) for kind, reason, _ in decision.events] == [("Warning", "BaselineChanged")]


@pytest.mark.parametrize("change", [
    lambda pm: pm["status"].update(phase="Reproduced"),  # its own reproduction ended: the proxy is the same
    lambda pm: pm["spec"].update(suspend=True, ttlSecondsAfterFinished=60),  # run control only
    lambda pm: pm["metadata"].update(generation=2, labels={"team": "rl"}),
])
def test_only_what_changes_the_baseline_stops_the_diagnosis(change):
    pm = _proxymodel()
    body = _started(pm)
    change(pm)
    decision = decide(body, pm, {}, Settings())  # the recorded run is missing: created again
    assert [m["metadata"]["name"] for _, m in decision.create] == ["dx-baseline-s0"]
    assert "baselineChanged" not in decision.status and not decision.events
    pm["spec"]["pruning"]["experts"] = 8  # and on top of it, a change that does
    decision = decide(body, pm, {}, Settings())
    assert decision.create == [] and decision.status["baselineChanged"] == "spec.pruning changed"


def test_structured_settings_are_pinned_as_digests_and_their_values_never_copied():
    pm = _proxymodel()
    pm["spec"]["reproduction"]["env"] = [{"name": "HF_TOKEN", "value": "hf_not_for_status"}]
    body = _started(pm)
    assert "hf_not_for_status" not in json.dumps(body["status"])
    pm["spec"]["reproduction"]["env"][0]["value"] = "hf_rotated"
    decision = decide(body, pm, {}, Settings())
    assert decision.create == [] and decision.status["baselineChanged"] == "spec.reproduction.env changed"
    assert "hf_" not in json.dumps(decision.status) + json.dumps(decision.events)


def test_a_baseline_pinned_by_an_older_operator_is_compared_on_what_it_recorded():
    pm = _proxymodel()
    body = _started(pm)
    body["status"]["proxyModel"] = {k: v for k, v in body["status"]["proxyModel"].items()
                                    if k in ("name", "uri", "runtime", "devices", "failOn")}
    assert [m["metadata"]["name"] for _, m in decide(body, pm, {}, Settings()).create] == ["dx-baseline-s0"]
    pm["status"]["proxy"]["uri"] = "s3://ckpt/proxies/pm-2/"
    decision = decide(body, pm, {}, Settings())
    assert decision.create == [] and decision.status["baselineChanged"] == (
        "proxy URI s3://ckpt/proxies/pm/ -> s3://ckpt/proxies/pm-2/")
