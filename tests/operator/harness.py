"""What the operator tests share: a kubectl for the emulator, waiting, example objects."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import kmock
import kopf

from proxymodel_operator.resources import JOBS, PODS, PROXYMODELS, SECRETS, Resource

ACCESS_KEY, SECRET_KEY = "AKIAMOEPROXYTEST", "s3cr3t-never-in-status-0123456789"
BUCKET = "ckpt"
SOURCE = f"s3://{BUCKET}/qwen3-moe/global_step_100"
QWEN3 = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
}  # Qwen3-30B-A3B
DENSE = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}


class Api:
    """A test's kubectl: requests to the emulator over HTTP (so watch streams see them)."""

    def __init__(self, emulator: kmock.KubernetesEmulator, session: aiohttp.ClientSession):
        self.emulator, self.session = emulator, session

    async def _call(self, method: str, path: str, body: dict | None = None, merge: bool = False) -> dict:
        headers = {"Content-Type": "application/merge-patch+json"} if merge else {}
        async with self.session.request(method, path.lstrip("/"), json=body, headers=headers) as response:
            data = await response.json(content_type=None)
            assert response.status < 400, (method, path, response.status, data)
            return data

    async def create(self, resource: Resource, namespace: str, obj: dict) -> dict:
        obj.setdefault("metadata", {}).setdefault("namespace", namespace)
        obj.setdefault("apiVersion", resource.api_version)
        obj.setdefault("kind", resource.kind)
        return await self._call("POST", resource.path(namespace), obj)

    async def patch(self, resource: Resource, namespace: str, name: str, body: dict) -> dict:
        return await self._call("PATCH", resource.path(namespace, name), body, merge=True)

    async def patch_status(self, resource: Resource, namespace: str, name: str, status: dict,
                           resource_version: str | None = None) -> dict:
        """What another controller writing this object's status would send."""
        body: dict = {"status": status}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self._call("PATCH", resource.path(namespace, name, "status"), body, merge=True)

    async def patch_spec(self, resource: Resource, namespace: str, name: str, spec: dict) -> dict:
        return await self.patch(resource, namespace, name, {"spec": spec})

    async def delete(self, resource: Resource, namespace: str, name: str) -> dict:
        return await self._call("DELETE", resource.path(namespace, name))

    def key(self, resource: Resource) -> str:
        return f"{resource.group}/{resource.version}/{resource.plural}".lstrip("/")

    def get(self, resource: Resource, namespace: str, name: str) -> dict | None:
        """The emulator's current state of an object (None if absent or deleted)."""
        key = (kmock.resource(self.key(resource)), namespace, name)
        if key not in self.emulator.objects or self.emulator.objects[key].deleted:
            return None
        return json.loads(json.dumps(dict(self.emulator.objects[key].raw)))

    def names(self, resource: Resource, namespace: str) -> list[str]:
        out = []
        for (res, ns, name), obj in list(self.emulator.objects.items()):
            if res == kmock.resource(self.key(resource)) and ns == namespace and not obj.deleted:
                out.append(name)
        return sorted(out)

    def objects_of(self, plural: str, namespace: str) -> list[dict]:
        """Every live object of a resource (by plural) in a namespace, oldest first."""
        found = [dict(obj.raw) for (resource, ns, _), obj in list(self.emulator.objects.items())
                 if resource.plural == plural and ns == namespace and not obj.deleted]
        return sorted(found, key=lambda o: int(o.get("metadata", {}).get("resourceVersion") or 0))

    def event_reasons(self, namespace: str, name: str) -> list[str]:
        """The reasons of the Events about object `name`, oldest first. kopf posts Events from a
        queue, so the last may land after the status patch a test waits for: poll with eventually."""
        return [e["reason"] for e in self.objects_of("events", namespace)
                if e.get("involvedObject", {}).get("name") == name]

    def status(self, namespace: str, name: str) -> dict:
        return (self.get(PROXYMODELS, namespace, name) or {}).get("status") or {}

    def condition(self, namespace: str, name: str, kind: str) -> dict:
        for c in self.status(namespace, name).get("conditions") or []:
            if c["type"] == kind:
                return c
        return {}

    async def secret(self, namespace: str, name: str, **data: str) -> None:
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        await self.create(SECRETS, namespace, {"metadata": {"name": name}, "type": "Opaque", "data": encoded})

    # --- what the Job controller and the kubelet would do -------------------------------------

    async def finish_pod(self, namespace: str, job: dict, container: str, exit_code: int, message: str = "",
                         reason: str | None = None, index: int = 0) -> None:
        """A pod of `job` whose container terminated (with a termination message)."""
        labels = job["spec"]["template"]["metadata"]["labels"] if "template" in job["spec"] else \
            _first_template(job)["metadata"]["labels"]
        pod = {
            "metadata": {"name": f"{job['metadata']['name']}-{index}", "labels": {**labels, "job-name": job["metadata"]["name"]}},
            "spec": {"containers": [{"name": container, "image": "x"}]},
            "status": {"phase": "Succeeded" if exit_code == 0 else "Failed", "containerStatuses": [{
                "name": container, "state": {"terminated": {
                    "exitCode": exit_code, "reason": reason or ("Completed" if exit_code == 0 else "Error"),
                    "message": message}}}]},
        }
        await self.create(PODS, namespace, pod)

    async def waiting_pod(self, namespace: str, job: dict, container: str, reason: str) -> None:
        labels = job["spec"]["template"]["metadata"]["labels"]
        pod = {"metadata": {"name": f"{job['metadata']['name']}-w", "labels": labels},
               "spec": {"containers": [{"name": container, "image": "x"}]},
               "status": {"phase": "Pending", "containerStatuses": [{
                   "name": container, "state": {"waiting": {"reason": reason, "message": "Back-off pulling image"}}}]}}
        await self.create(PODS, namespace, pod)

    async def transformer_succeeds(self, namespace: str, job: dict) -> None:
        """The transformer Job `job` completes and reports TRANSFORMER_REPORT."""
        await self.finish_pod(namespace, job, "transformer", 0, json.dumps(TRANSFORMER_REPORT))
        await self.job_condition(namespace, job["metadata"]["name"], "Complete")

    async def job_condition(self, namespace: str, name: str, kind: str, reason: str = "") -> None:
        cond = {"type": kind, "status": "True", "reason": reason, "message": ""}
        await self.patch(JOBS, namespace, name, {"status": {"conditions": [cond]}})


