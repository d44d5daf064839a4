"""The container images, built and run (docs/images.md).

The session builds them with `make images` when they are missing or stale (each is labelled
with the hash of its build inputs: Dockerfiles, sources, pyproject.toml, README.md, docker/),
so the tests run what the Dockerfiles make now; they are skipped, with the reason, where podman
is not installed. MOEPROXY_IMAGES=prebuilt uses the images already in podman's storage as they
are (a quicker loop while editing tests).

Everything runs on 127.0.0.1 with `--network host`: SeaweedFS as the S3 server, kmock's
emulated Kubernetes API server, and the containers."""

from __future__ import annotations

import asyncio
import base64
import importlib
import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PODMAN = os.environ.get("PODMAN") or str(ROOT / "docker" / "podman" / "podman")
ACCESS_KEY = "moe-proxy-images-key"
SECRET_KEY = "images-secret-" + uuid.uuid4().hex[:16]
SIZES: dict[str, int] = {}  # image -> bytes, for the terminal summary
BUILD: dict[str, str] = {}


def _module(*names: str):
    """The first of `names` that imports (the library's helpers are moving into subpackages)."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(names[0])


def podman(*args: str, timeout: float = 300, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([*PODMAN.split(), *args], capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:3])} ... exited {result.returncode}:\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def chart_defaults() -> dict[str, str]:
    """The images the chart installs by default: the operator's (image.repository at the
    chart's appVersion) and the transformer Job's (MOEPROXY_TRANSFORMER_IMAGE's default)."""
    helm = pytest.importorskip("helm_python")
    from tests.chart.conftest import render_objects  # noqa: PLC0415 - needs helm_python

    with helm.Chart.load(str(ROOT / "charts" / "moe-proxy")) as chart:
        objects = render_objects(chart)
    container = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    return {"operator": container["image"], "transformer": env["MOEPROXY_TRANSFORMER_IMAGE"]}


@pytest.fixture(scope="session")
def images() -> dict[str, str]:
    """{"operator": tag, "transformer": tag}: built by `make images` from the working tree."""
    if shutil.which("podman" if PODMAN.endswith("docker/podman/podman") else PODMAN.split()[0]) is None:
        pytest.skip("podman is not installed (apt-get install podman runc mmdebstrap; .ci/run does): "
                    "the images are not built or run here")
    tags = chart_defaults()
    if os.environ.get("MOEPROXY_IMAGES") == "prebuilt":
        missing = [t for t in tags.values() if podman("image", "exists", t, check=False).returncode != 0]
        if missing:
            pytest.skip(f"MOEPROXY_IMAGES=prebuilt but {', '.join(missing)} not in podman's storage (make images)")
    elif any(_stale(t) for t in tags.values()):
        start = time.monotonic()
        result = subprocess.run(["make", "-C", str(ROOT), "images"], capture_output=True, text=True, timeout=3600)
        BUILD["output"] = result.stdout.strip()
        BUILD["seconds"] = f"{time.monotonic() - start:.0f}"
        assert result.returncode == 0, f"make images failed:\n{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    for name, tag in tags.items():
        assert podman("image", "exists", tag, check=False).returncode == 0, f"make images did not tag {tag}"
        SIZES[tag] = int(podman("image", "inspect", "--format", "{{.Size}}", tag).stdout.strip())
    return tags


def _stale(tag: str) -> str:
    """Why `tag` must be (re)built; "" when it is there and built from the inputs of now."""
    found = podman("image", "inspect", "--format", "{{index .Labels \"io.moeproxy.build-inputs\"}}", tag, check=False)
    if found.returncode != 0:
        return "missing"
    now = subprocess.run([str(ROOT / "docker" / "images.sh"), "--inputs"], capture_output=True, text=True,
                         check=True, timeout=60).stdout.strip()
    return "" if found.stdout.strip() == now else f"built from {found.stdout.strip()}, inputs now {now}"


def pytest_terminal_summary(terminalreporter):
    if SIZES:
        terminalreporter.section("container images")
        if BUILD:
            terminalreporter.write_line(f"make images: {BUILD['seconds']} s")
        for tag, size in SIZES.items():
            terminalreporter.write_line(f"{tag}: {size / 1e6:.0f} MB")


@pytest.fixture(scope="session")
def operator_run(images, seaweed, s3_source, tmp_path_factory):
    """The operator image run once for the session's checks (a minute: start, preflight, Job)."""
    pytest.importorskip("kmock")
    from .operator_run import run_operator

    return asyncio.run(run_operator(images, seaweed, s3_source, tmp_path_factory.mktemp("operator")))


# --- S3 on loopback, with a tiny checkpoint ---------------------------------------------

@pytest.fixture(scope="session")
def seaweed(tmp_path_factory, images):
    SeaweedFS = _module("moe_proxy.demo.seaweed", "moe_proxy.seaweed").SeaweedFS
    with SeaweedFS(tmp_path_factory.mktemp("seaweedfs"), ACCESS_KEY, SECRET_KEY, buckets=["ckpt", "proxy"]) as s3:
        yield s3


@pytest.fixture(scope="session")
def s3_source(seaweed, tmp_path_factory) -> str:
    """A tiny random Qwen3-MoE (8 experts, top-2) at s3://ckpt/qwen3, uploaded with boto3."""
    make_tiny = _module("moe_proxy.demo.tiny", "moe_proxy.tiny").make_tiny
    path = tmp_path_factory.mktemp("ckpt") / "qwen3"
    make_tiny("qwen3_moe", path)
    client = seaweed.client()
    for f in sorted(path.iterdir()):
        client.upload_file(str(f), "ckpt", f"qwen3/{f.name}")
    return "s3://ckpt/qwen3"


def aws_env(seaweed) -> dict[str, str]:
    """Exactly the credentials of the test server, nothing from ~/.aws or instance metadata."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION="us-east-1",
               AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
               AWS_ENDPOINT_URL=seaweed.endpoint_url)
    return env


def secret(name: str, namespace: str) -> dict:
    data = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace},
            "type": "Opaque", "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


# --- Running a container the way the kubelet runs a pod's container ----------------------

def container_args(container: dict, pod_security: dict, secrets: dict[str, dict], *, read_only: bool,
                   writable: list[str], extra_env: dict[str, str] | None = None, binds: list[str] = ()) -> list[str]:
    """`podman run` options and image + command for a pod's container: its user (the pod's or
    container's runAsUser/runAsGroup, else the image's), env (values and secretKeyRefs resolved
    from `secrets`), a read-only root with only `writable` paths as tmpfs (the emptyDirs), all
    capabilities dropped and no privilege escalation, command and args as Kubernetes maps them
    to ENTRYPOINT and CMD."""
    security = {**pod_security, **container.get("securityContext", {})}
    opts = ["--network", "host", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]
    if "runAsUser" in security:
        opts += ["--user", f"{security['runAsUser']}:{security.get('runAsGroup', security['runAsUser'])}"]
    if read_only:
        # podman's --read-only adds tmpfs on /tmp, /var/tmp and /run by default; Kubernetes does not.
        opts += ["--read-only", "--read-only-tmpfs=false"]
    for path in writable:
        opts += ["--tmpfs", f"{path}:rw,mode=1777,size=256m"]
    for bind in binds:
        opts += ["--volume", bind]
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
            continue
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        assert ref, f"env {e['name']}: only values and secretKeyRefs are resolved here: {e}"
        data = secrets.get(ref["name"], {}).get("data", {})
        if ref["key"] in data:
            env[e["name"]] = base64.b64decode(data[ref["key"]]).decode()
        else:
            assert ref.get("optional"), f"env {e['name']}: Secret {ref['name']} has no key {ref['key']}"
    env.update(extra_env or {})
    for name, value in env.items():
        opts += ["--env", f"{name}={value}"]
    args = [_expand(a, env) for a in container.get("args", [])]
    if container.get("command"):
        opts += ["--entrypoint", json.dumps(container["command"])]
    return [*opts, container["image"], *args]


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args (only variables the container declares)."""
    for name, value in env.items():
        arg = arg.replace(f"$({name})", value)
    return arg


def crd_resources() -> list[tuple[str, str, str, str, bool]]:
    """(group, version, plural, kind, has status) of every CRD in crds/."""
    out = []
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if crd and crd.get("kind") == "CustomResourceDefinition":
                spec = crd["spec"]
                for version in spec["versions"]:
                    if version.get("served"):
                        out.append((spec["group"], version["name"], spec["names"]["plural"], spec["names"]["kind"],
                                    "status" in version.get("subresources", {})))
    return out
