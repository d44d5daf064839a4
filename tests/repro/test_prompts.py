"""--prompts: verl's RL data (parquet or JSON lines) instead of the built-in task."""

import json

import pytest

from moe_proxy.cli import main
from moe_proxy.errors import InvalidReproConfig
from moe_proxy.rl.config import ReproConfig
from moe_proxy.metrics.readers import read_metrics
from moe_proxy.rl.runner import run_repro
from moe_proxy.rl.task import PromptSet, load_prompts


def verl_rows(n=6):
    """Rows as verl's data preprocessing scripts write them (e.g. examples/data_preprocess/gsm8k.py)."""
    return [{"data_source": "arith", "prompt": [{"role": "system", "content": "Answer with a number."},
                                                 {"role": "user", "content": f"{i}+{i}="}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in verl_rows()))
    return path


@pytest.fixture
def parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), path)
    return path


def test_verl_rows_are_read_and_scored_by_exact_match(jsonl, parquet):
    for path in (jsonl, parquet):
        prompts = load_prompts(str(path))
        assert len(prompts) == 6 and prompts[2].answer == "4"
        assert prompts[2].messages[1] == {"role": "user", "content": "2+2="}
        assert prompts[2].score("4\n") == 1.0 and prompts[2].score("44") == 0.0 and prompts[2].score("4.0") == 0.0


def test_prompt_set_walks_shuffled_epochs():
    rows = load_prompts_from(verl_rows(5))
    data = PromptSet(rows, seed=3)
    seen = [p.answer for step in range(5) for p in data.batch(step, 2)]  # 10 rows: two epochs
    assert sorted(seen[:5]) == sorted(seen[5:]) == sorted(p.answer for p in rows)
    assert seen == [p.answer for step in range(5) for p in PromptSet(rows, seed=3).batch(step, 2)]


def load_prompts_from(rows):
    from moe_proxy.rl.task import _prompt

    return [_prompt(row, f"row {i}") for i, row in enumerate(rows)]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_repro_runs_on_a_prompts_file(tiny_qwen3, tmp_path, request, kind):
    path = request.getfixturevalue(kind)
    config = ReproConfig(steps=2, batch_size=2, group_size=2, mini_batches=1, lr=1e-4)
    result = run_repro(str(tiny_qwen3), tmp_path / "run", config, prompts=str(path))
    assert result.steps_completed == 2
    rows = read_metrics(tmp_path / "run")
    assert rows[1]["critic/rewards/mean"] in (0.0, 0.25, 0.5, 0.75, 1.0)  # exact match: 0 or 1 per answer
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["prompts"] == str(path)


@pytest.mark.parametrize("row, missing", [
    ({"reward_model": {"ground_truth": "1"}}, "`prompt`"),
    ({"prompt": [{"role": "user", "content": "1+0="}]}, "`reward_model.ground_truth`"),
    ({"prompt": [{"role": "user", "content": "1+0="}], "reward_model": {"style": "rule"}},
     "`reward_model.ground_truth`"),
    ({"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}}, "list of {role, content}"),
])
def test_rows_without_the_fields_are_refused(tmp_path, row, missing):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(verl_rows(1)[0]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(InvalidReproConfig, match="row 1") as err:
        load_prompts(str(path))
    assert missing in str(err.value)


def test_cli_refuses_a_bad_prompts_file(tiny_qwen3, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"question": "1+1="}) + "\n")
    assert main(["repro", str(tiny_qwen3), "--out", str(tmp_path / "o"), "--prompts", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "missing field `prompt`" in err and "\n" not in err
    (tmp_path / "text.jsonl").write_text("not json\n")
    assert main(["repro", str(tiny_qwen3), "--out", str(tmp_path / "o"), "--prompts", str(tmp_path / "text.jsonl")]) == 2
    assert "not JSON" in capsys.readouterr().err
    assert main(["repro", str(tiny_qwen3), "--out", str(tmp_path / "o"), "--prompts", str(tmp_path / "none")]) == 2
    assert "no such file" in capsys.readouterr().err
