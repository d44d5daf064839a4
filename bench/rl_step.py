"""`moe-proxy repro`'s RL step against TRL's GRPOTrainer, side by side in one run, on the same
proxy (bench/rl_cost.py's lab-like Qwen3-MoE, built to 50% of its experts by `moe-proxy build`'s
code): the same prompts per step (repro's arithmetic task, byte-level on both sides), group
size, completion length, precision (fp32), one optimizer update per step, KL to a frozen
reference on both (TRL: beta > 0), no activation recomputation on either (TRL's default
gradient checkpointing is turned off: the same work), one thread each.

Per step (the mean over steps 2..N) and per generated token, and by phase where both report it:
repro's `timing_s/*` metrics; TRL's own profiling (`profiling/Time taken: ...`, captured from
its ProfilingContext): `transformers.generate`, the reference pass (a log-prob pass inside
`_prepare_inputs`), and the rest of the step (forward, backward, optimizer) from a callback.
Neither runs an old-log-prob pass when each batch gets one update: both take the update's own
log-probs, detached (repro's `timing_s/old_log_prob` is then 0). Both step with the fused AdamW
kernel (TRL's Trainer's default `adamw_torch_fused`; repro's `rl.runner.adamw`); `--foreach` adds a
third loop, repro with the multi-tensor AdamW it used before (patched in this benchmark only).
repro's rows give the time of its gradient statistics (numerics/*, inside the update).

The loops run in one process, interleaved (A B, B A, A B, ...: other jobs' load drifts), `--repeats`
times each; every figure is the median over the repeats, and ours / TRL is the median of the
repeats' ratios (each of two runs next to each other) beside the ratio of the medians.

    .venv/bin/python bench/rl_step.py [--quick] [--width 128] [--steps 5] [--batch 8] [--group 4] [--tokens 16]
                                      [--repeats 5] [--foreach]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rl_cost import make_models  # noqa: E402  (the same lab-like original and proxies)

# grad_stats (numerics/* of the gradient) and metrics (those, plus the router and activation
# hooks and their moe/ and numerics/ figures): repro's own metrics, timed inside its phases
PHASES = ("gen", "old_log_prob", "ref", "update", "grad_stats", "metrics")
CPU_PHASES = ("gen", "log_probs", "update")  # log_probs: old + ref for repro, ref for TRL


@dataclass
class Timing:
    """One loop's figures: seconds per step (and by phase), generated tokens per step."""

    name: str
    step_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)  # this process's CPU seconds per step: robust to other jobs
    tokens: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=dict)
    cpu_phases: dict[str, list[float]] = field(default_factory=dict)  # CPU seconds: gen, log_probs, update

    def mean(self, values: list[float]) -> float:
        later = values[1:] or values  # the first step pays one-off costs
        return sum(later) / len(later)

    def summary(self) -> dict:
        step = self.mean(self.step_s)
        return {"step_s": step, "cpu_s": self.mean(self.cpu_s), "tokens_per_step": self.mean(self.tokens),
                "s_per_token": step / max(self.mean(self.tokens), 1e-9),
                "cpu_s_per_token": self.mean(self.cpu_s) / max(self.mean(self.tokens), 1e-9),
                "phases": {k: self.mean(v) for k, v in self.phases.items()},
                "cpu_phases": {k: self.mean(v) for k, v in self.cpu_phases.items()}}


