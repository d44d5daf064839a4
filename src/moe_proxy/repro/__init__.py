"""Reproduction runs: GRPO-style RL steps on an original or proxy checkpoint, with per-step
metrics named as verl names them, failure detection and optional fault injection.

Imports nothing itself, so the torch-free parts (`detect`, `metrics_io`) stay importable
without torch: take names from the submodules (`repro.runner.run_repro`, `repro.detect`)."""
