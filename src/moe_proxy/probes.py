"""MoE probes inside the user's own training framework: forward hooks on a transformers MoE
model that give, per optimizer step, the MoE and numerics metrics `moe-proxy repro` logs, under
moe-proxy's names, so that `moe-proxy watch` / `compare` can judge routing collapse and
activation overflow from a TRL, transformers Trainer or any other run.

    probe = moe_proxy.probes.attach(model, jsonl="run/probes.jsonl")  # any framework
    probe.step(step)  # after each optimizer step: returns the metrics and appends a JSON line

    trainer = GRPOTrainer(..., callbacks=[moe_proxy.probes.MoEProbeCallback()])  # TRL / Trainer

Metrics of a step cover every forward pass with gradients since the previous `step()` (the
training forwards; generation and reference passes under `torch.no_grad()` are left out unless
`grad_only=False`): per MoE layer, entropy and expert loads summed over those passes' tokens,
router logit maxima and activation maxima maxed, non-finite values counted. Padding positions
are left out when the model is called with an `attention_mask` of one row per token.
Routers are found as repro finds them (routers.find_routers: a `gate` / `router` submodule
with one weight row per routed expert), so every architecture repro runs is covered.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from pathlib import Path

import torch
from torch import nn

from moe_proxy.rl.routers import find_routers, moe_metrics, router_output

# The decoder layers whose output (the residual stream) is watched: runner.ActivationWatch's rule.
_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+$")
# Summed, not averaged, over the steps of a logging window; and maxed (runner._aggregate's rule,
# so that one bad step is not averaged away).
_SUMMED = ("numerics/nonfinite_activations",)
_MAXED = ("numerics/max_activation", "moe/router_logit_max", "numerics/params_nonfinite",
          "numerics/half_precision")
_HALF = (torch.float16, torch.bfloat16)


class _Layer:
    """One MoE layer's sums over a step's forward passes, kept as tensors on the model's device
    (read back once per step, not once per forward pass)."""

    def __init__(self):
        self.entropy = None  # sum over tokens of the router's entropy
        self.tokens = 0
        self.load = None  # routed slots per expert
        self.logit_max = None

    def add(self, entropy, tokens, load, logit_max):
        if self.entropy is None:
            self.entropy, self.load, self.logit_max = entropy, load, logit_max
        else:
            self.entropy = self.entropy + entropy
            self.load = self.load + load
            self.logit_max = torch.maximum(self.logit_max, logit_max)
        self.tokens += tokens


class Probes:
    """Forward hooks on `model`'s routers and decoder layers. `step()` returns the metrics since
    the last call (and writes them to `jsonl` when given); `detach()` removes the hooks."""

    def __init__(self, model: nn.Module, *, top_k: int | None = None, grad_only: bool = True,
                 jsonl: str | Path | None = None, check_params: bool = True):
        self.routers = find_routers(model)
        # step() also counts the parameters holding a non-finite value (after the update): a NaN
        # update often crashes the next step's sampling before any logged loss is NaN, and
        # transformers' logging_nan_inf_filter and TRL hide NaN losses anyway.
        self.params = list(model.parameters()) if check_params else []
        self.top_k = top_k or getattr(model.config, "num_experts_per_tok", None) or 1
        self.grad_only = grad_only
        self.writer = JsonlWriter(jsonl) if jsonl is not None else None
        self.steps = 0
        self._mask: torch.Tensor | None = None
        self._handles = [model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)]
        for router in self.routers:
            self._handles.append(router.module.register_forward_hook(self._router_hook(router.layer)))
        for name, module in model.named_modules():
            if _DECODER_LAYER.search(name):
                self._handles.append(module.register_forward_hook(self._activation_hook))
        self._reset()

    # -- hooks -------------------------------------------------------------------------------

    def _recording(self) -> bool:
        return torch.is_grad_enabled() or not self.grad_only

    def _pre_hook(self, _module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is None and len(args) > 1 and isinstance(args[1], torch.Tensor):
            mask = args[1]
        # A 2-D padding mask (batch, tokens); 4-D (already expanded) masks are not per token.
        self._mask = mask.reshape(-1).bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def _router_hook(self, layer: int):
        def hook(_module, _inputs, output):
            if not self._recording():
                return
            logits, chosen = router_output(output)
            logits = logits.detach().reshape(-1, logits.shape[-1]).float()
            if self._mask is not None and self._mask.numel() == logits.shape[0]:
                mask = self._mask.to(logits.device)
                logits = logits[mask]
                chosen = chosen.reshape(mask.numel(), -1)[mask] if chosen is not None else None
            if logits.shape[0] == 0:
                return
            # As routers.RouterTap.metrics and chosen_experts: the softmax's entropy; the loads
            # of the experts the router chose (the plain top-k of the logits when it does not
            # return its choice: grouped or bias-corrected routing is then approximated).
            probs = logits.softmax(-1)
            entropy = -(probs * probs.clamp_min(1e-30).log()).sum()
            if chosen is None:
                chosen = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).indices
            load = torch.bincount(chosen.reshape(-1), minlength=logits.shape[-1]).float()
            self._layers.setdefault(layer, _Layer()).add(entropy, logits.shape[0], load, logits.abs().max())
        return hook

    def _activation_hook(self, _module, _inputs, output):
        if not self._recording():
            return
        # As runner.ActivationWatch: the largest finite |value| of the residual stream, and how
        # many values are not finite.
        h = (output[0] if isinstance(output, tuple) else output).detach()
        finite = torch.isfinite(h)
        largest = torch.where(finite, h, torch.zeros((), dtype=h.dtype, device=h.device)).abs().max().float()
        nonfinite = (~finite).sum()
        # repro's numerics/half_precision: the detector calls non-finite hidden states an
        # overflow only in a half-precision step (in fp32 they are a broken op's NaN)
        self._half = self._half or h.dtype in _HALF or torch.is_autocast_enabled(h.device.type)
        self._act_max = largest if self._act_max is None else torch.maximum(self._act_max, largest)
        self._nonfinite = nonfinite if self._nonfinite is None else self._nonfinite + nonfinite

    # -- metrics -----------------------------------------------------------------------------

    def _reset(self) -> None:
        self._layers: dict[int, _Layer] = {}
        self._act_max = None
        self._nonfinite = None
        self._half = False

    def peek(self) -> dict[str, float]:
        """The metrics recorded since the last `step()`, without starting a new step: the names
        and formulas of routers.RouterTap.metrics and runner.ActivationWatch.metrics, and (with
        `check_params`) the runner's numerics/params_nonfinite over the weights as they are now."""
        out: dict[str, float] = {}
        layers = sorted(self._layers)
        parts = []  # read back in one transfer: one sync with the device per step
        for layer in layers:
            stat = self._layers[layer]
            parts += [stat.entropy.reshape(1), stat.load.max().reshape(1), stat.load.min().reshape(1),
                      stat.logit_max.reshape(1)]
        if self._act_max is not None:
            parts += [self._act_max.reshape(1), self._nonfinite.float().reshape(1)]
        if not parts:
            return out
        if self.params:
            parts.append(nonfinite_params(self.params).reshape(1))
        device = parts[0].device
        values = torch.cat([t.to(device) for t in parts]).tolist()
        if layers:
            per_layer = {}
            for i, layer in enumerate(layers):
                tokens = max(1.0, float(self._layers[layer].tokens))
                entropy, load_max, load_min, largest = values[4 * i:4 * i + 4]
                per_layer[layer] = {"router_entropy": entropy / tokens, "load_max_share": load_max / tokens,
                                    "load_min_share": load_min / tokens, "router_logit_max": largest}
            out.update(moe_metrics(per_layer, self.top_k / self._layers[layers[0]].load.numel()))
        if self.params:
            out["numerics/params_nonfinite"] = values.pop()
        if self._act_max is not None:
            largest, nonfinite = values[-2:]
            out["numerics/max_activation"] = math.inf if nonfinite else largest
            out["numerics/nonfinite_activations"] = float(nonfinite)
            out["numerics/half_precision"] = float(self._half)
        return out

    def step(self, step: int | None = None) -> dict[str, float]:
        """The metrics of the forward passes since the last call ({} when there were none); a
        new step starts. With a JSON-lines file, they are appended as step `step` (by default
        the count of calls)."""
        metrics = self.peek()
        self._reset()
        self.steps += 1
        if self.writer is not None and metrics:
            self.writer.write(self.steps if step is None else step, metrics)
        return metrics

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._reset()

    def __enter__(self) -> Probes:
        return self

    def __exit__(self, *_exc) -> None:
        self.detach()