def _first_template(workload: dict) -> dict:
    spec = workload["spec"]
    if "tasks" in spec:
        return spec["tasks"][0]["template"]
    return spec["replicaSpecs"]["Master"]["template"]


async def eventually(check: Callable[[], object], timeout: float = 20.0,
                     what: str | Callable[[], str] = "") -> object:
    """Poll until `check()` is truthy (returns it) or fail after `timeout` seconds. `what` may
    be a function: it then describes the state at the moment of failure (e.g. progress)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            described = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout}s waiting for {described or check}")
        await asyncio.sleep(0.05)


def proxymodel(name: str, **spec_overrides) -> dict:
    """A ProxyModel of the session's Qwen3-30B-A3B checkpoint, to 16 experts per layer."""
    spec = {
        "source": {"uri": SOURCE, "credentialsSecret": "s3-creds", "region": "us-east-1"},
        "pruning": {"experts": 16, "method": "cluster", "features": "router", "seed": 7, "pin": ["3:17"]},
        "reproduction": {"runtime": "Job", "maxSteps": 30, "failOn": {"signature": "overflow"},
                         "accelerator": {"devices": "auto"}},
    }
    for key, value in spec_overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return {"metadata": {"name": name}, "spec": spec}


TRANSFORMER_REPORT = {
    "proxy_uri": "s3://ckpt/qwen3-moe/global_step_100-proxies/team-a/q3/",
    "manifest_sha256": "ab" * 32, "architecture": "Qwen3-MoE",
    "experts_per_layer": {"before": 128, "after": 16, "top_k": 8},
    "params": {"total_before": 30532122624, "total_after": 4559142912, "active_before": 3347822592,
               "active_after": 3347822592},
    "bytes": {"before": 61064245248, "after": 9118285824},
}


def tiny_proxy_in(root) -> object:
    """A tiny Qwen3-MoE (8 experts, top-2) under `root`/original and its proxy at 4 experts
    (returned: `root`/proxy), in local directories, for runs as local processes."""
    from moe_proxy.pruning import build_proxy
    from moe_proxy.demo.tiny import make_tiny

    make_tiny("qwen3_moe", root / "original")
    build_proxy(str(root / "original"), str(root / "proxy"), experts=4)
    return root / "proxy"


