"""Issue 41 §3: device slots. Each concurrent run gets as many devices as it has ranks, through
CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES, none shared, and nothing is set when one run
has the machine (the arithmetic with a fake device count: no GPU here). A slot is taken when a
run starts, from those free: real processes of uneven length never share one (a slot fixed at
submission, job i on slot i % P, put the third job on the first's device while it still ran)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from moe_proxy.errors import InvalidReproConfig
from moe_proxy.rl.device import slot_envs
from moe_proxy.investigate.processes import run_each


@pytest.mark.parametrize("device, ranks, parallel, ids, expected", [
    ("cuda", 1, 1, ["0", "1"], [{}]),  # one run has the machine: its --device cuda:N means device N
    ("cuda:1", 2, 1, ["0", "1"], [{}]),
    ("cuda", 1, 3, list("0123"), [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1"},
                                  {"CUDA_VISIBLE_DEVICES": "2"}]),
    ("cuda", 2, 2, list("0123"), [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]),
    ("npu", 4, 2, [str(i) for i in range(8)], [{"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"},
                                                {"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}]),
    # the devices this process was given (its own CUDA_VISIBLE_DEVICES), not 0..n-1
    ("cuda", 1, 2, ["4", "6"], [{"CUDA_VISIBLE_DEVICES": "4"}, {"CUDA_VISIBLE_DEVICES": "6"}]),
    ("cpu", 1, 2, [], [{}, {}]),
])
def test_each_run_gets_the_devices_it_asks_for(device, ranks, parallel, ids, expected):
    assert slot_envs(device, ranks, parallel, ids) == expected


@pytest.mark.parametrize("device, ranks, parallel, ids, message", [
    ("cuda", 2, 3, list("0123"), "--parallel 3 runs of 2 rank(s) need 6 cuda devices, one per rank; 4 are visible"),
    ("cuda:1", 1, 2, list("0123"), "--device cuda:1 names one device, which 2 runs at a time would share"),
])
def test_too_few_devices_are_refused(device, ranks, parallel, ids, message):
    with pytest.raises(InvalidReproConfig, match=message.replace("(", r"\(").replace(")", r"\)")):
        slot_envs(device, ranks, parallel, ids)


def test_a_slot_is_taken_when_a_run_starts_from_those_free():
    """Four real processes, 2 at a time on 2 one-device slots; the first runs long, so the third
    starts while it runs and must get the second's slot, which is free by then."""
    slots = slot_envs("cuda", 1, 2, ["0", "1"])
    seconds = [1.5, 0.2, 0.2, 0.2]
    spans: list[tuple[str, float, float]] = []

    def run(job: int, env: dict[str, str]) -> str:
        began = time.monotonic()
        seen = subprocess.run([sys.executable, "-c", f"import os, time; time.sleep({seconds[job]}); "
                               "print(os.environ['CUDA_VISIBLE_DEVICES'])"], env=env, capture_output=True,
                              text=True, check=True).stdout.strip()
        spans.append((seen, began, time.monotonic()))
        return seen

    done: dict[int, str] = {}
    run_each(list(range(4)), slots, run, lambda job, seen: done.__setitem__(job, seen))
    assert sorted(done) == [0, 1, 2, 3] and done[0] == "0" and done[2] == "1"
    for i, (device, began, ended) in enumerate(spans):
        for other, b, e in spans[i + 1:]:
            assert device != other or ended <= b or e <= began, f"two runs at once on device {device}"
