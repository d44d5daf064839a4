"""The end of a user's run is a fact (#28 item 3): a framework that crashes is reported `crashed`
with the last step logged, its container's exit code and reason and the end of its log, read
from the pod's status; a non-finite signature the watcher saw before the crash comes first.

- outcome.outcome on pods as the kubelet reports them (the watcher's verdict in its init
  container's status, the framework's exit code and log tail in its container's); a Diagnosis
  run that crashed is inconclusive (it stopped early), as the CLI's rule has it;
- end to end (kopf, the API emulator, the test kubelet running the pods as local processes):
  a framework that logs 3 verl steps and dies on an exception; and TRL's GRPOTrainer
  (`tests/repro/trl_grpo.py`) as the template's framework, its TensorBoard events followed by the
  sidecar, whose NaN update at step 2 crashes step 3's sampling: `nan` at step 2, the crash
  after it. The verdict reaches the ProxyModel's status.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from proxymodel_operator.diagnosis_matrix import decide
from proxymodel_operator.outcome import FAILED, SUCCEEDED, outcome
from proxymodel_operator.reproduction import RUN_DIR
from proxymodel_operator.resources import JOBS, PROXYMODELS
from proxymodel_operator.runtimes import WATCHER

from .harness import eventually, proxymodel, tiny_proxy_in
from .test_diagnosis_decisions import SETTINGS, _done, _finish_all, apply, built, diagnosis
from .test_rendezvous_e2e import NS, _reproduction_of, _run_and_report

FAILED_JOB = {"status": {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}}
LOG = "step 3 done\nTraceback (most recent call last):\nRuntimeError: NCCL watchdog: collective timed out"
TRL_SCRIPT = Path(__file__).parents[1] / "repro" / "trl_grpo.py"


def _pod(watch: dict | None, code: int, log: str = "", reason: str = "Error") -> dict:
    """A pod of a template run: the watcher's verdict, the framework's end (as the kubelet writes them)."""
    inits = [{"name": WATCHER, "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                                          "message": json.dumps(watch)}}}] if watch else []
    return {"metadata": {"name": "r-0"}, "status": {"phase": "Failed", "initContainerStatuses": inits,
            "containerStatuses": [{"name": "verl", "state": {"terminated": {
                "exitCode": code, "reason": reason, "message": log}}}]}}


def _watched(reproduced: bool = False, signature: str | None = None, step: int | None = None, last: int = 3,
             **extra) -> dict:
    return {"reproduced": reproduced, "signature": signature, "step": step, "metrics": {}, "steps_completed": last,
            "last_step": last, **extra}


def test_a_crash_after_the_watchers_verdict_is_crashed_at_the_last_step_with_its_code_and_log():
    seen = outcome(JOBS, FAILED_JOB, [_pod(_watched(), 1, LOG)])
    assert seen.state == SUCCEEDED
    report = seen.report
    assert (report["reproduced"], report["signature"], report["step"]) == (False, "crashed", 3)
    assert report["crash"] == {"pod": "r-0", "container": "verl", "exitCode": 1, "reason": "Error", "lastStep": 3,
                               "log": LOG}
    assert report["stopped"] == "crashed: container verl of pod r-0 exited with code 1 (Error) after step 3"
    # killed for memory, before any step was logged
    oom = outcome(JOBS, FAILED_JOB, [_pod(_watched(last=None, steps_completed=0), 137, reason="OOMKilled")]).report
    assert (oom["signature"], oom["step"], oom["crash"]["reason"]) == ("crashed", None, "OOMKilled")
    assert oom["stopped"].endswith("exited with code 137 (OOMKilled) before logging a step")


def test_non_finite_values_before_the_crash_come_first():
    # asked for divergence; the watcher stopped on a NaN at step 2 (later steps mean nothing)
    nan_first = outcome(JOBS, FAILED_JOB, [_pod(_watched(last=2, also_seen={"nan": 2}), 1, LOG)]).report
    assert (nan_first["reproduced"], nan_first["signature"], nan_first["step"]) == (False, "nan", 2)
    assert nan_first["stopped"].startswith("nan at step 2, then container verl")
    # the NaN asked for: the verdict stands, the crash is added
    reproduced = outcome(JOBS, FAILED_JOB, [_pod(_watched(True, "nan", 2, last=2), 1, LOG)]).report
    assert (reproduced["reproduced"], reproduced["signature"], reproduced["step"]) == (True, "nan", 2)
    assert reproduced["crash"]["exitCode"] == 1


@pytest.mark.parametrize("onset, verdict", [(1, "fixed-but"), (2, "inconclusive")])
def test_a_diagnosis_run_that_crashed_is_never_fixed(onset, verdict):
    """Crashed after 2 steps: past the baseline's onset at step 1, a cure with a crash of its own;
    before its onset at step 2, no cure seen. The crash is in the note either way."""
    crashed = outcome(JOBS, FAILED_JOB, [_pod(_watched(last=2, steps_completed=2), 1, LOG)])
    pm = built()
    body = diagnosis({"candidates": ["fp32"], "seeds": 1})
    body = apply(body, decide(body, pm, {}, SETTINGS))
    body = _finish_all(body, pm, {("baseline", 0): _done(onset), ("fp32", 0): crashed})
    fp32 = body["status"]["candidates"][0]
    assert fp32["verdict"] == verdict, fp32
    assert "seed 0 stopped after 2 of 4 steps (crashed: container verl of pod r-0 exited with code 1" in fp32["note"]


def test_without_a_watchers_verdict_or_a_crash_the_failure_is_the_workloads_as_before():
    assert outcome(JOBS, FAILED_JOB, [_pod(None, 1, LOG)]).state == FAILED  # no verdict to add the crash to
    framework_done = outcome(JOBS, FAILED_JOB, [_pod(_watched(), 0, "", "Completed")])
    assert (framework_done.state, framework_done.reason) == (FAILED, "BackoffLimitExceeded")


CRASHING = textwrap.dedent("""\
    import json, os, time
    with open(os.environ["VERL_FILE_LOGGER_PATH"], "a") as f:
        for step in range(1, 4):
            f.write(json.dumps({"step": step, "data": {"actor/pg_loss": 0.1, "actor/grad_norm": 1.0}}) + "\\n")
            f.flush()
            time.sleep(0.2)
    raise RuntimeError("NCCL watchdog: collective operation timed out")
