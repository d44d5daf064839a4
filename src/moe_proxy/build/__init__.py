"""Building a proxy: which experts to keep (`expert_plan` from `features`, `selection`, `usage`;
`sequential`: selected layer by layer while sequential statistics are made), the layer-by-layer
passes that fit or measure it (`heal`, `merge`, `reconstruct`, `fidelity`), the streamed write
(`steps`, `writer`), the config rewrite (`config`) and the checks of a written proxy
(`verify`).

`from moe_proxy.build import build_proxy` is the library entry point; it is imported on first
use so that the torch-free modules of this package (`config`) stay torch-free.
"""


def __getattr__(name: str):
    if name == "build_proxy":
        from moe_proxy.build.steps import build_proxy

        return build_proxy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
