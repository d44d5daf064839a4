"""`compare` labels its runs apart by default (issue 41, section 6).

TRL writes its TensorBoard events under output_dir/runs/<date>_<host>: two runs started the same
minute on the same host share that name, and compare labelled both with it, so its report, its
printout and its plot legend could not tell the proxy from the original. The default label is
now each run's shortest path suffix that no other run's path ends with; `--names` labels must be
distinct too.
"""

from __future__ import annotations

import json

from moe_proxy.cli import main

RUN = "Dec05_00-00-00_host"


def write_tensorboard(directory, kl_jump: float) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(directory))
    for step in range(1, 7):
        row = {"loss": 0.01 * step, "grad_norm": 0.5 + 0.01 * step, "kl": 1e-4 if step < 3 else kl_jump,
               "entropy": 1.2 - 0.01 * step, "reward": 0.1 * step}
        for key, value in row.items():
            writer.add_scalar(f"train/{key}", value, step)
    writer.close()


def test_two_trl_runs_with_the_same_directory_name_are_labelled_apart(tmp_path, capsys):
    write_tensorboard(tmp_path / "orig" / "out" / "runs" / RUN, kl_jump=4.0)
    write_tensorboard(tmp_path / "proxy" / "out" / "runs" / RUN, kl_jump=1e-4)
    runs = [str(tmp_path / name / "out" / "runs" / RUN) for name in ("orig", "proxy")]
    assert main(["compare", *runs, "--out", str(tmp_path / "r"), "--permutations", "0"]) == 0
    out = capsys.readouterr().out
    labels = [f"orig/out/runs/{RUN}", f"proxy/out/runs/{RUN}"]
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert [r["name"] for r in report["runs"]] == labels and report["reference"] == labels[0]
    onsets = {c["run"]: c["onsets"] for c in report["comparisons"]}
    assert onsets == {labels[0]: {"divergence": 3}, labels[1]: {}}  # each verdict under its own run
    assert f"{labels[1]}: " in out and f"| {labels[1]} |" in (tmp_path / "r" / "report.md").read_text()

    # --names: one distinct label per run
    assert main(["compare", *runs, "--names", "a,a", "--out", str(tmp_path / "s")]) == 2
    assert capsys.readouterr().err.strip() == ("moe-proxy compare: error: --names: 'a' labels 2 runs; each run "
                                               "needs its own")
    assert not (tmp_path / "s").exists()


def test_labels_are_the_shortest_distinguishing_suffixes(tmp_path):
    from moe_proxy.metrics.compare import run_labels

    for d in ("a/x", "b/x", "c/y"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "c" / "y" / "one.jsonl").touch(), (tmp_path / "c" / "y" / "two.jsonl").touch()
    assert run_labels([tmp_path / "a/x", tmp_path / "b/x"]) == ["a/x", "b/x"]
    assert run_labels([tmp_path / "a/x", tmp_path / "c/y"]) == ["x", "y"]  # distinct names stay as they were
    # a file stands for its directory, unless another run's file shares it
    assert run_labels([tmp_path / "a/x", tmp_path / "c/y/one.jsonl"]) == ["x", "y"]
    assert run_labels([tmp_path / "c/y/one.jsonl", tmp_path / "c/y/two.jsonl"]) == ["one.jsonl", "two.jsonl"]
    assert run_labels([tmp_path / "a/x", tmp_path / "a/x"]) == ["x #1", "x #2"]
