"""The training probes' cost per step (docs/metrics.md, "Cost"): a tiny random model's training
steps timed without and with moe_proxy.probes attached.

Usage: .venv/bin/python bench/probes_cost.py [MODEL_TYPE [STEPS]]
"""

from __future__ import annotations

import torch

from moe_proxy.probes import Probes, attach


def measure_cost(model_type: str = "qwen3_moe", steps: int = 200, rounds: int = 3) -> dict[str, float]:
    """Seconds per training step (forward, backward, SGD step) of a tiny random `model_type`
    (demo.tiny), batch 4 x 64 tokens, one thread, without and with the probes: the best of
    `rounds` interleaved timed loops of `steps` steps each."""
    import tempfile
    import time

    from moe_proxy.demo.tiny import make_tiny

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny(model_type, tmp).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))

    def loop(n: int, probe: Probes | None = None) -> float:
        start = time.perf_counter()
        for _ in range(n):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if probe is not None:
                probe.step()
        return (time.perf_counter() - start) / n

    loop(20)  # warm-up
    off, on = [], []
    for _ in range(rounds):
        off.append(loop(steps))
        with attach(model) as probe:
            on.append(loop(steps, probe))
    return {"off": min(off), "on": min(on)}


if __name__ == "__main__":  # .venv/bin/python bench/probes_cost.py [MODEL_TYPE [STEPS]]
    import sys

    arch = sys.argv[1] if len(sys.argv) > 1 else "qwen3_moe"
    cost = measure_cost(arch, int(sys.argv[2]) if len(sys.argv) > 2 else 200)
    print(f"{arch}: off {cost['off'] * 1e3:.2f} ms/step, on {cost['on'] * 1e3:.2f} ms/step, "
          f"+{(cost['on'] - cost['off']) * 1e3:.2f} ms ({(cost['on'] / cost['off'] - 1) * 100:.1f}%)")
