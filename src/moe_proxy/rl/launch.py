"""`moe-proxy repro --nproc-per-node P [--nnodes N --node-rank R --master-addr A --master-port Q]`:
start this node's P ranks through torch.distributed.run (torchrun's own API: the elastic
agent spawns, watches and, when one fails, stops them all), each running
`python -m moe_proxy.rl.launch SPEC`, i.e. `run_repro` as one rank of the job.

A failed rank ends the whole run (no restarts): the agent stops the other local ranks, the
other nodes' ranks lose their peer and fail in their next collective, and this raises
RankFailed naming the rank and its error (or MoeProxyError when every rank refused the same
bad input)."""

from __future__ import annotations

import json
import math
import signal
import sys
from dataclasses import asdict
from pathlib import Path

from moe_proxy.errors import MoeProxyError
from moe_proxy.rl.config import Faults, RankFault, ReproConfig
from moe_proxy.metrics.detect import Signature
from moe_proxy.rl.distributed import DEFAULT_TIMEOUT_S, RankFailed, check_rows

SPEC_FILE = ".repro-launch.json"  # in RUN_DIR while the ranks run: what they run


class StoppedByLauncher(BaseException):
    """SIGTERM from the elastic agent: another rank failed (a BaseException, as SystemExit)."""


def launch(checkpoint: str, out_dir: str | Path, config: ReproConfig, *, nproc_per_node: int, nnodes: int = 1,
           node_rank: int = 0, master_addr: str | None = None, master_port: int = 29500,
           fail_on: str | None = None, device: str | None = None, termination_log: str | None = None,
           prompts: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
           rank_fault: RankFault | None = None) -> None:
    """Run this node's share of a (nnodes x nproc_per_node)-rank reproduction; returns when all
    its ranks have finished, raises when any failed."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import parse_args, run

    if nproc_per_node < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
        raise MoeProxyError(f"--nproc-per-node {nproc_per_node} --nnodes {nnodes} --node-rank {node_rank}: "
                            "need at least one rank and node, and 0 <= node rank < nodes")
    if nnodes > 1 and not master_addr:
        raise MoeProxyError(f"--nnodes {nnodes}: --master-addr (node 0's address) is required")
    check_rows(config, nproc_per_node * nnodes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = out / SPEC_FILE
    spec.write_text(json.dumps({
        "checkpoint": checkpoint, "out_dir": str(out), "config": config.to_dict(), "fail_on": fail_on,
        "device": device, "termination_log": termination_log, "prompts": prompts, "timeout_s": timeout_s,
        "rank_fault": asdict(rank_fault) if rank_fault else None}))
    # The rendezvous waits as long as a collective may (--dist-timeout), not torch's own 600 s.
    argv = ["--nproc-per-node", str(nproc_per_node), "--nnodes", str(nnodes), "--max-restarts", "0",
            "--monitor-interval", "0.5", "--rdzv-conf", f"timeout={max(1, math.ceil(timeout_s))}"]
    if nnodes == 1 and not master_addr:
        argv.append("--standalone")  # a free local port
    else:
        argv += ["--node-rank", str(node_rank), "--master-addr", master_addr, "--master-port", str(master_port)]
    argv += ["--module", __name__, str(spec)]
    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        raise _failure(exc) from None
    except (RendezvousError, DistError) as exc:  # before any rank started: the master was not there
        detail = (str(exc).splitlines() or [""])[0][:200]
        raise RankFailed(f"node {node_rank}: no rendezvous with the master at {master_addr or 'localhost'}:"
                         f"{master_port if master_addr else '(standalone)'} within {timeout_s:g}s, no rank was "
                         f"started ({type(exc).__name__}: {detail})") from None
    finally:
        spec.unlink(missing_ok=True)


def _failure(exc) -> Exception:
    """One error from the agent's failure table: the ranks whose own error started it first,
    then those that only lost a peer."""
    failures = exc.failures

    def message(rank: int) -> str:
        f = failures[rank]
        text = f.message.get("message", "") if isinstance(f.message, dict) else str(f.message or "")
        if text.startswith("To enable traceback"):  # no error recorded: killed, or died in native code
            text = "no error recorded"
        return text

    def consequence(rank: int) -> bool:  # lost a peer, or stopped by the agent because of it
        return (message(rank).startswith(("RankFailed", StoppedByLauncher.__name__))
                or failures[rank].exitcode == -signal.SIGTERM)

    order = sorted(failures, key=lambda r: (consequence(r), failures[r].timestamp, r))
    if failures[order[0]].exitcode == 2:  # bad input (each rank refuses the same)
        text = message(order[0])
        return MoeProxyError(text.split(": ", 1)[1] if ": " in text else text)
    parts = [f"rank {r} (local rank {failures[r].local_rank}) failed with exit code {failures[r].exitcode}: "
             f"{message(r)}" for r in order]
    return RankFailed("; ".join(parts) + "; the run was stopped, it has no verdict")


def _worker(spec_path: str) -> int:
    """One rank: run_repro from the launcher's spec. Its error goes to the agent's error file,
    so the launcher's failure names this rank and why."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    from moe_proxy.rl.runner import run_repro

    # The agent stops the other ranks with SIGTERM when one fails: unwind, so that rank 0
    # still writes its summary (the run's end, and why).
    def stopped(*_):
        raise StoppedByLauncher("SIGTERM: the launcher stopped this rank because another one failed")

    signal.signal(signal.SIGTERM, stopped)
    try:
        spec = json.loads(Path(spec_path).read_text())
        cfg = spec["config"]
        config = ReproConfig(**{**cfg, "faults": Faults(**cfg["faults"])})
        run_repro(spec["checkpoint"], spec["out_dir"], config,
                  fail_on=Signature.parse(spec["fail_on"]) if spec["fail_on"] else None, device=spec["device"],
                  termination_log=spec["termination_log"], prompts=spec["prompts"], timeout_s=spec["timeout_s"],
                  rank_fault=RankFault(**spec["rank_fault"]) if spec["rank_fault"] else None)
    except BaseException as exc:  # noqa: BLE001 - recorded for the launcher, then the exit status says it
        ErrorHandler().record_exception(exc)
        print(f"moe-proxy repro: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, MoeProxyError) else 1
    return 0


def _exit(code: int) -> None:
    """Leave without the interpreter's teardown. The ranks have left the group (Comm.close), but
    torch's objects still alive then (the FSDP model's mesh and its gloo group) are destroyed during
    finalization, where gloo can abort a rank that has finished ("terminate called without an
    active exception": SIGABRT after `_worker` returned, in 2 of 4 runs of the five-runtime
    rendezvous test under load). The agent then counts a clean run as failed, and the other
    nodes' agents wait out their exit barrier (300 s). The outputs are written and closed by
    then; only the streams need flushing."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _exit(_worker(sys.argv[1]))
