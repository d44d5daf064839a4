"""The super-expert study under issue 30's rules: a rarely routed expert whose output reaches
fp16's range, planted in the first, a middle or the last MoE layer of a Qwen3-MoE original;
calibrated (random token ids), built at 25% (4 of 16 experts: the default calibrated build,
and by gate mass with and without the super-expert rules), and each original and proxy run a few RL steps in fp16
(dynamic loss scaling) and bf16. Does every proxy that keeps the expert overflow like the
original, and every one that drops it stay clean?

    .venv/bin/python bench/super_layers.py [--out bench/out/super-layers] [--steps 3]

Prints a markdown table (docs/fidelity.md, "Super experts in every layer"). Tiny, untrained
models: the figures are about which rule keeps what, not about a real model's numerics.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent / "src"))  # after PYTHONPATH

import torch  # noqa: E402
import transformers  # noqa: E402

from moe_proxy.pruning import build_proxy  # noqa: E402
from moe_proxy.calibrate import statistics as cal  # noqa: E402
from moe_proxy.demo.tiny import tiny_config  # noqa: E402

LAYERS = 6  # MoE layers: REAP's rule judges the first int(0.75 x 6) = 4
ROUTER = 0.5  # the planted expert's router row shrunk: routed, but rarely
PLANT, SCALE = 5, 3e6  # the planted expert and its down_proj factor (max |output| ~1e4: fp16's range / 8 .. / 1)


# The default calibrated build (saliency-chosen cluster representatives: a massive, rarely routed
# expert is salient, so it may be kept anyway), and usage by gate mass, which drops a rarely routed
# expert unless the super-expert rules pin it.
BUILDS = {"default": {}, "frequency": dict(method="frequency"),
          "frequency --no-keep-super": dict(method="frequency", keep_super=False)}


def planted(path: Path, layer: int) -> Path:
    torch.manual_seed(0)
    config = tiny_config("qwen3_moe", num_hidden_layers=LAYERS, mlp_only_layers=[], num_experts=16,
                         num_experts_per_tok=2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for block in model.model.layers:
            block.mlp.gate.weight.normal_(0, 0.5)
        mlp = model.model.layers[layer].mlp
        mlp.gate.weight[PLANT] *= ROUTER  # rarely routed
        mlp.experts.down_proj[PLANT] *= SCALE
    model.save_pretrained(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "none"}))
    return path


def repro(ckpt: Path, out: Path, precision: str, steps: int) -> str:
    summary = out / "summary.json"
    if not summary.is_file():
        subprocess.run([sys.executable, "-m", "moe_proxy", "repro", str(ckpt), "--out", str(out), "--steps", str(steps),
                        "--precision", precision, "--fail-on", "overflow", "--no-progress"],
                       check=False, capture_output=True)
    if not summary.is_file():
        return "error"
    s = json.loads(summary.read_text())
    first = (s.get("failures") or {}).get("overflow")
    return f"overflow ({first['step']})" if first else "clean"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/out/super-layers")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    out = Path(args.out)
    started = time.monotonic()
    print("| planted in MoE layer | rules that flag it (max abs output) | precision | original | "
          + " | ".join(f"{n}: keeps it / run" for n in BUILDS) + " |")
    print("|---" * (4 + len(BUILDS)) + "|")
    for layer in (0, LAYERS // 2, LAYERS - 1):
        root = out / f"layer-{layer}"
        src = root / "original"
        if not (src / "config.json").is_file():
            planted(src, layer)
        stats = cal.calibrate(str(src), str(root / "stats"), samples=16, seq_len=32)
        info = stats["layers"][f"model.layers.{layer}.mlp"]
        rules = info["super_rules"].get(str(PLANT), "none")
        figure = cal.load(str(root / "stats")).layers[f"model.layers.{layer}.mlp"].max_abs[PLANT]
        builds = {}
        for name, options in BUILDS.items():
            m = build_proxy(str(src), str(root / name), experts=4, calibration=str(root / "stats"), **options)
            builds[name] = PLANT in m["layers"][f"model.layers.{layer}.mlp"]["kept"]
        for precision in ("fp16", "bf16"):
            original = repro(src, root / f"run-original-{precision}", precision, args.steps)
            cells = [f"{'yes' if builds[n] else 'no'} / {repro(root / n, root / f'run-{n}-{precision}', precision, args.steps)}"
                     for n in BUILDS]
            print(f"| {layer} of {LAYERS} | {rules} ({float(figure):.3g}) | {precision} | {original} | "
                  + " | ".join(cells) + " |", flush=True)
    print(f"\n{time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
