"""The reproduction run: GRPO-style RL steps on a checkpoint, one metrics line per step.

One step = sample `group_size` answers to each of `batch_size` prompts, score them with the
task's rule-based reward, normalise the rewards within each group (GRPO advantages), then
`mini_batches` clipped policy-gradient updates with a k3 KL term to a frozen copy of the
starting model (verl's use_kl_loss) and optional router load-balancing / z losses.

Distributed (one rank of a torchrun job, see distributed.py): every rank builds the models
empty, shards them (FSDP2) and reads only its own rows of the weights (sharded_load.py); the
rollout rows of the global batch are split across ranks and the sampled answers gathered back,
so every rank holds the whole batch (token ids: small) and the rewards, GRPO advantages and
data metrics are those of the one-process run. Each mini-batch is split across ranks in turn;
losses are normalised by the global token count and every metric is reduced to its global
value, so the failure detector sees the same numbers on every rank (and in a one-process run),
and all ranks stop at the same step. Rank 0 alone writes files.
Sampling draws each row's noise from a generator of its own (seed, step, row), so a row's
answer does not depend on which rows share its rank.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from moe_proxy.checkpoint.reader import Checkpoint, open_checkpoint
from moe_proxy.errors import MoeProxyError
from moe_proxy.reports import error_report, write_termination_log
from moe_proxy.rl.config import RankFault, ReproConfig
from moe_proxy.metrics.detect import FailureDetector, Signature, Thresholds
from moe_proxy.rl.distributed import (DEFAULT_TIMEOUT_S, Comm, RankFailed, check_rows, join,
                                         local, shard)
from moe_proxy.rl.faults import FaultInjector
from moe_proxy.rl.grad_sums import grad_sums
from moe_proxy.metrics.metrics_io import METRICS_FILE, SUMMARY_FILE, append_step
from moe_proxy.rl.policy_loss import gap_metrics, gap_sums, importance_ratio, rollout_is_weights
from moe_proxy.rl.precision import autocast, compute_in_fp32, fp32_modules
from moe_proxy.rl.rollout import RolloutEngine
from moe_proxy.rl.routers import RouterTap, find_routers
from moe_proxy.rl.routing import RoutingRecorder, RoutingReplay, mismatch_counts, replay_choices
from moe_proxy.rl.sharded_load import load_shards, meta_model
from moe_proxy.rl.source import check_source, local_checkpoint
from moe_proxy.rl.task import Codec, PromptSet, load_prompts, make_prompts
from moe_proxy.rl.weight_check import WeightBound
from moe_proxy.metrics.verdict import first_failure, stop_reason as stop_reason_of, verdict_report

log = logging.getLogger(__name__)

_LAYER = re.compile(r"layers\.(\d+)\.")
_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+$")


@dataclass
class RunResult:
    steps_completed: int
    failures: dict[str, dict]
    reproduced: bool
    signature: str | None
    step: int | None
    last_metrics: dict[str, float] = field(default_factory=dict)
    cannot_show: dict[str, str] = field(default_factory=dict)  # FailureDetector.cannot_show


def run_repro(checkpoint: str, out_dir: str | Path, config: ReproConfig, *, fail_on: Signature | None = None,
              thresholds: Thresholds | None = None, device: str | None = None,
              termination_log: str | Path | None = None, prompts: str | None = None,
              timeout_s: float = DEFAULT_TIMEOUT_S, rank_fault: RankFault | None = None) -> RunResult:
    """Run `config.steps` RL steps on `checkpoint`, writing metrics.jsonl and summary.json into
    `out_dir`. Stops early once `fail_on` is detected, or when the loss or weights are NaN.
    `prompts` (a file or s3:// object of verl RL data) replaces the built-in task. Launched by
    torchrun (RANK, WORLD_SIZE, LOCAL_RANK set), this process is one rank of the run."""
    out = Path(out_dir)
    try:  # a run that cannot start writes no summary: only the Job's termination message says why
        store = check_source(checkpoint)
        rows = load_prompts(prompts) if prompts else None
    except MoeProxyError as exc:
        if termination_log:
            write_termination_log(termination_log, error_report(exc))
        raise
    detector = FailureDetector(thresholds or Thresholds(), extra=[fail_on] if fail_on and fail_on.metric else [])
    started = time.time()
    done, device_used = StepsDone(), device
    comm, error = Comm(), None
    try:
        comm = join(device, timeout_s)
        device_used = str(comm.device)
        if comm.is_main:
            out.mkdir(parents=True, exist_ok=True)
            for stale in (METRICS_FILE, SUMMARY_FILE):  # a rerun into the same directory starts afresh
                (out / stale).unlink(missing_ok=True)
        dataset = PromptSet(rows, config.seed if config.prompt_seed is None else config.prompt_seed) \
            if rows is not None else None
        with local_checkpoint(store, weights=not comm.distributed) as path:
            loop = _Loop(path, config, comm, dataset, open_checkpoint(checkpoint) if comm.distributed else None)
            _run_steps(loop, config, comm, detector, fail_on, rank_fault, out, done)
    except BaseException as exc:  # the steps recorded so far stay readable, and say why they end
        # Set before naming the lost rank, which the launcher's SIGTERM may cut short.
        error = exc
        done.stop_reason = _ended_by(exc, exc)
        error = _rank_error(comm, exc)
        done.stop_reason = _ended_by(exc, error)
        if error is exc:
            raise
        raise error from exc
    finally:
        result = _result(detector, fail_on, done.steps, done.last)
        if comm.is_main:
            verdict = verdict_report(detector, fail_on, done.history, done.stop_reason)
            _write_outputs(out, termination_log, verdict, error, {
                "checkpoint": checkpoint, "device": device_used, "ranks": comm.world, "prompts": prompts,
                "steps_requested": config.steps, "steps_completed": done.steps, "stopped": done.stop_reason,
                "wall_s": round(time.time() - started, 3), "failures": result.failures,
                "cannot_show": result.cannot_show,
                "first_failure": ({"signature": result.signature, "step": result.step} if result.signature else None),
                "fail_on": fail_on.name if fail_on else None,
                # a run that ended in error has no verdict: its steps are a partial run
                "reproduced": result.reproduced if error is None else None,
                "thresholds": detector.thresholds.__dict__, "config": config.to_dict(),
            })
        comm.close(clean=error is None)
    return result


@dataclass
class StepsDone:
    """What a run has done so far, kept as it goes: a run cut short by an error still reports it."""

    steps: int = 0
    last: dict[str, float] = field(default_factory=dict)  # the last step's metrics
    history: dict[int, dict[str, float]] = field(default_factory=dict)  # step -> metrics, for the verdicts
    stop_reason: str = "completed"


def _run_steps(loop: _Loop, config: ReproConfig, comm: Comm, detector: FailureDetector, fail_on: Signature | None,
               rank_fault: RankFault | None, out: Path, done: StepsDone) -> None:
    """Run the steps, each one's metrics appended to metrics.jsonl (by the main rank), until the
    last or until a failure stops the run (fail_on, or NaN in the loss or weights)."""
    for step in range(config.steps):
        if rank_fault:
            rank_fault.maybe_fire(comm.rank, step)
        comm.mark(step)
        done.last = loop.step(step)
        if comm.is_main:
            append_step(out / METRICS_FILE, step, done.last)
        done.steps = step + 1
        done.history[step] = done.last
        for name in detector.update(step, done.last):
            if comm.is_main:
                log.info("%s", detector.onsets[name].line(name))
        stop = stop_reason_of(detector, fail_on)
        # The metrics are the same on every rank, so is the decision; agreeing on it
        # keeps the ranks in step even if it were not.
        if comm.any(stop is not None):
            done.stop_reason = stop or "another rank stopped"
            return
        if comm.is_main:
            log.info("step %d: reward %.3f grad_norm %.4g pg_loss %.4g", step, done.last["critic/rewards/mean"],
                     done.last["actor/grad_norm"], done.last["actor/pg_loss"])


def _ended_by(exc: BaseException, error: BaseException) -> str:
    """summary.json's `stopped` for a run that `exc` ended, reported as `error`."""
    return "interrupted" if isinstance(exc, KeyboardInterrupt) else f"error: {type(error).__name__}: {error}"


def _rank_error(comm: Comm, exc: BaseException) -> BaseException:
    """In a distributed run: an error of this rank is posted for the others to name; a failed
    collective (a peer died or hung) becomes RankFailed naming the peer."""
    if not comm.distributed or isinstance(exc, (RankFailed, KeyboardInterrupt)):
        return exc
    if _is_collective_error(exc):
        return comm.failure(exc)
    comm.report_error(exc)
    return exc


def _is_collective_error(exc: BaseException) -> bool:
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, getattr(dist, "DistError", ())) or any(
        word in text for word in ("gloo", "nccl", "NCCL", "hccl", "HCCL", "Connection closed", "Connection reset",
                                  "imed out", "Broken pipe"))


