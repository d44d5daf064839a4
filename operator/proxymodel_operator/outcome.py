"""What a child workload's objects say happened: still running, succeeded with a report, or
failed, and for a failure the most specific reason there is.

A Job's own condition only says `BackoffLimitExceeded`; the pods say why: the container's
termination message (our JSON, e.g. {"error": "S3AccessDenied", ...}), a terminated reason
(`OOMKilled`), or a waiting reason that will never resolve by itself (`ImagePullBackOff`).
The most specific one wins, so status names the real cause.

A user's framework that crashes (a container of the template ending with a non-zero exit code)
after its `moe-proxy watch` sidecar wrote a verdict is a finding, not a failure of the
operator's: the watcher's verdict, with the crash (which container, its exit code and reason,
the last lines of its log as the pod has them, the last step logged) added. A non-finite
signature the watcher saw before the crash comes first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_proxy.reports import parse_termination_log

from .resources import Resource
from .runtimes import WATCHER, Conditions, Fields, runtime_of

RUNNING, SUCCEEDED, FAILED = "Running", "Succeeded", "Failed"
WAITING_FOR_VERDICT = "WaitingForVerdict"  # the workload ended, its pods (holding the verdict) not yet
# Waiting reasons that never resolve without a change to the spec: fail instead of hanging.
STUCK_WAITING = ("ImagePullBackOff", "ErrImagePull", "InvalidImageName", "CreateContainerConfigError",
                 "CreateContainerError")
CRASHED = "crashed"  # the signature of a framework that ended with an error before any failure was seen
NON_FINITE = ("nan", "overflow")  # seen before a crash, they are the verdict: the crash followed from them
LOG_TAIL = 2048  # characters of a crashed container's log kept (the kubelet's own limit for it)


@dataclass(frozen=True)
class Outcome:
    state: str  # Running | Succeeded | Failed
    reason: str = ""  # CamelCase, for conditions and Events
    message: str = ""
    report: dict = field(default_factory=dict)  # the parsed termination message, if any


def _condition(obj: dict, kind: str) -> dict | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind and c.get("status") == "True":
            return c
    return None


def workload_state(resource: Resource, obj: dict) -> Outcome:
    """The workload's own verdict, before looking at its pods, read as its runtime says."""
    runtime = runtime_of(resource)
    if runtime is None:
        return Outcome(RUNNING)
    rule = runtime.state
    if isinstance(rule, Fields):
        return Outcome(*rule.read(obj))
    if isinstance(rule, Conditions):
        if _condition(obj, rule.succeeded):
            return Outcome(SUCCEEDED)
        failed = _condition(obj, rule.failed)
        if failed:
            return Outcome(FAILED, failed.get("reason") or "JobFailed", failed.get("message", ""))
        return Outcome(RUNNING)
    state = obj.get("status") or {}  # the object holding the phase, with its reason and message
    for key in rule.path[:-1]:
        state = state.get(key) or {}
    phase = state.get(rule.path[-1])
    if phase in rule.succeeded:
        return Outcome(SUCCEEDED)
    if phase in rule.failed:
        return Outcome(FAILED, state.get("reason") or f"{runtime.name}{phase}", state.get("message", ""))
    if phase in rule.pending and state.get("reason"):
        return Outcome(RUNNING, state["reason"], state.get("message", ""))  # e.g. gang unschedulable
    return Outcome(RUNNING)


@dataclass(frozen=True)
class Crash:
    """A framework container that ended with a non-zero exit code."""

    pod: str
    container: str
    exit_code: int
    reason: str  # the kubelet's: Error, OOMKilled, ...
    log: str = ""  # its log's last lines: the termination message under FallbackToLogsOnError

    def what(self) -> str:
        return f"container {self.container} of pod {self.pod} exited with code {self.exit_code} ({self.reason})"


@dataclass
class PodFindings:
    success_report: dict = field(default_factory=dict)
    watch_report: dict = field(default_factory=dict)  # the moe-proxy watch sidecar's verdict
    crash: Crash | None = None  # the first framework container to end with an error
    error_report: dict = field(default_factory=dict)
    terminated_reason: str = ""  # e.g. OOMKilled
    terminated_message: str = ""
    stuck_reason: str = ""  # e.g. ImagePullBackOff
    stuck_message: str = ""
    unschedulable: str = ""


