"""Peak memory of `calibrate` grows with one layer, not with depth (bench/calibrate_memory.py
measures the same at a larger size; figures in docs/performance.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_proxy.demo.tiny import make_tiny

# bf16 (oneDNN matmuls, whose per-shape caches grew the process before), every layer MoE;
# 32 experts x 3 x 256 x 256 x 2 bytes = 12 MiB of experts per layer.
CONFIG = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=512, num_experts=32,
              num_experts_per_tok=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024,
              mlp_only_layers=[])
LAYER_BYTES = 32 * 3 * 256 * 256 * 2

# The process's peak resident memory (VmHWM) after calibrating, in a fresh process: the
# kernel caches are bounded only before the process's first bf16 matmul.
PEAK = """
import sys
from moe_proxy.calibrate.statistics import calibrate
calibrate(sys.argv[1], sys.argv[2], samples=8, seq_len=64)
print([int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')][0])
"""


def peak_rss(src: Path, out: Path) -> int:
    done = subprocess.run([sys.executable, "-c", PEAK, str(src), str(out)], capture_output=True, text=True,
                          check=True)
    return int(done.stdout.split()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc for VmHWM")
def test_peak_memory_grows_with_one_layer_not_with_depth(tmp_path):
    peaks = {}
    for depth in (2, 6):
        src = tmp_path / f"d{depth}"
        make_tiny("qwen3_moe", src, dtype=torch.bfloat16, num_hidden_layers=depth, **CONFIG)
        peaks[depth] = peak_rss(src, tmp_path / f"stats{depth}")
    # 4 more layers; before the fix each layer added about 15 MiB (119 MiB from depth 2 to 10).
    assert peaks[6] - peaks[2] < LAYER_BYTES, {d: p >> 20 for d, p in peaks.items()}
