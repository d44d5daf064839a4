"""The Ready condition (`status.ready`): what `kubectl wait --for=condition=Ready` and Argo CD's
health check (docs/operator.md) read. True once everything the spec asks for is
done: the proxy is built and, when a reproduction is asked for, it finished with a verdict.
False with a reason otherwise. It is derived from the rest of status by the code path that
writes phase (`pipeline.decide`, and the validate step), never set on its own.

First the decisions, without an API server (as test_decide.py); then the operator for real
against the emulated API (as test_lifecycle.py)."""

from __future__ import annotations

import json
import re

import pytest

from proxymodel_operator.children import REPRODUCTION
from proxymodel_operator.outcome import FAILED, RUNNING, Outcome
from proxymodel_operator.pipeline import (ADMITTED, SPEC_CHANGED, VALIDATED, WORKERS_PROGRESS, Child, CreateChild,
                                          Observed, PatchStatus, StartPipeline, decide, ready_added,
                                          refusal)
from proxymodel_operator.resources import JOBS, PROXYMODELS
from proxymodel_operator.status import READY, READY_REASONS, ready, with_ready

from ..checkpoints.crd_schema import load_crd
from .harness import ACCESS_KEY, SECRET_KEY, eventually, proxymodel
from .test_decide import REPRODUCED_REPORT, SETTINGS, accepted, child, only, pxm, succeeded, transforming, walk


def _ready(body: dict) -> dict:
    return next((c for c in body["status"].get("conditions") or [] if c["type"] == READY), {})


def _said(body: dict) -> tuple[str, str]:
    c = _ready(body)
    return c.get("status"), c.get("reason")


def column(obj: dict, name: str) -> object:
    """The value `kubectl get pxm -o wide` prints in the CRD's printer column `name`: its
    jsonPath evaluated as the API server does for the two shapes the CRD uses (a field path, and
    `.status.conditions[?(@.KEY=="VALUE")].FIELD`: the first match)."""
    (version,) = load_crd("proxymodels.moeproxy.io")["spec"]["versions"]
    path = next(c["jsonPath"] for c in version["additionalPrinterColumns"] if c["name"] == name)
    match = re.fullmatch(r'\.status\.conditions\[\?\(@\.(\w+)=="([^"]*)"\)\]\.(\w+)', path)
    assert match, f"column {name}: {path} is not a shape this helper reads"
    key, value, field = match.groups()
    found = [c.get(field) for c in (obj.get("status") or {}).get("conditions") or [] if c.get(key) == value]
    return found[0] if found else None


# --- the decisions ------------------------------------------------------------------------------------


def test_ready_goes_false_then_true_across_a_build_and_a_reproduction():
    body = accepted(pxm())
    assert _ready(body) == {}  # as the validate step's test double leaves it (the step itself sets Ready)
    building = walk(body, decide(body, Observed(VALIDATED), SETTINGS))
    assert _said(building) == ("False", "Building") and "q3-transform-g1" in _ready(building)["message"]
    reproducing = walk(building, decide(building, child("q3-transform-g1", succeeded()), SETTINGS))
    assert _said(reproducing) == ("False", "Reproducing") and "q3-repro-g1" in _ready(reproducing)["message"]
    done = walk(reproducing, decide(reproducing, child("q3-repro-g1", succeeded(REPRODUCED_REPORT), REPRODUCTION),
                                     SETTINGS))
    assert _said(done) == ("True", "Reproduced")
    assert _ready(done)["message"] == "the reproduction finished: GradientOverflow: overflow at step 12"
    assert _ready(done)["observedGeneration"] == done["status"]["observedGeneration"] == 1
    for state in (building, reproducing, done):  # last: the first False condition is the step's own
        assert state["status"]["conditions"][-1]["type"] == READY
    assert column(done, "Ready") == "True" and column(building, "Ready") == "False"
    assert column(building, "Reason") == "TransformerRunning"  # the first False condition: the step's
    assert column(reproducing, "Reason") == "Reproducing"  # FailureReproduced is Unknown while it runs


