"""The reproduction workload: one RL run on the proxy over the planned accelerators.

One pod per node, one pod template, wrapped by the runtime spec.reproduction.runtime names
(`runtimes.py`: a batch/v1 Job, a Volcano gang, an Ascend MindCluster AscendJob, a JobSet, a
Kubeflow TrainJob, or a KubeRay RayJob, whose head and workers run the template's container
with its command as the Ray job's entrypoint). The pods
find each other as the runtime's `Rendezvous` says: every container gets MASTER_ADDR,
MASTER_PORT, NNODES, NODE_RANK and NPROC_PER_NODE (or the runtime's own variables for them).

By default the container runs `moe-proxy repro --nnodes N --node-rank R --nproc-per-node D
--master-addr A --master-port Q`: one torch.distributed run of N x D ranks; rank 0 (node 0's
pod) writes the verdict as its termination message. A user's own pod template (verl,
MindSpeed-RL...) keeps its containers and gets the same environment, the proxy's facts, and a
`moe-proxy watch` native sidecar (an init container that restarts Always) that follows the
framework's metrics (a verl FileLogger file, or TensorBoard events: `watched_path`) on a shared
volume and writes the verdict as its termination message.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from moe_proxy.options import to_args

from .children import (REPRODUCTION, TERMINATION_LOG, child_name, container_basics, labels, merge_env,
                       pod_spec_basics, s3_env)
from .resources import KUEUE_QUEUE_LABEL, LABEL_CHILD, SERVICES
from .runtimes import MASTER_PORT, RUNTIMES, WATCHER, Runtime
from .spec_types import ProxyModelSpec

RUN_DIR = "/run/moe-proxy"
DEFAULT_CONTAINER = "reproduction"
RUN_VOLUME = "moe-proxy-run"  # the emptyDir a user's framework shares with the watcher
METRICS_PATH = f"{RUN_DIR}/metrics.jsonl"  # VERL_FILE_LOGGER_PATH unless the template sets it
STOP_FILE = f"{RUN_DIR}/stop"  # the watcher makes it when the failure is in (failOn.stopOnReproduce)
READY_FILE = f"{RUN_DIR}/watcher-ready"  # the watcher makes it once SIGTERM cannot kill it unheard
SHELLS = frozenset({"sh", "bash", "dash", "ash", "ksh", "zsh"})
SHELL_ZERO = "moe-proxy-run"  # $0 of a `sh -c SCRIPT` given extra args: they are then its "$@"


@dataclass(frozen=True)
class Placement:
    devices: int  # total accelerators
    per_pod: int  # accelerators per pod (one pod per node)
    pods: int


def placement(devices: int, devices_per_node: int) -> Placement:
    per_pod = min(devices, devices_per_node)
    return Placement(devices, per_pod, math.ceil(devices / per_pod))


def _var(name: str) -> str:
    """A reference Kubernetes expands in command, args (and later env values): $(NAME)."""
    return f"$({name})"


def repro_args(spec: ProxyModelSpec, proxy_uri: str, runtime: Runtime | None = None,
               where: Placement | None = None) -> list[str]:
    """`moe-proxy repro` for one pod: with a placement, this node's ranks of the whole run."""
    return ["repro", proxy_uri, "--out", RUN_DIR, *repro_flags(spec, runtime, where)]


def repro_flags(spec: ProxyModelSpec, runtime: Runtime | None = None, where: Placement | None = None) -> list[str]:
    """repro's flags for spec.reproduction (what rl.run_options.repro_settings reads back)."""
    r = spec.reproduction
    # spec.reproduction's RL settings as the CLI spells them (the same model: rl.config.ReproConfig);
    # steps and precision always, as their ProxyModel defaults are not the CLI's.
    args = to_args(r.config, always=("steps", "precision"))
    if r.fail_on:
        args += ["--fail-on", r.fail_on.cli()]
    if where is not None:
        args += ["--nproc-per-node", str(where.per_pod)]
        rv = runtime.rendezvous
        if where.pods > 1 and rv.per_node:
            args += ["--nnodes", str(where.pods), "--node-rank", _var(rv.node_rank),
                     "--master-addr", _var(rv.master_addr), "--master-port", _var(rv.master_port)]
    return args + ["--termination-log", TERMINATION_LOG]