def byte_tokenizer():
    """repro's byte codec as a tokenizer: id = byte value, pad 0, newline ends an answer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(256)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=chr(0)))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=chr(0), eos_token="\n")
    fast.padding_side = "left"
    return fast


def timing(fn, spent: list[float], clock=time.perf_counter):
    """fn, recording the `clock` seconds of every call in `spent`."""
    def wrapper(*args, **kwargs):
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            spent.append(clock() - start)
    return wrapper


@contextlib.contextmanager
def patched(owner, name: str, replace):
    """owner.name = replace(owner.name), for one run."""
    original = getattr(owner, name)
    setattr(owner, name, replace(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def timed(cls, method: str, spent: list[float], clock=time.perf_counter):
    return patched(cls, method, lambda fn: timing(fn, spent, clock))


def timed_hooks(cls, factory: str, spent: list[float]):
    """Like `timed`, for the hooks that cls.factory makes (RouterTap registers closures)."""
    return patched(cls, factory, lambda make: lambda self, *args: timing(make(self, *args), spent))


def foreach_adamw():
    """repro's AdamW as the multi-tensor (foreach) loop it stepped with before the fused kernel,
    patched for this run only."""
    import torch

    from moe_proxy.rl import runner

    def foreach(_adamw):
        return lambda params, config, device: torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0,
                                                                eps=config.adam_eps, foreach=True)

    return patched(runner, "adamw", foreach)


def run_repro_loop(model: Path, out: Path, steps: int, batch: int, group: int, tokens: int,
                   foreach: bool = False) -> Timing:
    from moe_proxy.rl.config import ReproConfig
    from moe_proxy.metrics.readers import read_metrics
    from moe_proxy.rl.routers import RouterTap
    from moe_proxy.rl.runner import ActivationWatch, _Loop, run_repro

    config = ReproConfig(steps=steps, batch_size=batch, group_size=group, max_new_tokens=tokens, precision="fp32",
                         mini_batches=1, kl_coef=0.04, lr=1e-5)
    spent: list[float] = []  # gradient statistics (numerics/*: counts and per-layer norms), one per update
    other: list[float] = []  # the other metrics: hooks in every forward, and their figures
    cpu, gen_cpu, forward_cpu, update_cpu = [], [], [], []  # the update: its forward, then the rest
    with contextlib.ExitStack() as patches:
        for patch in (timed(_Loop, "_grad_stats", spent), timed(_Loop, "step", cpu, time.process_time),
                      timed(_Loop, "_rollout", gen_cpu, time.process_time),
                      timed(_Loop, "_forward", forward_cpu, time.process_time),
                      timed(_Loop, "_update", update_cpu, time.process_time),
                      timed_hooks(RouterTap, "_hook", other), timed(RouterTap, "metrics", other),
                      timed(ActivationWatch, "_hook", other), timed(ActivationWatch, "metrics", other)):
            patches.enter_context(patch)
        if foreach:
            patches.enter_context(foreach_adamw())
        run_repro(str(model), out, config)
    t = Timing("moe-proxy repro" + (", foreach AdamW (patched here)" if foreach else ""))
    for _, m in sorted(read_metrics(out).items()):
        t.step_s.append(m["perf/time_per_step"])
        t.tokens.append(m["response_length/mean"] * batch * group)
        for phase, key in zip(PHASES, ("gen", "old_log_prob", "ref", "update_actor")):
            t.phases.setdefault(phase, []).append(m[f"timing_s/{key}"])
    t.phases["grad_stats"] = spent  # one update per step
    # each step's gradient statistics, and the hooks (they run in every phase) at their mean per step
    t.phases["metrics"] = [g + sum(other) / steps for g in spent]
    t.cpu_s = cpu
    update_cpu = [f + u for f, u in zip(forward_cpu, update_cpu)]  # one update per step
    t.cpu_phases = {"gen": gen_cpu, "log_probs": [c - g - u for c, g, u in zip(cpu, gen_cpu, update_cpu)],
                    "update": update_cpu}
    return t


def run_trl_loop(model: Path, out: Path, steps: int, batch: int, group: int, tokens: int) -> Timing:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from moe_proxy.rl.task import make_prompts

    prompts = [p for step in range(steps) for p in make_prompts("arithmetic", 0, step, batch)]
    dataset = Dataset.from_dict({"prompt": [p.text for p in prompts], "answer": [p.answer for p in prompts]})
    events: list[tuple[str, float, float]] = []  # (name, start, end) of every profiled block
    cpu: list[float] = []  # CPU seconds per step
    record, enter = profiling.ProfilingContext._log_metrics, profiling.ProfilingContext.__enter__
    cpu_of: dict[tuple[str, float], float] = {}  # (name, start) -> CPU seconds

    def enter_with_cpu(self):
        self.cpu_start = time.process_time()
        return enter(self)

    def log_metrics(self, duration):
        start = time.perf_counter() - duration
        events.append((self.name, start, time.perf_counter()))
        cpu_of[self.name, start] = time.process_time() - self.cpu_start
        return record(self, duration)

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            events.append(("step", time.perf_counter(), 0.0))
            cpu.append(time.process_time())

        def on_step_end(self, args, state, control, **kwargs):
            name, start, _ = events.pop(next(i for i in range(len(events) - 1, -1, -1) if events[i][0] == "step"))
            events.append(("step", start, time.perf_counter()))
            cpu[-1] = time.process_time() - cpu[-1]

    def reward(completions, answer, **_):
        return [float(c.split("\n")[0].strip() == a) for c, a in zip(completions, answer)]

    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    policy.config.pad_token_id = policy.generation_config.pad_token_id = 0
    policy.config.eos_token_id = policy.generation_config.eos_token_id = ord("\n")
    args = GRPOConfig(output_dir=str(out), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
                      report_to="none", max_steps=steps, logging_steps=1, per_device_train_batch_size=batch * group,
                      num_generations=group, gradient_accumulation_steps=1, max_completion_length=tokens,
                      temperature=1.0, beta=0.04, learning_rate=1e-5, shuffle_dataset=False, save_strategy="no",
                      disable_tqdm=True, seed=0)
    profiling.ProfilingContext._log_metrics = log_metrics
    profiling.ProfilingContext.__enter__ = enter_with_cpu
    try:
        trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=args, train_dataset=dataset,
                              processing_class=byte_tokenizer(), callbacks=[Steps()])
        trainer.train()
    finally:
        profiling.ProfilingContext._log_metrics, profiling.ProfilingContext.__enter__ = record, enter
    t = Timing("TRL GRPOTrainer", cpu_s=cpu)
    lengths = [row["completions/mean_length"] for row in trainer.state.log_history if "completions/mean_length" in row]
    for (_, start, end), length, step_cpu in zip([e for e in events if e[0] == "step"], lengths, cpu):
        inside = [(n, s, e) for n, s, e in events if start <= s and e <= end and n != "step"]
        [(_, p0, p1)] = [(n, s, e) for n, s, e in inside if n.endswith("_prepare_inputs")]
        blocks = {"gen": [(n, s, e) for n, s, e in inside if n.endswith("transformers.generate")],
                  "ref": [(n, s, e) for n, s, e in inside  # the log-prob pass inside _prepare_inputs
                          if n.endswith("_get_per_token_logps_and_entropies") and p0 <= s <= p1],
                  "prepare": [(n, s, e) for n, s, e in inside if n.endswith("_prepare_inputs")]}
        wall = {k: sum(e - s for _, s, e in v) for k, v in blocks.items()}
        used = {k: sum(cpu_of[n, s] for n, s, _ in v) for k, v in blocks.items()}
        t.step_s.append(end - start)
        t.tokens.append(length * batch * group)
        for phase, value in (("gen", wall["gen"]), ("ref", wall["ref"]), ("update", end - start - wall["prepare"])):
            t.phases.setdefault(phase, []).append(value)
        for phase, value in (("gen", used["gen"]), ("log_probs", used["ref"]), ("update", step_cpu - used["prepare"])):
            t.cpu_phases.setdefault(phase, []).append(value)
    return t


def median_summary(runs: list[Timing]) -> dict:
    """Every figure of the runs' summaries, the median over the runs."""
    summaries = [t.summary() for t in runs]

    def median(values: list):
        if isinstance(values[0], dict):
            return {k: median([v[k] for v in values]) for k in values[0]}
        return statistics.median(values)

    return median(summaries)