def examine_pods(pods: list[dict]) -> PodFindings:
    found = PodFindings()
    for pod in sorted(pods, key=lambda p: p.get("metadata", {}).get("creationTimestamp") or ""):
        status = pod.get("status") or {}
        for c in status.get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
                found.unschedulable = c.get("message") or "no node can hold the pod"
        # init containers first: a native sidecar (`moe-proxy watch`) reports a user framework's verdict
        for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
            state = cs.get("state") or {}
            terminated, waiting = state.get("terminated"), state.get("waiting")
            if terminated:
                report = parse_termination_log(terminated.get("message"))
                if terminated.get("exitCode") == 0 and report:
                    found.success_report = report
                elif report.get("error"):
                    found.error_report = report
                if terminated.get("reason") not in (None, "Completed", "Error"):
                    found.terminated_reason = terminated["reason"]
                    found.terminated_message = f"container {cs.get('name')} exited with code {terminated.get('exitCode')}"
            if waiting and waiting.get("reason") in STUCK_WAITING:
                found.stuck_reason = waiting["reason"]
                found.stuck_message = (waiting.get("message") or "")[:500]
        for cs in status.get("initContainerStatuses") or []:
            terminated = (cs.get("state") or {}).get("terminated") or {}
            if cs.get("name") == WATCHER and terminated.get("exitCode") == 0:
                found.watch_report = parse_termination_log(terminated.get("message")) or found.watch_report
        for cs in status.get("containerStatuses") or []:
            terminated = (cs.get("state") or {}).get("terminated") or {}
            if found.crash is None and terminated.get("exitCode") not in (None, 0):
                message = terminated.get("message") or ""
                found.crash = Crash(pod.get("metadata", {}).get("name", ""), cs.get("name", ""),
                                    int(terminated["exitCode"]), terminated.get("reason") or "Error",
                                    "" if parse_termination_log(message) else message[-LOG_TAIL:])
    return found


def with_crash(report: dict, crash: Crash) -> dict:
    """The watcher's verdict on a run whose framework then crashed: unchanged when it reproduced
    the failure; else the first non-finite signature it saw, or `crashed` at the last step
    logged. Either way with the crash (`crash`, and `stopped`, which says what happened)."""
    last = report.get("last_step")
    after = f"after step {last}" if last is not None else "before logging a step"
    what = f"{crash.what()} {after}"
    seen = sorted(((step, name) for name, step in (report.get("also_seen") or {}).items() if name in NON_FINITE))
    out = {**report, "crash": {"pod": crash.pod, "container": crash.container, "exitCode": crash.exit_code,
                               "reason": crash.reason, "lastStep": last, "log": crash.log}}
    if report.get("reproduced"):
        return {**out, "stopped": f"{report.get('signature')} at step {report.get('step')}, then {what}"[:200]}
    if seen:
        step, name = seen[0]
        return {**out, "signature": name, "step": step, "stopped": f"{name} at step {step}, then {what}"[:200]}
    return {**out, "signature": CRASHED, "step": last, "stopped": f"crashed: {what}"[:200]}


def outcome(resource: Resource, obj: dict, pods: list[dict]) -> Outcome:
    """The verdict on a child workload, from the workload and its pods."""
    verdict = workload_state(resource, obj)
    found = examine_pods(pods)
    runtime = runtime_of(resource)
    if verdict.state != RUNNING and runtime is not None and runtime.pods_outlive and not found.success_report \
            and any((p.get("status") or {}).get("phase") in ("Pending", "Running") for p in pods):
        return Outcome(RUNNING, WAITING_FOR_VERDICT, f"the {runtime.name} ended ({verdict.state}); the verdict "
                       "comes with its pods' end (the watcher's or rank 0's termination message)")
    if verdict.state == SUCCEEDED:
        return Outcome(SUCCEEDED, report=found.success_report)
    if verdict.state == FAILED and found.watch_report and found.crash:
        # The framework crashed after the watcher judged what it logged: that is the answer.
        return Outcome(SUCCEEDED, report=with_crash(found.watch_report, found.crash))
    if verdict.state == FAILED and found.success_report.get("reproduced") is True:
        # The failure came back (the watcher's verdict) and then broke the framework: that is the answer.
        return Outcome(SUCCEEDED, report=found.success_report)
    if verdict.state == FAILED or found.stuck_reason:
        if found.error_report:
            return Outcome(FAILED, str(found.error_report["error"]), str(found.error_report.get("message", "")),
                           found.error_report)
        if found.terminated_reason:
            return Outcome(FAILED, found.terminated_reason, found.terminated_message)
        if found.stuck_reason:
            return Outcome(FAILED, found.stuck_reason, found.stuck_message)
        return verdict
    if found.unschedulable:
        return Outcome(RUNNING, "Unschedulable", found.unschedulable)
    return verdict


def count_indexes(ranges: str | None) -> int:
    """How many indexes an Indexed Job's `status.completedIndexes` (or `failedIndexes`) lists:
    "0-2,5" is 4."""
    count = 0
    for part in filter(None, (ranges or "").split(",")):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


COULD_NOT_JUDGE = "could not judge"  # a run whose metrics cannot show the failure asked for: never clean, never cured


def cannot_show(report: dict, fail_on: str | None) -> str | None:
    """Why a run's metrics cannot show `fail_on` (the --fail-on name the run was given), from its
    termination message's `cannot_show` (FailureDetector's, e.g. collapse on a proxy keeping <=
    top-k experts), in the CLI's words (diagnose.seed_outcome); None when they can."""
    said = report.get("cannot_show")
    why = said.get(fail_on) if isinstance(said, dict) and fail_on else None
    return f"{fail_on} cannot show in this run: {why}" if why else None
