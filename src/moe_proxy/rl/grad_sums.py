"""Each gradient's sum of squares and count of exact zeros: what the update's figures are made of
(`runner._Loop._grad_stats`: the norms, `numerics/grad_zero_frac`, and the fp16-underflow figure
`numerics/dense_grad_zero_frac`).

Eager torch takes two passes over a gradient for them (the multi-tensor norm, then a count of
zeros, itself slower than the norm). A compiled reduction (torch.compile: Inductor's C++ on CPU)
takes both in one pass: at width 512, 54M fp32 gradients on one CPU thread, 68 -> 25 ms a step
(bench/grad_stats.py). It is compiled once a process, at the first large gradient, for a one-off
3-10 s; so only fp32 CPU gradients of at least `FUSED_MIN` elements take it (the small models of
tests and the demo never compile). Where compiling fails (no C++ compiler in the image), every
gradient takes the eager passes, with the same figures."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

FUSED_MIN = 1 << 20  # elements: a smaller gradient's eager passes cost under 1 ms
_FUSED_MAX = 2**31 - 1  # the fused zero count is an int32 sum


def zero_count(flat: torch.Tensor) -> int:
    """How many elements of a 1-D tensor are 0 (+0.0 or -0.0). fp32 by its bit patterns:
    count_nonzero of the int32 view is 2-3x as fast as of the floats on CPU (bench/rl_step.py:
    79 -> 50 ms a step of 54M gradients with the check below), +0.0 being the pattern 0; -0.0
    (fp16 underflow of a negative value) is the least int32 pattern, counted only where present."""
    if flat.dtype != torch.float32:
        return flat.numel() - int(torch.count_nonzero(flat))
    bits = flat.view(torch.int32)
    zeros = flat.numel() - int(torch.count_nonzero(bits))
    if flat.numel() and int(bits.min()) == -2**31:
        zeros += int((bits == -2**31).sum())
    return zeros


def _sums(flat: torch.Tensor) -> torch.Tensor:
    """[sum of squares, zero count] of a 1-D fp32 tensor in one pass (`== 0` holds for -0.0 too);
    as float64, which holds any count exactly."""
    return torch.stack([(flat * flat).sum().double(), (flat == 0).sum(dtype=torch.int32).double()])


_compiled = None  # _sums compiled at first use; False once compiling failed in this process


def _fusable(flat: torch.Tensor) -> bool:
    return flat.device.type == "cpu" and flat.dtype == torch.float32 and FUSED_MIN <= flat.numel() <= _FUSED_MAX


def _fused_sums(flats: list[torch.Tensor]) -> list[tuple[float, int]] | None:
    """The compiled pass's figures of `flats`; None where it cannot be compiled."""
    global _compiled
    if _compiled is False:
        return None
    try:
        if _compiled is None:  # dynamic: one kernel for every length (no recompile per shape)
            _compiled = torch.compile(_sums, dynamic=True)
        with torch.no_grad():
            values = torch.stack([_compiled(f) for f in flats]).tolist()
    except Exception as exc:  # noqa: BLE001 (no compiler, or an Inductor fault: the eager passes are exact)
        log.warning("gradient statistics: compiling the one-pass kernel failed (%s: %s); taking two eager "
                    "passes per gradient", type(exc).__name__, exc)
        _compiled = False
        return None
    return [(sq, int(zeros)) for sq, zeros in values]


def grad_sums(flats: list[torch.Tensor]) -> list[tuple[float, int]]:
    """(sum of squares, zero count) of each 1-D tensor of `flats`, in their order. A NaN or inf
    makes the sum non-finite; so may finite values whose squares overflow."""
    out: list[tuple[float, int] | None] = [None] * len(flats)
    big = [i for i, f in enumerate(flats) if _fusable(f)]
    fused = _fused_sums([flats[i] for i in big]) if big else None
    for i, sums in zip(big, fused or []):
        out[i] = sums
    rest = [i for i, sums in enumerate(out) if sums is None]
    # The others: one multi-tensor kernel for the norms, then the zeros.
    norms = torch.stack(torch._foreach_norm([flats[i] for i in rest], 2, dtype=torch.float32)).tolist() if rest else []
    for i, norm in zip(rest, norms):
        out[i] = (norm * norm, zero_count(flats[i]))
    return out