def table(rows: dict[str, dict]) -> str:
    lines = ["| loop | s per step | CPU s per step | generated tokens per step | ms per generated token | CPU ms per "
             "generated token | " + " | ".join(f"{p} s" for p in PHASES) + " | CPU s: gen / log-prob passes / update |",
             "|" + "---|" * (7 + len(PHASES))]
    for name, r in rows.items():
        cells = [f"{r['phases'][p]:.3f}" if p in r["phases"] else "-" for p in PHASES]
        lines.append(f"| {name} | {r['step_s']:.3f} | {r['cpu_s']:.3f} | {r['tokens_per_step']:.1f} | "
                     f"{r['s_per_token'] * 1e3:.2f} | {r['cpu_s_per_token'] * 1e3:.2f} | "
                     + " | ".join(cells) + " | " + " / ".join(f"{r['cpu_phases'][p]:.3f}" for p in CPU_PHASES) + " |")
    return "\n".join(lines)


def run_interleaved(loops: list, repeats: int) -> list[list[Timing]]:
    """Each loop `repeats` times, the order reversed every other repeat (A B, B A, ...)."""
    runs: list[list[Timing]] = [[] for _ in loops]
    for repeat in range(repeats):
        for i in (range(len(loops)) if repeat % 2 == 0 else reversed(range(len(loops)))):
            runs[i].append(loops[i]())
    return runs


