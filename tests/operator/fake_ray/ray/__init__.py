"""A stand-in for the part of Ray's API that runtimes_ray.LAUNCHER uses, for the test kubelet's
processes (no Ray here): NNODES alive nodes (the plan's pods), the first at this machine's address (the
head), the others elsewhere; a remote function's calls run in threads of this process (the
subprocesses they start are the nodes' ranks, on this machine)."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

from . import util  # noqa: F401 - ray.util, as `import ray` gives it

_POOL = ThreadPoolExecutor(max_workers=16)


def init(*args, **kwargs) -> None:
    pass


def nodes() -> list[dict]:
    count = int(os.environ.get("NNODES", "1"))  # the cluster KubeRay made for the plan: a pod per node
    return [{"Alive": True, "NodeID": f"{i:056x}", "NodeManagerAddress": util.get_node_ip_address() if i == 0
             else f"10.0.0.{i}"} for i in range(count)]


class _Remote:
    def __init__(self, fn, options: dict) -> None:
        self.fn, self.options_ = fn, options

    def options(self, **options) -> _Remote:
        assert "scheduling_strategy" in options  # pinned to its node
        assert "num_gpus" in options or "NPU" in options.get("resources", {})  # holding its devices
        return _Remote(self.fn, {**self.options_, **options})

    def remote(self, *args) -> Future:
        return _POOL.submit(self.fn, *args)


def remote(**options):
    return lambda fn: _Remote(fn, options)


def get(futures: list[Future]) -> list:
    return [f.result() for f in futures]
