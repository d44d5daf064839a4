"""The operator image, run as the chart's Deployment runs it: the rendered command, exactly the
rendered environment, user 65532, a read-only root filesystem with the chart's /tmp emptyDir as
the only writable path, all capabilities dropped. It logs in through a kubeconfig to kmock's
emulated API server, its liveness endpoint answers, its preflight reads the source's config.json
from SeaweedFS with the credentials Secret the ProxyModel names (boto3 in the image), it turns the
ProxyModel into a transformer Job, it stops cleanly on SIGTERM, and no module it loads is
torch (nor numpy, scikit-learn, scipy or transformers, none of which is even installed)."""

from __future__ import annotations

import pytest

from .conftest import podman

# The first test also waits for the session's `make images` (10-15 minutes on a busy 2-core
# machine) and the operator run: more than the suite's 600 s per test.
pytestmark = pytest.mark.timeout(2700)

HEAVY = ("torch", "numpy", "sklearn", "scipy", "transformers", "safetensors", "accelerate")
OPERATOR_IMAGE_LIMIT = 300_000_000  # bytes, on python:3.11-slim (the local Debian base is as big)


def _log_tail(run) -> str:
    lines = [line for line in run.log.splitlines() if not line.startswith("import time:")]
    return "\n".join(lines[-60:])


def test_operator_image_answers_its_liveness_probe(operator_run):
    assert operator_run.healthy, f"the liveness endpoint never answered; operator log:\n{_log_tail(operator_run)}"


def test_operator_image_turns_a_proxymodel_into_a_transformer_job(operator_run, images):
    assert operator_run.jobs, f"no transformer Job; operator log:\n{_log_tail(operator_run)}"
    (job,) = operator_run.jobs
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == images["transformer"]  # the chart's default transformer image
    assert container["args"][:3] == ["build", "s3://ckpt/qwen3", "s3://proxy/qwen3-tiny"]


def test_operator_image_stops_cleanly_on_sigterm(operator_run):
    assert operator_run.exit_code == 0, f"exit code {operator_run.exit_code}; log:\n{_log_tail(operator_run)}"


def test_operator_loads_no_torch(operator_run, images):
    """Python's import log of the running operator (startup, preflight, the Job): kopf, aiohttp
    and boto3, never torch or the other heavy libraries; and they are not installed."""
    loaded = {line.split("|")[-1].strip().split(".")[0] for line in operator_run.log.splitlines()
              if line.startswith("import time:") and "|" in line}
    assert {"kopf", "aiohttp", "boto3", "proxymodel_operator", "moe_proxy"} <= loaded, sorted(loaded)
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
    code = ("import importlib.metadata as m\n"
            "print('\\n'.join(sorted(d.metadata['Name'].lower() for d in m.distributions())))\n")
    installed = set(podman("run", "--rm", "--network", "none", "--entrypoint", "python", images["operator"],
                           "-c", code).stdout.split())
    assert {"kopf", "boto3", "moe-proxy"} <= installed
    assert not installed & {"torch", "numpy", "scikit-learn", "scipy", "transformers", "safetensors", "accelerate"}


def test_operator_image_is_small(images):
    size = int(podman("image", "inspect", "--format", "{{.Size}}", images["operator"]).stdout.strip())
    print(f"{images['operator']}: {size / 1e6:.0f} MB")
    assert size < OPERATOR_IMAGE_LIMIT, f"{images['operator']} is {size / 1e6:.0f} MB"


def test_operator_image_runs_as_65532_with_home_on_tmp(images):
    """The chart's runAsUser is also the image's own user: a pod without a securityContext (or a
    plain `docker run`) is not root either."""
    out = podman("run", "--rm", "--network", "none", "--read-only", "--read-only-tmpfs=false", "--entrypoint", "sh",
                 images["operator"], "-c", 'id -u; id -g; echo "$HOME"').stdout.split()
    assert out == ["65532", "65532", "/tmp"], out
