"""Issue 41 §2: never a stale or a borrowed run. A run record is reused only when what made the
run is the same (its arguments, the moe-proxy version, the content of what it read: a proxy's
manifest sha256, a checkpoint's content key), and a reused run says so in stdout and the report.
An --out that holds another diagnosis is refused, untouched, unless --replace; the same settings
resume, and other candidates extend it."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from moe_proxy.cli import main

FLAGS = ["--fail-on", "divergence", "--steps", "4", "--lr", "0.1", "--seeds", "1", "--candidates", "lower-lr"]


@pytest.fixture(scope="module")
def proxies(tmp_path_factory):
    """Two proxies of one tiny checkpoint (4 and 2 experts) and the checkpoint itself."""
    from moe_proxy.pruning import build_proxy
    from moe_proxy.demo.tiny import make_tiny

    root = tmp_path_factory.mktemp("records")
    make_tiny("qwen3_moe", root / "original")
    build_proxy(str(root / "original"), str(root / "proxy"), experts=4)
    build_proxy(str(root / "original"), str(root / "other"), experts=2)
    return root


@pytest.fixture(scope="module")
def diagnosed(proxies):
    """A finished diagnosis (2 runs) of the 4-expert proxy."""
    out = proxies / "d"
    assert main(["diagnose", str(proxies / "proxy"), "--out", str(out), *FLAGS]) == 0
    return out


def _files(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_a_rerun_reuses_its_runs_and_says_so(proxies, diagnosed, capsys):
    capsys.readouterr()
    stamps = {p: p.stat().st_mtime_ns for p in (diagnosed / "runs").rglob("summary.json")}
    assert main(["diagnose", str(proxies / "proxy"), "--out", str(diagnosed), *FLAGS]) == 0
    assert {p: p.stat().st_mtime_ns for p in (diagnosed / "runs").rglob("summary.json")} == stamps
    assert "reused (same proxy content, moe-proxy version and flags): baseline seed 0, lower-lr seed 0" \
        in capsys.readouterr().out
    report = json.loads((diagnosed / "report.json").read_text())
    assert report["baseline"]["seeds"]["0"]["reused"] and report["candidates"]["lower-lr"]["seeds"]["0"]["reused"]
    assert "Reused (the same proxy content, moe-proxy version and flags): baseline seed 0" in \
        (diagnosed / "report.md").read_text()
    # what the record says made the run: the proxy's manifest, by its sha256
    record = json.loads((diagnosed / "runs" / "baseline" / "seed-0" / "diagnose-run.json").read_text())
    manifest = hashlib.sha256((proxies / "proxy" / "proxy-manifest.json").read_bytes()).hexdigest()
    assert record["inputs"] == {str(proxies / "proxy"): f"manifest sha256:{manifest}"}


def test_a_record_of_another_version_or_proxy_content_is_not_reused(proxies, tmp_path):
    """A proxy rebuilt at the same path (other experts), or a record written by another moe-proxy,
    runs again; the same recipe is reused. (`moe-proxy --version` as the run: a second's work.)"""
    from moe_proxy.investigate.processes import content_key, run_recorded

    proxy = tmp_path / "proxy"
    shutil.copytree(proxies / "proxy", proxy)
    argv, keys = ["--version"], {str(proxy): content_key(str(proxy))}
    assert not run_recorded(argv, tmp_path / "run", "rec.json", "log", inputs=keys).reused
    assert run_recorded(argv, tmp_path / "run", "rec.json", "log", inputs=keys).reused
    shutil.rmtree(proxy)
    shutil.copytree(proxies / "other", proxy)  # rebuilt at the same path, 2 experts
    rebuilt = {str(proxy): content_key(str(proxy))}
    assert rebuilt != keys and not run_recorded(argv, tmp_path / "run", "rec.json", "log", inputs=rebuilt).reused
    record = tmp_path / "run" / "rec.json"
    record.write_text(json.dumps(json.loads(record.read_text()) | {"version": "0.0.1"}))
    assert not run_recorded(argv, tmp_path / "run", "rec.json", "log", inputs=rebuilt).reused
    # a checkpoint without a manifest: its content key (config, tensor table, router bytes)
    original = content_key(str(proxies / "original"))
    assert original.startswith("source identity:") and original != content_key(str(proxies / "proxy"))


def test_what_a_diagnosis_reads_is_part_of_its_runs_recipe(proxies, tmp_path):
    """The proxy and a --prompts file, by content: a file or a directory (calibration statistics)
    rewritten at the same path has another key."""
    from moe_proxy.investigate.catalogue import pick
    from moe_proxy.investigate.diagnose import plan_diagnosis
    from moe_proxy.investigate.processes import content_key

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    d = plan_diagnosis(str(proxies / "proxy"), tmp_path / "d", "divergence", ["--prompts", str(prompts)],
                       pick(["lower-lr"]), 1)
    keys = d.recipe(d.variants[1], 0).inputs
    assert keys == {str(proxies / "proxy"): content_key(str(proxies / "proxy")), str(prompts): content_key(str(prompts))}
    prompts.write_text('{"prompt": "2+2=", "answer": "4"}\n')
    assert content_key(str(prompts)) != keys[str(prompts)]
    stats = tmp_path / "stats"
    stats.mkdir()
    (stats / "calibration.json").write_text("{}")
    before = content_key(str(stats))
    (stats / "calibration.json").write_text('{"tokens": 1}')
    assert content_key(str(stats)) != before and before.startswith("files sha256:")


def test_another_diagnosis_into_the_same_out_is_refused_untouched(proxies, diagnosed, capsys):
    before = _files(diagnosed)
    other = [*FLAGS[:4], "--lr", "0.05", *FLAGS[6:]]
    assert main(["diagnose", str(proxies / "proxy"), "--out", str(diagnosed), *other]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"moe-proxy diagnose: error: --out {diagnosed} holds another moe-proxy diagnose "
                          "(repro options: --steps 4 --lr 0.1 there, --steps 4 --lr 0.05 here): "), err
    assert "--replace" in err and "\n" not in err
    assert _files(diagnosed) == before
    # other candidates with the same baseline and seeds extend it: the baseline's run is reused
    assert main(["diagnose", str(proxies / "proxy"), "--out", str(diagnosed), *FLAGS[:-1], "grad-clip"]) == 0
    assert "reused (same proxy content, moe-proxy version and flags): baseline seed 0\n" in capsys.readouterr().out
    assert (diagnosed / "runs" / "lower-lr").is_dir()


def test_an_out_with_a_diagnosis_of_unknown_settings_is_refused(proxies, diagnosed, tmp_path, capsys):
    """A diagnosis written before settings were kept (no settings file) is another's too."""
    out = tmp_path / "d"
    shutil.copytree(diagnosed, out)
    (out / "moe-proxy-settings.json").unlink()
    before = _files(out)
    assert main(["diagnose", str(proxies / "proxy"), "--out", str(out), *FLAGS]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds another moe-proxy diagnose (of unknown settings: runs, report.json, report.md" in err, err
    assert _files(out) == before


def test_replace_deletes_the_other_diagnosis_first(proxies, diagnosed, tmp_path):
    out = tmp_path / "d"
    shutil.copytree(diagnosed, out)
    (out / "runs" / "stale").mkdir()  # e.g. a candidate the other diagnosis had
    (out / "notes.txt").write_text("mine")  # not a diagnosis' file: kept
    other = [*FLAGS[:4], "--lr", "0.05", *FLAGS[6:]]
    assert main(["diagnose", str(proxies / "proxy"), "--out", str(out), *other, "--replace"]) == 0
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["baseline", "lower-lr"]
    assert json.loads((out / "report.json").read_text())["baseline"]["settings"]["flags"] == ["--steps", "4", "--lr", "0.05"]
    assert (out / "notes.txt").read_text() == "mine"
