"""The ProxyModel pipeline's decisions (`pipeline.decide`), branch by branch, without an API
server or a running operator: a ProxyModel as read, what a handler observed, the actions.

`walk` plays the handlers' part where it matters: it writes each PatchStatus into status, so
a test can follow the pipeline from admission to the verdict and decide again on what it wrote.
"""

from __future__ import annotations

import copy
import json

import pytest

from proxymodel_operator.children import REPRODUCTION, TRANSFORMER
from proxymodel_operator.outcome import FAILED, RUNNING, SUCCEEDED, Outcome
from proxymodel_operator.pipeline import (ADMITTED, CHILD_CHANGED, RECHECK, REJUDGE, RETRY, SPEC_CHANGED, VALIDATED,
                                          WORKERS_PROGRESS, AskJudgment, Child, CreateChild, DeleteChildren, Emit,
                                          Failure, JudgeChild, Log, Observed, PatchStatus, StartPipeline,
                                          child_resource, create_refused, decide, failed, recorded_child, refusal,
                                          refusal_of, spec_hash, waits_on_refusal, wants_verdict)
from proxymodel_operator.resources import ASCEND_JOBS, JOBS, SERVICES, VOLCANO_JOBS
from proxymodel_operator.settings import Settings

from .harness import TRANSFORMER_REPORT, proxymodel

SETTINGS = Settings()
NS, NAME = "team-a", "q3"
PLAN = {"proxy": {"devices": 16, "expertsPerLayer": 16}, "original": {"devices": 32}}
REPRODUCED_REPORT = {"reproduced": True, "signature": "overflow", "step": 12, "metrics": {"actor/grad_norm": "inf"}}


def pxm(spec: dict | None = None, status: dict | None = None, generation: int = 1, **spec_overrides) -> dict:
    """A ProxyModel as the API returns it."""
    spec = spec if spec is not None else proxymodel(NAME, **spec_overrides)["spec"]
    return {"apiVersion": "moeproxy.io/v1alpha1", "kind": "ProxyModel",
            "metadata": {"name": NAME, "namespace": NS, "uid": "uid-1", "generation": generation,
                         "resourceVersion": "7"},
            "spec": spec, "status": status or {}}


def accepted(body: dict) -> dict:
    """`body` as the validate step leaves it: its spec accepted, with a plan."""
    generation = body["metadata"]["generation"]
    status = {"pipeline": {"specHash": spec_hash(body["spec"]), "generation": generation, "transformerJob": None,
                           "transformerStep": None, "reproductionJob": None, "reproductionKind": None},
              "phase": "Pending", "observedGeneration": generation, "plan": PLAN,
              "conditions": [{"type": "Accepted", "status": "True", "reason": "SpecValid"}]}
    return {**body, "status": status}


def walk(body: dict, actions: list) -> dict:
    """`body` after the status patches among `actions` (JSON merge patch at the top level)."""
    status = copy.deepcopy(body.get("status") or {})
    for action in actions:
        if isinstance(action, PatchStatus):
            for key, value in action.status.items():
                if value is None:
                    status.pop(key, None)
                else:
                    status[key] = copy.deepcopy(value)
    return {**body, "status": status}


