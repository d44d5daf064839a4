"""`make demo` (#41 sections 2 and 4): a rerun keeps what the user made in its directory, and
writes a short run's checkpoints on which the bisect command it prints finds step 40."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from moe_proxy.cli import main
from moe_proxy.investigate.bisect import sources


def test_the_demo_keeps_the_users_files_and_writes_a_run_to_bisect(tmp_path, capsys):
    out = tmp_path / "demo-out"
    (out / "diagnosis").mkdir(parents=True)
    (out / "diagnosis" / "report.md").write_text("the user's diagnosis")
    (out / "proxy").mkdir()
    (out / "proxy" / "stale.txt").write_text("an older demo's file")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | {"OMP_NUM_THREADS": "1"}
    demo = subprocess.run([sys.executable, "-m", "moe_proxy.demo", "--out", str(out)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert (out / "diagnosis" / "report.md").read_text() == "the user's diagnosis"
    assert not (out / "proxy" / "stale.txt").exists() and (out / "proxy" / "proxy-manifest.json").is_file()
    assert f"kept in {out} from before: diagnosis" in demo.stdout
    assert [c.step for c in sources(str(out / "run"), None, None, None, None)] == [10, 20, 30, 40, 50]
    # the printed bisect command, around the boundary it names (the whole search: docs/diagnosis.md)
    printed = demo.stdout[demo.stdout.index("moe-proxy bisect"):].replace("\\\n", " ")
    command = printed.split("#")[0].split()[1:]
    assert command[:2] == ["bisect", str(out / "run")]
    assert main([*command, "--good", "30", "--bad", "40"]) == 0
    report = json.loads((out / "bisect" / "report.json").read_text())
    assert report["first_bad"]["step"] == 40
    assert report["boundary"] == "confirmed: step 30, the checkpoint before, ran clean"
