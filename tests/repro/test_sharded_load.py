"""Loading straight into FSDP2 shards (rl/sharded_load.py): each rank reads only the rows it
owns, and the shards put together are exactly the model from_pretrained loads, buffers (rotary
tables) and tied weights included. Three ranks, so that shards are uneven (8 experts, 2 heads of
key/value: some ranks get fewer rows, some none)."""

from pathlib import Path

import pytest

from moe_proxy.checkpoint.reader import open_checkpoint
from moe_proxy.demo.tiny import make_tiny

RANKS = 3


class CountingStore:
    """A Store that counts the tensor bytes read through it."""

    def __init__(self, store):
        self.store, self.bytes = store, 0

    def read_range(self, name, start, length):
        self.bytes += length
        return self.store.read_range(name, start, length)

    def __getattr__(self, name):
        return getattr(self.store, name)


def rank_loads(path: str) -> dict:
    """One rank: the sharded load, checked against from_pretrained (started by elastic_launch)."""
    import torch
    from torch.distributed.tensor import DTensor

    from moe_proxy.rl.distributed import join, shard
    from moe_proxy.rl.sharded_load import load_shards, meta_model
    from moe_proxy.layerwise.load import load_causal_lm

    torch.set_num_threads(1)
    comm = join("cpu", 120)
    ckpt = open_checkpoint(path)
    ckpt.store = counting = CountingStore(ckpt.store)
    model = load_shards(shard(meta_model(Path(path)), comm), ckpt, comm.device)
    expected = load_causal_lm(path, dtype=torch.float32)
    params = dict(model.named_parameters(remove_duplicate=False))
    local_rows = {name: p.to_local().shape[0] for name, p in params.items() if isinstance(p, DTensor)}
    different = [name for name, p in expected.named_parameters(remove_duplicate=False)
                 if not torch.equal(params[name].full_tensor(), p)]
    buffers = dict(expected.named_buffers())
    different += [name for name, b in model.named_buffers() if not torch.equal(b, buffers[name])]
    result = {"different": different, "bytes_read": counting.bytes, "local_rows": local_rows,
              "tied": model.lm_head.weight is model.model.embed_tokens.weight,
              "buffers": sorted(buffers)}
    comm.close()
    return result


def launch_ranks(path: Path) -> dict[int, dict]:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=RANKS, run_id="sharded-load",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5)
    return elastic_launch(config, rank_loads)(str(path))


@pytest.mark.parametrize("tied", [False, True])
def test_shards_put_together_are_the_from_pretrained_model(tmp_path, tied):
    make_tiny("qwen3_moe", tmp_path / "m", tie_word_embeddings=tied)
    results = launch_ranks(tmp_path / "m")
    for rank, result in results.items():
        assert result["different"] == [], f"rank {rank}"
        assert result["tied"] is tied
        assert any("rotary_emb.inv_freq" in name for name in result["buffers"])
    # Each stored byte was read by exactly one rank: no rank read, let alone held, the whole model.
    stored = sum(t.nbytes for t in open_checkpoint(str(tmp_path / "m")).tensors.values())
    read = [results[r]["bytes_read"] for r in range(RANKS)]
    assert sum(read) == stored and max(read) < stored / 2, read
    experts = [results[r]["local_rows"]["model.layers.1.mlp.experts.gate_up_proj"] for r in range(RANKS)]
    assert experts == [3, 3, 2]  # 8 experts over 3 ranks, as torch.chunk splits them
