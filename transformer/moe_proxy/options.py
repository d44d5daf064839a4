"""Each stage's options, declared once: every option with its type, default and help, and the
rules that tie options together. The CLI's flags, the operator's Job arguments and the
ProxyModel CRD's schema come from here. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PruningOptions:
    experts: int | None = None
    keep_ratio: float | None = None
    method: str = "cluster"
    features: str = "router"
    clustering: str = "kmeans"
    seed: int = 0
    top_k: int | None = None
    pins: dict[int, list[int]] = field(default_factory=dict)  # layer -> expert ids to keep
    # Usage-aware selection (usage.py), from `moe-proxy calibrate` statistics at this location.
    calibration: str | None = None
    keep_super: bool = True
    representative: str | None = None  # medoid | saliency (default saliency with calibration)
    heal: bool = False  # re-fit the kept router rows (heal.py)
    reconstruct: bool = False  # re-fit the kept experts and router rows layer by layer (reconstruct.py)
    max_kl: float | None = None  # --experts auto: the KL target the chosen count met (fidelity.py)
    merge: bool = False  # kept experts = gate-mass-weighted merges of their clusters (merge.py)
