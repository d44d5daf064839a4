"""Sequential calibration, --reconstruct and --merge against the plain selection.

A small byte-level Qwen3-MoE (4 layers, hidden 64, 32 experts, top-4) is trained briefly on the
Python standard library (bench/fidelity.py's corpus and training mix), calibrated one-pass and
sequentially (saliency, 4 experts) on the lab's calibration bytes, and pruned to 4 of 32 experts
(12.5%) four ways: plain one-pass saliency, sequential, one-pass + --reconstruct, sequential +
--reconstruct. Printed per proxy: held-out loss (nats/byte, 32 x 128 held-out stdlib bytes) and
KL(original || proxy) per token on the same bytes.

    .venv/bin/python bench/reconstruct.py [--steps 300] [--samples 16]

--merge: instead, at each of --ratios (default 12.5%, 25%, 50%: 4, 8 and 16 of 32 experts), with
one-pass statistics: saliency plain, saliency + --merge, saliency + --reconstruct, and saliency +
--merge --reconstruct (--fit-steps caps the fit per layer); with --cluster also the default
calibrated selection (cluster on router rows, most salient representative), plain and + --merge:

    nice -n 10 .venv/bin/python bench/reconstruct.py --merge --steps 120 --samples 8 --fit-steps 100

Outputs in bench/out/reconstruct/ (the trained original is cached by its settings).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from fidelity import calibration_ids, lm_batch, train_text  # noqa: E402
from moe_proxy.pruning import reconstruct as rec  # noqa: E402
from moe_proxy.options import PruningOptions  # noqa: E402
from moe_proxy.pruning.build import build_proxy  # noqa: E402
from moe_proxy.calibrate.statistics import calibrate  # noqa: E402

OUT = ROOT / "bench" / "out" / "reconstruct"
MODEL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=32, num_experts_per_tok=4,
             norm_topk_prob=True, router_aux_loss_coef=0.01, output_router_logits=True, tie_word_embeddings=False,
             max_position_embeddings=512)
KEPT = 4  # 12.5%


def train(path: Path, steps: int) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    stamp = path / "train.json"
    key = {"model": MODEL, "steps": steps}
    if stamp.exists() and json.loads(stamp.read_text()) == key:
        return
    torch.manual_seed(0)
    rng, text = random.Random(0), train_text()[0]
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MODEL))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 3e-3, total_steps=steps, pct_start=0.05)
    for step in range(steps):
        ids = lm_batch(rng, text, 16, 128, 0.3)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0:
            logging.info("train step %d loss %.3f", step, loss.item())
    model.config.output_router_logits = False
    model.save_pretrained(path)
    stamp.write_text(json.dumps(key))


@torch.no_grad()
def evaluate(original: Path, proxy: Path) -> dict:
    from transformers import AutoModelForCausalLM

    held = train_text()[1]
    starts = np.linspace(0, len(held) - 129, 32).astype(int)
    ids = torch.tensor(np.stack([held[s:s + 128] for s in starts]), dtype=torch.long)
    ref = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32).eval()(input_ids=ids, labels=ids)
    out = AutoModelForCausalLM.from_pretrained(proxy, dtype=torch.float32).eval()(input_ids=ids, labels=ids)
    p, q = ref.logits.double().log_softmax(-1), out.logits.double().log_softmax(-1)
    return {"held_out_loss": round(float(out.loss), 4), "original_loss": round(float(ref.loss), 4),
            "kl": round(float((p.exp() * (p - q)).sum(-1).mean()), 4)}


MERGE_VARIANTS = {  # name -> build options (one-pass statistics; reconstruct said, it is on by default)
    "saliency (plain)": dict(method="saliency", reconstruct=False),
    "saliency + merge": dict(method="saliency", merge=True, reconstruct=False),
    "saliency + reconstruct": dict(method="saliency", reconstruct=True),
    "saliency + merge + reconstruct": dict(method="saliency", merge=True, reconstruct=True),
}
CLUSTER_VARIANTS = {  # --cluster: the default calibrated selection too
    "cluster (plain)": dict(method="cluster", reconstruct=False),
    "cluster + merge": dict(method="cluster", merge=True, reconstruct=False),
}


def merge_table(original: Path, ratios: list[float], variants: dict) -> dict:
    """Every variant's proxy at each ratio: held-out loss and KL, printed as a table."""
    rows = {}
    for ratio in ratios:
        kept = round(MODEL["num_experts"] * ratio)
        for name, options in variants.items():
            started = time.time()
            dst = OUT / "merge" / f"{kept}-{name.replace(' ', '').replace('(', '-').replace(')', '').replace('+', '-')}"
            build_proxy(str(original), str(dst), experts=kept, calibration=str(OUT / "stats-one-pass"),
                        overwrite=True, **options)
            row = evaluate(original, dst) | {"build_seconds": round(time.time() - started, 1)}
            rows[f"{kept}/{MODEL['num_experts']} {name}"] = row
            print(json.dumps({f"{kept} of {MODEL['num_experts']}": name} | row), flush=True)
    print(f"\n| proxy | kept | held-out loss | KL | build s |\n|---|---|---|---|---|")
    for key, row in rows.items():
        kept, name = key.split(" ", 1)
        print(f"| {name} | {kept} | {row['held_out_loss']:.3f} | {row['kl']:.4f} | {row['build_seconds']:.0f} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300, help="training steps of the original")
    ap.add_argument("--samples", type=int, default=16, help="calibration sequences --reconstruct uses")
    ap.add_argument("--merge", action="store_true", help="the --merge table at --ratios instead")
    ap.add_argument("--ratios", default="0.125,0.25,0.5", help="with --merge: fractions of the experts kept")
    ap.add_argument("--cluster", action="store_true", help="with --merge: the cluster selection, plain and merged, too")
    ap.add_argument("--only", help="with --merge: these variants only, comma-separated names")
    ap.add_argument("--fit-steps", type=int, default=rec.RECON_STEPS,
                    help="--reconstruct's fit steps per layer, at most")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rec.RECON_SAMPLES, rec.RECON_STEPS = args.samples, args.fit_steps
    original = OUT / "original"
    train(original, args.steps)
    ids = calibration_ids()
    calibrate(str(original), str(OUT / "stats-one-pass"), token_ids=ids)
    if args.merge:
        variants = MERGE_VARIANTS | (CLUSTER_VARIANTS if args.cluster else {})
        if args.only:
            unknown = set(args.only.split(",")) - set(variants)
            if unknown:
                raise SystemExit(f"--only: unknown variant(s) {sorted(unknown)}; choose from {sorted(variants)}")
            variants = {k: v for k, v in variants.items() if k in args.only.split(",")}
        rows = merge_table(original, [float(r) for r in args.ratios.split(",")], variants)
        (OUT / "merge-results.json").write_text(json.dumps(rows, indent=2))
        return 0
    calibrate(str(original), str(OUT / "stats-sequential"), token_ids=ids,
              sequential=PruningOptions(experts=KEPT, method="saliency"))
    rows = {}
    for name, stats, recon in (("saliency (one-pass)", "one-pass", False), ("sequential", "sequential", False),
                               ("one-pass + reconstruct", "one-pass", True),
                               ("sequential + reconstruct", "sequential", True)):
        started = time.time()
        dst = OUT / "proxies" / name.replace(" ", "").replace("(", "-").replace(")", "").replace("+", "-")
        m = build_proxy(str(original), str(dst), experts=KEPT, method="saliency",
                        calibration=str(OUT / f"stats-{stats}"), reconstruct=recon, overwrite=True)
        rows[name] = evaluate(original, dst) | {"build_seconds": round(time.time() - started, 1)}
        if recon:
            rows[name]["block_error"] = {p: [layer["reconstruct"]["error_before"]["held_out"],
                                             layer["reconstruct"]["error_after"]["held_out"]]
                                         for p, layer in m["layers"].items()}
        print(json.dumps({name: rows[name]}), flush=True)
    (OUT / "results.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
