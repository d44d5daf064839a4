"""One reproduction run over W ranks (processes): joining the process group, sharding the
models, reducing metrics to their global values, and failing loudly when a rank is lost.

- Backend from the device: hccl (Ascend, torch_npu), nccl (CUDA), gloo (CPU).
- Policy and reference are sharded with FSDP2 (`fully_shard` per decoder layer, then the
  root), as the planner's ZeRO-3/FSDP memory model assumes.
- `Comm` is the run's view of the group. With one rank it is the identity: the
  single-process run needs no process group at all.
- Every collective has a timeout. A rank that dies or hangs makes the others' collectives
  fail; the rank that sees it names the lost rank(s) from the progress each rank posts in
  the rendezvous store, and the run ends with `RankFailed` (no verdict from a partial run).
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import re
import signal
import time

import torch

from moe_proxy.errors import InvalidReproConfig

log = logging.getLogger(__name__)

BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
DEFAULT_TIMEOUT_S = 600.0  # a collective that waits longer than this ends the run
_KEY = "moe_proxy/repro"
SURVIVOR_WAIT_S = 2.0  # how long a rank that saw a collective fail waits for the others to say so too
_NATIVE_PREFIX = re.compile(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")


class RankFailed(RuntimeError):
    """A rank of a distributed run died, hung or failed: the run is void, there is no verdict."""


def launched() -> bool:
    """Whether this process is one rank of a torchrun / torch.distributed.run job."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def backend_for(device: torch.device) -> str:
    return BACKENDS.get(device.type, "gloo")


def device_count(device_type: str) -> int | None:
    """Devices of this type on this node; None for the CPU (any number of ranks may share it)."""
    if device_type == "cuda":
        return torch.cuda.device_count()
    if device_type == "npu":
        return torch.npu.device_count()  # type: ignore[attr-defined]
    return None


def check_local_ranks(device_type: str, nproc: int) -> None:
    present = device_count(device_type)
    if present is not None and nproc > present:
        raise InvalidReproConfig(
            f"--nproc-per-node {nproc}: this node has {present} {device_type} device(s); "
            f"one rank per device, so at most {present}")


def check_rows(config, world: int) -> None:
    """Every rank needs at least one row of every mini-batch (ReproConfig `config`)."""
    rows = config.batch_size * config.group_size
    if rows // config.mini_batches < world:
        raise InvalidReproConfig(
            f"{config.batch_size} prompts x {config.group_size} answers in {config.mini_batches} mini-batches "
            f"give {rows // config.mini_batches} rows per update, fewer than the {world} ranks; "
            "raise --batch-size or lower --mini-batches")