def ep_sizes(experts: int, devices: int) -> list[int]:
    """Expert-parallel sizes that fit: they divide the experts per layer and the devices."""
    return [size for size in range(1, min(experts, devices) + 1) if experts % size == 0 and devices % size == 0]


def proxy_env(spec: ProxyModelSpec, proxy_uri: str, manifest_sha256: str, where: Placement,
              experts_per_layer: int | None = None, top_k: int | None = None) -> list[dict]:
    """What any reproduction container learns about the proxy and the run it is part of."""
    r = spec.reproduction
    env = [
        {"name": "MOEPROXY_PROXY_URI", "value": proxy_uri},
        {"name": "MOEPROXY_PROXY_MANIFEST_SHA256", "value": manifest_sha256},
        {"name": "MOEPROXY_MAX_STEPS", "value": str(r.max_steps)},
        {"name": "MOEPROXY_DEVICES", "value": str(where.devices)},
        {"name": "MOEPROXY_NODES", "value": str(where.pods)},
    ]
    if experts_per_layer:
        env += [{"name": "MOEPROXY_EXPERTS_PER_LAYER", "value": str(experts_per_layer)},
                {"name": "MOEPROXY_EP_SIZES",
                 "value": ",".join(map(str, ep_sizes(experts_per_layer, where.devices)))}]
    if top_k:
        env.append({"name": "MOEPROXY_TOP_K", "value": str(top_k)})
    if r.fail_on:
        env.append({"name": "MOEPROXY_FAIL_ON", "value": r.fail_on.cli()})
    return env


def rendezvous_env(runtime: Runtime, name: str, where: Placement) -> list[dict]:
    """MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK, NPROC_PER_NODE as far as the operator can
    declare them: the rest is the runtime's own (Ascend: MASTER_ADDR/PORT; Volcano and Ascend:
    the node rank, see `node_rank_prelude`)."""
    rv = runtime.rendezvous
    env = [{"name": "NNODES", "value": str(where.pods)}, {"name": "NPROC_PER_NODE", "value": str(where.per_pod)}]
    if where.pods == 1:
        return env + [{"name": "NODE_RANK", "value": "0"}, {"name": "MASTER_ADDR", "value": "127.0.0.1"},
                      {"name": "MASTER_PORT", "value": str(MASTER_PORT)}]
    if rv.node_rank_field:
        env.append({"name": "NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": rv.node_rank_field}}})
    if rv.master:
        env += [{"name": "MASTER_ADDR", "value": rv.master(name, where.pods)},
                {"name": "MASTER_PORT", "value": str(MASTER_PORT)}]
    return env


def headless_service(runtime: Runtime, workload: dict) -> dict | None:
    """The Service whose name is the pods' subdomain (`<job>-<i>.<job>`): DNS records for every
    pod, ready or not, as the ranks meet before any is ready. None when the runtime makes its
    own (Volcano's svc plugin, the Ascend operator) or the run has one pod."""
    subdomain = runtime.pod_templates(workload["spec"])[0]["spec"].get("subdomain")
    if not runtime.rendezvous.service or not subdomain:
        return None
    meta = workload["metadata"]
    return {"apiVersion": SERVICES.api_version, "kind": SERVICES.kind,
            "metadata": {"name": subdomain, "namespace": meta["namespace"], "labels": dict(meta["labels"])},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {LABEL_CHILD: meta["name"]}}}


def _accelerator_resources(existing: dict, resource: str, count: int) -> dict:
    out = copy.deepcopy(existing or {})
    for kind in ("limits", "requests"):  # extended resources: requests must equal limits
        out.setdefault(kind, {})[resource] = count
    return out


def node_rank_prelude(runtime: Runtime, where: Placement) -> str:
    """Shell that exports NODE_RANK from the runtime's own variable, where only that holds it."""
    rv = runtime.rendezvous
    if where.pods == 1 or rv.node_rank == "NODE_RANK":
        return ""
    return f'export NODE_RANK="${{NODE_RANK:-${rv.node_rank}}}"; '


