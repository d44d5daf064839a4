"""Bad input to calibrate and to calibrated builds: a clear error, and nothing half-written
that looks complete."""

from __future__ import annotations

import json

import pytest
import torch

from moe_proxy.calibrate import statistics as cal
from moe_proxy.pruning.build import build_proxy
from moe_proxy.errors import BadDataset
from moe_proxy.checkpoint.reader import MANIFEST
from moe_proxy.cli import main
from moe_proxy.errors import InvalidExpertCount, InvalidOptions, MoeProxyError
from moe_proxy.demo.tiny import make_tiny


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "qwen"
    make_tiny("qwen3_moe", path)
    return path


def test_statistics_of_another_checkpoint_are_refused(qwen, tmp_path):
    other = tmp_path / "other"
    make_tiny("qwen3_moe", other, seed=7)  # same architecture and shapes, other weights
    cal.calibrate(str(other), str(tmp_path / "s"), samples=2, seq_len=8)
    with pytest.raises(cal.CalibrationError, match="computed on .*other.*not on"):
        build_proxy(str(qwen), str(tmp_path / "p"), experts=4, calibration=str(tmp_path / "s"))
    assert not (tmp_path / "p").exists() or not any((tmp_path / "p").iterdir())


def test_incomplete_statistics_are_refused(qwen, tmp_path):
    cal.calibrate(str(qwen), str(tmp_path / "s"), samples=2, seq_len=8)
    (tmp_path / "s" / cal.SUMMARY).unlink()  # as if calibrate died before publishing
    with pytest.raises(cal.CalibrationError, match="incomplete"):
        build_proxy(str(qwen), str(tmp_path / "p"), experts=4, calibration=str(tmp_path / "s"))
    with pytest.raises(cal.CalibrationError, match="no calibration.json"):
        build_proxy(str(qwen), str(tmp_path / "p"), experts=4, calibration=str(tmp_path / "nowhere"))


@pytest.mark.parametrize("name,content,match", [
    ("missing.jsonl", None, "no such file"),
    ("empty.jsonl", "", "no documents"),
    ("blank.txt", "\n\n  \n", "no documents"),
    ("broken.jsonl", '{"text": "fine"}\n{"text": \n', "line 2: not valid JSON"),
    ("fields.jsonl", '{"question": "no text field"}\n', "line 1: no usable 'text'"),
    ("notobj.jsonl", '["a list"]\n', "line 1: expected a JSON object"),
])
def test_bad_dataset(qwen, tmp_path, name, content, match):
    dataset = tmp_path / name
    if content is not None:
        dataset.write_text(content)
    with pytest.raises(BadDataset, match=match):
        cal.calibrate(str(qwen), str(tmp_path / "s"), dataset=str(dataset), samples=2, seq_len=8)
    assert not (tmp_path / "s" / cal.SUMMARY).exists()


