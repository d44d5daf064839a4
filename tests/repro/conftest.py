import pytest

from moe_proxy.demo.tiny import make_tiny


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A tiny random Qwen3-MoE (layer 0 dense, layer 1 with 8 experts, top-2), no vocabulary:
    repro talks to it in bytes."""
    path = tmp_path_factory.mktemp("repro") / "qwen3_moe"
    make_tiny("qwen3_moe", path)
    return path


@pytest.fixture(autouse=True)
def one_torch_thread():
    """These tiny models gain nothing from a second thread, and on a busy 2-core machine two
    threads per process thrash (measured ~10x slower); restored after each test."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
