"""The CLI's promise for bad input: exit status 2 and one line, `moe-proxy CMD: error: ...`
(argparse's own errors: its usage, then that line), never a traceback, and nothing written.
One table drives every command; a command without a row fails the table's coverage test."""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_proxy.cli import build_parser, main, parse_args, subcommands
from moe_proxy.demo.tiny import make_tiny

from .house.blocked import run_blocked

# (command, arguments, a fragment of the error line). Placeholders: {tiny} a real checkpoint,
# {truncated} its copy with config.json cut short, {file} a regular file, {run} a run directory
# (metrics.jsonl), {missing} a path that does not exist, {root} their folder, {out} an output
# path the command must leave unwritten, {events_empty} / {events_cut} TensorBoard directories
# holding an empty and a truncated event file.
ROWS = [
    ("inspect", "{missing}", "no config.json"),
    ("inspect", "{truncated}", "not valid JSON"),
    ("inspect", "{tiny} --streams x", "--streams: expected a whole number, got 'x'"),
    ("inspect", "{tiny} --jsn", "unrecognized arguments: --jsn"),
    ("plan", "{truncated} --experts 4", "not valid JSON"),
    ("plan", "{file} --experts 4", "not valid JSON"),
    ("plan", "{tiny} --experts 0", "--experts: 0: must be at least 1"),  # as build says it
    ("plan", "{tiny}", "--experts --keep-ratio is required"),
    ("build", "{tiny} {file} --experts 4", "is a file"),
    ("build", "{truncated} {out} --experts 4", "not valid JSON"),
    ("build", "{tiny} {out} --experts 4 --pin garbage", "--pin 'garbage'"),
    ("build", "{tiny} {out} --keep-ratio -1", "must be above 0"),
    ("calibrate", "{missing} --out {out}", "no config.json"),
    ("calibrate", "{tiny} --out {file}", "is a file"),
    ("calibrate", "{tiny} --out {out} --one-pass --experts 4", "--one-pass"),
    ("verify", "{tiny} --no-forward", "no proxy-manifest.json"),
    ("checkpoints", "{missing}", "no such directory"),
    ("checkpoints", "{root} --step-regex (", "not a regular expression"),
    ("repro", "{truncated} --out {out}", "not valid JSON"),
    ("repro", "{tiny} --out {out} --device cuda:99", "--device cuda:99: this"),  # CPU build or too few GPUs
    ("repro", "{missing} --out {out} --lr -1", "--lr: -1: must be above 0"),
    ("repro", "{tiny} --out {out} --nproc-per-node 0", "--nproc-per-node 0"),
    ("repro", "{tiny} --out {out} --node-rank 5 --nnodes 2", "the node rank must be in 0..1"),
    ("repro", "{tiny} --out {file}", "is a file"),
    ("repro", "{tiny} --out {out} --prompts {missing}", "--prompts"),  # a run that cannot start writes nothing
    ("repro", "{tiny} --out {out} --fail-on garbage", "--fail-on 'garbage'"),
    ("diagnose", "{tiny} --out {out}", "the following arguments are required: --fail-on"),
    ("diagnose", "{tiny} --out {out} --fail-on divergence", "no candidates"),
    ("diagnose", "{tiny} --out {out} --fail-on divergence --candidates no-such", "unknown candidate 'no-such'"),
    ("diagnose", "{truncated} --out {out} --fail-on divergence --candidates lower-lr", "not valid JSON"),
    ("diagnose", "{tiny} --out {file} --fail-on divergence --candidates lower-lr", "is a file"),
    ("diagnose", "{tiny} --out {out} --fail-on divergence --candidates lower-lr --lr -1", "--lr: -1: must be above 0"),
    ("bisect", "{missing} --out {out} --fail-on nan --experts 4", "no such directory"),
    ("bisect", "{root} --out {out} --fail-on nan --experts 4", "bisect needs at least 2"),
    ("bisect", "{root} --out {out} --fail-on nan", "--experts --keep-ratio is required"),
    ("bisect", "{root} --out {file} --fail-on nan --experts 4", "is a file"),
    ("bisect", "{root} --out {out} --fail-on nan --experts 4 --lr -1", "--lr: -1: must be above 0"),
    ("compare", "{run} {run} --out {out} --metrics no/such", "'no/such': not in run"),
    ("compare", "{run} {missing} --out {out}", "no metrics.jsonl"),
    ("compare", "{run} --out {out}", "at least two runs"),
    ("watch", "{run}/metrics.jsonl --fail-on garbage", "--fail-on 'garbage'"),
    ("watch", "{missing}/metrics.jsonl --timeout 0.2 --poll 0.05", "the file never appeared"),
    ("watch", "", "no METRICS_FILE given"),
    ("watch", "{file}", "not a metrics file of a known format; readable formats: jsonl"),
    ("watch", "{run} --profile nope", "--profile 'nope': no such profile; one of verl, trl"),
    ("watch", "{run} --metric kl", "--metric 'kl': expected ROLE=NAME"),
    ("watch", "{run} --format csv", "--format: invalid choice: 'csv'"),
    ("triage", "{run}/metrics.jsonl {root} --out {out}", "the following arguments are required: --fail-on"),
    ("triage", "{run}/metrics.jsonl {root} --out {out} --fail-on garbage --experts 4", "--fail-on 'garbage'"),
    ("triage", "{missing}/metrics.jsonl {root} --out {out} --fail-on nan --experts 4", "no steps logged"),
    ("triage", "{file} {root} --out {out} --fail-on nan --experts 4", "not a metrics file of a known format"),
    ("triage", "{run}/metrics.jsonl {root} --out {file} --fail-on nan --experts 4", "is a file"),
    ("triage", "{run}/metrics.jsonl {root} --out {out} --fail-on nan", "--experts --keep-ratio is required"),
    ("triage", "{run}/metrics.jsonl {root} --out {out} --fail-on nan --experts 4 --lr -1", "--lr: -1: must be above 0"),
    ("triage", "{run}/metrics.jsonl {root} --out {out} --fail-on nan --experts 4 --candidates no-such",
     "unknown candidate 'no-such'"),
    ("compare", "{run} {file} --out {out}", "not a metrics file of a known format; readable formats: jsonl"),
    ("compare", "{run} {tiny} --out {out}", "no metrics.jsonl, trainer_state.json, checkpoint-N/"),
    ("compare", "{run} {run} --out {out} --profile nope", "--profile 'nope': no such profile"),
    ("compare", "{run} {events_empty} --out {out}", "empty event file"),
    ("compare", "{run} {events_cut} --out {out}", "truncated or corrupt event file"),
]


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-input")
    make_tiny("qwen3_moe", root / "tiny")
    shutil.copytree(root / "tiny", root / "truncated")
    config = root / "truncated" / "config.json"
    config.write_bytes(config.read_bytes()[:40])
    (root / "a-file").write_text("not a directory\n")
    (root / "run").mkdir()
    (root / "run" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "data": {"actor/pg_loss": s % 3, "actor/grad_norm": s}}) + "\n" for s in range(6)))
    (root / "tb-empty").mkdir()
    (root / "tb-empty" / "events.out.tfevents.1.host").touch()
    (root / "tb-cut").mkdir()
    (root / "tb-cut" / "events.out.tfevents.1.host").write_bytes(_event_record(0) + _event_record(1)[:-5])
    return {"root": root, "tiny": root / "tiny", "truncated": root / "truncated", "file": root / "a-file",
            "run": root / "run", "missing": root / "no-such", "events_empty": root / "tb-empty",
            "events_cut": root / "tb-cut"}


