"""One reproduction over several ranks (CPU, gloo, FSDP2): the same metrics as one process,
the same detection step, and a lost rank ends the run loudly with nothing left running.

Tolerance: discrete metrics (rewards, lengths, expert loads, counts) are equal; float metrics
agree within 1e-5 relative or 1e-6 absolute. They differ at all because the ranks' partial sums
(losses, gradients through FSDP's reduce-scatter) add up in another order, and forward passes
run on fewer rows at a time; differences of near-equal log-probabilities (actor/ppo_kl,
actor/pg_loss, actor/kl_loss near 0) show it most, about 1e-8 absolute. Times are not compared."""

import json
import math
import os
from pathlib import Path

import pytest

from moe_proxy.cli import main
from moe_proxy.errors import InvalidReproConfig
from moe_proxy.rl.config import Faults, ReproConfig
from moe_proxy.metrics.readers import read_metrics
from moe_proxy.rl.runner import run_repro

from ..ports import listen_port

STEPS = 4
ARGS = ["--steps", str(STEPS), "--lr", "1e-4", "--seed", "1"]
RTOL, ATOL = 1e-5, 1e-6
UNTIMED = ("timing_s/", "perf/time_per_step", "perf/throughput")


def assert_same_metrics(a: dict, b: dict, steps) -> None:
    for step in steps:
        assert a[step].keys() == b[step].keys(), set(a[step]) ^ set(b[step])
        for key, x in a[step].items():
            if key.startswith(UNTIMED):
                continue
            y = b[step][key]
            same = (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=RTOL, abs_tol=ATOL)
            assert same, f"step {step} {key}: {x} != {y}"


def launch(tiny, out, ranks, *extra):
    return main(["repro", str(tiny), "--out", str(out), *ARGS, "--nproc-per-node", str(ranks), *extra])


@pytest.fixture(scope="module")
def one_rank(tiny_qwen3, tmp_path_factory):
    out = tmp_path_factory.mktemp("w1")
    run_repro(str(tiny_qwen3), out, ReproConfig(steps=STEPS, lr=1e-4, seed=1))
    return read_metrics(out)


def test_four_ranks_give_the_one_process_metrics(tiny_qwen3, tmp_path, one_rank, capsys):
    assert launch(tiny_qwen3, tmp_path, 4) == 0
    assert "no failure in 4 steps" in capsys.readouterr().out
    assert_same_metrics(one_rank, read_metrics(tmp_path), range(STEPS))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ranks"] == 4 and summary["steps_completed"] == STEPS and summary["reproduced"] is False
    assert not (tmp_path / ".repro-launch.json").exists()


def test_fault_detected_at_the_same_step_on_one_and_two_ranks(tiny_qwen3, tmp_path, one_rank, capsys):
    nan_at = ["--fault-op", "model.layers.1.mlp@3", "--fault-op-mode", "nan", "--fail-on", "nan"]
    log = tmp_path / "termination-log"
    assert launch(tiny_qwen3, tmp_path / "w2", 2, *nan_at, "--termination-log", str(log)) == 0
    assert "nan at step 3 (reproduced)" in capsys.readouterr().out
    two = read_metrics(tmp_path / "w2")
    assert list(two) == [0, 1, 2, 3]  # every rank stopped at the step the detector fired
    assert_same_metrics(one_rank, two, range(3))  # before the fault: the one-process run
    assert json.loads(log.read_text())["step"] == 3
    faults = Faults(op_module="model.layers.1.mlp", op_step=3, op_mode="nan")
    single = run_repro(str(tiny_qwen3), tmp_path / "w1", ReproConfig(steps=STEPS, lr=1e-4, seed=1, faults=faults))
    assert (single.signature, single.step) == ("nan", 3)
    assert_same_metrics(read_metrics(tmp_path / "w1"), two, range(4))


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_rank_that_dies_ends_the_run_naming_it(tiny_qwen3, tmp_path, capsys):
    log = tmp_path / "termination-log"
    code = launch(tiny_qwen3, tmp_path / "run", 2, "--fault-rank-exit", "1@1", "--termination-log", str(log))
    assert code == 1
    err = capsys.readouterr().err
    assert "error: rank 1 (local rank 1) failed" in err and "SIGKILL" in err
    report = json.loads(log.read_text())
    assert report["error"] == "RankFailed" and "reproduced" not in report  # no verdict from a partial run
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["reproduced"] is None and summary["stopped"].startswith("error: ")
    assert _processes_mentioning(str(tmp_path / "run")) == []  # no rank left running


