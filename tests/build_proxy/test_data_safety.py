"""A build never loses a user's data: a destination that overlaps its source is refused however
it is spelled, --overwrite replaces only an earlier proxy's own files, built files honour the
umask, and a run on a half-built proxy is refused without writing anything."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from moe_proxy.checkpoint.reader import MANIFEST
from moe_proxy.cli import main
from moe_proxy.demo.tiny import make_tiny
from moe_proxy.storage import overlap


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("orig") / "qwen3"
    make_tiny("qwen3_moe", path, max_shard_size="100KB")
    return path


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root (dotfiles included) -> sha256 of its bytes."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def cli(*argv: str, capsys) -> tuple[int, str]:
    code = main([*argv])
    return code, capsys.readouterr().err


@pytest.fixture
def workspace(original, tmp_path, monkeypatch) -> Path:
    """tmp/parent/src: a copy of the original; the test's cwd is tmp/parent."""
    parent = tmp_path / "parent"
    shutil.copytree(original, parent / "src")
    monkeypatch.chdir(parent)
    return parent


@pytest.mark.parametrize("dst", [
    "src", "./src", "src/", "src/../src", "{parent}/src",  # the source itself, however spelled
    "link-to-src",  # through a symlink
    ".", "{parent}",  # a parent of the source
    "src/proxy", "{parent}/src/sub/proxy", "link-to-src/proxy",  # inside the source
])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_destination_overlapping_the_source_is_refused(workspace, dst, overwrite, capsys):
    (workspace / "link-to-src").symlink_to(workspace / "src")
    (workspace / "bystander.txt").write_text("not yours")
    before = snapshot(workspace)
    dst = dst.format(parent=workspace)
    code, err = cli("build", "src", dst, "--experts", "2", "--no-progress",
                    *(["--overwrite"] if overwrite else []), capsys=capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert "source checkpoint" in err and "Traceback" not in err
    assert snapshot(workspace) == before  # source and bystanders intact, byte for byte, nothing added
    assert not (workspace / "src" / "proxy").exists()


def test_a_source_spelled_relatively_and_absolutely_cannot_replace_itself(workspace, capsys):
    before = snapshot(workspace / "src")
    code, err = cli("build", str(workspace / "src"), "./src", "--experts", "2", "--overwrite", capsys=capsys)
    assert code == 2 and "is the source checkpoint itself" in err
    assert snapshot(workspace / "src") == before


def test_s3_prefixes_overlap_however_spelled():
    assert overlap("s3://b/run/ckpt", "s3://b//run/ckpt/") == "same"
    assert overlap("s3://b/run/ckpt/proxy", "s3://b/run/ckpt") == "inside"
    assert overlap("s3://b/run", "s3://b/run/ckpt") == "contains"
    assert overlap("s3://b", "s3://b/run/ckpt") == "contains"  # the whole bucket
    assert overlap("s3://b/run/ckpt2", "s3://b/run/ckpt") is None  # a sibling whose name extends it
    assert overlap("s3://other/run/ckpt", "s3://b/run/ckpt") is None
    assert overlap("/tmp/run/ckpt", "s3://b/tmp/run/ckpt") is None


def fake_home(root: Path) -> Path:
    (root / "projects" / "important").mkdir(parents=True)
    (root / "models").mkdir()
    (root / ".bashrc").write_text("export PATH=$HOME/bin:$PATH\n")
    (root / "projects" / "important" / "main.py").write_text("print('hello')\n")
    (root / "models" / "weights.bin").write_bytes(os.urandom(1000))
    return root


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_destination_that_is_not_a_proxy_is_refused_whatever_the_flags(workspace, overwrite, capsys):
    home = fake_home(workspace / "home")
    before = snapshot(home)
    code, err = cli("build", "src", str(home), "--experts", "2", "--no-progress",
                    *(["--overwrite"] if overwrite else []), capsys=capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "not a moe-proxy output" in err and ".bashrc" in err  # names files that would have been lost
    assert "pass --overwrite" not in err
    assert snapshot(home) == before


def test_overwrite_replaces_an_earlier_proxy_and_nothing_else(workspace, capsys):
    assert cli("build", "src", "out", "--experts", "4", "--no-progress", capsys=capsys)[0] == 0
    earlier = json.loads((workspace / "out" / MANIFEST).read_text())
    (workspace / "out" / "NOTES.md").write_text("my notes on this proxy\n")  # the user's own file
    (workspace / "out" / "stale-shard.safetensors").write_bytes(b"x")  # not listed by the earlier proxy
    code, err = cli("build", "src", "out", "--experts", "2", "--no-progress", capsys=capsys)
    assert code == 2 and "pass --overwrite" in err
    assert cli("build", "src", "out", "--experts", "2", "--no-progress", "--overwrite", capsys=capsys)[0] == 0
    m = json.loads((workspace / "out" / MANIFEST).read_text())
    assert m["experts"]["after"] == 2 and m["build_id"] != earlier["build_id"]
    assert (workspace / "out" / "NOTES.md").read_text() == "my notes on this proxy\n"
    assert (workspace / "out" / "stale-shard.safetensors").read_bytes() == b"x"
    left = {p.name for p in (workspace / "out").iterdir()}
    assert left == set(m["files"]) | {MANIFEST, "NOTES.md", "stale-shard.safetensors"}  # no journal left


def test_overwrite_deletes_the_earlier_proxys_files_it_does_not_rewrite(workspace, original, tmp_path, capsys):
    """An earlier proxy of another checkpoint with a file this one does not write: that file goes."""
    other = tmp_path / "other"
    make_tiny("qwen3_moe", other, max_shard_size="100KB")
    (other / "extra_tokenizer_file.txt").write_text("other's own\n")
    assert cli("build", str(other), "out", "--experts", "4", "--no-progress", capsys=capsys)[0] == 0
    assert (workspace / "out" / "extra_tokenizer_file.txt").exists()
    assert cli("build", "src", "out", "--experts", "2", "--no-progress", "--overwrite", capsys=capsys)[0] == 0
    assert not (workspace / "out" / "extra_tokenizer_file.txt").exists()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_built_files_honour_the_umask(original, tmp_path, umask):
    """Files are created as `cp` and save_pretrained create them (0666 & ~umask), in a child
    process so the umask is its own."""
    dst, stats = tmp_path / "proxy", tmp_path / "stats"
    code = (f"import os, sys; os.umask({umask}); from moe_proxy.cli import main; "
            f"sys.exit(main(sys.argv[1:]))")
    for argv in (["calibrate", str(original), "--out", str(stats), "--samples", "4", "--seq-len", "16",
                  "--one-pass", "--no-progress"],
                 ["build", str(original), str(dst), "--experts", "4", "--no-progress"]):
        r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
    files = [p for d in (dst, stats) for p in d.rglob("*") if p.is_file()]
    assert any(p.name == MANIFEST for p in files) and any(p.name == "config.json" for p in files)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in files}
    assert set(modes.values()) == {0o666 & ~umask}, modes


def half_built(original: Path, dst: Path) -> Path:
    """A build killed before its manifest: journals and shards there, no proxy-manifest.json."""
    assert main(["build", str(original), str(dst), "--experts", "4", "--no-progress"]) == 0
    m = json.loads((dst / MANIFEST).read_text())
    (dst / MANIFEST).unlink()
    (dst / ".moe-proxy-journal-0-of-1.json").write_text(json.dumps({"build_id": m["build_id"], "files": {}}))
    return dst


def test_repro_refuses_a_half_built_proxy_and_writes_nothing(original, tmp_path, capsys):
    dst = half_built(original, tmp_path / "proxy")
    capsys.readouterr()
    run_dir, log = tmp_path / "run", tmp_path / "termination-log"
    code, err = cli("repro", str(dst), "--out", str(run_dir), "--steps", "1", "--termination-log", str(log),
                    capsys=capsys)
    assert code == 2 and "incomplete proxy" in err and "rerun the build" in err
    assert not run_dir.exists()
    assert json.loads(log.read_text())["error"]  # the Job still says why


def test_repro_on_a_missing_path_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, err = cli("repro", str(tmp_path / "no-such-checkpoint"), "--out", str(run_dir), capsys=capsys)
    assert code == 2 and "no config.json" in err
    assert not run_dir.exists()


def test_a_half_built_proxy_is_not_a_source(original, tmp_path, capsys):
    dst = half_built(original, tmp_path / "proxy")
    capsys.readouterr()
    code, err = cli("build", str(dst), str(tmp_path / "proxy-of-proxy"), "--experts", "2", capsys=capsys)
    assert code == 2 and "incomplete proxy" in err
