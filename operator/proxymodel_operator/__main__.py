"""`python -m proxymodel_operator`: run the operator with the settings from the environment
(see settings.py): watched namespaces or cluster-wide, a liveness endpoint, JSON logs."""

from __future__ import annotations

import sys

import kopf

from . import handlers  # registers the handlers (the workloads' with the settings)
from .settings import SettingsError, from_env


def main() -> int:
    try:
        settings = from_env()
    except SettingsError as exc:
        print(f"proxymodel-operator: {exc}", file=sys.stderr)
        return 2
    handlers.register_workloads(settings.runtimes)
    if settings.checkpoint_watch:
        from . import checkpoint_watch

        checkpoint_watch.register(settings.checkpoint_tick)
    from . import diagnosis

    diagnosis.register(settings.diagnosis_tick)
    kopf.configure(log_format=kopf.LogFormat[settings.log_format.upper()])
    kopf.run(
        standalone=True,  # one replica (Deployment strategy Recreate); no peering objects
        clusterwide=settings.cluster_wide,
        namespaces=settings.namespaces,
        liveness_endpoint=settings.liveness or None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
