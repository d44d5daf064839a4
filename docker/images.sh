#!/usr/bin/env bash
# `make images`: build the operator and transformer images with podman, tag them as the chart's
# defaults, and save each as an OCI archive under dist/images/ (docs/images.md).
#
# Settings (environment or make variables):
#   PYTHON_IMAGE     base of both images. Default `auto`: python:3.11-slim-bookworm from Docker
#                    Hub, or, when no registry can be reached, a local Debian bookworm base made
#                    with mmdebstrap (docker/podman/debian-base.sh).
#   TORCH_INDEX_URL  where torch comes from (default: the CPU index download.pytorch.org/whl/cpu).
#   TORCH_WHEELS     a folder holding the CPU torch wheel, mounted into the build and preferred
#                    to the index. Default `auto`: a folder on pip's find-links (pip config) that
#                    holds torch-$TORCH_VERSION+cpu; none: the index only.
#   PODMAN           the podman command (default docker/podman/podman: runc, cgroupfs, vfs and
#                    docker/podman/containers.conf, which these build machines need).
#   PIP_CERT         a CA bundle for pip in the builds (default: pip's `cert` setting here).
#   IMAGES_DIR       where the OCI archives go (default dist/images).
#   IMAGE_LAYERS     true: keep a cached layer per Dockerfile instruction (quicker rebuilds
#                    after small changes). Default false: with podman's vfs driver every layer is
#                    a full copy of the image so far (a 1.7 GB transformer image took 30 GB).
#
#   docker/images.sh --inputs   prints the hash of the build inputs that the images are labelled
#                               with (tests/images rebuilds when it differs).
set -euo pipefail
cd "$(dirname "$0")/.."
INPUTS_LABEL=io.moeproxy.build-inputs

# Everything the Dockerfiles COPY or are: a change to any of it makes the images stale.
inputs_hash() {
    find .dockerignore pyproject.toml README.md docker operator/Dockerfile operator/proxymodel_operator src/moe_proxy \
         -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 \
        | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
}
if [ "${1:-}" = --inputs ]; then
    inputs_hash
    exit 0
fi
PODMAN=${PODMAN:-docker/podman/podman}
PYTHON_IMAGE=${PYTHON_IMAGE:-auto}
TORCH_WHEELS=${TORCH_WHEELS:-auto}
IMAGES_DIR=${IMAGES_DIR:-dist/images}
REGISTRY_BASE=docker.io/library/python:3.11-slim-bookworm
LOCAL_BASE=localhost/moe-proxy-python:3.11-bookworm
TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' docker/moe-proxy/Dockerfile)

# The chart's defaults: image.repository (values.yaml) and ghcr.io/moe-proxy/moe-proxy
# (jobs.transformerImage's default, templates/deployment.yaml), both at the chart's appVersion.
VERSION=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' charts/moe-proxy/Chart.yaml)
OPERATOR_REPO=$(sed -n '/^image:/,/^[^ ]/s/^  repository: *//p' charts/moe-proxy/values.yaml)
TRANSFORMER_REPO=$(sed -n '/MOEPROXY_TRANSFORMER_IMAGE/{n;s/.*printf "\([^"%]*\):%s".*/\1/p}' \
                   charts/moe-proxy/templates/deployment.yaml)
OPERATOR_IMAGE=${OPERATOR_IMAGE:-$OPERATOR_REPO:$VERSION}
TRANSFORMER_IMAGE=${TRANSFORMER_IMAGE:-$TRANSFORMER_REPO:$VERSION}
[ -n "$VERSION" ] && [ -n "$OPERATOR_REPO" ] && [ -n "$TRANSFORMER_REPO" ] \
    || { echo "images.sh: cannot read the chart's default images" >&2; exit 1; }

engine=${PODMAN%% *}
[ "$engine" = docker/podman/podman ] && engine=podman
command -v "$engine" > /dev/null || { echo "images.sh: $engine not found (apt-get install podman runc mmdebstrap)" >&2; exit 1; }
total=$SECONDS