@pytest.mark.parametrize("report, reason", [
    ({"reproduced": False, "signature": None, "step": None}, "NotObserved"),
    ({}, "NoReport"),  # finished without a termination message: a verdict all the same (see its logs)
])
def test_a_reproduction_that_did_not_reproduce_is_ready_too(report, reason):
    body = walk(transforming(), decide(transforming(), child("q3-transform-g1", succeeded()), SETTINGS))
    done = walk(body, decide(body, child("q3-repro-g1", succeeded(report), REPRODUCTION), SETTINGS))
    assert done["status"]["phase"] == "NotReproduced" and _said(done) == ("True", "NotReproduced")
    assert reason in _ready(done)["message"]


def test_without_a_reproduction_ready_is_the_proxy():
    body = transforming(reproduction={"enabled": False})
    done = walk(body, decide(body, child("q3-transform-g1", succeeded()), SETTINGS))
    assert done["status"]["phase"] == "ProxyReady" and _said(done) == ("True", "ProxyBuilt")
    assert "128 -> 16 experts per layer" in _ready(done)["message"]
    # The same phase with a reproduction asked for is not done.
    assert ready(done["status"], reproduce=True)["status"] == "False"


@pytest.mark.parametrize("role, verdict, message", [
    ("transformer", Outcome(FAILED, "OOMKilled", "container transformer exited with code 137"),
     "transformer failed: OOMKilled: container transformer exited with code 137"),
    ("reproduction", Outcome(FAILED, "BackoffLimitExceeded", "Job has reached the specified backoff limit"),
     "reproduction failed: BackoffLimitExceeded: Job has reached the specified backoff limit"),
])
def test_a_failed_job_leaves_ready_false(role, verdict, message):
    body = transforming()
    if role == "reproduction":
        body = walk(body, decide(body, child("q3-transform-g1", succeeded()), SETTINGS))
        observed = child("q3-repro-g1", verdict, REPRODUCTION)
    else:
        observed = child("q3-transform-g1", verdict)
    after = walk(body, decide(body, observed, SETTINGS))
    assert after["status"]["phase"] == "Failed" and _said(after) == ("False", "Failed")
    assert _ready(after)["message"] == message
    # `kubectl get pxm -o wide`'s Reason column still shows the cause, not Ready's summary.
    assert column(after, "Reason") == verdict.reason and column(after, "Ready") == "False"


def test_a_refusal_leaves_ready_false():
    """As the validate step leaves a refused spec (`handlers._refuse`): phase Failed, or Pending
    while the cause may pass by itself; the kopf tests below check the step itself."""
    accepted_false = {"type": "Accepted", "status": "False", "reason": "NotMoE", "message": "llama is dense"}
    status = {"phase": "Failed", "observedGeneration": 2, "conditions": [accepted_false],
              "refusal": refusal("NotMoE", 2, {}, temporary=False)}
    said = ready(status)
    assert (said["status"], said["reason"]) == ("False", "Refused")
    assert said["message"] == "the spec is refused: NotMoE: llama is dense" and said["observedGeneration"] == 2
    waiting = {**status, "phase": "Pending", "refusal": refusal("SecretNotFound", 2, {}, temporary=True)}
    assert ready(waiting)["reason"] == "Refused" and "judged again" in ready(waiting)["message"]
    # A refusal of an older spec does not speak for this one (suspended meanwhile, say).
    older = {**status, "phase": "Suspended", "observedGeneration": 3}
    assert ready(older)["reason"] == "Suspended"


def test_suspension_and_resumption():
    actions = decide(pxm(suspend=True), Observed(ADMITTED), SETTINGS)
    assert _said(walk(pxm(), actions)) == ("False", "Suspended")
    body = transforming()
    body["spec"]["suspend"] = True
    body = walk(body, decide(body, child("q3-transform-g1", succeeded()), SETTINGS))  # built while suspended
    assert _said(body) == ("False", "Suspended")
    resumed = {**body, "spec": {**body["spec"], "suspend": False}}
    assert _said(walk(resumed, decide(resumed, Observed(SPEC_CHANGED), SETTINGS))) == ("False", "Reproducing")


