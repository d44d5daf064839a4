import pytest

from moe_proxy.demo.tiny import TINY, make_tiny

ARCHS = sorted(TINY)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """One tiny, sharded, real checkpoint per architecture (DeepSeek-V3 with its MTP layer)."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for model_type in ARCHS:
        path = root / model_type
        make_tiny(model_type, path, max_shard_size="100KB", mtp=model_type == "deepseek_v3")
        out[model_type] = path
    return out


@pytest.fixture(scope="session")
def dsv3_16(tmp_path_factory):
    """DeepSeek-V3 with 16 experts in 4 routing groups and its MTP layer, in 19 small shards:
    MoE layers spread over several, shards without routed experts first (scale-out tests)."""
    path = tmp_path_factory.mktemp("workers") / "dsv3"
    make_tiny("deepseek_v3", path, max_shard_size="60KB", mtp=True, num_hidden_layers=4, n_routed_experts=16,
              n_group=4, topk_group=2)
    return path