def _event_record(step: int) -> bytes:
    """One TFRecord of an Event (a TensorBoard event file is a sequence of them)."""
    import struct

    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    event = Event(step=step, wall_time=1.0)
    event.summary.value.add(tag="train/loss", simple_value=0.5)
    data = event.SerializeToString()
    head = struct.pack("<Q", len(data))
    return head + struct.pack("<I", masked_crc32c(head)) + data + struct.pack("<I", masked_crc32c(data))


def one_error_line(stderr: str, command: str) -> str:
    """The error line, after checking the form: that line alone, or argparse's usage and then it."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines, "no error printed"
    assert lines[-1].startswith(f"moe-proxy {command}: error: "), stderr
    if len(lines) > 1:  # argparse: "usage: moe-proxy CMD ...", its continuation lines indented
        assert lines[0].startswith(f"usage: moe-proxy {command} "), stderr
        assert all(line.startswith(" ") for line in lines[1:-1]), stderr
    return lines[-1]


@pytest.mark.parametrize("command, arguments, fragment", ROWS, ids=[f"{c} {a}" for c, a, _ in ROWS])
def test_bad_input_is_one_line_and_exit_2(command, arguments, fragment, places, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("VERL_FILE_LOGGER_PATH", raising=False)  # watch's default METRICS_FILE
    out = tmp_path / "out"
    argv = [command, *shlex.split(arguments.format(**places, out=out))]
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's errors
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert fragment in one_error_line(captured.err, command)
    assert captured.out == ""
    assert not out.exists(), f"a refused {command} wrote {out}"


def test_every_command_has_rows():
    assert set(subcommands(build_parser())) <= {command for command, _, _ in ROWS}


@pytest.mark.parametrize("arguments", ["{missing} --lr -1", "{missing}", "{truncated}", "{tiny} --fail-on garbage",
                                       "{tiny} --out {file}", "{tiny} --fault-rank-exit x"])
def test_repro_refuses_before_torch_loads(arguments, places, tmp_path):
    """A mistake costs no torch import: the refusal comes from an interpreter that cannot import
    torch, transformers, scikit-learn or scipy."""
    argv = shlex.split(arguments.format(**places))
    argv += [] if "--out" in argv else ["--out", str(tmp_path / "out")]
    r = run_blocked("import sys; from moe_proxy.cli import main; sys.exit(main(sys.argv[1:]))", "repro", *argv)
    assert r.returncode == 2, r.stderr[-3000:]
    one_error_line(r.stderr, "repro")
    assert not (tmp_path / "out").exists()


def test_output_into_a_closed_pipe_ends_quietly(places, tmp_path, capsys):
    """`moe-proxy checkpoints ROOT --json | head -1`: more JSON than the pipe holds, the reader
    gone after one line; Python's way (docs: signal, note on SIGPIPE): no traceback, exit 1."""
    for step in range(600):
        (tmp_path / f"global_step_{step}").mkdir()
        shutil.copy(places["tiny"] / "config.json", tmp_path / f"global_step_{step}")
    assert main(["checkpoints", str(tmp_path), "--json"]) == 0
    assert len(capsys.readouterr().out) > 2 * 65536, "the output fits a pipe: nothing would break"
    script = Path(sys.executable).with_name("moe-proxy")
    cli = [str(script)] if script.exists() else [sys.executable, "-m", "moe_proxy"]
    r = subprocess.run(["bash", "-c", f"{shlex.join([*cli, 'checkpoints', str(tmp_path), '--json'])} | head -1; "
                        "exit ${PIPESTATUS[0]}"], capture_output=True, text=True, timeout=120)
    assert r.stdout == "[\n"
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr
    assert r.returncode == 1


def test_a_broken_pipe_that_is_not_stdout_is_not_hidden(places, monkeypatch):
    def run(args):
        raise BrokenPipeError("a peer's socket")

    monkeypatch.setattr("moe_proxy.commands.inspect.run", run)
    with pytest.raises(BrokenPipeError):
        main(["inspect", str(places["tiny"])])


def test_every_option_has_help_and_shows_its_default():
    for name, parser in subcommands(build_parser()).items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            assert action.help and action.help.strip(), f"{name} {action.option_strings or action.dest}: no help"
            shown = formatter._get_help_string(action)
            if action.option_strings and action.default not in (None, "", [], argparse.SUPPRESS) \
                    and not isinstance(action.default, bool):
                assert "default" in shown.lower(), f"{name} {action.option_strings}: default not shown"


@pytest.mark.parametrize("argv", [["inspect", "X", "-v"], ["inspect", "X", "--verbose"], ["-v", "inspect", "X"]])
def test_verbose_before_or_after_the_command(argv):
    assert parse_args(argv).verbose
    assert not parse_args(["inspect", "X"]).verbose
