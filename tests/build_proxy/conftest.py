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
