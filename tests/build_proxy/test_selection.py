"""Expert selection: one medoid per cluster, pins, baselines, groups, degenerate inputs."""

import numpy as np
import pytest

from moe_proxy.errors import MoeProxyError
from moe_proxy.pruning.selection import select


def planted(groups: int, per: int, dim: int = 16, seed: int = 0, noise: float = 1e-3):
    """Experts planted as near-duplicates of `groups` well-separated centres, shuffled."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 1, (groups, dim)) * 10
    labels = rng.permutation(np.repeat(np.arange(groups), per))
    return centres[labels] + rng.normal(0, noise, (len(labels), dim)), labels


@pytest.mark.parametrize("clustering", ["kmeans", "agglomerative"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_expert_per_planted_group(clustering, seed):
    x, labels = planted(groups=6, per=5, seed=seed)
    sel = select(x, 6, clustering=clustering, seed=seed)
    assert sorted(labels[sel.kept]) == list(range(6))
    assert sorted(sel.cluster_sizes) == [5] * 6


def test_medoid_is_the_member_nearest_the_centre():
    x = np.array([[0.0], [1.0], [2.0], [100.0], [101.0], [103.0]])
    sel = select(x, 2)
    assert sel.kept == [1, 4]  # 1 is the centre of {0,1,2}; 101.33 is nearest 101
    assert sel.assignment == [0, 0, 0, 1, 1, 1]


def test_pins_are_kept_and_take_their_cluster():
    x, labels = planted(groups=4, per=4, seed=3)
    pin = int(np.flatnonzero(labels == 2)[-1])
    sel = select(x, 4, pins=[pin])
    assert pin in sel.kept
    assert sorted(labels[sel.kept]) == [0, 1, 2, 3]


def test_two_pins_in_one_cluster_both_kept():
    x, labels = planted(groups=4, per=4, seed=4)
    pins = [int(i) for i in np.flatnonzero(labels == 1)[:2]]
    sel = select(x, 4, pins=pins)
    assert set(pins) <= set(sel.kept) and len(sel.kept) == 4


def test_identical_experts_after_sparse_upcycling():
    x = np.ones((8, 4))
    sel = select(x, 4)
    assert len(set(sel.kept)) == 4 and sum(sel.cluster_sizes) == 8


def test_two_distinct_experts_duplicated():
    x = np.array([[0.0, 0]] * 4 + [[1.0, 1]] * 4)
    sel = select(x, 3)
    assert len(sel.kept) == 3 and {0, 4} <= set(sel.kept)


def test_grouped_selection_stays_within_groups():
    x, _ = planted(groups=8, per=4, seed=5)
    sel = select(x, 8, n_group=4)
    per_group = [sum(1 for e in sel.kept if e // 8 == g) for g in range(4)]
    assert per_group == [2, 2, 2, 2]
    assert all(sel.kept[a] // 8 == e // 8 for e, a in enumerate(sel.assignment))


def test_deterministic_for_a_seed_and_seed_matters_for_random():
    x, _ = planted(groups=3, per=10, seed=6, noise=1.0)
    assert select(x, 5, seed=7).kept == select(x, 5, seed=7).kept
    r = {tuple(select(x, 5, method="random", seed=s).kept) for s in range(5)}
    assert len(r) > 1
    assert select(x, 5, method="random", seed=3).kept == select(x, 5, method="random", seed=3).kept


def test_first_n_baseline_with_pin():
    x = np.random.default_rng(0).normal(size=(8, 3))
    assert select(x, 3, method="first-n").kept == [0, 1, 2]
    assert select(x, 3, method="first-n", pins=[7]).kept == [0, 1, 7]


def test_too_many_pins_in_a_group():
    x = np.random.default_rng(0).normal(size=(8, 3))
    with pytest.raises(MoeProxyError, match="pinned experts in routing group 0"):
        select(x, 4, n_group=2, pins=[0, 1, 2])


def test_unknown_method():
    with pytest.raises(MoeProxyError, match="unknown method"):
        select(np.zeros((4, 2)), 2, method="best")


def test_random_draws_differently_in_every_layer():
    """A random baseline must be random across layers too, not the same ids everywhere (seeded
    by seed, layer and routing group: the same build twice is still the same proxy)."""
    x = np.random.default_rng(0).normal(size=(64, 8))
    per_layer = [tuple(select(x, 8, method="random", seed=0, layer=layer).kept) for layer in range(6)]
    assert len(set(per_layer)) == 6
    assert per_layer[3] == tuple(select(x, 8, method="random", seed=0, layer=3).kept)