def only(actions: list, kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


def child(name: str, verdict: Outcome, role: str = TRANSFORMER, **kwargs) -> Observed:
    return Observed(CHILD_CHANGED, child=Child(name, role, verdict, **kwargs))


def succeeded(report: dict | None = None) -> Outcome:
    return Outcome(SUCCEEDED, report=report if report is not None else TRANSFORMER_REPORT)


def condition(body: dict, kind: str) -> dict:
    return next(c for c in body["status"]["conditions"] if c["type"] == kind)


def transforming(**spec_overrides) -> dict:
    """Accepted, its transformer's first Job recorded (the handler creates it next)."""
    body = accepted(pxm(**spec_overrides))
    return walk(body, decide(body, Observed(VALIDATED), SETTINGS))


def reproducing(**spec_overrides) -> dict:
    body = transforming(**spec_overrides)
    return walk(body, decide(body, child("q3-transform-g1", succeeded()), SETTINGS))


# --- admission --------------------------------------------------------------------------------------


def test_first_admission_starts_the_pipeline():
    assert decide(pxm(), Observed(ADMITTED), SETTINGS) == [StartPipeline()]


def test_admission_while_suspended_creates_nothing():
    actions = decide(pxm(suspend=True), Observed(ADMITTED), SETTINGS)
    [patch] = actions
    assert patch.status["phase"] == "Suspended" and patch.status["observedGeneration"] == 1
    assert walk(pxm(), actions)["status"]["conditions"][0]["reason"] == "SuspendedBySpec"


def test_admission_of_a_running_pipeline_checks_its_recorded_child():
    body = transforming()
    assert recorded_child(body["spec"], body["status"]) == (JOBS, "q3-transform-g1")
    assert decide(body, Observed(ADMITTED, child_exists=True), SETTINGS) == []  # a resume: nothing to do


def test_a_recorded_child_that_is_missing_is_created():
    """The operator stopped between recording a child and creating it."""
    body = transforming()
    [create] = decide(body, Observed(ADMITTED, child_exists=False), SETTINGS)
    assert create.resource == JOBS and create.manifest["metadata"]["name"] == "q3-transform-g1"
    assert create.created == Emit("Normal", "TransformerCreated", "Job q3-transform-g1")
    assert create.refused is None  # an API refusal fails the handler: kopf retries it

    body = reproducing(reproduction={"runtime": "VolcanoJob"})
    assert recorded_child(body["spec"], body["status"]) == (VOLCANO_JOBS, "q3-repro-g1")
    [create] = decide(body, Observed(ADMITTED, child_exists=False), SETTINGS)
    assert (create.resource, create.manifest["kind"]) == (VOLCANO_JOBS, "Job")
    assert create.refused == Failure("FailureReproduced", "reproduction")
    assert walk(body, [create])["status"] == body["status"]  # recorded already: status unchanged


def test_nothing_is_recorded_for_another_spec_or_after_the_verdict():
    body = transforming()
    assert recorded_child({**body["spec"], "pruning": {"experts": 8}}, body["status"]) is None
    done = walk(body, decide(body, child("q3-transform-g1", succeeded()), SETTINGS))
    done = walk(done, decide(done, child("q3-repro-g1", succeeded(REPRODUCED_REPORT), REPRODUCTION), SETTINGS))
    assert recorded_child(done["spec"], done["status"]) is None
    assert decide(done, Observed(ADMITTED, child_exists=None), SETTINGS) == []


# --- the transformer's first Job ---------------------------------------------------------------------


def test_validated_records_then_creates_the_build():
    body = accepted(pxm())
    patch, create = decide(body, Observed(VALIDATED), SETTINGS)
    assert patch.first  # status first, then the Job: the Job's first event finds it recorded
    assert patch.status["phase"] == "Transforming"
    assert patch.status["pipeline"] == {**body["status"]["pipeline"], "transformerJob": "q3-transform-g1",
                                        "transformerStep": "build"}
    assert create.resource == JOBS and create.manifest["metadata"]["name"] == "q3-transform-g1"
    assert create.created.reason == "TransformerCreated"
    assert "--experts" in create.manifest["spec"]["template"]["spec"]["containers"][0]["args"]


def test_a_keep_ratio_builds_the_planned_expert_count():
    spec = proxymodel(NAME)["spec"]
    spec["pruning"] = {"keepRatio": 0.1}
    body = accepted(pxm(spec))
    _, create = decide(body, Observed(VALIDATED), SETTINGS)
    args = create.manifest["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--experts") + 1] == "16" and "--keep-ratio" not in args


def test_a_later_generation_first_replaces_older_children():
    body = accepted(pxm(generation=3))
    actions = decide(body, Observed(VALIDATED), SETTINGS)
    assert actions[0] == DeleteChildren(3, announce=True)
    assert actions[-1].manifest["metadata"]["name"] == "q3-transform-g3"


def test_an_unaccepted_spec_gets_no_job():
    body = pxm()  # validate refused it: status records no pipeline for this spec
    assert only(decide(body, Observed(VALIDATED), SETTINGS), CreateChild) == []


@pytest.mark.parametrize("calibrated, first", [(True, "calibrate"), (False, "workers")])
def test_several_workers_start_with_calibration_or_the_workers(calibrated, first):
    extra = {"calibration": {"samples": 8}, "pruning": {"experts": 16, "features": "routing"}} if calibrated else {}
    body = accepted(pxm(transformer={"parallelism": 3}, **extra))
    patch, create = decide(body, Observed(VALIDATED), SETTINGS)
    assert patch.status["pipeline"]["transformerStep"] == first
    assert patch.status["workers"] == "0/3"
    name = {"calibrate": "q3-calibrate-g1", "workers": "q3-transform-g1"}[first]
    assert create.manifest["metadata"]["name"] == name


