"""Reproduction runs: GRPO-style RL steps on an original or proxy checkpoint, with per-step
metrics named as verl names them, failure detection and optional fault injection."""

from .config import Faults, ReproConfig
from .detect import FailureDetector, Signature, Thresholds
from .runner import RunResult, run_repro

__all__ = ["Faults", "FailureDetector", "ReproConfig", "RunResult", "Signature", "Thresholds", "run_repro"]