def tiny_report(proxy) -> str:
    """The transformer's termination message for the tiny proxy at `proxy`."""
    return json.dumps({"proxy_uri": str(proxy), "manifest_sha256": "ab" * 32, "architecture": "Qwen3-MoE",
                       "experts_per_layer": {"before": 8, "after": 4, "top_k": 2}, "params": {}, "bytes": {}})


def registry_copy(runtimes: tuple[str, ...] | None = ()) -> kopf.OperatorRegistry:
    """A registry of its own holding what the default one holds (the handlers that importing
    proxymodel_operator.handlers registers) and the handlers of the workloads of `runtimes`
    (empty: all; None: none): a test adds to it without touching other tests."""
    from proxymodel_operator.handlers import register_workloads

    default, fresh = kopf.get_default_registry(), kopf.OperatorRegistry()
    for part in ("_activities", "_indexing", "_watching", "_spawning", "_changing", "_webhooks"):
        for handler in getattr(default, part).get_all_handlers():
            getattr(fresh, part).append(handler)
    if runtimes is not None:
        register_workloads(runtimes, fresh)
    return fresh


@dataclass(frozen=True)
class Record:
    """One log record of the operator's: about an object (kopf's object logger) or not."""

    index: int
    logger: str
    level: int
    message: str
    namespace: str | None
    name: str | None
    exception: bool  # logged with a traceback (logger.exception)


class _Recorder(logging.Handler):
    def __init__(self, records: list[Record]) -> None:
        super().__init__(logging.DEBUG)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        if not record.name.startswith(("kopf", "proxymodel_operator", "asyncio")):
            return
        ref = getattr(record, "k8s_ref", None) or {}
        self.records.append(Record(len(self.records), record.name, record.levelno, record.getMessage(),
                                   ref.get("namespace"), ref.get("name"), bool(record.exc_info)))


class _EventQueue:
    """kopf queues the Events the handlers post (kopf.event, kopf.warn, and object-logger records
    above its posting level) and a background task posts them: how many were queued and how
    many posts have ended (posted, or given up on), counted at kopf's two ends of the queue.
    Queued is counted before the event enters the queue, so posted == queued means drained."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.queued = self.posted = 0

    def reset(self) -> None:  # a new operator: what a stopped one left queued is gone with it
        with self._lock:
            self.queued = self.posted = 0

    def count(self, attr: str) -> None:
        with self._lock:
            setattr(self, attr, getattr(self, attr) + 1)

    def drained(self) -> bool:
        with self._lock:
            return self.queued == self.posted

    def install(self) -> None:
        """Wrap kopf's enqueue and post (kopf._core.engines.posting looks both up at call time)."""
        from kopf._core.engines import posting

        enqueue, post = posting.enqueue, posting.events.post_event

        def counted_enqueue(*args, **kwargs):
            self.count("queued")
            return enqueue(*args, **kwargs)

        async def counted_post(*args, **kwargs):
            try:
                return await post(*args, **kwargs)
            finally:
                self.count("posted")

        posting.enqueue, posting.events.post_event = counted_enqueue, counted_post


EVENT_QUEUE = _EventQueue()
EVENT_QUEUE.install()


# What kopf logs when a handler raised something other than kopf's Temporary/PermanentError (it
# then retries it, or for event handlers, drops it), and what asyncio logs for a task that died.
HANDLER_ERRORS = ("failed with an exception", "Task exception was never retrieved", "Unhandled error")