# --- the transformer's verdict -------------------------------------------------------------------------


def test_transformer_success_makes_the_proxy_ready_and_starts_the_reproduction():
    body = transforming()
    actions = decide(body, child("q3-transform-g1", succeeded()), SETTINGS)
    patch, event, service, create = only(actions, PatchStatus) + only(actions, Emit) + only(actions, CreateChild)
    assert not patch.first and event == Emit("Normal", "ProxyReady", event.message)
    assert actions.index(patch) < actions.index(service) < actions.index(create)  # recorded before it is created
    # two pods: the headless Service that names them (<job>-<index>.<job>) comes first
    assert service.resource == SERVICES and service.manifest["metadata"]["name"] == "q3-repro-g1"
    assert service.manifest["spec"]["clusterIP"] == "None"
    assert service.refused == Failure("FailureReproduced", "reproduction", retry=True)  # waits; the Job fails
    assert create.manifest["spec"]["template"]["spec"]["subdomain"] == "q3-repro-g1"
    after = walk(body, actions)
    assert after["status"]["phase"] == "Reproducing" and after["status"]["experts"] == "128->16"
    assert after["status"]["proxy"]["uri"] == TRANSFORMER_REPORT["proxy_uri"]
    assert after["status"]["pipeline"]["reproductionJob"] == "q3-repro-g1"
    assert condition(after, "ProxyReady")["status"] == "True"
    assert condition(after, "FailureReproduced")["reason"] == "ReproductionRunning"
    assert create.resource == JOBS and create.manifest["spec"]["completions"] == 2  # 16 devices, 8 per node
    assert create.created.message == "Job q3-repro-g1 (8 x huawei.com/Ascend910 per pod)"
    assert create.refused == Failure("FailureReproduced", "reproduction")


def test_a_refused_service_holds_the_job_back_until_the_back_off_creates_both():
    body = transforming()
    actions = decide(body, child("q3-transform-g1", succeeded()), SETTINGS)
    service = only(actions, CreateChild)[0]
    before = walk(body, actions[:actions.index(service)])  # the handler stops at the refused create
    refused = create_refused(before["status"], service.refused, "Service q3-repro-g1", "HTTP 403 Forbidden: quota")
    waiting = walk(before, refused)
    assert waits_on_refusal(waiting["status"]) and waiting["status"]["phase"] == "Reproducing"
    cond = condition(waiting, "FailureReproduced")
    assert (cond["status"], cond["reason"]) == ("Unknown", "CreateRefused") and "403" in cond["message"]
    assert [e.type for e in only(refused, Emit)] == ["Warning"]
    again = create_refused(waiting["status"], service.refused, "Service q3-repro-g1", "HTTP 403 Forbidden: quota")
    assert only(again, Emit) == []  # one Event for the refusal, none per try

    retry = decide(waiting, Observed(RETRY, child_exists=False), SETTINGS)
    svc, resumed, job = retry
    assert (svc.resource, job.resource, job.manifest["metadata"]["name"]) == (SERVICES, JOBS, "q3-repro-g1")
    after = walk(waiting, retry)
    assert not waits_on_refusal(after["status"]) and "message" not in after["status"]
    assert condition(after, "FailureReproduced")["reason"] == "ReproductionRunning"
    assert decide(after, Observed(RETRY, child_exists=True), SETTINGS) == []
    # a refused workload (not its Service) fails the ProxyModel, as before
    assert walk(before, create_refused(before["status"], job.refused, "Job q3-repro-g1", "HTTP 403"))[
        "status"]["phase"] == "Failed"


@pytest.mark.parametrize("runtime, resource, container", [
    ("VolcanoJob", VOLCANO_JOBS, "reproduction"), ("AscendJob", ASCEND_JOBS, "ascend")])