def test_seq_len_beyond_max_positions(qwen, tmp_path, capsys):
    limit = json.loads((qwen / "config.json").read_text())["max_position_embeddings"]
    assert main(["calibrate", str(qwen), "--out", str(tmp_path / "s"), "--seq-len", str(limit + 1),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--seq-len {limit + 1} exceeds the model's max_position_embeddings ({limit})" in err
    assert not (tmp_path / "s").exists()


def test_calibration_needed_for_usage_options(qwen, tmp_path):
    for kwargs in (dict(method="frequency"), dict(method="saliency"), dict(features="output"),
                   dict(features="routing"), dict(heal=True)):
        with pytest.raises(InvalidOptions, match="need.*--calibration"):
            build_proxy(str(qwen), str(tmp_path / "p"), experts=4, **kwargs)


def test_experts_that_dead_exclusion_cannot_fill(planted, tmp_path):
    from .conftest import DEAD

    # 16 x 32 tokens: the rare super expert 12 is routed (on 8 x 16 it is not, so it is dead, not super)
    cal.calibrate(str(planted), str(tmp_path / "s"), samples=16, seq_len=32)
    with pytest.raises(InvalidExpertCount, match=r"only 7 of 8 experts are alive in routing group 0"):
        build_proxy(str(planted), str(tmp_path / "p"), experts=16, calibration=str(tmp_path / "s"))
    assert not (tmp_path / "p" / MANIFEST).exists()
    # Pinning the dead experts is the user's explicit choice: then it fits.
    m = build_proxy(str(planted), str(tmp_path / "q"), experts=16, calibration=str(tmp_path / "s"),
                    pins={1: list(DEAD)}, reconstruct=False)
    assert m["layers"]["model.layers.1.mlp"]["kept"] == list(range(16))


def test_fill_dead_keeps_the_dead_a_count_needs_and_says_so(planted, tmp_path):
    """The loop's probes build a collapsed checkpoint (fewer alive experts than the count) with
    --fill-dead: the dead experts fill the count, named in the manifest and the notes; sequential
    statistics for that proxy are made the same way (calibrate --experts N --fill-dead)."""
    from .conftest import DEAD

    stats, proxy = tmp_path / "s", tmp_path / "p"
    assert main(["calibrate", str(planted), "--out", str(stats), "--samples", "16", "--seq-len", "32",
                 "--experts", "16", "--fill-dead", "--no-progress"]) == 0
    assert main(["build", str(planted), str(proxy), "--experts", "16", "--calibration", str(stats),
                 "--fill-dead", "--no-reconstruct", "--no-progress"]) == 0
    m = json.loads((proxy / MANIFEST).read_text())
    layer = m["layers"]["model.layers.1.mlp"]
    assert layer["kept"] == list(range(16)) and layer["dead_kept"] == sorted(DEAD)
    assert any(n.startswith("layer 1: fewer alive experts than the 16 kept") and "[1, 9]" in n
               for n in m["notes"]), m["notes"]
    # without the flag the same statistics still refuse: filling is asked for, never silent
    with pytest.raises(InvalidExpertCount, match="only 7 of 8 experts are alive"):
        build_proxy(str(planted), str(tmp_path / "q"), experts=16, calibration=str(stats), reconstruct=False)


def test_fill_dead_takes_the_most_routed_dead_experts_first():
    """Gate mass first, then saliency, then the number; pinned experts count towards the count."""
    from types import SimpleNamespace

    import numpy as np

    from moe_proxy.pruning.usage import _fill_dead

    block = SimpleNamespace(n_experts=8)
    stats = SimpleNamespace(gate_mass=torch.tensor([.5, .4, 0, .003, .001, 0, 0, .003]),
                            saliency=torch.tensor([1., 1., .2, .1, 0, 0, .3, .2]))
    alive = np.array([True, True] + [False] * 6)
    assert _fill_dead(block, alive, [], 4, 1, stats) == [3, 7]  # .003 each: 7 has more saliency
    assert alive.tolist() == [True, True, False, True, False, False, False, True]
    alive = np.array([True, True] + [False] * 6)
    assert _fill_dead(block, alive, [5], 4, 1, stats) == [7]  # the pin is kept already: one short
    assert _fill_dead(block, np.ones(8, bool), [], 4, 1, stats) == []  # enough alive: nothing filled
    # two routing groups of 4, 2 kept in each: group 1 (experts 4..7) has none alive
    alive = np.array([True, True, False, False, False, False, False, False])
    assert _fill_dead(block, alive, [], 2, 2, stats) == [4, 7]  # .003 and .001 beat the unrouted 5, 6


def test_super_experts_beyond_the_budget_are_said_not_dropped_silently(planted, tmp_path):
    """Pins come first; a super expert that no longer fits its routing group is named in the
    notes and the manifest with its rule and max |output| (issue 30). Pins beyond it still fail."""
    cal.calibrate(str(planted), str(tmp_path / "s"), samples=16, seq_len=32)  # expert 12 routed: alive
    m = build_proxy(str(planted), str(tmp_path / "p"), experts=4, calibration=str(tmp_path / "s"),
                    pins={1: [8, 10]}, reconstruct=False)
    layer = m["layers"]["model.layers.1.mlp"]
    assert 12 not in layer["kept"] and set(layer["super_not_kept"]) == {"12"}
    assert layer["super_not_kept"]["12"]["max_abs"] > 0 and layer["super_not_kept"]["12"]["rule"]
    assert any(n.startswith("layer 1: super experts not kept") and "12 (" in n for n in m["notes"]), m["notes"]
    with pytest.raises(InvalidExpertCount, match="3 experts in routing group 1 are pinned"):
        build_proxy(str(planted), str(tmp_path / "q"), experts=4, calibration=str(tmp_path / "s"),
                    pins={1: [8, 10, 11]})


def test_bad_samples(qwen, tmp_path):
    with pytest.raises(MoeProxyError, match="must be positive"):
        cal.calibrate(str(qwen), str(tmp_path / "s"), samples=0, seq_len=8)


def test_mxfp4_experts_are_refused_clearly(tmp_path):
    """GPT-OSS MXFP4 (U8 blocks and scales) cannot be run layer by layer yet: say so, write nothing."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "mx"
    make_tiny("gpt_oss", src)
    sd = load_file(src / "model.safetensors")
    p = "model.layers.0.mlp.experts.gate_up_proj"
    n, h, two_i = sd.pop(p).shape  # MXFP4: 4-bit codes in 32-value blocks of 16 bytes, one scale per block
    sd[p + "_blocks"] = torch.zeros(n, two_i, h // 32, 16, dtype=torch.uint8)
    sd[p + "_scales"] = torch.full((n, two_i, h // 32), 127, dtype=torch.uint8)
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MoeProxyError, match="gate_up_proj: MXFP4 experts .* cannot be run layer by layer yet"):
        cal.calibrate(str(src), str(tmp_path / "s"), samples=2, seq_len=8)
    assert not (tmp_path / "s" / cal.SUMMARY).exists()
