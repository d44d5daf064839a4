"""Choose which experts of one MoE block to keep.

`cluster` (default): cluster the experts' feature vectors into k clusters (scikit-learn
k-means or agglomerative) and keep, per cluster, the member nearest its centre (the medoid).
Pinned experts are kept whatever happens: each becomes the representative of its cluster.
`random` (seeded) and `first-n` are baselines. With grouped routing, selection runs within
each group, keeping the same number per group so the group structure stays valid.

With calibration statistics (calibration.py) the caller also passes `scores` (one number per
expert, higher = more worth keeping: gate mass or REAP saliency) and `alive` (False for
experts dead on the calibration data). `frequency` / `saliency` keep the top-scoring experts;
`representative="saliency"` makes each cluster's highest-scoring member its representative;
dead experts are never kept unless pinned.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np

from moe_proxy.errors import MoeProxyError
from moe_proxy.options import CLUSTERINGS, METHODS, SCORED_METHODS


@dataclass
class Selection:
    kept: list[int]  # ascending old expert ids; new id j = kept[j]
    cluster_sizes: list[int]  # experts represented by kept[j] (sums to the old count)
    assignment: list[int]  # per old expert: the new id of its representative
    record: dict = field(default_factory=dict)  # extra per-layer manifest fields (calibrated builds)


def select(
    features: np.ndarray,
    k: int,
    *,
    n_group: int = 1,
    method: str = "cluster",
    clustering: str = "kmeans",
    seed: int = 0,
    pins: list[int] | tuple[int, ...] = (),
    scores: np.ndarray | None = None,
    alive: np.ndarray | None = None,
    representative: str = "medoid",
    layer: int = 0,
) -> Selection:
    n = len(features)
    alive = np.ones(n, dtype=bool) if alive is None else np.asarray(alive, dtype=bool)
    if (method in SCORED_METHODS or representative == "saliency") and scores is None:
        raise MoeProxyError(f"--method {method} / --representative {representative} need calibration scores")
    if method not in METHODS:
        raise MoeProxyError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    if clustering not in CLUSTERINGS:
        raise MoeProxyError(f"unknown clustering {clustering!r}: choose one of {', '.join(CLUSTERINGS)}")
    per, k_per = n // n_group, k // n_group
    reps: list[int] = []
    for g in range(n_group):
        members = np.arange(g * per, (g + 1) * per)
        local_pins = sorted(p - g * per for p in pins if g * per <= p < (g + 1) * per)
        if len(local_pins) > k_per:
            raise MoeProxyError(
                f"{len(local_pins)} pinned experts in routing group {g} but only {k_per} are kept per group"
            )
        # Candidates: alive experts and pins (all experts without calibration).
        cands = [i for i in range(per) if alive[members[i]] or i in local_pins]
        if len(cands) < k_per:
            raise MoeProxyError(
                f"routing group {g}: only {len(cands)} experts are alive or pinned, cannot keep {k_per}"
            )
        x = features[members[cands]]
        cand_pins = [cands.index(p) for p in local_pins]
        rest = [i for i in range(len(cands)) if i not in cand_pins]
        if method == "cluster":
            rep_scores = scores[members[cands]] if representative == "saliency" else None
            chosen = _cluster(x, k_per, clustering, seed, cand_pins, rep_scores)
        elif method in SCORED_METHODS:
            ranked = sorted(rest, key=lambda i: -scores[members[cands[i]]])
            chosen = cand_pins + ranked[: k_per - len(cand_pins)]
        elif method == "random":
            rng = np.random.default_rng([seed, layer, g])  # a different draw in every layer and group
            chosen = cand_pins + sorted(rng.choice(rest, k_per - len(cand_pins), replace=False).tolist())
        else:
            chosen = cand_pins + rest[: k_per - len(cand_pins)]
        reps += [int(members[cands[i]]) for i in chosen]
    kept = sorted(reps)
    assignment = _assign(features, kept, n_group)
    sizes = [assignment.count(j) for j in range(len(kept))]
    return Selection(kept, sizes, assignment)


def _cluster(x: np.ndarray, k: int, clustering: str, seed: int, pins: list[int],
             scores: np.ndarray | None = None) -> list[int]:
    n = len(x)
    if k >= n:
        return list(range(n))
    # scikit-learn loads here, not on import: a scale-out's finalize takes the workers' plan and
    # never clusters, so it starts without it (seconds of start-up).
    from sklearn.cluster import AgglomerativeClustering, KMeans
    from threadpoolctl import threadpool_limits

    distinct = len(np.unique(x, axis=0))
    if distinct <= k:
        # Fewer distinct experts than clusters (e.g. identical after sparse upcycling): one per
        # distinct vector, then fill up in index order; clustering would only warn and misbehave.
        _, labels = np.unique(x, axis=0, return_inverse=True)
    else:
        # One thread for scikit-learn's OpenMP and BLAS pools, set here because torch's
        # operations between two blocks set OpenMP's back: the problem is tiny, and spinning
        # pool threads cost about 4x the CPU where cores are busy (bench/plan_cpu.py; same choice).
        with threadpool_limits(limits=1), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            labels = (KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(x) if clustering == "kmeans"
                      else AgglomerativeClustering(n_clusters=k, linkage="ward").fit_predict(x))
    labels = np.asarray(labels).ravel()
    clusters = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    centres = [x[m].mean(axis=0) for m in clusters]
    if scores is None:  # the medoid: the member nearest its cluster's centre
        reps = [int(m[np.argmin(np.linalg.norm(x[m] - c, axis=1))]) for m, c in zip(clusters, centres)]
    else:  # the member the model relies on most
        reps = [int(m[np.argmax(scores[m])]) for m in clusters]

    # Pins take over the cluster they fall in; a second pin in one cluster takes the cluster
    # with the nearest centre that has no pin yet.
    pinned: set[int] = set()
    for p in pins:
        own = next(i for i, m in enumerate(clusters) if p in m)
        free = [i for i in range(len(reps)) if i not in pinned]
        target = own if own in free else min(free, key=lambda i: np.linalg.norm(x[p] - centres[i]))
        reps[target] = p
        pinned.add(target)
    chosen = list(dict.fromkeys(reps))
    chosen += [i for i in range(n) if i not in chosen][: k - len(chosen)]
    return chosen


def _assign(features: np.ndarray, kept: list[int], n_group: int) -> list[int]:
    """Each expert's representative: the nearest kept expert of its own routing group."""
    n = len(features)
    per = n // n_group
    out = []
    for e in range(n):
        g = e // per
        cands = [j for j, r in enumerate(kept) if r // per == g]
        if e in kept:
            out.append(kept.index(e))
            continue
        d = [np.linalg.norm(features[e] - features[kept[j]]) for j in cands]
        out.append(cands[int(np.argmin(d))])
    return out