def test_the_reproduction_runs_as_its_runtime(runtime, resource, container):
    body = transforming(reproduction={"runtime": runtime})
    [create] = only(decide(body, child("q3-transform-g1", succeeded()), SETTINGS), CreateChild)
    assert create.resource == resource and create.manifest["kind"] == resource.kind
    assert create.created.message.startswith(f"{resource.kind} q3-repro-g1 (8 x ")
    after = walk(body, decide(body, child("q3-transform-g1", succeeded()), SETTINGS))
    assert child_resource(after["status"], REPRODUCTION) == resource
    assert after["status"]["pipeline"]["reproductionKind"] == runtime
    assert container in json.dumps(create.manifest)


def test_transformer_success_without_reproduction_or_while_suspended():
    body = transforming(reproduction={"enabled": False})
    actions = decide(body, child("q3-transform-g1", succeeded()), SETTINGS)
    assert only(actions, CreateChild) == [] and walk(body, actions)["status"]["phase"] == "ProxyReady"
    body = transforming()
    body["spec"]["suspend"] = True
    actions = decide(body, child("q3-transform-g1", succeeded()), SETTINGS)
    assert only(actions, CreateChild) == [] and walk(body, actions)["status"]["phase"] == "Suspended"


def test_transformer_success_without_a_report_fails():
    body = transforming()
    after = walk(body, decide(body, child("q3-transform-g1", succeeded({})), SETTINGS))
    assert after["status"]["phase"] == "Failed" and condition(after, "ProxyReady")["reason"] == "NoProxyReport"


@pytest.mark.parametrize("verdict, reason", [
    (Outcome(FAILED, "OOMKilled", "container transformer exited with code 137"), "OOMKilled"),
    # bad input (exit code 2): the report names the cause, the pod failure policy failed the Job at once
    (Outcome(FAILED, "UnsupportedArchitecture", "llama is dense",
             {"error": "UnsupportedArchitecture", "message": "llama is dense"}), "UnsupportedArchitecture"),
])
def test_transformer_failure_fails_the_proxymodel(verdict, reason):
    body = transforming()
    actions = decide(body, child("q3-transform-g1", verdict), SETTINGS)
    assert [type(a) for a in actions] == [type(a) for a in failed(body["status"], "ProxyReady", reason, "", "")]
    after = walk(body, actions)
    assert condition(after, "ProxyReady")["reason"] == reason
    assert after["status"]["phase"] == "Failed"
    assert after["status"]["message"] == f"transformer failed: {reason}: {verdict.message}"
    assert only(actions, Emit)[0].type == "Warning"
    assert decide(after, child("q3-transform-g1", verdict), SETTINGS) == []  # failed: judged once


def test_a_notable_running_state_is_reported_once():
    body = transforming()
    pending = Outcome(RUNNING, "Unschedulable", "0/3 nodes are available")
    actions = decide(body, child("q3-transform-g1", pending), SETTINGS)
    after = walk(body, actions)
    assert condition(after, "ProxyReady")["reason"] == "Unschedulable" and after["status"]["phase"] == "Transforming"
    assert only(actions, Emit) == [Emit("Warning", "Unschedulable", "transformer: 0/3 nodes are available")]
    assert decide(after, child("q3-transform-g1", pending), SETTINGS) == []
    assert decide(after, child("q3-transform-g1", Outcome(RUNNING)), SETTINGS) == []


def test_verdicts_of_other_children_or_given_already_are_ignored():
    body = transforming()
    assert decide(body, child("q3-transform-g0", succeeded()), SETTINGS) == []  # an older spec's
    assert not wants_verdict(body["status"], REPRODUCTION, "q3-repro-g1")
    after = walk(body, decide(body, child("q3-transform-g1", succeeded()), SETTINGS))
    assert decide(after, child("q3-transform-g1", succeeded()), SETTINGS) == []  # idempotent


# --- several workers: calibrate -> workers -> finalize ----------------------------------------------------


