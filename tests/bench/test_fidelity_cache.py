"""The fidelity lab's cache follows the code: every cache key holds the code's version (a
sha256 over bench/fidelity.py and every moe_proxy module it imports), so a rerun after a code
change recomputes instead of reusing results of the old code. Checked without running the lab."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from .conftest import BENCH, load_bench_module


@pytest.fixture(scope="module")
def lab():
    return load_bench_module("fidelity")


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_code_version_follows_what_the_lab_imports_directly_or_not(lab, tmp_path):
    root = tmp_path / "src"
    init, a, b, c = (write(root / "pkg" / name, text) for name, text in (
        ("__init__.py", ""), ("a.py", "def f():\n    from pkg import b\n"), ("b.py", "from . import c\n"),
        ("c.py", "X = 1\n")))
    unused = write(root / "pkg" / "unused.py", "Y = 1\n")
    entry = write(tmp_path / "lab.py", "import os\nfrom pkg.a import f\n")
    assert lab.imported_sources(entry, root, "pkg") == sorted(p.resolve() for p in (entry, init, a, b, c))
    before = lab.code_version(entry, root, "pkg")
    unused.write_text("Y = 2\n")
    assert lab.code_version(entry, root, "pkg") == before  # not imported: not part of the key
    c.write_text("X = 2\n")  # imported through a function-level import, then a relative one
    assert lab.code_version(entry, root, "pkg") != before


def test_the_real_lab_key_covers_the_library_code_it_runs(lab):
    package = lab.PACKAGE.resolve() / "moe_proxy"
    sources = set(lab.imported_sources(BENCH / "fidelity.py"))
    for module in ("rl/runner.py", "pruning/steps.py", "calibrate/statistics.py", "layerwise/model.py",
                   "storage/__init__.py", "sizing.py"):
        assert package / module in sources, module
    assert (BENCH / "fidelity.py").resolve() in sources and package / "cli.py" not in sources


def test_a_cached_run_is_reused_until_the_code_changes(lab, tmp_path, monkeypatch):
    version, calls = ["one"], []

    def fake_run(model, out, config):
        calls.append(out)
        Path(out).mkdir(parents=True, exist_ok=True)
        return SimpleNamespace(failures={})

    monkeypatch.setattr(lab, "OUT", tmp_path)
    monkeypatch.setattr(lab, "run_repro", fake_run)
    monkeypatch.setattr(lab, "lab_code_version", lambda: version[0])
    model = tmp_path / "model"
    write(model / "model.safetensors", "weights")
    config = lab.ReproConfig(steps=2)
    for _ in range(2):
        lab.cached_run(model, tmp_path / "run", config)
    assert len(calls) == 1
    version[0] = "two"  # a change to the lab or to a moe_proxy module it imports
    lab.cached_run(model, tmp_path / "run", config)
    assert len(calls) == 2
    lab.cached_run(model, tmp_path / "run", config)
    assert len(calls) == 2


def test_outputs_that_calibrate_or_build_would_reuse_are_remade_after_a_code_change(lab, tmp_path, monkeypatch):
    version, made = ["one"], []

    def make():  # like calibrate and build_proxy: nothing to do where the output exists
        if not out.exists():
            write(out / "statistics", version[0])
            made.append(version[0])

    monkeypatch.setattr(lab, "lab_code_version", lambda: version[0])
    out = tmp_path / "calibration"
    lab.code_checked(out, make)
    lab.code_checked(out, make)
    assert made == ["one"]
    version[0] = "two"
    lab.code_checked(out, make)
    assert made == ["one", "two"] and (out / "statistics").read_text() == "two"


def test_the_original_is_retrained_when_the_code_that_trains_it_changes(lab, tmp_path, monkeypatch):
    """Training takes the longest and runs no moe_proxy code: its key is the source of the lab's
    training functions, not the whole lab's version."""
    version, trained = ["one"], []
    monkeypatch.setattr(lab, "MODEL", lab.MODEL | lab.QUICK_MODEL)
    monkeypatch.setattr(lab, "TRAIN", lab.TRAIN | dict(steps=1, batch=1, seq_len=16))
    monkeypatch.setattr(lab, "training_code_version", lambda: version[0])
    monkeypatch.setattr(lab, "lab_code_version", lambda: "the rest of the lab changed")
    monkeypatch.setattr(lab, "held_out_loss", lambda path, held_out=None: trained.append(version[0]) or 1.0)
    for _ in range(2):
        lab.train_original(tmp_path / "original")
    assert trained == ["one"]
    version[0] = "two"
    assert lab.train_original(tmp_path / "original")["key"]["code"] == "two" and trained == ["one", "two"]
