"""Header-only commands start without the heavy stack: `moe-proxy --help`, `inspect`, `plan`
and `checkpoints` run in a fresh interpreter under `python -X importtime`, and the import log
must not name torch, transformers, scikit-learn or scipy. Wall-clock time is printed, never
asserted (machines differ; bench/ is where timings live)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ..checkpoints import synthetic
from .blocked import HEAVY

# Qwen3-30B-A3B's config.json (the sizes that matter to the planner).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
    "tie_word_embeddings": False, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16",
}


def imported(importtime_log: str) -> set[str]:
    """Top-level packages named in a `python -X importtime` log."""
    names = set()
    for line in importtime_log.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().partition(".")[0])
    return names


def moe_proxy(*args: str) -> subprocess.CompletedProcess:
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "moe_proxy", *args], capture_output=True,
                       text=True, timeout=120)
    print(f"moe-proxy {' '.join(args)}: exit {r.returncode} in {time.perf_counter() - start:.2f} s")
    return r


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    root = tmp_path_factory.mktemp("startup")
    (root / "qwen3-30b-a3b").mkdir()
    (root / "qwen3-30b-a3b" / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    synthetic.write(root / "run" / "global_step_10", synthetic.files())
    return root


@pytest.mark.parametrize("command", ["help", "inspect", "plan", "checkpoints"])
def test_header_only_commands_import_nothing_heavy(command, places):
    args = {
        "help": ["--help"],
        "inspect": ["inspect", str(places / "run" / "global_step_10")],
        "plan": ["plan", str(places / "qwen3-30b-a3b"), "--keep-ratio", "0.125"],
        "checkpoints": ["checkpoints", str(places / "run")],
    }[command]
    r = moe_proxy(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    names = imported(r.stderr)
    assert "moe_proxy" in names, "the import log is empty: -X importtime did not report"
    heavy = sorted(names & set(HEAVY))
    assert not heavy, f"moe-proxy {' '.join(args)} imported {heavy}"
    if command == "plan":
        assert "Qwen3-MoE" in r.stdout and "devices" in r.stdout
