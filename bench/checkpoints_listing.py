"""How long `moe-proxy checkpoints` takes, and how many bytes it reads, on a run of many
full-size checkpoints.

    python bench/checkpoints_listing.py [--checkpoints 50] [--shards 163] [--dir DIR] [--s3] [--quick]

A DeepSeek-V3-shaped checkpoint (61 layers, 256 routed experts, fp8 weights with their
block scales: ~91k tensors, ~690 GB) is written as sparse files: every shard holds its real
safetensors header and is extended to its full size without writing data, so fifty of them
(~34 TB apparent) fit on any disk. The listing reads config, index and headers only, so it
cannot tell. Each listing runs twice: the default quick check and `--deep`. With --s3 the same layout, at a small scale (data must really be uploaded), is
listed from a local SeaweedFS, to count requests' bytes as the S3 store sees them.
--quick: 3 checkpoints of 4 shards (with --s3: every dimension / 1024), a smoke run whose
figures mean nothing; tests/bench/test_bench_quick.py runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from moe_proxy.checkpoint.reader import INDEX, ITEMSIZE
from moe_proxy.checkpoint.listing import CountingStore, list_checkpoints
from moe_proxy.pruning.writer import OutTensor, header_bytes
from moe_proxy.storage import LocalStore

DSV3 = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "first_k_dense_replace": 3, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "n_group": 8, "topk_group": 4, "vocab_size": 129280, "num_attention_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
        "v_head_dim": 128}


def tensors(c: dict, scale: float = 1.0) -> list[tuple[str, str, tuple[int, ...]]]:
    """DeepSeek-V3's tensor names and shapes (fp8 weights + 128x128 block scales), with every
    dimension multiplied by `scale` (1.0: the real sizes)."""
    def d(n: int) -> int:
        return max(1, int(n * scale))

    def fp8(name: str, rows: int, cols: int) -> list:
        return [(f"{name}.weight", "F8_E4M3", (d(rows), d(cols))),
                (f"{name}.weight_scale_inv", "F32", (math.ceil(d(rows) / 128), math.ceil(d(cols) / 128)))]

    h, out = c["hidden_size"], [("model.embed_tokens.weight", "BF16", (d(c["vocab_size"]), d(c["hidden_size"])))]
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out += [(f"{p}.input_layernorm.weight", "BF16", (d(h),)), (f"{p}.post_attention_layernorm.weight", "BF16", (d(h),))]
        out += fp8(f"{p}.self_attn.q_a_proj", c["q_lora_rank"], h) + fp8(f"{p}.self_attn.q_b_proj", 128 * 192, c["q_lora_rank"])
        out += fp8(f"{p}.self_attn.kv_a_proj_with_mqa", 576, h) + fp8(f"{p}.self_attn.kv_b_proj", 128 * 256, 512)
        out += fp8(f"{p}.self_attn.o_proj", h, 128 * 128)
        if layer < c["first_k_dense_replace"]:
            for proj, r, k in (("gate_proj", c["intermediate_size"], h), ("up_proj", c["intermediate_size"], h),
                               ("down_proj", h, c["intermediate_size"])):
                out += fp8(f"{p}.mlp.{proj}", r, k)
            continue
        out += [(f"{p}.mlp.gate.weight", "BF16", (c["n_routed_experts"], d(h))),
                (f"{p}.mlp.gate.e_score_correction_bias", "F32", (c["n_routed_experts"],))]
        m = c["moe_intermediate_size"]
        for e in [*map(str, range(c["n_routed_experts"]))]:
            for proj, r, k in (("gate_proj", m, h), ("up_proj", m, h), ("down_proj", h, m)):
                out += fp8(f"{p}.mlp.experts.{e}.{proj}", r, k)
        for proj, r, k in (("gate_proj", m, h), ("up_proj", m, h), ("down_proj", h, m)):
            out += fp8(f"{p}.mlp.shared_experts.{proj}", r, k)
    out += [("model.norm.weight", "BF16", (d(h),)), ("lm_head.weight", "BF16", (d(c["vocab_size"]), d(h)))]
    return out


def layout(n_shards: int, scale: float) -> tuple[dict[str, bytes], dict[str, int], bytes]:
    """(shard headers, shard full sizes, index bytes) of one checkpoint."""
    all_tensors = tensors(DSV3, scale)
    per = math.ceil(len(all_tensors) / n_shards)
    headers, sizes, weight_map = {}, {}, {}
    for i in range(n_shards):
        name = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = [OutTensor(t, dt, shape, []) for t, dt, shape in all_tensors[i * per:(i + 1) * per]]
        headers[name] = header_bytes(part)
        sizes[name] = len(headers[name]) + sum(math.prod(t.shape) * ITEMSIZE[t.dtype] for t in part)
        weight_map.update({t.name: name for t in part})
    # As transformers writes it: keys sorted (metadata first); total_size counts tensor bytes only.
    total = sum(sizes[name] - len(headers[name]) for name in sizes)
    index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, sort_keys=True).encode()
    return headers, sizes, index


def write_sparse(root: Path, checkpoints: int, n_shards: int) -> int:
    headers, sizes, index = layout(n_shards, 1.0)
    for k in range(checkpoints):
        d = root / f"global_step_{(k + 1) * 100}" / "actor" / "huggingface"
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(DSV3))
        (d / INDEX).write_bytes(index)
        for name, header in headers.items():
            with open(d / name, "wb") as f:
                f.write(header)
                f.truncate(sizes[name])  # sparse: the data region is a hole
    return sum(sizes.values())


def timed_listing(store, deep: bool, expected: int) -> float:
    """Seconds to list the run; every checkpoint must come out a complete source."""
    t0 = time.perf_counter()
    found = list_checkpoints(store, pattern="global_step_*/actor/huggingface", deep=deep)
    took = time.perf_counter() - t0
    assert len(found) == expected and all(c.source for c in found), found[:1]
    return took


def bench_local(args) -> None:
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp) / "run"
        t0 = time.perf_counter()
        per_checkpoint = write_sparse(root, args.checkpoints, args.shards)
        print(f"wrote {args.checkpoints} sparse DeepSeek-V3-shaped checkpoints of {per_checkpoint / 1e9:.0f} GB "
              f"({args.shards} shards each) in {time.perf_counter() - t0:.1f}s")
        for deep in (False, True):
            store = CountingStore(LocalStore(root))
            took = timed_listing(store, deep, args.checkpoints)
            print(f"{'deep ' if deep else 'quick'}: listed {args.checkpoints} checkpoints "
                  f"({args.checkpoints * per_checkpoint / 1e12:.1f} TB) in {took:.2f}s: read {store.bytes_read / 1e6:.2f} "
                  f"MB in {store.reads} reads ({store.bytes_read / args.checkpoints / 1e3:.1f} KB per checkpoint)")


def bench_s3(args) -> None:
    from moe_proxy.storage.s3 import S3Store
    from moe_proxy.demo.seaweed import SeaweedFS

    # Every dimension divided by --shrink: the same tensor names and count, far less data to upload.
    headers, sizes, index = layout(args.shards, 1 / args.shrink)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, \
            SeaweedFS(Path(tmp) / "s3", "bench-key", "bench-secret", buckets=["runs"]) as s3:
        client = s3.client()
        t0 = time.perf_counter()
        for k in range(args.checkpoints):
            prefix = f"run/global_step_{(k + 1) * 100}/actor/huggingface"
            client.put_object(Bucket="runs", Key=f"{prefix}/config.json", Body=json.dumps(DSV3).encode())
            client.put_object(Bucket="runs", Key=f"{prefix}/{INDEX}", Body=index)
            for name, header in headers.items():
                client.put_object(Bucket="runs", Key=f"{prefix}/{name}",
                                  Body=header + bytes(sizes[name] - len(header)))
        print(f"uploaded {args.checkpoints} checkpoints of {sum(sizes.values()) / 1e6:.0f} MB in "
              f"{time.perf_counter() - t0:.0f}s")
        os.environ.update(AWS_ACCESS_KEY_ID="bench-key", AWS_SECRET_ACCESS_KEY="bench-secret")
        for deep in (False, True):
            store = S3Store("s3://runs/run", endpoint_url=s3.endpoint_url, region="us-east-1")
            took = timed_listing(store, deep, args.checkpoints)
            print(f"{'deep ' if deep else 'quick'}: listed {args.checkpoints} checkpoints from SeaweedFS in "
                  f"{took:.2f}s: downloaded {store.bytes_downloaded / 1e6:.2f} MB "
                  f"({store.bytes_downloaded / args.checkpoints / 1e3:.1f} KB per checkpoint) of "
                  f"{args.checkpoints * sum(sizes.values()) / 1e6:.0f} MB stored")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoints", type=int, default=50)
    p.add_argument("--shards", type=int, default=163)
    p.add_argument("--dir", help="where to write (default: the system's temporary directory)")
    p.add_argument("--s3", action="store_true", help="list from SeaweedFS instead of local sparse files")
    p.add_argument("--shrink", type=int, default=256, help="with --s3: divide every tensor dimension by this")
    p.add_argument("--quick", action="store_true", help="3 checkpoints of 4 shards (--s3: shrink 1024): a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.checkpoints, args.shards, args.shrink = 3, 4, 1024
    (bench_s3 if args.s3 else bench_local)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
