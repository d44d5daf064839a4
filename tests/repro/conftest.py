import pytest

from moe_proxy.tiny import make_tiny


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A tiny random Qwen3-MoE (layer 0 dense, layer 1 with 8 experts, top-2), no vocabulary:
    repro talks to it in bytes."""
    path = tmp_path_factory.mktemp("repro") / "qwen3_moe"
    make_tiny("qwen3_moe", path)
    return path
