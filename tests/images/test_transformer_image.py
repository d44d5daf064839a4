"""The transformer image, run as the kubelet would run the Job the operator image created: its
command, args and environment (the credentials resolved from the ProxyModel's Secret), as user
65532 on a read-only root filesystem, with /dev/termination-log the only file it may write
besides /tmp. It builds a proxy from the tiny checkpoint in SeaweedFS to SeaweedFS, the proxy
verifies on the host (`moe-proxy verify`, forward pass included), and the same image runs
`moe-proxy repro` on the proxy for two RL steps on CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import aws_env, container_args, podman

# The first test also waits for the session's `make images` (10-15 minutes on a busy 2-core
# machine) and the operator run: more than the suite's 600 s per test.
pytestmark = pytest.mark.timeout(2700)

# Kubernetes' default for a pod without a securityContext is the image's user; the test makes the
# user explicit as a restricted PodSecurity namespace would (runAsNonRoot, a numeric user).
USER = {"runAsUser": 65532, "runAsGroup": 65532}
# One thread per process: two torch threads per container thrash a busy 2-core machine.
THREADS = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="session")
def built_proxy(operator_run, images, seaweed, tmp_path_factory):
    """The transformer Job the operator created, run: (completed process, termination message, proxy URI)."""
    if not operator_run.jobs:
        pytest.fail("the operator image created no transformer Job to run (see test_operator_image.py)")
    (job,) = operator_run.jobs
    pod = job["spec"]["template"]["spec"]
    assert not pod.get("initContainers"), "this ProxyModel asks for no calibration"
    container = pod["containers"][0]
    assert container["image"] == images["transformer"]
    termination = tmp_path_factory.mktemp("transformer") / "termination-log"
    termination.write_text("")
    termination.chmod(0o666)  # the kubelet's file, written by the container's user
    args = container_args(container, {**pod.get("securityContext", {}), **USER}, operator_run.secrets,
                          read_only=True, writable=["/tmp"], extra_env=THREADS,
                          binds=[f"{termination}:{container['terminationMessagePath']}:rw"])
    result = podman("run", "--rm", *args, timeout=900, check=False)
    message = termination.read_text()
    return result, message, container["args"][2]


def test_transformer_image_builds_the_proxy_the_operator_asked_for(built_proxy):
    result, message, _ = built_proxy
    assert result.returncode == 0, f"moe-proxy build exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-4000:]}"
    report = json.loads(message)  # what the operator reads back from the pod's status
    assert report, message


def test_the_proxy_verifies_on_the_host(built_proxy, seaweed):
    result, _, proxy = built_proxy
    assert result.returncode == 0, "the build failed (see the test above)"
    verify = subprocess.run([sys.executable, "-m", "moe_proxy", "verify", proxy, "--endpoint-url", seaweed.endpoint_url,
                             "--no-progress"], capture_output=True, text=True, env=aws_env(seaweed), timeout=600)
    assert verify.returncode == 0, verify.stdout[-3000:] + verify.stderr[-3000:]


@pytest.mark.parametrize("ranks", [1, 2])
def test_transformer_image_reproduces_on_the_proxy(built_proxy, images, seaweed, tmp_path, ranks):
    """`moe-proxy repro` in the image for two steps on CPU, reading the proxy from S3, on one
    process and as one distributed run of two ranks (gloo); the run's metrics land in a mounted
    folder (a reproduction Job's volume), written by rank 0 alone."""
    result, _, proxy = built_proxy
    assert result.returncode == 0, "the build failed (see the test above)"
    out = tmp_path / "run"
    out.mkdir()
    out.chmod(0o777)
    env = {"AWS_ACCESS_KEY_ID": aws_env(seaweed)["AWS_ACCESS_KEY_ID"],
           "AWS_SECRET_ACCESS_KEY": aws_env(seaweed)["AWS_SECRET_ACCESS_KEY"],
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": seaweed.endpoint_url, **THREADS}
    container = {"image": images["transformer"], "command": ["moe-proxy"],
                 "args": ["repro", proxy, "--out", "/run-out", "--steps", "2", "--device", "cpu",
                          *(["--nproc-per-node", str(ranks)] if ranks > 1 else [])],
                 "env": [{"name": k, "value": v} for k, v in env.items()]}
    args = container_args(container, USER, {}, read_only=True, writable=["/tmp"], binds=[f"{out}:/run-out:rw"])
    run = podman("run", "--rm", *args, timeout=900, check=False)
    assert run.returncode == 0, f"moe-proxy repro exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-4000:]}"
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [s["step"] for s in steps] == [0, 1], steps  # verl numbers steps from 0
    assert (out / "summary.json").is_file()


def test_transformer_image_runs_as_65532_with_a_cpu_torch(images):
    """One container (each costs a copy of the 1.7 GB image under podman's vfs driver): the
    image's own user is 65532, the CLI starts on a read-only root, and torch is a CPU build."""
    script = ('id -u; id -g; moe-proxy --help > /dev/null && echo cli-ok; '
              'python -c "import torch; print(torch.__version__, torch.version.cuda)"')
    out = podman("run", "--rm", "--network", "none", "--read-only", "--read-only-tmpfs=false", "--entrypoint", "sh",
                 images["transformer"], "-c", script).stdout.split()
    assert out[:3] == ["65532", "65532", "cli-ok"], out
    version, cuda = out[3:]
    assert cuda == "None", f"torch {version} is a CUDA build"
    size = int(podman("image", "inspect", "--format", "{{.Size}}", images["transformer"]).stdout.strip())
    print(f"{images['transformer']}: {size / 1e6:.0f} MB (torch {version})")