# Runs the framework; ends it when the watcher made the stop file (then the run ended as asked:
# exit 0); passes SIGTERM on.
_STOPPABLE = ('"$@" & child=$!; trap \'kill -TERM $child 2>/dev/null\' TERM; '
              'while kill -0 $child 2>/dev/null; do '
              f'if [ -e {STOP_FILE} ]; then kill -TERM $child; wait $child; exit 0; fi; sleep 1; done; '
              'wait $child')


def _wrapped(container: dict, prelude: str, stoppable: bool) -> None:
    """Put the rendezvous prelude (and the stop watch) in front of a container's own command.
    A container without `command` (the image's entrypoint) is left as it is."""
    if not container.get("command") or not (prelude or stoppable):
        return
    script = prelude + (_STOPPABLE if stoppable else 'exec "$@"')
    container["command"] = ["/bin/sh", "-c", script, "moe-proxy-rendezvous", *container["command"]]


class ArgsIgnored(ValueError):
    """Args added to a container would not reach the command it runs: the message says why."""


def shell_script(argv: Sequence[str]) -> int | None:
    """Where SCRIPT is in `argv` when it is `SHELL [options] -c SCRIPT [ARG0 [ARGS]]` (None: it is not)."""
    if not argv or argv[0].rsplit("/", 1)[-1] not in SHELLS:
        return None
    command_mode, i = False, 1
    while i < len(argv):
        arg = argv[i]
        if arg in ("-o", "+o", "-O", "+O"):  # an option name follows
            i += 2
        elif arg == "--":
            i += 1
            break
        elif arg.startswith("--"):  # --login, --norc, ...
            i += 1
        elif arg[:1] in ("-", "+") and len(arg) > 1:
            command_mode = command_mode or "c" in arg[1:]
            i += 1
        else:
            break
    return i if command_mode and i < len(argv) else None


def appended(container: dict, extra: Sequence[str]) -> list[str]:
    """The container's args with `extra` added where they reach what it runs. A command takes
    them after its own args; a `sh -c SCRIPT` only as "$@" (or $*), after a $0 of its own, so a
    script that reads neither would silently drop them: ArgsIgnored, as for a container without
    command or args (args would replace the image's CMD)."""
    own = list(container.get("args") or [])
    if not extra:
        return own
    argv = [*(container.get("command") or []), *own]
    if not argv:
        raise ArgsIgnored("it has neither command nor args: added args would replace the image's CMD (give it a "
                          "command; args then follow it)")
    script = shell_script(argv)
    if script is None:
        return [*own, *extra]
    if not re.search(r"\$\{?[@*]", argv[script]):
        raise ArgsIgnored(f"it runs `{argv[0].rsplit('/', 1)[-1]} -c SCRIPT`, whose script reads no arguments: added "
                          'args would be dropped (end the command that should take them with "$@" in the script, or '
                          "patch env instead)")
    return [*own, *([] if script + 1 < len(argv) else [SHELL_ZERO]), *extra]


def first_container(spec: ProxyModelSpec) -> dict:
    """The reproduction's first container as the spec gives it (what a Diagnosis run's args
    extend): a template's own, else spec.reproduction.workload's command and args or
    `moe-proxy repro`'s."""
    r = spec.reproduction
    if r.template is not None:
        return r.template["spec"]["containers"][0]
    return {"command": r.workload.command or ["moe-proxy"], "args": r.workload.args or ["repro"]}


def _env_value(env: list[dict], name: str) -> str | None:
    return next((e.get("value") for e in env if e["name"] == name), None)


def watched_path(env: list[dict], verl: str) -> str:
    """What the watcher follows: the framework's first container's MOEPROXY_METRICS_PATH, else its
    verl FileLogger file (`verl`, set by the template or ours), unless only TENSORBOARD_LOGGING_DIR
    is set (transformers' Trainer and TRL write their event files there)."""
    chosen = _env_value(env, "MOEPROXY_METRICS_PATH") or _env_value(env, "VERL_FILE_LOGGER_PATH")
    return chosen or _env_value(env, "TENSORBOARD_LOGGING_DIR") or verl


