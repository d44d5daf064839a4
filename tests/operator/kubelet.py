"""A kubelet for tests: run the pods of a workload the operator made as local processes.

What a node would do with each pod of an Indexed Job / Volcano Job / AscendJob (as its controller
made it from the workload: `controllers.py`), as far as the reproduction's wiring depends on it:
the container's env resolved as the pod spec says (values, `$(VAR)` references to earlier
variables, secretKeyRef and configMapKeyRef from the emulator's Secrets and ConfigMaps,
downward-API fields and annotations such as the completion index), configMap volumes as files,
a failed container's log tail as its termination message under FallbackToLogsOnError,
`$(VAR)` expanded in command and args,
native sidecars (init containers with `restartPolicy: Always`) started first (their startupProbe
passed) and sent SIGTERM once the main containers have exited, and each container's termination
message read from its terminationMessagePath. Where a node differs, it is said: every pod's volumes are directories of
the test, the images' `moe-proxy` and `python` are this checkout's, the pods' host names resolve
to 127.0.0.1 and, all pods sharing this machine's network, MASTER_PORT is a free local port
below the kernel's ephemeral range (`tests/ports.py`: why).
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from proxymodel_operator.resources import PODS, SECRETS, Resource

from ..ports import listen_port

CONFIGMAPS = Resource("", "v1", "configmaps", "ConfigMap")

_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_FIELD = re.compile(r"metadata\.(annotations|labels)\['([^']+)'\]")
MOE_PROXY = str(Path(sys.executable).with_name("moe-proxy"))
# kubelet: pkg/kubelet/kuberuntime/kuberuntime_container.go, FallbackToLogsOnError's tail
# (kubecontainer.MaxContainerTerminationMessageLogLines, ...LogLength)
LOG_TAIL_LINES, LOG_TAIL_BYTES = 80, 2048


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)`: replaced when VAR is defined, left as it is otherwise."""
    return _REF.sub(lambda m: env.get(m.group(1), m.group(0)), text)


@dataclass
class Pod:
    """One pod as the runtime's controller creates it: `template` is its pod template with what
    the controller adds to it (env, volumes, host name) already in `template["spec"]`."""

    name: str
    template: dict
    annotations: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    hostname: str = ""
    subdomain: str = ""


@dataclass
class Ran:
    """A container that ran: its exit code and termination message."""

    name: str
    exit_code: int
    message: str
    output: str


