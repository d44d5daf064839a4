"""The update's numerics figures on bench/rl_step.py's proxy, one CPU thread: each gradient's sum
of squares and zero count (rl.grad_sums) in two eager passes against the compiled one-pass
kernel; the weight check's read (rl.weight_check) against the per-tensor sum it replaced; and a
clipped AdamW step (rl.runner.clipped_step: the factor as the fused kernel's grad_scale) against
the multiply, then the step. The gradients are those of one backward of 32 random byte rows; CPU
ms, the median of --repeats.

    .venv/bin/python bench/grad_stats.py [--width 512] [--repeats 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rl_cost import make_models  # noqa: E402  (the same lab-like proxies as bench/rl_step.py)


def cpu_ms(fn, repeats: int) -> tuple[float, float, float]:
    """Median, least and most CPU ms of `repeats` calls of fn."""
    spent = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        spent.append((time.process_time() - start) * 1e3)
    return statistics.median(spent), min(spent), max(spent)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "rl_step")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from moe_proxy.rl import grad_sums as sums
    from moe_proxy.rl.distributed import Comm
    from moe_proxy.rl.runner import clip_grads, clipped_step
    from moe_proxy.rl.weight_check import WeightBound

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(make_models(args.out / "models", args.width)["proxy 0.5"],
                                                 dtype=torch.float32)
    model(input_ids=torch.randint(0, 256, (32, 60)), logits_to_keep=17).logits.logsumexp(-1).mean().backward()
    params = [p for p in model.parameters() if p.grad is not None]
    flats = [p.grad.detach().reshape(-1) for p in params]
    eager_min, fused_min = 2**62, sums.FUSED_MIN

    def two_passes():
        sums.FUSED_MIN = eager_min
        try:
            return sums.grad_sums(flats)
        finally:
            sums.FUSED_MIN = fused_min

    start = time.perf_counter()
    one = sums.grad_sums(flats)  # compiles (or loads Inductor's cache)
    compile_s = time.perf_counter() - start
    two = two_passes()
    assert [z for _, z in one] == [z for _, z in two], "the passes disagree on the zeros"

    def per_tensor_sum():  # the weight check before rl.weight_check
        return [bool(torch.isfinite(p.detach().sum())) for p in params]

    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=True)
    optimizer.step()  # its states

    def multiply_then_step():  # clipping at norm 2 against 1: the factor 0.5
        clip_grads(params, 2.0, 1.0)
        optimizer.step()

    rows = [("gradient figures, two eager passes (norms, then zeros)", cpu_ms(two_passes, args.repeats)),
            ("gradient figures, one compiled pass", cpu_ms(lambda: sums.grad_sums(flats), args.repeats)),
            ("weight check, a sum per tensor (before)", cpu_ms(per_tensor_sum, args.repeats)),
            ("weight check, a read (first step, or bound too large)",
             cpu_ms(lambda: WeightBound().read(params, Comm()), args.repeats)),
            ("fused AdamW step, unclipped", cpu_ms(optimizer.step, args.repeats)),
            ("clipped step, the multiply then the step (before)", cpu_ms(multiply_then_step, args.repeats)),
            ("clipped step, the factor in the fused kernel", cpu_ms(lambda: clipped_step(optimizer, params, 2.0, 1.0),
                                                                    args.repeats))]
    total = sum(f.numel() for f in flats)
    print(f"\nwidth {args.width}: {len(flats)} gradients, {total / 1e6:.1f}M elements, 1 thread; "
          f"first one-pass call (compile or cache load) {compile_s:.1f} s\n")
    print("| figure | CPU ms, median | least | most |\n|---|---|---|---|")
    for name, (median, least, most) in rows:
        print(f"| {name} | {median:.1f} | {least:.1f} | {most:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
