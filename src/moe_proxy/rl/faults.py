"""Hooks that inject model-level faults into the policy from a given step: router logit
scaling and a faulty operator. (The learning-rate spike and fp16-without-loss-scaling faults
are settings of the loop, see ReproConfig.lr_at and precision_at.)"""

from __future__ import annotations

import torch
from torch import nn

from moe_proxy.errors import InvalidReproConfig
from moe_proxy.rl.config import Faults
from moe_proxy.rl.routers import Router


class FaultInjector:
    """Registers the hooks once; `step` (set by the loop) switches them on when due."""

    def __init__(self, model: nn.Module, routers: list[Router], faults: Faults, seed: int):
        self.faults = faults
        self.step = 0
        self.generator = torch.Generator().manual_seed(seed + 7919)
        if faults.router_scale_step is not None:
            for router in routers:
                router.module.register_forward_pre_hook(self._scale_router_input)
        if faults.op_step is not None:
            modules = dict(model.named_modules())
            if faults.op_module not in modules:
                near = [n for n in modules if faults.op_module.split(".")[-1] in n][:5]
                raise InvalidReproConfig(
                    f"faulty-op module {faults.op_module!r} not in the model; similar names: {near}")
            modules[faults.op_module].register_forward_hook(self._perturb_output)

    def _scale_router_input(self, _module, args):
        # Scaling the router's input scales its logits (x W^T), before softmax/top-k, as a
        # router kernel with a wrong scale would. (Routers with a bias get the bias unscaled.)
        if self.step < self.faults.router_scale_step:
            return None
        return (args[0] * self.faults.router_scale_factor, *args[1:])

    def _perturb_output(self, _module, _inputs, output):
        if self.step < self.faults.op_step:
            return None
        tensor = output[0] if isinstance(output, tuple) else output
        if self.faults.op_mode == "scale":
            tensor = tensor * self.faults.op_value
        elif self.faults.op_mode == "noise":
            noise = torch.randn(tensor.shape, generator=self.generator).to(tensor.device, tensor.dtype)
            tensor = tensor + self.faults.op_value * tensor.detach().float().std().to(tensor.dtype) * noise
        else:  # nan: one poisoned output channel, as a kernel with a bad tile would give
            tensor = tensor.clone()
            tensor[..., 0] = float("nan")
        return (tensor, *output[1:]) if isinstance(output, tuple) else tensor