class Kubelet:
    def __init__(self, api, namespace: str, root: Path, hosts: list[str], master_port: int | None = None):
        self.api, self.namespace, self.root = api, namespace, root
        self.hosts = sorted(hosts, key=len, reverse=True)  # the pods' FQDNs -> 127.0.0.1
        self.master_port = str(master_port or listen_port())

    def _field(self, pod: Pod, path: str) -> str:
        if path == "metadata.name":
            return pod.name
        if path == "metadata.namespace":
            return self.namespace
        if path in ("status.podIP", "status.hostIP"):
            return "127.0.0.1"
        match = _FIELD.fullmatch(path)
        assert match, f"downward API field {path!r} is not emulated"
        return (pod.annotations if match.group(1) == "annotations" else pod.labels).get(match.group(2), "")

    def _key(self, resource: Resource, ref: dict) -> str | None:
        """A Secret's (base64) or ConfigMap's value; None for an optional key that is absent."""
        obj = self.api.get(resource, self.namespace, ref["name"]) or {}
        data = obj.get("data") or {}
        if ref["key"] not in data:
            assert ref.get("optional", False), f"{resource.kind} {ref['name']} has no key {ref['key']}"
            return None
        value = data[ref["key"]]
        return base64.b64decode(value).decode() if resource == SECRETS else value

    def resolve_env(self, pod: Pod, container: dict) -> dict[str, str]:
        env: dict[str, str] = {}
        for var in container.get("env") or []:
            if "valueFrom" in var:
                source = var["valueFrom"]
                if "secretKeyRef" in source or "configMapKeyRef" in source:
                    resource, ref = ((SECRETS, source["secretKeyRef"]) if "secretKeyRef" in source
                                     else (CONFIGMAPS, source["configMapKeyRef"]))
                    value = self._key(resource, ref)
                    if value is None:
                        continue
                elif "fieldRef" in source:
                    value = self._field(pod, source["fieldRef"]["fieldPath"])
                else:
                    raise AssertionError(f"env source {source} is not emulated")
            else:
                value = expand(var.get("value", ""), env)
            env[var["name"]] = value
        return env

    def _local(self, pod: Pod, container: dict, text: str) -> str:
        """Paths in the pod's volumes -> the test's directories; pod host names -> 127.0.0.1."""
        for mount in sorted(container.get("volumeMounts") or [], key=lambda m: -len(m["mountPath"])):
            text = text.replace(mount["mountPath"], str(self.root / pod.name / mount["name"]))
        path = container.get("terminationMessagePath", "/dev/termination-log")
        text = text.replace(path, str(self._termination_file(pod, container)))
        for host in self.hosts:
            text = text.replace(host, "127.0.0.1")
        return text

    def _termination_file(self, pod: Pod, container: dict) -> Path:
        return self.root / pod.name / f"{container['name']}.termination-log"

    def start(self, pod: Pod, container: dict) -> subprocess.Popen:
        (self.root / pod.name).mkdir(parents=True, exist_ok=True)
        volumes = {v["name"]: v for v in pod.template["spec"].get("volumes") or []}
        for mount in container.get("volumeMounts") or []:
            directory = self.root / pod.name / mount["name"]
            directory.mkdir(parents=True, exist_ok=True)
            source = volumes.get(mount["name"], {}).get("configMap")
            if source:  # a file per key, as the kubelet projects a ConfigMap
                data = (self.api.get(CONFIGMAPS, self.namespace, source["name"]) or {}).get("data") or {}
                assert data or source.get("optional"), f"ConfigMap {source['name']} is missing"
                for key, value in data.items():
                    (directory / key).write_text(value)
        env = {k: self._local(pod, container, v) for k, v in self.resolve_env(pod, container).items()}
        for port in ("MASTER_PORT", "PET_MASTER_PORT"):  # a free port of this machine's (the Trainer's is PET_)
            if port in env:
                env[port] = self.master_port
        argv = [self._local(pod, container, expand(a, env))
                for a in [*(container.get("command") or []), *(container.get("args") or [])]]
        argv = [MOE_PROXY if a == "moe-proxy" else sys.executable if a in ("python", "python3") else a for a in argv]
        base = {k: os.environ[k] for k in ("PATH", "HOME", "TMPDIR", "PYTHONPATH") if k in os.environ}
        base.update(OMP_NUM_THREADS="1", HOSTNAME=pod.hostname or pod.name)
        out = open(self.root / pod.name / f"{container['name']}.log", "w")  # noqa: SIM115 - closed in wait()
        process = subprocess.Popen(argv, env={**base, **env}, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        process.log = out  # type: ignore[attr-defined]
        return process

    def _ran(self, pod: Pod, container: dict, process: subprocess.Popen) -> Ran:
        process.log.close()  # type: ignore[attr-defined]
        file = self._termination_file(pod, container)
        message = file.read_text() if file.is_file() else ""
        output = (self.root / pod.name / f"{container['name']}.log").read_text()
        if not message and process.returncode != 0 and container.get("terminationMessagePolicy") == \
                "FallbackToLogsOnError":  # the kubelet's log tail: at most 80 lines and 2048 bytes
            message = "\n".join(output.splitlines()[-LOG_TAIL_LINES:]).encode()[-LOG_TAIL_BYTES:].decode(errors="ignore")
        return Ran(container["name"], process.returncode, message, output)

    def _wait_started(self, pod: Pod, container: dict, process: subprocess.Popen) -> None:
        """A sidecar is started once its startupProbe (exec) succeeds, as the kubelet has it (polled
        faster than periodSeconds, within the same failureThreshold x periodSeconds); without one,
        once its process runs (a short grace here)."""
        probe = container.get("startupProbe")
        if not probe:
            time.sleep(0.5)
            return
        argv = [self._local(pod, container, a) for a in probe["exec"]["command"]]
        limit = time.monotonic() + probe.get("failureThreshold", 3) * probe.get("periodSeconds", 10)
        while subprocess.run(argv, check=False).returncode != 0:
            assert process.poll() is None, f"sidecar {container['name']} exited ({process.returncode}) before it started"
            assert time.monotonic() < limit, f"sidecar {container['name']}: startupProbe {argv} never succeeded"
            time.sleep(0.05)

    def run(self, pods: list[Pod], timeout: float = 300) -> dict[str, dict[str, Ran]]:
        """Run every pod at once (a gang); returns pod name -> container name -> Ran."""
        started = []
        for pod in pods:
            sidecars = [c for c in pod.template["spec"].get("initContainers") or [] if c.get("restartPolicy") == "Always"]
            assert len(sidecars) == len(pod.template["spec"].get("initContainers") or []), "plain init containers"
            side = [(c, self.start(pod, c)) for c in sidecars]
            for container, process in side:  # started before the main containers, as the kubelet does
                self._wait_started(pod, container, process)
            main = [(c, self.start(pod, c)) for c in pod.template["spec"]["containers"]]
            started.append((pod, side, main))
        deadline = time.monotonic() + timeout
        results: dict[str, dict[str, Ran]] = {}
        try:
            for pod, side, main in started:
                for container, process in main:
                    try:
                        process.wait(timeout=max(1.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        raise AssertionError(f"pod {pod.name}: {container['name']} still ran after {timeout:g}s; "
                                             + self._tails(started)) from None
                for container, process in reversed(side):  # then the sidecars, in reverse order
                    process.send_signal(signal.SIGTERM)
                    process.wait(timeout=30)
                results[pod.name] = {c["name"]: self._ran(pod, c, p) for c, p in [*side, *main]}
        finally:
            for _, side, main in started:
                for _, process in [*side, *main]:
                    if process.poll() is None:
                        os.killpg(process.pid, signal.SIGKILL)
                        process.wait()
        return results

    def _tails(self, started) -> str:
        """The end of every container's output so far: what a hang was waiting for."""
        parts = []
        for pod, side, main in started:
            for container, _ in [*side, *main]:
                log = self.root / pod.name / f"{container['name']}.log"
                text = log.read_text(errors="replace") if log.is_file() else ""
                parts.append(f"--- {pod.name}/{container['name']}:\n{text[-2000:]}")
        return "\n".join(parts)

    async def report(self, pod: Pod, ran: dict[str, Ran]) -> None:
        """Write the pod, with its containers' terminated states, into the emulator (the kubelet's status)."""
        def state(r: Ran) -> dict:
            return {"name": r.name, "state": {"terminated": {
                "exitCode": r.exit_code, "reason": "Completed" if r.exit_code == 0 else "Error", "message": r.message}}}

        spec = pod.template["spec"]
        inits = [c["name"] for c in spec.get("initContainers") or []]
        status = {"phase": "Succeeded" if all(r.exit_code == 0 for r in ran.values()) else "Failed",
                  "initContainerStatuses": [state(ran[n]) for n in inits],
                  "containerStatuses": [state(ran[c["name"]]) for c in spec["containers"]]}
        await self.api.create(PODS, self.namespace, {
            "metadata": {"name": pod.name, "labels": pod.labels, "annotations": pod.annotations},
            "spec": spec, "status": status})