if [ "$PYTHON_IMAGE" = auto ]; then
    if $PODMAN image exists "$REGISTRY_BASE" || $PODMAN pull --quiet "$REGISTRY_BASE" > /dev/null 2>&1; then
        PYTHON_IMAGE=$REGISTRY_BASE
    else
        echo "images: $REGISTRY_BASE cannot be pulled here; using a local Debian bookworm base"
        PODMAN=$PODMAN docker/podman/debian-base.sh "$LOCAL_BASE"
        PYTHON_IMAGE=$LOCAL_BASE
    fi
fi

pip=pip
[ -x .venv/bin/pip ] && pip=.venv/bin/pip
pip_config=$($pip config list 2>/dev/null || true)
pip_setting() { sed -n "s/^[^=]*\.$1='\(.*\)'$/\1/p" <<< "$pip_config"; }

torch_args=()
if [ "$TORCH_WHEELS" = auto ]; then
    TORCH_WHEELS=
    for dir in $(pip_setting find-links) ${PIP_FIND_LINKS:-}; do
        if compgen -G "$dir/torch-$TORCH_VERSION+cpu-*.whl" > /dev/null; then TORCH_WHEELS=$dir; break; fi
    done
fi
if [ -n "$TORCH_WHEELS" ]; then
    # torch from the local wheel; its own dependencies (sympy, networkx...) from PyPI.
    torch_args=(--volume "$(cd "$TORCH_WHEELS" && pwd):/wheels:ro" --build-arg TORCH_FIND_LINKS=/wheels
                --build-arg "TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://pypi.org/simple}")
    echo "images: torch $TORCH_VERSION from $TORCH_WHEELS"
elif [ -n "${TORCH_INDEX_URL:-}" ]; then
    torch_args=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
fi

# pip's CA bundle (its `cert` setting, PIP_CERT): where a TLS-intercepting proxy stands between
# this machine and the package index, pip in the build needs it as much as pip here does.
PIP_CERT=${PIP_CERT:-$(pip_setting cert | head -n 1)}
cert_args=()
if [ -n "$PIP_CERT" ]; then
    cert_args=(--volume "$(readlink -f "$PIP_CERT"):/etc/ssl/build-ca.crt:ro" --build-arg PIP_CERT=/etc/ssl/build-ca.crt)
    echo "images: pip in the builds trusts $PIP_CERT"
fi

build() {  # build NAME DOCKERFILE TAG [ARGS...]
    local name=$1 dockerfile=$2 tag=$3 start=$SECONDS
    shift 3
    echo "images: building $tag ($dockerfile, base $PYTHON_IMAGE)"
    # --network host: pip in the build reaches the same package index as this machine.
    $PODMAN build --quiet --network host --layers="${IMAGE_LAYERS:-false}" --file "$dockerfile" \
        --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE" --label "$INPUTS_LABEL=$inputs" \
        --tag "$tag" "${cert_args[@]}" "$@" . > /dev/null
    times+=("$name build $((SECONDS - start)) s")
}
times=()
inputs=$(inputs_hash)
build operator operator/Dockerfile "$OPERATOR_IMAGE"
build transformer docker/moe-proxy/Dockerfile "$TRANSFORMER_IMAGE" "${torch_args[@]}"

# The images these replaced (now untagged) go: each is another full copy under vfs.
$PODMAN image prune --force --filter "label=$INPUTS_LABEL" > /dev/null

mkdir -p "$IMAGES_DIR"
for pair in "operator=$OPERATOR_IMAGE" "moe-proxy=$TRANSFORMER_IMAGE"; do
    name=${pair%%=*} tag=${pair#*=} start=$SECONDS
    archive="$IMAGES_DIR/$name-$VERSION.oci.tar"
    rm -f "$archive"
    $PODMAN save --quiet --format oci-archive --output "$archive" "$tag"
    times+=("$name save $((SECONDS - start)) s")
done

summary=$(printf '%s; ' "${times[@]}")
echo "images: built in $((SECONDS - total)) s (${summary%; })"
for pair in "operator=$OPERATOR_IMAGE" "moe-proxy=$TRANSFORMER_IMAGE"; do
    name=${pair%%=*} tag=${pair#*=}
    size=$($PODMAN image inspect --format '{{.Size}}' "$tag")
    archive="$IMAGES_DIR/$name-$VERSION.oci.tar"
    printf 'images: %-40s %5d MB   %s (%d MB)\n' "$tag" $((size / 1000000)) "$archive" $(($(stat -c %s "$archive") / 1000000))
done