def watcher(spec: ProxyModelSpec, runtime: Runtime, where: Placement, env: list[dict], metrics: str,
            mounts: list[dict]) -> dict:
    """The native sidecar: `moe-proxy watch` on the framework's metrics file. It writes the
    verdict (its termination message) as soon as it decides and stays until the pod ends (a
    native sidecar that exits is restarted); on SIGTERM it reads the rest and writes the final
    one. Only node 0 has metrics: on the other nodes it waits and writes nothing. Its startupProbe
    holds the framework's containers back until the watcher listens for SIGTERM: a framework that
    ends within the watcher's start-up would otherwise leave no verdict."""
    r = spec.reproduction
    rank = runtime.rendezvous.init_node_rank
    args = ["watch", metrics, "--termination-log", TERMINATION_LOG, "--hold", "--ready-file", READY_FILE,
            "--node-rank", _var(rank) if rank and where.pods > 1 else "0",
            # logged, the run is judged at once (a framework that never marks its end is judged at SIGTERM)
            "--last-step", str(r.max_steps)]
    if r.fail_on:
        args += ["--fail-on", r.fail_on.cli()]
        if r.fail_on.stop_on_reproduce:
            args += ["--stop-file", STOP_FILE]
    container = container_basics(r.workload, WATCHER)
    container.pop("resources", None)  # the framework's requests are the pod's; the watcher needs little
    container.update(restartPolicy="Always", command=["moe-proxy"], args=args, env=env, volumeMounts=mounts,
                     startupProbe={"exec": {"command": ["test", "-e", READY_FILE]},
                                   "periodSeconds": 1, "failureThreshold": 300})
    return container