def _write_outputs(out: Path, termination_log: str | Path | None, verdict: dict, error: BaseException | None,
                   summary: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    if termination_log:
        write_termination_log(termination_log, error_report(error) if error is not None else verdict)


def _result(detector: FailureDetector, fail_on: Signature | None, steps: int, last: dict) -> RunResult:
    signature, step = first_failure(detector, fail_on)
    return RunResult(steps, detector.to_dict(), signature is not None, signature, step, last,
                     dict(detector.cannot_show))


def _aggregate(updates: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics from its mini-batch updates: means (as verl), but sums of counts and
    maxima of magnitudes, so that one bad update is not averaged away."""
    m = {key: float(np.mean([u[key] for u in updates])) for key in updates[0]}
    for key in ("numerics/nonfinite_grads", "numerics/nonfinite_activations", "numerics/skipped_steps",
                "numerics/loss_scale_backoffs"):
        m[key] = float(sum(u[key] for u in updates))
    for key in ("numerics/max_activation", "numerics/max_logit", "moe/router_logit_max",
                "rollout_corr/rollout_is_applied_max"):
        if key in m:
            m[key] = float(max(u[key] for u in updates))
    m["numerics/grad_overflow"] = float(m["numerics/nonfinite_grads"] > 0)
    return m


def _batch_metrics(batch: dict[str, torch.Tensor], max_new_tokens: int) -> dict[str, float]:
    scores, adv, lengths = batch["scores"], batch["adv"], batch["lengths"].float()
    return {
        "critic/score/mean": scores.mean().item(),
        "critic/rewards/mean": scores.mean().item(), "critic/rewards/max": scores.max().item(),
        "critic/rewards/min": scores.min().item(),
        "critic/advantages/mean": adv.mean().item(), "critic/advantages/max": adv.max().item(),
        "critic/advantages/min": adv.min().item(),
        "response_length/mean": lengths.mean().item(), "response_length/max": lengths.max().item(),
        "response_length/min": lengths.min().item(),
        "response_length/clip_ratio": (lengths >= max_new_tokens).float().mean().item(),
    }


class ActivationWatch:
    """The residual stream after every decoder layer (the last one before the final norm):
    its largest finite magnitude, and how many values are not finite. In fp16/bf16 a value
    beyond the dtype's range (fp16: 65504) comes out as inf or, from a CPU matmul, NaN: an
    overflow in the forward pass, which no loss scaling can save."""

    def __init__(self, model: torch.nn.Module):
        self.recording = False
        self.max_abs, self.nonfinite = 0.0, 0
        for name, module in model.named_modules():
            if _DECODER_LAYER.search(name):
                module.register_forward_hook(self._hook)

    def _hook(self, _module, _inputs, output) -> None:
        if not self.recording:
            return
        h = (output[0] if isinstance(output, tuple) else output).detach()
        # One pass, no temporary: the extremes are finite only when every value is (a NaN or inf
        # anywhere makes one of them so). The masked copy and count of every finite value cost 60x
        # as much (bench/rl_step.py: 2.5 ms a layer of 1,400 tokens x 128) and run only when needed.
        if h.numel() == 0:
            return
        lo, hi = torch.stack(torch.aminmax(h)).tolist()  # one read (a GPU: one synchronisation)
        largest = max(-lo, hi)
        if math.isfinite(largest):
            self.max_abs = max(self.max_abs, largest)
            return
        finite = torch.isfinite(h)
        if finite.any():
            self.max_abs = max(self.max_abs, h[finite].abs().max().item())
        self.nonfinite += int((~finite).sum())

    def start(self) -> None:
        self.max_abs, self.nonfinite, self.recording = 0.0, 0, True

    def stop(self) -> None:
        self.recording = False

    def metrics(self, comm: Comm) -> dict[str, float]:
        """Of the global batch: the max over ranks, and the count summed over ranks."""
        (largest,), (nonfinite,) = comm.max([self.max_abs]), comm.sum([self.nonfinite])
        return {"numerics/max_activation": math.inf if nonfinite else largest,
                "numerics/nonfinite_activations": float(nonfinite)}


class _RowSampler:
    """Sampling whose draws do not depend on which rows share a batch (or a rank): row i's
    noise comes from a generator seeded with its own (run seed, step, global row), and
    argmax(logits / T + Gumbel noise) is an exact sample of softmax(logits / T). Used as a
    logits processor under greedy decoding, after transformers' own processors."""

    def __init__(self, seeds: list[int], temperature: float):
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        self.temperature = temperature

    def __call__(self, _input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.temperature <= 0:  # greedy
            return scores
        noise = torch.stack([torch.rand(scores.shape[-1], generator=g) for g in self.generators])
        gumbel = -torch.log(-torch.log(noise.clamp_min(1e-20)))
        return scores / self.temperature + gumbel.to(scores.device, scores.dtype)


def adamw(params: list[torch.nn.Parameter], config: ReproConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW as TRL's Trainer steps it by default (`adamw_torch_fused`): the fused kernel, one pass
    over each parameter's states (CPU: 0.06 s against the multi-tensor loop's 0.28 s a step of 54M
    parameters), where the device has it; the multi-tensor (foreach) loop elsewhere. The fused
    kernel's values differ from the loop's in the last bits, not by rank: a tensor stepped whole
    and in two FSDP halves is bitwise equal (tests/repro/test_distributed.py)."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    fused = device.type in _get_fused_kernels_supported_devices() and all(p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0, eps=config.adam_eps,
                             **({"fused": True} if fused else {"foreach": True}))


def clip_factor(norm: float, max_norm: float) -> float:
    """clip_grad_norm_'s factor with the gradient's norm already taken (`norm`, of the full
    gradient: `_Loop._grad_stats` reduces it over the ranks): max_norm / (norm + 1e-6), at most 1."""
    return min(max_norm / (norm + 1e-6), 1.0)


def clip_grads(params: list[torch.nn.Parameter], norm: float, max_norm: float) -> None:
    """Every gradient times clip_factor where that is below 1 (a non-finite norm makes every
    gradient so); a factor of 1 is no pass."""
    factor = clip_factor(norm, max_norm)
    if factor != 1.0:
        torch._foreach_mul_([p.grad for p in params if p.grad is not None], factor)


def clipped_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], norm: float,
                 max_norm: float) -> None:
    """optimizer.step() on the gradients as `clip_grads` clips them. The fused kernel takes a
    factor below 1 itself, as its grad_scale input (every gradient divided by 1 / factor, as
    GradScaler uses it): no pass of its own over the gradients (bench/grad_stats.py: 84 -> 64 CPU
    ms a step of 54M with clipping on); the weights differ from multiply-then-step in the last bit."""
    factor = clip_factor(norm, max_norm)
    if factor != 1.0 and math.isfinite(factor) and factor > 0 and optimizer.defaults.get("fused"):
        optimizer.grad_scale = torch.tensor(1 / factor, device=params[0].device)
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale
        return
    clip_grads(params, norm, max_norm)
    optimizer.step()