def test_calibrate_then_workers_then_finalize():
    spec = {"calibration": {"samples": 8}, "pruning": {"experts": 16, "features": "routing"},
            "transformer": {"parallelism": 3}}
    body = transforming(**spec)
    assert body["status"]["pipeline"]["transformerStep"] == "calibrate"

    # Calibrated (routing features): it reconstructs, so a fit step fits once before the workers.
    actions = decide(body, child("q3-calibrate-g1", succeeded({})), SETTINGS)
    [create] = only(actions, CreateChild)
    assert create.manifest["metadata"]["name"] == "q3-fit-g1" and create.created.reason == "FitCreated"
    assert "--fit" in create.manifest["spec"]["template"]["spec"]["containers"][0]["args"]
    body = walk(body, actions)
    assert body["status"]["pipeline"]["transformerStep"] == "fit" and body["status"]["workers"] == "0/3"
    assert condition(body, "ProxyReady")["reason"] == "Fitting"

    actions = decide(body, child("q3-fit-g1", succeeded({})), SETTINGS)
    [create] = only(actions, CreateChild)
    assert create.manifest["metadata"]["name"] == "q3-transform-g1" and create.manifest["spec"]["completions"] == 3
    assert create.created.reason == "WorkersCreated"
    assert create.refused == Failure("ProxyReady", "transformer workers")
    body = walk(body, actions)
    assert body["status"]["pipeline"]["transformerStep"] == "workers" and body["status"]["workers"] == "0/3"
    assert condition(body, "ProxyReady")["reason"] == "WorkersRunning"
    assert decide(body, child("q3-calibrate-g1", succeeded({})), SETTINGS) == []  # not the current child
    assert decide(body, child("q3-fit-g1", succeeded({})), SETTINGS) == []

    progress = Observed(WORKERS_PROGRESS, child=Child("q3-transform-g1", TRANSFORMER, progress="2/3"))
    [patch] = decide(body, progress, SETTINGS)
    assert patch == PatchStatus({"workers": "2/3"})
    body = walk(body, [patch])
    assert decide(body, progress, SETTINGS) == []  # nothing new
    assert decide(body, Observed(WORKERS_PROGRESS, child=Child("q3-calibrate-g1", TRANSFORMER, progress="1/1")),
                  SETTINGS) == []

    actions = decide(body, child("q3-transform-g1", succeeded({})), SETTINGS)
    [create] = only(actions, CreateChild)
    assert create.manifest["metadata"]["name"] == "q3-finalize-g1" and create.created.reason == "FinalizeCreated"
    body = walk(body, actions)
    assert body["status"]["pipeline"]["transformerStep"] == "finalize" and body["status"]["workers"] == "3/3"

    body = walk(body, decide(body, child("q3-finalize-g1", succeeded()), SETTINGS))
    assert body["status"]["phase"] == "Reproducing" and body["status"]["proxy"]


def test_failed_worker_indexes_are_named():
    body = transforming(transformer={"parallelism": 4})
    verdict = Outcome(FAILED, "OOMKilled", "container transformer exited with code 137")
    after = walk(body, decide(body, child("q3-transform-g1", verdict, failed_indexes="1,3"), SETTINGS))
    assert after["status"]["message"].startswith("transformer workers failed: OOMKilled: worker index(es) 1,3 failed")


def test_a_step_done_while_suspended_or_for_an_older_spec_goes_no_further():
    body = transforming(transformer={"parallelism": 2})
    suspended = {**body, "spec": {**body["spec"], "suspend": True}}
    assert [type(a) for a in decide(suspended, child("q3-transform-g1", succeeded({})), SETTINGS)] == [Log]
    changed = {**body, "spec": {**body["spec"], "pruning": {"experts": 8}}}
    assert decide(changed, child("q3-transform-g1", succeeded({})), SETTINGS) == []


# --- the reproduction's verdict ----------------------------------------------------------------------------


@pytest.mark.parametrize("verdict, phase, reason, event", [
    (succeeded(REPRODUCED_REPORT), "Reproduced", "GradientOverflow", "Normal"),
    (succeeded({"reproduced": True, "signature": "actor/grad_norm>100", "step": 3}), "Reproduced",
     "MetricThreshold", "Normal"),
    (succeeded({"reproduced": False, "signature": None, "step": None}), "NotReproduced", "NotObserved", "Warning"),
    (succeeded({}), "NotReproduced", "NoReport", "Warning"),
    (Outcome(FAILED, "BackoffLimitExceeded", "Job has reached the specified backoff limit"), "Failed",
     "BackoffLimitExceeded", "Warning"),
])
def test_reproduction_verdicts(verdict, phase, reason, event):
    body = reproducing()
    actions = decide(body, child("q3-repro-g1", verdict, REPRODUCTION), SETTINGS)
    after = walk(body, actions)
    assert after["status"]["phase"] == phase
    assert condition(after, "FailureReproduced")["reason"] == reason
    assert only(actions, Emit)[0].type == event
    assert only(actions, CreateChild) == []
    assert decide(after, child("q3-repro-g1", verdict, REPRODUCTION), SETTINGS) == []  # judged once