def ratios(ours: list[Timing], trl: list[Timing]) -> list[float]:
    """ours / TRL, CPU s per generated token, of each repeat's two runs."""
    return [a.summary()["cpu_s_per_token"] / b.summary()["cpu_s_per_token"] for a, b in zip(ours, trl)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--width", type=int, default=None, help="hidden size of the lab original (default 128; quick 64)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="prompts per step")
    ap.add_argument("--group", type=int, default=None, help="answers per prompt")
    ap.add_argument("--tokens", type=int, default=None, help="completion length, at most")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs of each loop, interleaved; figures are medians over them (default 5; quick 1)")
    ap.add_argument("--foreach", action="store_true", help="a third loop: repro with the multi-tensor AdamW")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "rl_step")
    args = ap.parse_args()
    quick = args.quick
    width = args.width or (64 if quick else 128)
    steps, batch = args.steps or (2 if quick else 5), args.batch or (2 if quick else 8)
    group, tokens = args.group or (2 if quick else 4), args.tokens or (4 if quick else 16)

    import torch

    torch.set_num_threads(1)
    proxy = make_models(args.out / "models", width)["proxy 0.5"]
    loops = [lambda: run_repro_loop(proxy, args.out / "repro", steps, batch, group, tokens),
             lambda: run_trl_loop(proxy, args.out / "trl", steps, batch, group, tokens)]
    if args.foreach:
        loops.append(lambda: run_repro_loop(proxy, args.out / "repro-foreach", steps, batch, group, tokens, True))
    runs = run_interleaved(loops, args.repeats or (1 if quick else 5))
    rows = {r[0].name: median_summary(r) for r in runs}
    print(f"\nproxy {proxy} (width {width}); {batch} prompts x {group} answers, up to {tokens} new tokens, "
          f"fp32, 1 update per step, 1 thread; mean of steps 2-{steps}; medians of {len(runs[0])} interleaved runs\n")
    print(table(rows))
    paired = ratios(runs[0], runs[1])
    ours, trl = list(rows.values())[:2]
    print(f"\nours / TRL, CPU s per generated token: {statistics.median(paired):.3f} (median of the repeats' "
          f"ratios {', '.join(f'{r:.3f}' for r in paired)}); of the medians "
          f"{ours['cpu_s_per_token'] / trl['cpu_s_per_token']:.3f}")
    (args.out / "rl_step.json").write_text(json.dumps(
        {"quick": quick, "width": width, "steps": steps, "batch": batch, "group": group, "tokens": tokens,
         "repeats": len(runs[0]), "ratios": paired, "ratio": statistics.median(paired), "loops": rows,
         "runs": {r[0].name: [t.summary()["cpu_s_per_token"] for t in r] for r in runs}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
