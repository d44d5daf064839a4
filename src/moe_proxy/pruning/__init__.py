"""Building a proxy: which experts to keep (`expert_plan` from `features`, `selection`, `usage`;
`sequential`: selected layer by layer while sequential statistics are made), the layer-by-layer
passes that fit or measure it (`heal`, `merge`, `reconstruct`, `fidelity`), the build's entry
points (`build`) and the steps they run (`steps`: prepare, write a share, finalize; on
`prepared`, `output_shards`, `shares`, `fits`, `destination`, `writer`), the config rewrite
(`config`) and the checks of a written proxy (`verify`).

`from moe_proxy.pruning import build_proxy` is the library entry point (and, for a scale-out
build, `fit_for_workers`, `build_share`, `finalize_build`); they are imported on first use so
that the torch-free modules of this package (`config`) stay torch-free.
"""

ENTRY_POINTS = ("build_proxy", "fit_for_workers", "build_share", "finalize_build")


def __getattr__(name: str):
    if name in ENTRY_POINTS:
        from moe_proxy.pruning import build

        return getattr(build, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