def run_volume(spec: ProxyModelSpec) -> dict:
    """What a framework and its watcher share at RUN_DIR: spec.reproduction.sharedVolumeClaim (a
    volume every pod mounts: a framework whose logger runs off node 0, as verl's TaskRunner on
    Ray), else an emptyDir of the pod's own."""
    claim = spec.reproduction.shared_volume_claim
    return {"name": RUN_VOLUME, **({"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}})}


def pod_template(spec: ProxyModelSpec, proxy_uri: str, manifest_sha256: str, where: Placement,
                 pod_labels: dict[str, str], runtime: Runtime, name: str = "",
                 experts_per_layer: int | None = None, top_k: int | None = None,
                 extra_args: Sequence[str] = ()) -> dict:
    """`extra_args`: added to the first container's (`appended`), before the rendezvous wrapper."""
    r = spec.reproduction
    env = merge_env(s3_env(spec.source), proxy_env(spec, proxy_uri, manifest_sha256, where, experts_per_layer, top_k))
    env = merge_env(env, rendezvous_env(runtime, name, where)) + runtime.pod_env(spec)
    if r.template is not None:  # the user's own RL framework
        template = copy.deepcopy(r.template)
        template.setdefault("metadata", {}).setdefault("labels", {}).update(pod_labels)
        pod = template["spec"]
        pod.setdefault("restartPolicy", "Never")
        first = pod["containers"][0]
        verl = _env_value(first.get("env") or [], "VERL_FILE_LOGGER_PATH") or METRICS_PATH
        env = merge_env(env, [{"name": "VERL_FILE_LOGGER_PATH", "value": verl}])
        metrics = watched_path(first.get("env") or [], verl)
        shared = {"name": RUN_VOLUME, "mountPath": RUN_DIR}
        prelude = node_rank_prelude(runtime, where)
        stoppable = bool(r.fail_on and r.fail_on.stop_on_reproduce)
        for i, c in enumerate(pod["containers"]):
            c["env"] = merge_env(env, c.get("env") or [])
            mounts = c.setdefault("volumeMounts", [])
            if not any(m.get("mountPath") == RUN_DIR for m in mounts):
                mounts.append(shared)
            # A crash's last log lines reach the pod's status (outcome.Crash) unless the template says otherwise.
            c.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
            if i == 0 and extra_args:
                c["args"] = appended(c, extra_args)
            _wrapped(c, prelude, stoppable and i == 0)
            if i == 0:
                c["resources"] = _accelerator_resources(c.get("resources"), r.accelerator.resource, where.per_pod)
                if runtime.container:
                    c["name"] = runtime.container
        # The watcher sees what the framework's first container sees (a metrics path on its own volume).
        seen = [m for m in first["volumeMounts"] if m.get("mountPath") != RUN_DIR] + [shared]
        pod["initContainers"] = [watcher(spec, runtime, where, env, metrics, seen), *pod.get("initContainers", [])]
        pod.setdefault("volumes", []).append(run_volume(spec))
        return template

    container = container_basics(r.workload, runtime.container or DEFAULT_CONTAINER)
    launcher = ["moe-proxy"]
    if runtime.rendezvous.clears:  # the runtime's RANK/WORLD_SIZE are not torchrun's: our launcher sets them
        launcher = ["env", *(arg for v in runtime.rendezvous.clears for arg in ("-u", v)), "moe-proxy"]
    container["command"] = r.workload.command or launcher
    container["args"] = r.workload.args or repro_args(spec, proxy_uri, runtime, where)
    container["args"] = appended(container, extra_args)
    container["env"] = merge_env(env, r.workload.env)
    container["resources"] = _accelerator_resources(r.workload.resources, r.accelerator.resource, where.per_pod)
    container["volumeMounts"] = [{"name": "run", "mountPath": RUN_DIR}]
    return {
        "metadata": {"labels": pod_labels},
        "spec": {**pod_spec_basics(r.workload), "containers": [container],
                 "volumes": [{"name": "run", "emptyDir": {}}]},
    }


def name_reserve(spec: ProxyModelSpec, devices: int) -> int:
    """Characters a reproduction workload's name leaves free: its pods' host names,
    <name><suffix><index>, are DNS labels too."""
    runtime = RUNTIMES[spec.reproduction.runtime]
    where = placement(devices, spec.reproduction.accelerator.devices_per_node)
    return len(runtime.rendezvous.hostname_suffix) + len(str(where.pods - 1)) if where.pods > 1 else 0


@dataclass(frozen=True)
class Naming:
    """Another owner's name and labels for a reproduction workload (a Diagnosis run): `labels`
    go on the workload and its pods (with the ProxyModel's Kueue queue label, where the runtime
    takes one); `args` are added to the first container's where they take effect (`appended`)."""

    name: str
    labels: dict
    args: tuple[str, ...] = ()
    env: tuple[dict, ...] = ()  # the container's env, over the operator's (a candidate's patch)


def reproduction_workload(proxymodel: str, namespace: str, generation: int, spec: ProxyModelSpec,
                          proxy_uri: str, manifest_sha256: str, devices: int,
                          experts_per_layer: int | None = None, top_k: int | None = None,
                          naming: Naming | None = None) -> dict:
    """The manifest for spec.reproduction.runtime, on `devices` accelerators in total (one pod
    per node); `headless_service` gives the Service it needs, if any. `naming`: the name, labels
    and extra arguments of a run that is not the ProxyModel's own (a Diagnosis's)."""
    r = spec.reproduction
    runtime = RUNTIMES[r.runtime]
    where = placement(devices, r.accelerator.devices_per_node)
    if naming is None:
        name = child_name(proxymodel, REPRODUCTION, generation, name_reserve(spec, devices))
        pod_labels = {**labels(proxymodel, REPRODUCTION, name, generation), **runtime.pod_labels(spec)}
        workload_labels = {**labels(proxymodel, REPRODUCTION, name, generation, spec, kueue=runtime.kueue),
                           **runtime.labels(spec)}
    else:
        name = naming.name
        queue = {KUEUE_QUEUE_LABEL: spec.queue_name} if runtime.kueue and spec.queue_name else {}
        pod_labels = {**naming.labels, **runtime.pod_labels(spec)}
        workload_labels = {**naming.labels, **queue, **runtime.labels(spec)}
    template = pod_template(spec, proxy_uri, manifest_sha256, where, pod_labels, runtime, name,
                            experts_per_layer, top_k, naming.args if naming else ())
    if naming is not None and naming.env:
        first = template["spec"]["containers"][0]
        first["env"] = merge_env(first.get("env") or [], list(naming.env))
    if runtime.rendezvous.service and where.pods > 1:
        template["spec"]["subdomain"] = name  # the headless Service has the workload's name
    return {"apiVersion": runtime.resource.api_version, "kind": runtime.resource.kind,
            "metadata": {"name": name, "namespace": namespace, "labels": workload_labels},
            "spec": runtime.build(spec, where.pods, template)}