class Operator:
    """The operator's handlers run by kopf in a thread with its own event loop, as `kopf run`
    would. (In the test's loop kopf would cancel the test's own tasks when it stops.) Every
    record it logs is kept (`records`): tests wait on what the operator reported about an
    object, and a handler exception fails the test (`check_handler_errors`)."""

    def __init__(self, namespaces: list[str] | None = None, registry: kopf.OperatorRegistry | None = None) -> None:
        self.namespaces = namespaces or []  # none: cluster-wide
        self.registry = registry
        self.thread: threading.Thread | None = None
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None
        self.records: list[Record] = []
        self.expected_errors: list[str] = []
        self.stopping: list[int] = []  # record counts when each stop began
        self.starting: list[int] = []  # ... and each start
        self._recorder = _Recorder(self.records)

    def _run(self, ready: threading.Event) -> None:
        try:
            asyncio.run(kopf.operator(clusterwide=not self.namespaces, namespaces=self.namespaces, standalone=True,
                                      stop_flag=self.stop_flag, ready_flag=ready, registry=self.registry))
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self.error = exc

    async def start(self) -> None:
        ready = threading.Event()
        self.stop_flag = threading.Event()
        self.starting.append(len(self.records))
        EVENT_QUEUE.reset()
        for name in ("kopf", "proxymodel_operator"):  # INFO at least: handlers report outcomes there
            logger = logging.getLogger(name)
            if logger.getEffectiveLevel() > logging.INFO:
                logger.setLevel(logging.INFO)
        for name in ("kopf", "proxymodel_operator", "asyncio"):
            logging.getLogger(name).addHandler(self._recorder)
        self.thread = threading.Thread(target=self._run, args=(ready,), name="operator", daemon=True)
        self.thread.start()
        assert await asyncio.to_thread(ready.wait, 15), "the operator did not start"
        await asyncio.sleep(0.3)  # let the watch streams open

    async def stop(self) -> None:
        if self.thread is not None:
            self.stopping.append(len(self.records))  # what handlers log after this is shutdown's
            self.stop_flag.set()
            await asyncio.to_thread(self.thread.join, 20)
            assert not self.thread.is_alive(), "the operator did not stop"
            self.thread = None
        for name in ("kopf", "proxymodel_operator", "asyncio"):
            logging.getLogger(name).removeHandler(self._recorder)
        assert self.error is None, f"the operator failed: {self.error!r}"

    async def events_posted(self, timeout: float = 20.0) -> None:
        """Wait until every Event the operator has queued so far is posted (or given up on):
        kopf posts them from a queue, after the status patch that ends a handler. Count Events
        after this, once whatever could queue a duplicate has run."""
        await eventually(EVENT_QUEUE.drained, timeout, what=lambda: f"kopf to post its queued Events "
                         f"({EVENT_QUEUE.posted} of {EVENT_QUEUE.queued} posted)")

    def mark(self) -> int:
        """A point in the operator's log: `logged(..., since=mark)` looks only after it."""
        return len(self.records)

    def found(self, text: str, name: str | None = None, since: int = 0) -> list[Record]:
        return [r for r in self.records[since:] if text in r.message and (name is None or r.name == name)]

    async def logged(self, text: str, name: str | None = None, since: int = 0, timeout: float = 20.0) -> Record:
        """Wait until the operator logs `text` (about the object `name`) after `since`."""
        found = await eventually(lambda: self.found(text, name, since), timeout,
                                 what=f"the operator to log {text!r} about {name or 'anything'}")
        return found[0]

    async def handled(self, handler: str, name: str, since: int = 0, timeout: float = 20.0) -> Record:
        """Wait until kopf reports that `handler` finished with object `name` after `since`
        (succeeded, failed, or, for the pipeline, refused the ProxyModel)."""
        def done() -> list[Record]:
            return [r for r in self.records[since:] if r.name == name and r.message.startswith(f"Handler '{handler}' ")
                    and not r.message.startswith(f"Handler '{handler}' is ")]
        found = await eventually(done, timeout, what=f"kopf to finish handler {handler!r} for {name}")
        return found[0]

    def expect_handler_errors(self, text: str) -> None:
        """This test causes handler errors whose message holds `text`: they do not fail it."""
        self.expected_errors.append(text)

    def handler_errors(self) -> list[Record]:
        """Handler exceptions while the operator ran (those of its shutdown, e.g. a timer whose
        client the cleanup closed, are not the test's doing)."""
        running = [range(start, stop) for start, stop in zip(self.starting, [*self.stopping, len(self.records)])]
        return [r for r in self.records if any(r.index in span for span in running) and r.level >= logging.ERROR
                and (any(e in r.message for e in HANDLER_ERRORS) or r.exception and r.logger != "asyncio")
                and not any(e in r.message for e in self.expected_errors)]

    def check_handler_errors(self) -> None:
        errors = self.handler_errors()
        assert not errors, "handlers raised exceptions (kopf caught them): " + "; ".join(
            f"{r.name or r.logger}: {r.message}" for r in errors[:5])