class _Loop:
    """Models, optimiser and per-step state of one run."""

    def __init__(self, path: Path, config: ReproConfig, comm: Comm, dataset: PromptSet | None = None,
                 weights: Checkpoint | None = None):
        from moe_proxy.layerwise.load import load_causal_lm

        self.config, self.comm, self.device, self.dataset = config, comm, comm.device, dataset
        check_rows(config, comm.world)
        random.seed(config.seed)
        np.random.seed(config.seed)
        torch.manual_seed(config.seed)

        def load() -> torch.nn.Module:
            # A rank of a distributed run: an empty (meta) model, filled once sharded (sharded()).
            if comm.distributed:
                return meta_model(path)
            return load_causal_lm(path, dtype=torch.float32).to(self.device)

        def sharded(model: torch.nn.Module) -> torch.nn.Module:
            """FSDP2 shards, filled with this rank's rows of `weights` only: no rank holds the model."""
            shard(model, comm)
            return load_shards(model, weights, self.device) if comm.distributed else model

        self.policy = load()
        self.fp32_experts = getattr(self.policy.config, "_experts_implementation", None)
        self.codec = Codec(path, self.policy.config.vocab_size)
        top_k = getattr(self.policy.config, "num_experts_per_tok", None) or 1
        self.tap = RouterTap(self.policy, top_k)
        self.faults = FaultInjector(self.policy, self.tap.routers, config.faults, config.seed)
        self.activations = ActivationWatch(self.policy)
        # Routing replay goes ahead of the tap's hooks (prepend), so the tap sees the routing used.
        self.replay = RoutingReplay(self.tap.routers) if config.routing_replay != "off" else None
        self.routing = RoutingRecorder(self.tap.routers)  # the trainer's own old-log-prob forward
        # The old-log-prob pass is redundant when the batch gets one update: that update's forward is
        # the same weights on the same rows (TRL skips it then; verl takes the actor's forward). Not
        # with a noisy operator fault, whose two forwards differ.
        self.old_pass = config.mini_batches > 1 or (config.faults.op_step is not None
                                                    and config.faults.op_mode == "noise")
        sharded(self.policy)  # hooks stay; parameters become this rank's shards (DTensors)
        self.reference = sharded(load().eval().requires_grad_(False))
        for model in (self.policy, self.reference):
            for module in fp32_modules(model, find_routers(model), config.router_dtype, config.lm_head_dtype):
                compute_in_fp32(module)
        self.engine = RolloutEngine(self.policy, path, config, comm, config.seed)
        self.params = [p for p in self.policy.parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in self.policy.named_parameters()}
        # Router weights are not dense in the underflow sense: with a renormalised top-k, the row
        # of an expert no token chose gets no gradient (exactly 0 in fp16, rounding noise in fp32).
        self.router_params = {id(p) for r in self.tap.routers for p in r.module.parameters()}
        self.optimizer = adamw(self.params, config, self.device)
        self.weight_bound = WeightBound()  # numerics/params_nonfinite reads the weights only where needed
        if comm.distributed:  # found-inf agreed over ranks, so all skip the same steps
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(self.device.type, init_scale=config.init_loss_scale)
        else:
            self.scaler = torch.amp.GradScaler(self.device.type, init_scale=config.init_loss_scale)

    def _experts_kernel(self, precision: str) -> None:
        """transformers' default experts kernel (grouped_mm) is not autocast-enabled: under fp16/bf16
        autocast the experts would still compute in fp32, hiding the overflows a half-precision job
        has (a super expert's massive activation). Half-precision steps use the eager kernel, whose
        linears autocast covers; fp32 steps keep the faster default, so they stay bitwise equal to
        the same run without an fp16 fault."""
        wanted = self.fp32_experts if precision == "fp32" else "eager"
        if self.fp32_experts is None or self.policy.config._experts_implementation == wanted:
            return
        for model in (self.policy, self.reference):
            model.set_experts_implementation(wanted)

    def _autocast(self, precision: str):
        return autocast(precision, self.device)

    def step(self, step: int) -> dict[str, float]:
        cfg = self.config
        self.faults.step = step
        precision, scaled = cfg.precision_at(step)
        self._experts_kernel(precision)
        self.engine.set_kernels(self.fp32_experts and self.policy.config._experts_implementation)
        lr = cfg.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        t0 = time.perf_counter()

        batch = self._rollout(step, precision)
        t_gen = time.perf_counter()
        # Mini-batch k is the same rows as in a one-process run, split across the ranks: this
        # rank's part of each, in order.
        world, rank = self.comm.world, self.comm.rank
        parts = [rows.tensor_split(world)[rank] for rows in torch.arange(batch["seq"].shape[0]).tensor_split(
            cfg.mini_batches)]
        mine = torch.cat(parts)
        positions = batch["seq"].shape[1]
        r3 = cfg.routing_replay == "R3"
        old = None  # the old-log-prob pass's log-probs and the trainer's routing in it
        with torch.no_grad(), self._autocast(precision):
            if self.old_pass:
                self.routing.start(len(mine))
                self._replay(r3, batch["rollout_routing"], mine, positions)
                old_logp = self._logp(self.policy, batch, mine)[0]
                self._replay(False)
                old = (old_logp, self.routing.stop())
            t_old = time.perf_counter()
            ref_logp = self._logp(self.reference, batch, mine)[0]
        t_ref = time.perf_counter()

        gap, updates = self._updates(batch, parts, mine, precision, scaled, ref_logp, old)
        t_end = time.perf_counter()
        # Without an old-log-prob pass, its time is 0.
        times = [t_gen - t0, (t_old - t_gen) * self.old_pass, t_ref - t_old, t_end - t_ref, t_end - t0]
        return self._step_metrics(step, lr, precision, scaled, batch, gap, updates, times)

    def _updates(self, batch, parts: list[torch.Tensor], mine: torch.Tensor, precision: str, scaled: bool,
                 ref_logp: torch.Tensor, old: tuple | None) -> tuple[dict[str, float], list[dict[str, float]]]:
        """The step's updates, one per mini-batch (this rank's rows of each in `parts`), and the
        rollout-vs-trainer gap metrics; `old`: the old-log-prob pass's (log-probs, routing)."""
        cfg = self.config
        if old is not None:
            old_logp, trainer_routing = old
            gap, behaviour, weights = self._trainer_view(batch, mine, old_logp, trainer_routing)
            updates, start = [], 0
            for idx in parts:
                at = slice(start, start + len(idx))
                replayed = {"R3": (batch["rollout_routing"], idx),
                            "R2": (trainer_routing, torch.arange(at.start, at.stop))}.get(cfg.routing_replay)
                logp, logits = self._forward(batch, idx, precision, replayed)
                updates.append(self._update(batch, idx, logp, logits, behaviour[at], ref_logp[at], scaled,
                                            None if weights is None else weights[at]))
                start += len(idx)
            return gap, updates
        # One update of the whole batch: its forward is the old policy's (detached, the ratio is
        # 1 with the policy's gradient, as TRL and verl take it), and its routing the trainer's.
        # R2 has nothing to replay: the update routes as itself.
        self.routing.start(len(mine))
        r3 = cfg.routing_replay == "R3"
        logp, logits = self._forward(batch, mine, precision, (batch["rollout_routing"], mine) if r3 else None)
        trainer_routing = self.routing.stop()
        gap, behaviour, weights = self._trainer_view(batch, mine, logp.detach(), trainer_routing)
        return gap, [self._update(batch, mine, logp, logits, behaviour, ref_logp, scaled, weights)]

    def _step_metrics(self, step: int, lr: float, precision: str, scaled: bool, batch, gap: dict[str, float],
                      updates: list[dict[str, float]], times: list[float]) -> dict[str, float]:
        """The step's metrics, verl-named: the updates' (aggregated), the gap's, the numerics, the
        batch's, and the times of its phases (gen, old log-prob, ref, update, all) on this rank."""
        cfg = self.config
        m = _aggregate(updates)
        m.update(gap)
        m["numerics/half_precision"] = float(precision != "fp32")
        if scaled:
            m["numerics/loss_scale"] = float(self.scaler.get_scale())
        # a weight bad on any rank; read only where the updates' bound cannot rule it out (weight_check)
        bound = self.weight_bound
        m["numerics/params_nonfinite"] = 0.0 if bound.finite() else float(bound.read(self.params, self.comm))
        m.update(_batch_metrics(batch, cfg.max_new_tokens))
        # The slowest rank's times: the step takes as long as it does.
        gen, old, ref, update, total = self.comm.max(times)
        m.update({
            "training/global_step": float(step), "actor/lr": lr, "actor/kl_coef": cfg.kl_coef,
            "timing_s/gen": gen, "timing_s/old_log_prob": old, "timing_s/ref": ref,
            "timing_s/update_actor": update, "perf/time_per_step": total,
            "perf/total_num_tokens": float(batch["attn"].sum().item()),
        })
        m["perf/throughput"] = m["perf/total_num_tokens"] / max(m["perf/time_per_step"], 1e-9)
        return m

    def _rollout(self, step: int, precision: str) -> dict[str, torch.Tensor]:
        """The global batch's rollouts, on every rank: each rank samples its block of rows, and
        the answers are gathered."""
        cfg, codec, comm = self.config, self.codec, self.comm
        prompt_seed = cfg.seed if cfg.prompt_seed is None else cfg.prompt_seed
        prompts = make_prompts(cfg.task, prompt_seed, step, cfg.batch_size, self.dataset)
        encoded = [codec.encode(codec.render(p)) for p in prompts]
        width = max(len(ids) for ids in encoded)
        rows = cfg.batch_size * cfg.group_size
        input_ids = torch.full((rows, width), codec.pad_id, dtype=torch.long)
        prompt_attn = torch.zeros_like(input_ids)
        for row in range(rows):  # left padding: every answer starts at the same column
            ids = encoded[row // cfg.group_size]
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            prompt_attn[row, width - len(ids):] = 1
        input_ids, prompt_attn = input_ids.to(self.device), prompt_attn.to(self.device)
        blocks = torch.arange(rows).tensor_split(comm.world)
        seeds = [((cfg.seed * 1_000_003 + step) * 1_000_033 + int(row)) % 2**63 for row in blocks[comm.rank]]
        rollout = self.engine.generate(input_ids, prompt_attn, blocks, seeds, _RowSampler, codec, precision, step)
        response = rollout.response
        # The answer runs up to and including the first end-of-sequence token.
        is_eos = (response == codec.eos_id).long()
        resp_mask = ((is_eos.cumsum(-1) - is_eos) == 0).long()
        lengths = resp_mask.sum(-1)
        # As wide as the longest answer, as generation on one rank stops when all rows have ended.
        keep = int(lengths.max())
        response, resp_mask = response[:, :keep], resp_mask[:, :keep]
        rollout_logp = rollout.logp[:, :keep].to(self.device)
        scores = torch.tensor([prompts[i // cfg.group_size].score(codec.decode(response[i, : lengths[i]].tolist()))
                               for i in range(rows)])
        grouped = scores.view(cfg.batch_size, cfg.group_size)
        adv = ((grouped - grouped.mean(-1, keepdim=True)) / (grouped.std(-1, keepdim=True) + 1e-6)).reshape(-1)
        attn = torch.cat([prompt_attn, resp_mask], dim=-1)
        return {"seq": torch.cat([input_ids, response], dim=-1), "attn": attn,
                "positions": (attn.cumsum(-1) - 1).clamp_min(0),
                "resp_mask": resp_mask.float(), "prompt_len": torch.tensor(width), "lengths": lengths,
                "scores": scores, "adv": adv.to(self.device),
                "rollout_logp": rollout_logp, "rollout_routing": rollout.routing}

    def _logp(self, model, batch, idx=None, **kwargs):
        """Log-probabilities of the answer tokens (and the forward output)."""
        sel = slice(None) if idx is None else idx
        seq = batch["seq"][sel]
        width = int(batch["prompt_len"])
        # The LM head on the positions that predict an answer token only (the prompt's last on), as
        # TRL's logits_to_keep: the prompt's other positions' logits are never read.
        out = model(input_ids=seq, attention_mask=batch["attn"][sel], position_ids=batch["positions"][sel],
                    logits_to_keep=seq.shape[1] - width + 1, use_cache=False, **kwargs)
        logits = out.logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, seq[:, width:].unsqueeze(-1)).squeeze(-1)
        return logp, logits, out

    def _replay(self, on: bool, choices: dict | None = None, rows: torch.Tensor | None = None,
                positions: int = 0) -> None:
        """Route the policy's next forwards as `choices` did for `rows` (off: as it chooses)."""
        if self.replay is not None:
            self.replay.use(replay_choices(choices, rows, positions) if on else None)

    def _trainer_view(self, batch, mine, old_logp, trainer_routing):
        """From the trainer's old log-probs of this rank's rows `mine` (and the routing of their
        forward): the rollout/trainer gap's metrics, the PPO ratio's denominator (the trainer's
        recompute, or the rollout's own: verl's bypass) and the rollout IS weights (or None)."""
        cfg = self.config
        rollout_logp, mask = batch["rollout_logp"][mine], batch["resp_mask"][mine]
        gap = self._gap(old_logp, rollout_logp, mask, batch["rollout_routing"], trainer_routing,
                        batch["attn"][mine][:, :-1], mine)
        behaviour = rollout_logp if cfg.old_logprobs == "rollout" else old_logp
        weights = (rollout_is_weights(old_logp, rollout_logp, mask, cfg.rollout_is, cfg.rollout_is_threshold,
                                      cfg.rollout_is_mode) if cfg.rollout_is != "off" else None)
        return gap, behaviour, weights

    def _gap(self, old_logp, rollout_logp, mask, rollout_routing, trainer_routing, valid, mine) -> dict[str, float]:
        """The rollout/trainer gap of this step, over the global batch: verl's probs-diff figures,
        the mismatch KL, the raw IS weights' figures, and the share of tokens whose routed expert
        set differs between the rollout's forwards and the trainer's recompute, per layer."""
        cfg, comm = self.config, self.comm
        sums, maxes = gap_sums(old_logp, rollout_logp, mask, cfg.rollout_is if cfg.rollout_is != "off" else "token",
                               cfg.rollout_is_threshold)
        out = gap_metrics(comm.sum(sums), comm.max(maxes))
        counts = mismatch_counts({layer: idx[mine] for layer, idx in rollout_routing.items()}, trainer_routing, valid)
        layers = sorted(counts)
        totals = comm.sum([v for layer in layers for v in counts[layer]])
        differ, seen = totals[0::2], totals[1::2]
        for layer, d, n in zip(layers, differ, seen):
            out[f"moe/routing_mismatch/layer_{layer}"] = d / max(n, 1.0)
        if layers:
            out["moe/routing_mismatch"] = sum(differ) / max(sum(seen), 1.0)
        return out

    def _forward(self, batch, idx, precision: str, replayed: tuple | None = None):
        """The update's forward on this rank's rows `idx`, with the router tap and the activation
        watch on: the answer tokens' log-probabilities and logits, with their graph. `replayed`:
        (recorded routing, its rows for `idx`) to replay."""
        self.tap.start(batch["attn"][idx])
        if replayed is not None:
            self._replay(True, *replayed, batch["seq"].shape[1])
        with self._autocast(precision):
            self.activations.start()
            logp, logits, _ = self._logp(self.policy, batch, idx)
            self.activations.stop()
        self._replay(False)
        self.tap.stop()
        return logp, logits

    def _update(self, batch, idx, logp, logits, old_logp, ref_logp, scaled: bool,
                is_weights: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer update on this rank's rows `idx` of a mini-batch, from their forward
        (`_forward`). Token means are over the whole mini-batch (all ranks): each rank's share is
        its sum over the global count. `is_weights`: the rollout IS correction of each token's loss."""
        cfg, comm = self.config, self.comm
        mask, adv = batch["resp_mask"][idx].to(self.device), batch["adv"][idx].unsqueeze(-1)
        tokens = max(1.0, comm.sum([mask.sum().item()])[0])

        def share(values: torch.Tensor) -> torch.Tensor:
            return (values * mask).sum() / tokens

        ratio = importance_ratio(logp, old_logp, mask, cfg.ratio_level)
        pg_losses = -adv * ratio
        pg_clipped = -adv * ratio.clamp(1 - cfg.clip_ratio, 1 + cfg.clip_ratio)
        pg_token = torch.maximum(pg_losses, pg_clipped)
        pg_loss = share(pg_token if is_weights is None else pg_token * is_weights)
        log_ratio = (ref_logp - logp).clamp(-20, 20)
        kl_loss = share((log_ratio.exp() - log_ratio - 1).clamp(-10, 10))  # k3 estimator
        aux_loss, z_loss = self.tap.aux_losses(comm)
        loss = pg_loss + cfg.kl_coef * kl_loss + cfg.router_aux_coef * aux_loss + cfg.router_z_coef * z_loss
        with torch.no_grad():
            probs = logits.softmax(-1)
            entropy = share(-(probs * probs.clamp_min(1e-30).log()).sum(-1))
            shares = comm.sum([t.item() for t in (
                pg_loss, kl_loss, entropy, share(old_logp - logp), share((pg_clipped > pg_losses).float()),
                aux_loss, z_loss)])
            metrics = dict(zip(("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/ppo_kl",
                                "actor/pg_clipfrac", "moe/aux_loss", "moe/z_loss"), shares))
            metrics.update(self.activations.metrics(comm))
            metrics["numerics/max_logit"] = comm.max([logits.abs().max().item()])[0]
            if is_weights is not None:
                applied = is_weights[mask.bool()]
                (metrics["rollout_corr/rollout_is_applied_mean"],) = [
                    v / tokens for v in comm.sum([applied.sum().item()])]
                metrics["rollout_corr/rollout_is_applied_max"] = comm.max(
                    [applied.max().item() if applied.numel() else 0.0])[0]
            metrics.update(self.tap.metrics(comm))
        metrics.update(self._optimizer_step(loss, scaled))
        return metrics

    def _optimizer_step(self, loss: torch.Tensor, scaled: bool) -> dict[str, float]:
        """Backward and one optimizer step, skipped where the gradients are not finite (the grad
        scaler's rule when the loss is scaled, verl's otherwise); the gradient's figures."""
        cfg, comm = self.config, self.comm
        self.optimizer.zero_grad(set_to_none=True)
        # FSDP averages the ranks' gradients; the ranks' shares of the loss must add up instead.
        loss = loss * comm.world
        (self.scaler.scale(loss) if scaled else loss).backward()
        if scaled:
            self.scaler.unscale_(self.optimizer)
        metrics = self._grad_stats()  # with the full gradient's norm (reduced over the ranks)
        norm, max_norm = metrics["actor/grad_norm"], cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        found_inf = metrics["numerics/nonfinite_grads"] > 0
        backoff, stepped = 0.0, False
        if scaled:
            clip_grads(self.params, norm, max_norm)
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # skips the update when gradients overflowed
            self.scaler.update()
            backoff = float(self.scaler.get_scale() < before)  # the scale backs off where it skipped
            stepped = not backoff
        elif not found_inf or cfg.skip_nonfinite is False:
            clipped_step(self.optimizer, self.params, norm, max_norm)
            stepped = True
        if stepped:
            self.weight_bound.stepped(norm, self.optimizer.param_groups[0])
        # Otherwise skip the update, as verl's actor does when grad_norm is not finite.
        metrics["numerics/skipped_steps"] = float(found_inf and cfg.skip_nonfinite is not False)
        metrics["numerics/loss_scale_backoffs"] = backoff
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def _grad_stats(self) -> dict[str, float]:
        """Counts and per-layer norms of the full gradient, and its norm (`actor/grad_norm`, the
        clipping's): summed over the ranks' shards."""
        nonfinite, zeros, total, dense_zeros, dense_total, norm_sq = 0, 0, 0, 0, 0, 0.0
        layer_sq = {int(m.group(1)): 0.0 for m in map(_LAYER.search, (self.names[id(p)] for p in self.params)) if m}
        grads = [(p, local(p.grad.detach()).reshape(-1)) for p in self.params if p.grad is not None]
        # Each gradient's sum of squares and zero count, in one pass where it is large (grad_sums);
        # the clipping takes the total norm. A NaN or inf anywhere makes a sum non-finite (so may an
        # overflow of finite values: then they are counted). bench/rl_step.py: a norm per figure (the
        # sum's finiteness, a dot product, clip_grad_norm_'s own) cost 1.6x as much as one.
        for (p, flat), (square, zero) in zip(grads, grad_sums([g for _, g in grads])):
            name = self.names[id(p)]
            if not math.isfinite(square):
                nonfinite += int((~torch.isfinite(flat)).sum())
            zeros += zero
            total += flat.numel()
            # Dense weights get a gradient from every token, so in fp32 none of its elements is
            # exactly 0; zeros there are values flushed by fp16 underflow. (Unrouted experts, router
            # rows of unchosen experts and unused embedding rows are legitimately zero: left out.)
            if "experts" not in name and "embed" not in name and id(p) not in self.router_params:
                dense_zeros += zero
                dense_total += flat.numel()
            match = _LAYER.search(name)
            if match:
                layer_sq[int(match.group(1))] += square
            norm_sq += square
        layers = sorted(layer_sq)
        nonfinite, zeros, total, dense_zeros, dense_total, norm_sq, *squares = self.comm.sum(
            [nonfinite, zeros, total, dense_zeros, dense_total, norm_sq, *(layer_sq[k] for k in layers)])
        stats = {f"numerics/grad_norm/layer_{k}": math.sqrt(v) for k, v in zip(layers, squares)}
        stats["numerics/nonfinite_grads"] = float(nonfinite)
        stats["numerics/grad_zero_frac"] = zeros / max(1, total)
        stats["numerics/dense_grad_zero_frac"] = dense_zeros / max(1, dense_total)
        stats["actor/grad_norm"] = math.sqrt(norm_sq)
        return stats