def test_a_reproduction_that_cannot_show_the_failure_asked_for_is_no_verdict():
    """A proxy keeping <= top-k experts cannot collapse: not seeing it says nothing (Unknown, CannotShow)."""
    body = reproducing(reproduction={"failOn": {"signature": "collapse"}})
    report = {"reproduced": False, "signature": None, "step": None,
              "cannot_show": {"collapse": "2 experts <= top-2", "overflow": "not asked"}}
    actions = decide(body, child("q3-repro-g1", succeeded(report), REPRODUCTION), SETTINGS)
    said = condition(walk(body, actions), "FailureReproduced")
    assert (said["status"], said["reason"]) == ("Unknown", "CannotShow")
    assert said["message"] == "could not judge: collapse cannot show in this run: 2 experts <= top-2"
    assert (only(actions, Emit)[0].type, only(actions, Emit)[0].reason) == ("Warning", "CannotShow")
    other = reproducing(reproduction={"failOn": {"signature": "overflow", "stopOnReproduce": False}})
    report = {**report, "cannot_show": {"collapse": "2 experts <= top-2"}}  # not the failure asked for
    after = walk(other, decide(other, child("q3-repro-g1", succeeded(report), REPRODUCTION), SETTINGS))
    assert condition(after, "FailureReproduced")["reason"] == "NotObserved"


def test_a_running_reproduction_reports_an_unschedulable_gang():
    body = reproducing(reproduction={"runtime": "VolcanoJob"})
    verdict = Outcome(RUNNING, "PodGroupPending", "gang of 2 cannot be scheduled")
    after = walk(body, decide(body, child("q3-repro-g1", verdict, REPRODUCTION), SETTINGS))
    assert condition(after, "FailureReproduced")["status"] == "Unknown"
    assert condition(after, "FailureReproduced")["reason"] == "PodGroupPending"
    assert after["status"]["phase"] == "Reproducing"


# --- spec changes ----------------------------------------------------------------------------------------


def test_a_new_spec_restarts_the_pipeline():
    body = reproducing()
    changed = {**body, "spec": {**body["spec"], "pruning": {"experts": 8}}, "metadata": {**body["metadata"],
                                                                                          "generation": 2}}
    actions = decide(changed, Observed(SPEC_CHANGED), SETTINGS)
    assert actions[-1] == StartPipeline() and not only(actions, PatchStatus)


def test_a_new_spec_while_suspended_deletes_every_child_and_waits():
    body = reproducing()
    changed = {**body, "spec": {**body["spec"], "pruning": {"experts": 8}, "suspend": True}}
    actions = decide(changed, Observed(SPEC_CHANGED), SETTINGS)
    assert actions[0] == DeleteChildren(None)
    after = walk(changed, actions)
    assert after["status"]["phase"] == "Suspended"
    assert not {"pipeline", "proxy", "reproduction", "plan"} & set(after["status"])
    resumed = {**after, "spec": {**after["spec"], "suspend": False}}
    assert decide(resumed, Observed(SPEC_CHANGED), SETTINGS)[-1] == StartPipeline()


def test_suspend_and_ttl_alone_do_not_restart():
    body = reproducing()
    suspended = {**body, "spec": {**body["spec"], "suspend": True, "ttlSecondsAfterFinished": 60}}
    [patch] = decide(suspended, Observed(SPEC_CHANGED), SETTINGS)
    assert patch.status["phase"] == "Suspended"
    done = walk(body, decide(body, child("q3-repro-g1", succeeded(REPRODUCED_REPORT), REPRODUCTION), SETTINGS))
    [patch] = decide({**done, "spec": suspended["spec"]}, Observed(SPEC_CHANGED), SETTINGS)
    assert patch.status == {"observedGeneration": 1}  # a finished ProxyModel stays as it is
    [patch] = decide({**body, "spec": {**body["spec"], "ttlSecondsAfterFinished": 60}}, Observed(SPEC_CHANGED),
                     SETTINGS)
    assert "phase" not in patch.status and patch.status["conditions"][-1]["reason"] == "Resumed"


def test_resume_before_the_first_job_starts_the_pipeline():
    body = walk(pxm(suspend=True), decide(pxm(suspend=True), Observed(ADMITTED), SETTINGS))
    body = {**accepted(body), "status": {**accepted(body)["status"], "phase": "Suspended"}}
    resumed = {**body, "spec": {**body["spec"], "suspend": False}}
    patch, start = decide(resumed, Observed(SPEC_CHANGED), SETTINGS)
    assert start == StartPipeline() and not patch.first