def test_a_proxy_only_model_resumed_is_ready_and_starts_no_reproduction():
    """spec.reproduction.enabled false: the proxy built while suspended is all there is to do."""
    body = transforming(reproduction={"enabled": False}, suspend=True)
    body = walk(body, decide(body, child("q3-transform-g1", succeeded()), SETTINGS))
    assert body["status"]["phase"] == "Suspended"
    resumed = {**body, "spec": {**body["spec"], "suspend": False}}
    actions = decide(resumed, Observed(SPEC_CHANGED), SETTINGS)
    assert only(actions, CreateChild) == []
    after = walk(resumed, actions)
    assert after["status"]["phase"] == "ProxyReady" and _said(after) == ("True", "ProxyBuilt")
    # ... and suspending it again leaves it as it is, as a finished ProxyModel.
    [patch] = decide({**after, "spec": body["spec"]}, Observed(SPEC_CHANGED), SETTINGS)
    assert patch.status == {"observedGeneration": 1}


def test_a_patch_that_leaves_ready_as_it_is_writes_no_conditions():
    body = transforming(transformer={"parallelism": 3})
    [patch] = decide(body, Observed(WORKERS_PROGRESS, child=Child("q3-transform-g1", "transformer", progress="1/3")),
                     SETTINGS)
    assert patch == PatchStatus({"workers": "1/3"})
    # A running step's news (an unschedulable pod) reaches Ready's message, its status stays.
    pending = Outcome(RUNNING, "Unschedulable", "0/3 nodes are available")
    after = walk(body, decide(body, child("q3-transform-g1", pending), SETTINGS))
    assert _said(after) == ("False", "Building") and "Unschedulable: 0/3 nodes" in _ready(after)["message"]


def test_ready_keeps_its_transition_time_while_its_status_does_not_change():
    body = transforming()
    for c in body["status"]["conditions"]:
        if c["type"] == READY:
            c["lastTransitionTime"] = "2020-01-01T00:00:00Z"
    reproducing = walk(body, decide(body, child("q3-transform-g1", succeeded()), SETTINGS))
    assert _said(reproducing) == ("False", "Reproducing")
    assert _ready(reproducing)["lastTransitionTime"] == "2020-01-01T00:00:00Z"
    done = walk(reproducing, decide(reproducing, child("q3-repro-g1", succeeded(REPRODUCED_REPORT), REPRODUCTION),
                                     SETTINGS))
    assert _ready(done)["lastTransitionTime"] != "2020-01-01T00:00:00Z"  # False -> True: now
    assert with_ready(done["status"]) is None  # as status implies: nothing to write


def test_a_restart_adds_ready_to_status_written_without_it():
    """ProxyModels an operator without the Ready condition finished (or left waiting for their
    child) get it when this one resumes them; a resume with Ready in place writes nothing."""
    body = transforming()
    done = walk(body, decide(body, child("q3-transform-g1", succeeded()), SETTINGS))
    done = walk(done, decide(done, child("q3-repro-g1", succeeded(REPRODUCED_REPORT), REPRODUCTION), SETTINGS))
    assert ready_added(done, decide(done, Observed(ADMITTED), SETTINGS)) == []
    older = {**done, "status": {**done["status"], "conditions": [c for c in done["status"]["conditions"]
                                                                 if c["type"] != READY]}}
    [patch] = ready_added(older, decide(older, Observed(ADMITTED), SETTINGS))
    assert set(patch.status) == {"conditions"} and _said(walk(older, [patch])) == ("True", "Reproduced")
    # Actions that write status or start the pipeline bring Ready themselves.
    assert ready_added(pxm(), [StartPipeline()]) == [StartPipeline()]


def test_every_phase_has_a_ready_reason():
    for phase in ("Pending", "Transforming", "ProxyReady", "Reproducing", "Reproduced", "NotReproduced", "Failed",
                  "Suspended"):
        for reproduce in (True, False):
            said = ready({"phase": phase}, reproduce)
            assert said["reason"] in READY_REASONS and said["message"], (phase, said)
            assert (said["status"] == "True") == (phase in ("Reproduced", "NotReproduced")
                                                  or (phase == "ProxyReady" and not reproduce))


# --- the operator, against the emulated API -----------------------------------------------------------


NS = "team-r"


async def _secret(cluster) -> None:
    await cluster.secret(NS, "s3-creds", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)


def _condition(cluster, name: str) -> dict:
    return cluster.condition(NS, name, READY)


