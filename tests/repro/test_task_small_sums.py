"""The built-in tasks: `small-sums` (the fidelity lab's learning task, bench/learning.py) beside
`arithmetic`, whose prompts and scores it must leave as they were."""

import random

import pytest

from moe_proxy.errors import InvalidReproConfig
from moe_proxy.rl.task import distance_reward, make_prompts, reward


def test_small_sums_are_one_digit_sums_scored_by_distance():
    prompts = make_prompts("small-sums", seed=3, step=5, count=64)
    for p in prompts:
        a, b = (int(x) for x in p.text.rstrip("=").split("+"))
        assert 0 <= a < 10 and 0 <= b < 10 and p.answer == str(a + b)
    p = next(p for p in prompts if int(p.answer) >= 4)
    total = int(p.answer)
    assert p.score(f"{total}\n12+3=") == 1.0
    assert p.score(f"{total - 3}") == pytest.approx(0.7)
    assert p.score(f"{total + 12}") == 0.0  # 10 or more away: nothing
    assert p.score("x7") == 0.0 and p.score("") == 0.0 and p.score("\u00b2") == 0.0  # digits only, ASCII
    assert distance_reward(" 9 \n", "7") == pytest.approx(0.8)


def test_arithmetic_prompts_and_scores_are_unchanged():
    rng = random.Random("0:2")
    expected = [(rng.randrange(100), rng.randrange(100)) for _ in range(8)]
    prompts = make_prompts("arithmetic", seed=0, step=2, count=8)
    assert [p.text for p in prompts] == [f"{a}+{b}=" for a, b in expected]
    assert all(p.score(r) == reward(r, p.answer) for p in prompts for r in (p.answer, "12", "ab"))
    assert prompts[0].score(str(sum(expected[0]) + 3)) < 1.0


def test_an_unknown_task_is_refused():
    with pytest.raises(InvalidReproConfig, match="known: arithmetic, small-sums"):
        make_prompts("sums", seed=0, step=0, count=1)