@pytest.mark.slow
def test_a_rank_that_hangs_ends_the_run_at_the_collective_timeout(tiny_qwen3, tmp_path, capsys):
    code = launch(tiny_qwen3, tmp_path / "run", 2, "--fault-rank-hang", "1@1", "--dist-timeout", "8")
    assert code == 1
    err = capsys.readouterr().err
    assert "lost rank 1 (last seen in step 0): it died or hung" in err
    assert _processes_mentioning(str(tmp_path / "run")) == []


def test_more_ranks_than_devices_is_refused(tiny_qwen3, tmp_path, monkeypatch, capsys):
    import torch

    from moe_proxy.rl.distributed import check_local_ranks

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(InvalidReproConfig, match="--nproc-per-node 4: this node has 2 cuda device"):
        check_local_ranks("cuda", 4)
    check_local_ranks("cuda", 2)
    check_local_ranks("cpu", 64)  # ranks share the CPU
    # From the command line: refused before anything starts.
    assert launch(tiny_qwen3, tmp_path / "run", 3, "--device", "cuda") == 2
    assert "--nproc-per-node 3: this node has 2 cuda device(s); one rank per device, so at most 2" in \
        capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_an_unreachable_master_is_one_clear_error_and_starts_no_rank(tiny_qwen3, tmp_path, capsys):
    port = listen_port()  # nobody listens there
    log = tmp_path / "termination-log"
    code = launch(tiny_qwen3, tmp_path / "run", 2, "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                  "--master-port", str(port), "--dist-timeout", "3", "--termination-log", str(log))
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"moe-proxy repro: error: node 1: no rendezvous with the master at 127.0.0.1:{port} "
                          "within 3s, no rank was started"), err
    assert json.loads(log.read_text())["error"] == "RankFailed"
    assert not (tmp_path / "run" / "summary.json").exists()  # no rank ran, nothing claims a run
    assert _processes_mentioning(str(tmp_path / "run")) == []


def test_a_bad_prompts_file_is_refused_before_any_rank_starts(tiny_qwen3, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1="}]}) + "\n")
    assert launch(tiny_qwen3, tmp_path / "run", 2, "--prompts", str(bad)) == 2
    err = capsys.readouterr().err.strip()
    assert "bad.jsonl row 0: missing field `reward_model.ground_truth`" in err and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_bad_launch_options_are_one_clear_line(tiny_qwen3, tmp_path, capsys):
    assert main(["repro", str(tiny_qwen3), "--out", str(tmp_path), "--nnodes", "2"]) == 2
    assert "--master-addr" in capsys.readouterr().err
    assert main(["repro", str(tiny_qwen3), "--out", str(tmp_path), "--fault-rank-exit", "one"]) == 2
    assert "expected RANK@STEP" in capsys.readouterr().err


def test_too_few_rows_for_the_ranks_is_refused(tiny_qwen3, tmp_path, capsys):
    code = launch(tiny_qwen3, tmp_path, 2, "--batch-size", "1", "--group-size", "2", "--mini-batches", "2")
    assert code == 2
    assert "fewer than the 2 ranks" in capsys.readouterr().err


@pytest.mark.parametrize("rows", [8, 7])  # FSDP2 shards dim 0: evenly, and unevenly (the last rank's shard padded)
def test_the_fused_adamw_steps_a_shard_as_it_steps_the_whole(rows):
    """The RL optimizer is the fused AdamW kernel (as TRL's Trainer's default): elementwise, so a
    parameter stepped whole (1 rank) and in two row halves (2 ranks' FSDP2 shards) is bitwise the
    same after several steps with the same gradients. What 1 and 2 ranks still differ by is the
    gradients' reduction order, which the tolerance above covers."""
    import torch

    from moe_proxy.rl.runner import adamw

    torch.manual_seed(0)
    whole = torch.nn.Parameter(torch.randn(rows, 5))
    start = whole.detach().clone()
    halves = [torch.nn.Parameter(h.detach().clone()) for h in whole.detach().tensor_split(2)]
    config = ReproConfig(lr=1e-2)
    one, two = adamw([whole], config, whole.device), adamw(halves, config, whole.device)
    assert one.defaults["fused"] and two.defaults["fused"]
    for _ in range(5):
        grad = torch.randn(rows, 5) * 1e-3
        whole.grad = grad.clone()
        for h, g in zip(halves, grad.tensor_split(2)):
            h.grad = g.clone()
        one.step()
        two.step()
    assert torch.equal(whole.detach(), torch.cat([h.detach() for h in halves]))
    assert not torch.equal(whole.detach(), start)  # it moved