async def _ready_is(cluster, name: str, status: str, reason: str) -> dict:
    await eventually(lambda: (_condition(cluster, name).get("status"), _condition(cluster, name).get("reason"))
                     == (status, reason),
                     what=lambda: f"Ready {status} {reason} on {name}; it is {json.dumps(_condition(cluster, name))}")
    return _condition(cluster, name)


async def _build_and_reproduce(cluster, name: str) -> dict:
    """The pipeline from apply to the verdict, Ready checked at each step; Ready at the end."""
    await cluster.create(PROXYMODELS, NS, proxymodel(name))
    job = await eventually(lambda: cluster.get(JOBS, NS, f"{name}-transform-g1"), what="transformer Job")
    await _ready_is(cluster, name, "False", "Building")
    await cluster.transformer_succeeds(NS, job)
    repro = await eventually(lambda: cluster.get(JOBS, NS, f"{name}-repro-g1"), what="reproduction Job")
    await _ready_is(cluster, name, "False", "Reproducing")
    report = {"reproduced": True, "signature": "overflow", "step": 9, "metrics": {"actor/grad_norm": "inf"}}
    await cluster.finish_pod(NS, repro, "reproduction", 0, json.dumps(report))
    await cluster.job_condition(NS, f"{name}-repro-g1", "Complete")
    return await _ready_is(cluster, name, "True", "Reproduced")


async def test_operator_ready_goes_false_then_true(cluster, operator):
    await _secret(cluster)
    ready_ = await _build_and_reproduce(cluster, "ok")
    pxm_ = cluster.get(PROXYMODELS, NS, "ok")
    # What Argo CD's health check compares: the condition is about the spec as it is now.
    assert ready_["observedGeneration"] == pxm_["status"]["observedGeneration"] == pxm_["metadata"]["generation"]
    assert "overflow at step 9" in ready_["message"] and column(pxm_, "Ready") == "True"
    assert pxm_["status"]["phase"] == "Reproduced"


async def test_operator_ready_stays_false_on_a_refusal(cluster, operator):
    await _secret(cluster)
    await cluster.create(PROXYMODELS, NS, proxymodel("bad", pruning={"experts": 200}))
    refused = await _ready_is(cluster, "bad", "False", "Refused")
    assert "InvalidExpertCount" in refused["message"] and cluster.status(NS, "bad")["phase"] == "Failed"
    assert cluster.names(JOBS, NS) == []
    # A refusal that may pass (no Secret yet) says so, and Ready follows the recovery.
    await cluster.create(PROXYMODELS, NS, proxymodel("w", source={"credentialsSecret": "later"}))
    waiting = await _ready_is(cluster, "w", "False", "Refused")
    assert "SecretNotFound" in waiting["message"] and "judged again" in waiting["message"]
    await cluster.secret(NS, "later", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    await _ready_is(cluster, "w", "False", "Building")
    assert cluster.condition(NS, "bad", READY)["reason"] == "Refused"  # still


async def test_operator_ready_stays_false_on_a_failed_job(cluster, operator):
    await _secret(cluster)
    await cluster.create(PROXYMODELS, NS, proxymodel("oom"))
    job = await eventually(lambda: cluster.get(JOBS, NS, "oom-transform-g1"))
    await cluster.finish_pod(NS, job, "transformer", 137, reason="OOMKilled")
    await cluster.job_condition(NS, "oom-transform-g1", "Failed", "BackoffLimitExceeded")
    failed = await _ready_is(cluster, "oom", "False", "Failed")
    assert "OOMKilled" in failed["message"]
    assert column(cluster.get(PROXYMODELS, NS, "oom"), "Reason") == "OOMKilled"


async def test_operator_restart_adds_ready_to_a_status_written_without_it(cluster, operator):
    """A ProxyModel an operator without the Ready condition finished gets it at the restart."""
    await _secret(cluster)
    await _build_and_reproduce(cluster, "old")
    await operator.stop()
    conditions = [c for c in cluster.status(NS, "old")["conditions"] if c["type"] != READY]
    await cluster.patch_status(PROXYMODELS, NS, "old", {"conditions": conditions})
    assert _condition(cluster, "old") == {}
    await operator.start()
    await _ready_is(cluster, "old", "True", "Reproduced")
    assert cluster.status(NS, "old")["conditions"][:-1] == conditions  # the others as they were