class Comm:
    """The process group as the run uses it. Every method is a collective: all ranks call
    them in the same order. With `world == 1` they return their input."""

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0, device: torch.device | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.device = device or torch.device("cpu")
        self.timeout_s = timeout_s
        self.mesh = None
        self._store = None
        self._step = -1
        # HCCL reduces no float64; elsewhere sums of partial sums keep float64's precision.
        self.float = torch.float32 if self.device.type == "npu" else torch.float64

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # --- reductions -------------------------------------------------------------------------

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (NaN and inf propagate, as in any sum)."""
        if not self.distributed or not values:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=self.float, device=self.device)
        self._all_reduce(t, "sum")
        return t.tolist()

    def max(self, values: list[float]) -> list[float]:
        """Element-wise max over ranks; a NaN on any rank is NaN everywhere (a plain MAX
        reduction would keep or drop it depending on the order)."""
        if not self.distributed or not values:
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=self.float, device=self.device)
        nan = torch.isnan(t)
        both = torch.cat([torch.where(nan, math.inf, t), nan.to(self.float)])
        self._all_reduce(both, "max")
        out, any_nan = both[: len(values)], both[len(values):] > 0
        return torch.where(any_nan, math.nan, out).tolist()

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A detached copy of `t` summed over ranks (for statistics such as expert loads)."""
        if not self.distributed:
            return t.detach()
        out = t.detach().to(self.float).clone()
        self._all_reduce(out, "sum")
        return out.to(t.dtype)

    def any(self, flag: bool) -> bool:
        return bool(self.max([float(flag)])[0] > 0)

    def gather_rows(self, local: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Concatenate each rank's rows (rank r holds counts[r] rows) on every rank."""
        if not self.distributed:
            return local
        import torch.distributed as dist

        rows = max(counts)
        padded = local.new_zeros((rows, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        self._guard(lambda: dist.all_gather(parts, padded), "all_gather")
        return torch.cat([part[:n] for part, n in zip(parts, counts)])

    def _all_reduce(self, t: torch.Tensor, op: str) -> None:
        import torch.distributed as dist

        red = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        self._guard(lambda: dist.all_reduce(t, op=red), f"all_reduce {op}")

    # --- progress and failures ----------------------------------------------------------------

    def _guard(self, call, what: str):
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - any backend error means a peer is gone
            raise self.failure(exc, what) from exc

    def mark(self, step: int) -> None:
        """Post this rank's progress (the step it is starting) for the others' diagnosis."""
        self._step = step
        if self._store is not None:
            try:
                self._store.set(f"{_KEY}/step/{self.rank}", str(step))
            except Exception:  # noqa: BLE001 - the store's own failure shows in the next collective
                pass

    def report_error(self, exc: BaseException) -> None:
        if self._store is not None and not isinstance(exc, RankFailed):
            try:
                self._store.set(f"{_KEY}/error/{self.rank}", f"{type(exc).__name__}: {exc}"[:500])
            except Exception:  # noqa: BLE001
                pass

    def failure(self, exc: BaseException, what: str = "a collective") -> RankFailed:
        """The error of a collective that failed, naming the rank(s) that are to blame."""
        if isinstance(exc, RankFailed):
            return exc
        detail = _NATIVE_PREFIX.sub("", (str(exc).splitlines() or [""])[0]).split(". This is typically")[0]
        return RankFailed(f"rank {self.rank}: {what} failed in step {self._step}, {self.diagnose()} "
                          f"({type(exc).__name__}: {detail[:200]})")

    def diagnose(self) -> str:
        """Which ranks are to blame, from the store (best effort, a few seconds): those that posted
        an error, else those that did not post that they are alive after the failure (died or
        hung)."""
        if self._store is None:
            return "a peer rank is gone"
        errors, alive, steps = {}, set(), {}
        try:
            self._store.set_timeout(datetime.timedelta(seconds=5))
            self._store.set(f"{_KEY}/alive/{self.rank}", str(self._step))
            deadline = time.monotonic() + SURVIVOR_WAIT_S
            while True:
                for r in range(self.world):
                    if r != self.rank and self._store.check([f"{_KEY}/error/{r}"]):
                        errors[r] = self._store.get(f"{_KEY}/error/{r}").decode()
                    if r != self.rank and self._store.check([f"{_KEY}/alive/{r}"]):
                        alive.add(r)
                if errors or len(alive) == self.world - 1 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            for r in range(self.world):
                key = f"{_KEY}/step/{r}"
                steps[r] = int(self._store.get(key).decode()) if self._store.check([key]) else -1
        except Exception:  # noqa: BLE001 - the store is gone too: its host (the master's node) died
            return "the rendezvous store is unreachable (the master's node is gone)"
        if errors:
            return "; ".join(f"rank {r} failed: {msg}" for r, msg in sorted(errors.items()))
        lost = [r for r in range(self.world) if r != self.rank and r not in alive]
        if not lost:
            return "a peer rank died or hung"
        return "lost " + ", ".join(
            f"rank {r} ({'before its first step' if steps[r] < 0 else f'last seen in step {steps[r]}'})"
            for r in lost) + ": it died or hung"

    def close(self, clean: bool = True) -> None:
        """Leave the group. After a clean run every rank first waits for the others (rank 0
        writes the outputs last): a rank that tears its connections down while a peer still
        uses them can abort that peer (gloo: "terminate called without an active exception").
        After an error no rank waits: a peer may be gone."""
        if self.distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                if clean:
                    try:
                        dist.barrier()
                    except Exception:  # noqa: BLE001 - the run's outcome is already written
                        log.warning("rank %d: the closing barrier failed; leaving the group anyway", self.rank)
                dist.destroy_process_group()


def join(requested_device: str | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Comm:
    """This process's Comm: a one-rank Comm outside a launched job, else the joined group."""
    from moe_proxy.rl.device import pick_device

    if not launched() or int(os.environ["WORLD_SIZE"]) == 1:  # one rank: no group needed
        return Comm(device=pick_device(requested_device), timeout_s=timeout_s)
    import torch.distributed as dist

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    device = pick_device(requested_device)
    if device.type != "cpu":
        check_local_ranks(device.type, local + 1)
        device = torch.device(device.type, local)
        getattr(torch, device.type).set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:  # ranks sharing the CPU: split its cores
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    comm = Comm(rank, world, local, device, timeout_s)
    try:
        dist.init_process_group(backend_for(device), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": device} if device.type != "cpu" else {}))
    except Exception as exc:  # noqa: BLE001
        raise RankFailed(f"rank {rank}: could not join the {world}-rank group at "
                         f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} within "
                         f"{timeout_s:g}s: {type(exc).__name__}: {exc}") from exc
    comm._store = _group_store()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        comm.mesh = init_device_mesh(device.type, (world,))
    return comm


def _group_store():
    """The rendezvous store behind the default group (TCPStore), for progress and errors."""
    try:
        import torch.distributed.distributed_c10d as c10d

        store = c10d._get_default_store()
        return store
    except Exception:  # noqa: BLE001 - diagnosis is best effort
        return None


def shard(model: torch.nn.Module, comm: Comm) -> torch.nn.Module:
    """FSDP2: each decoder layer is one unit (gathered for its forward and backward, then
    freed), the rest (embeddings, final norm, head) the root unit."""
    if not comm.distributed:
        return model
    from torch.distributed.fsdp import fully_shard

    layers = _decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=comm.mesh)
    fully_shard(model, mesh=comm.mesh)
    return model


def reshard(model: torch.nn.Module) -> None:
    """Free the gathered parameters a forward-only pass left behind (FSDP2 keeps the root unit's
    unsharded after forward, for the backward that a generate never has)."""
    for module in model.modules():
        if hasattr(module, "reshard") and hasattr(module, "unshard"):  # an FSDPModule
            module.reshard()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, torch.nn.ModuleList):
            return list(module)
    raise InvalidReproConfig(f"{type(model).__name__}: no decoder layers (a `layers` ModuleList) to shard")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter or gradient (the tensor itself when not sharded)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (e.g. clip_grad_norm_'s total norm); a plain tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t