def test_resume_with_the_proxy_built_starts_the_reproduction():
    body = transforming()
    body["spec"]["suspend"] = True
    body = walk(body, decide(body, child("q3-transform-g1", succeeded()), SETTINGS))
    assert body["status"]["phase"] == "Suspended" and not body["status"]["pipeline"]["reproductionJob"]
    resumed = {**body, "spec": {**body["spec"], "suspend": False}}
    patch, service, create = decide(resumed, Observed(SPEC_CHANGED), SETTINGS)
    assert service.resource == SERVICES and patch.first and patch.status["phase"] == "Reproducing"
    assert patch.status["pipeline"]["reproductionJob"] == create.manifest["metadata"]["name"] == "q3-repro-g1"
    assert condition(walk(resumed, [patch]), "Suspended")["reason"] == "Resumed"


def test_resume_judges_a_step_that_finished_while_suspended():
    body = transforming(transformer={"parallelism": 2})
    body = {**body, "status": {**body["status"], "phase": "Suspended"}}
    patch, judge = decide(body, Observed(SPEC_CHANGED), SETTINGS)
    assert patch.first and patch.status["phase"] == "Transforming"  # written before the judge reads it
    assert judge == JudgeChild(JOBS, "q3-transform-g1", TRANSFORMER)


def test_resume_of_a_single_build_or_a_reproduction_only_sets_the_phase():
    for body, phase in ((transforming(), "Transforming"), (reproducing(), "Reproducing")):
        body = {**body, "status": {**body["status"], "phase": "Suspended"}}
        [patch] = decide(body, Observed(SPEC_CHANGED), SETTINGS)
        assert patch.status["phase"] == phase


# --- idempotency -------------------------------------------------------------------------------------------


def test_deciding_again_on_what_was_written_creates_nothing_twice():
    """Every decision that creates a child records it first; deciding again on that status
    (the same event seen twice, a restart) creates no second child."""
    body = accepted(pxm(transformer={"parallelism": 2}))
    seen_creates = []
    events = [Observed(VALIDATED), child("q3-transform-g1", succeeded({})), child("q3-finalize-g1", succeeded()),
              child("q3-repro-g1", succeeded(REPRODUCED_REPORT), REPRODUCTION)]
    for observed in events:
        actions = decide(body, observed, SETTINGS)
        seen_creates += [a.manifest["metadata"]["name"] for a in only(actions, CreateChild)
                         if a.resource != SERVICES]  # a multi-node Job's Service has its name
        body = walk(body, actions)
        if observed.event == CHILD_CHANGED:
            assert decide(body, observed, SETTINGS) == []
        assert decide(body, Observed(ADMITTED, child_exists=True), SETTINGS) == []
    assert seen_creates == ["q3-transform-g1", "q3-finalize-g1", "q3-repro-g1"]
    assert body["status"]["phase"] == "Reproduced"


def test_decide_reads_nothing_but_its_arguments():
    body = transforming()
    before = copy.deepcopy(body)
    first = decide(body, child("q3-transform-g1", succeeded()), SETTINGS)
    again = decide(body, child("q3-transform-g1", succeeded()), SETTINGS)
    assert [type(a) for a in first] == [type(a) for a in again]
    assert only(first, CreateChild) == only(again, CreateChild)
    assert body == before  # the ProxyModel as read is not changed


# --- refusals: judged again only when what they depended on changed ---------------------------------

DEPENDED = {"settings": "s1", "secret": "41", "source": "abc"}


def refused(generation: int = 1, **depended: str) -> dict:
    """A ProxyModel whose spec (generation) was refused, the judgment depending on `DEPENDED`."""
    body = pxm(generation=generation)
    body["status"] = {"phase": "Failed", "refusal": refusal("NotMoE", 1, {**DEPENDED, **depended}, False)}
    return body


def test_a_refusal_is_not_judged_again_while_nothing_it_depended_on_changed():
    (log,) = decide(refused(), Observed(ADMITTED, dependencies=dict(DEPENDED)), SETTINGS)
    assert isinstance(log, Log) and "not judged again" in log.message
    assert decide(refused(), Observed(RECHECK, dependencies=dict(DEPENDED)), SETTINGS) == []