""")


@pytest.mark.slow
async def test_a_framework_that_crashes_is_crashed_in_status_with_its_exit_code_and_log(cluster, operator, tmp_path):
    script = tmp_path / "framework.py"
    script.write_text(CRASHING)
    template = {"spec": {"containers": [{"name": "verl", "image": "verl:test", "command": ["python", str(script)]}]}}
    await cluster.create(PROXYMODELS, NS, proxymodel("c1", reproduction={
        "runtime": "Job", "maxSteps": 5, "template": template, "failOn": {"signature": "nan"},
        "accelerator": {"devices": 1, "devicesPerNode": 1}}))
    workload = await _reproduction_of(cluster, "c1", tmp_path / "proxy")
    assert workload["spec"]["template"]["spec"]["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"
    _, ran, _ = await _run_and_report(cluster, tmp_path / "node", "Job", workload)
    [pod] = ran.values()
    assert pod["verl"].exit_code == 1 and "RuntimeError: NCCL watchdog" in pod["verl"].message  # the log's tail

    await eventually(lambda: cluster.status(NS, "c1").get("phase") == "NotReproduced", 30, "the verdict in status")
    result = cluster.status(NS, "c1")["reproduction"]
    assert (result["reproduced"], result["signature"], result["step"]) == (False, "crashed", 3)
    crash = result["crash"]
    assert (crash["container"], crash["exitCode"], crash["reason"], crash["lastStep"]) == ("verl", 1, "Error", 3)
    assert crash["log"].rstrip().endswith("RuntimeError: NCCL watchdog: collective operation timed out")
    judged = cluster.condition(NS, "c1", "FailureReproduced")
    assert (judged["status"], judged["reason"]) == ("False", "Crashed")
    assert "exited with code 1 (Error) after step 3" in judged["message"] and "NCCL watchdog" in judged["message"]
    await eventually(lambda: [e for e in cluster.objects_of("events", NS) if e.get("reason") == "Crashed"],
                     what="the Crashed Event")


@pytest.mark.slow
async def test_trl_as_the_framework_nan_at_step_2_then_its_crash(cluster, operator, tmp_path):
    """The same TRL script as tests/repro/test_trl_runs.py, run by the kubelet as the template's
    "framework" on the built proxy ($MOEPROXY_PROXY_URI); the sidecar follows its TensorBoard
    events ($TENSORBOARD_LOGGING_DIR, on the shared volume)."""
    proxy = tiny_proxy_in(tmp_path)
    container = {"name": "trl", "image": "trl:test", "command": ["python", str(TRL_SCRIPT), "--nan-at", "2"],
                 "env": [{"name": "TENSORBOARD_LOGGING_DIR", "value": f"{RUN_DIR}/tb"},
                         {"name": "TRL_OUTPUT_DIR", "value": f"{RUN_DIR}/trl"}]}
    await cluster.create(PROXYMODELS, NS, proxymodel("c2", reproduction={
        "runtime": "Job", "maxSteps": 4, "template": {"spec": {"containers": [container]}},
        "failOn": {"signature": "nan"}, "accelerator": {"devices": 1, "devicesPerNode": 1}}))
    workload = await _reproduction_of(cluster, "c2", proxy)
    pod = workload["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["args"][1] == f"{RUN_DIR}/tb"  # the sidecar follows the event files
    _, ran, _ = await _run_and_report(cluster, tmp_path / "node", "Job", workload)
    [containers] = ran.values()
    assert containers["trl"].exit_code == 1, containers["trl"].output[-3000:]
    assert json.loads(containers[WATCHER].message)["signature"] == "nan", containers[WATCHER].output[-2000:]

    await eventually(lambda: cluster.status(NS, "c2").get("phase") == "Reproduced", 60, "the verdict in status")
    result = cluster.status(NS, "c2")["reproduction"]
    assert (result["reproduced"], result["signature"], result["step"]) == (True, "nan", 2)
    assert (result["crash"]["exitCode"], result["crash"]["lastStep"]) == (1, 2)
    assert "probability tensor contains" in result["crash"]["log"]
    assert cluster.condition(NS, "c2", "FailureReproduced")["message"].startswith(
        "nan at step 2, then container trl of pod")