def nonfinite_params(params: list[torch.Tensor]) -> torch.Tensor:
    """How many of `params` hold a NaN or inf (repro's numerics/params_nonfinite), as a 0-d
    tensor on the parameters' device: one pass over the weights, no sync per tensor."""
    device = params[0].device
    return torch.stack([(~torch.isfinite(p.detach())).any().to(device) for p in params]).sum().float()


def attach(model: nn.Module, **kwargs) -> Probes:
    """Hooks on `model`'s routers and decoder layers (see Probes); raises errors.NotMoE when the
    model has no router."""
    return Probes(model, **kwargs)


class JsonlWriter:
    """Flat JSON lines, `{"step": N, "moe/...": value, ...}`, one per step, which `moe-proxy
    watch` and `compare` read (format `jsonl`). Non-finite values are written as NaN /
    Infinity, which the readers take as non-finite."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
            f.flush()


def aggregate(steps: list[dict[str, float]]) -> dict[str, float]:
    """One logging window's metrics from its steps': means, but sums of counts and maxima of
    magnitudes (runner._aggregate's rule). A name missing from some steps is taken over the
    steps that have it."""
    out: dict[str, float] = {}
    for key in {k for s in steps for k in s}:
        values = [s[key] for s in steps if key in s]
        if key in _SUMMED:
            out[key] = float(sum(values))
        elif key in _MAXED:
            out[key] = float(max(values))
        else:
            out[key] = float(sum(values) / len(values))
    return out


try:
    from transformers import TrainerCallback as _CallbackBase
except ImportError:  # transformers is optional for attach(); the callback needs it
    _CallbackBase = object


class MoEProbeCallback(_CallbackBase):
    """A transformers `TrainerCallback` (the Trainer's and TRL's trainers'): attaches the probes
    to the trained model at the start of training, takes a step's metrics at each optimizer
    step, and at each logging step adds their aggregate over the steps since the last log to
    the logs (so they reach the reporters, TensorBoard as `train/moe/...`, and
    `trainer_state.json`'s `log_history`). Detaches at the end of training.

    The Trainer calls the reporters' callbacks before the user's; so that the reporters see the
    metrics, the callback moves itself to the front of the Trainer's callback list when
    training begins."""

    def __init__(self, **probe_kwargs):
        self.probe_kwargs = probe_kwargs
        self.probes: Probes | None = None
        self.pending: list[dict[str, float]] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._move_to_front()
        if self.probes is None and model is not None:
            self.probes = attach(model, **self.probe_kwargs)
        self.pending = []

    def on_step_end(self, args, state, control, **kwargs):
        if self.probes is not None:
            metrics = self.probes.step(state.global_step)
            if metrics:
                self.pending.append(metrics)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.pending or logs is None or any(k.startswith("eval_") for k in logs):
            return
        metrics = aggregate(self.pending)
        self.pending = []
        logs.update(metrics)
        # The Trainer appended a copy of the logs to the history before calling the callbacks.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def on_train_end(self, args, state, control, **kwargs):
        if self.probes is not None:
            self.probes.detach()
            self.probes = None

    def _move_to_front(self) -> None:
        # The calling CallbackHandler (transformers' trainer_callback.CallbackHandler.call_event,
        # which iterates its list: moving this callback from index i to 0 leaves the next one
        # at i + 1, so no callback is skipped or called twice).
        frame = inspect.currentframe()
        for _ in range(4):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return
            handler = frame.f_locals.get("self")
            callbacks = getattr(handler, "callbacks", None)
            if isinstance(callbacks, list) and any(c is self for c in callbacks):
                if callbacks[0] is not self:
                    callbacks.remove(self)
                    callbacks.insert(0, self)
                return