@pytest.mark.parametrize("changed", ["secret", "source", "settings"])
def test_a_changed_dependency_judges_a_refusal_again(changed):
    now = {**DEPENDED, changed: "new"}
    assert decide(refused(), Observed(ADMITTED, dependencies=now), SETTINGS) == [StartPipeline()]
    (ask,) = decide(refused(), Observed(RECHECK, dependencies=now), SETTINGS)
    assert isinstance(ask, AskJudgment) and ask.why.startswith(f"{changed} changed")
    assert decide(refused(), Observed(REJUDGE), SETTINGS)[-1] == StartPipeline()


def test_a_refusal_of_an_older_spec_does_not_hold_back_a_new_one():
    body = refused(generation=2)
    assert refusal_of(body["status"], 2) is None
    assert decide(body, Observed(ADMITTED, dependencies=None), SETTINGS) == [StartPipeline()]
    assert decide(body, Observed(RECHECK, dependencies=dict(DEPENDED)), SETTINGS) == []


def test_asking_again_leaves_a_running_pipeline_alone():
    body = walk(accepted(pxm()), decide(accepted(pxm()), Observed(VALIDATED), SETTINGS))
    (log,) = decide(body, Observed(REJUDGE), SETTINGS)
    assert isinstance(log, Log) and "not refused" in log.message
    # Accepted by the judgment asked for, before its first Job: the transformer step follows.
    assert decide(accepted(pxm()), Observed(REJUDGE), SETTINGS) == [StartPipeline()]


# --- the validate step's status (pipeline.refused / pipeline.accepted) -------------------------------


def test_a_refusal_is_news_once_per_reason_and_ready_follows_it():
    from proxymodel_operator.pipeline import refused

    spec = pxm()["spec"]
    patch, news = refused({}, spec, 2, "InvalidSpec", "spec.pruning.experts: 0", {"settings": "s1"})
    assert news and patch["phase"] == "Failed" and patch["observedGeneration"] == 2
    assert patch["refusal"] == refusal("InvalidSpec", 2, {"settings": "s1"}, False)
    kinds = {c["type"]: (c["status"], c["reason"]) for c in patch["conditions"]}
    assert kinds == {"Accepted": ("False", "InvalidSpec"), "Ready": ("False", "Refused")}
    again, news = refused(patch, spec, 2, "InvalidSpec", "spec.pruning.experts: 0", {"settings": "s1"})
    assert not news and again["conditions"] == patch["conditions"]  # judged again: no second Event
    other, news = refused(patch, spec, 2, "SecretNotFound", "no Secret creds", {}, temporary=True)
    assert news and other["phase"] == "Pending" and other["refusal"]["temporary"]


def test_acceptance_starts_the_pipeline_and_keeps_only_accepted_and_ready():
    from moe_proxy.sizing import SizingOptions, estimate
    from proxymodel_operator.pipeline import accepted as accept
    from proxymodel_operator.spec import parse

    from .test_planner import QWEN3

    body = pxm()
    parsed = parse(body["spec"], NS, NAME, SETTINGS)
    plan = estimate(QWEN3, SizingOptions(experts=4))
    before = {"phase": "Failed", "refusal": refusal("InvalidSpec", 1, {}, False),
              "conditions": [{"type": "Accepted", "status": "False", "reason": "InvalidSpec"},
                             {"type": "ProxyReady", "status": "True", "reason": "Built"}]}
    patch, message = accept(before, body["spec"], 1, parsed, plan)
    assert patch["refusal"] is None and patch["phase"] == "Pending"
    assert patch["plan"]["proxy"]["expertsPerLayer"] == 4
    assert patch["pipeline"]["specHash"] == spec_hash(body["spec"]) and patch["pipeline"]["generation"] == 1
    assert patch["experts"] == "8->4" and message.startswith("Qwen3-MoE: 8 -> 4 experts per layer; 8 -> ")
    kinds = {c["type"]: (c["status"], c["reason"]) for c in patch["conditions"]}
    assert kinds == {"Accepted": ("True", "SpecValid"), "Ready": ("False", "Pending")}  # ProxyReady: the old spec's
    patch, message = accept({}, body["spec"], 1, parsed, None)
    assert patch["plan"] is None and message.startswith("spec accepted (preflight disabled)")
