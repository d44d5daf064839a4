#!/usr/bin/env bash
# A local stand-in for python:3.11-slim-bookworm where no container registry can be reached:
# Debian bookworm (minbase) with python3 (3.11), its venv module and CA certificates, made with
# mmdebstrap from a Debian mirror (about 40 s) and imported into podman. Like the slim image it
# has no docs, man pages, locales or perl (usrmerge pulls perl in: usr-is-merged stands in
# for it and it is purged).
#   docker/podman/debian-base.sh [TAG]        default: localhost/moe-proxy-python:3.11-bookworm
# DEBIAN_MIRROR overrides the mirror (default http://deb.debian.org/debian); PODMAN the podman.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
TAG=${1:-localhost/moe-proxy-python:3.11-bookworm}
PODMAN=${PODMAN:-$here/podman}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if $PODMAN image exists "$TAG"; then
    echo "base image: $TAG (already there)"
    exit 0
fi
command -v mmdebstrap > /dev/null || { echo "debian-base.sh: mmdebstrap is not installed (apt-get install mmdebstrap)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
# stdin from /dev/null: mmdebstrap reads sources.list lines from a non-terminal stdin.
mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates,usr-is-merged \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --customize-hook='chroot "$1" dpkg --purge usrmerge libfile-find-rule-perl libnumber-compare-perl libtext-glob-perl perl libperl5.36 perl-modules-5.36' \
    bookworm "$tmp/rootfs.tar" "$MIRROR" < /dev/null
$PODMAN import --quiet \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    "$tmp/rootfs.tar" "$TAG" > /dev/null
echo "base image: $TAG (mmdebstrap bookworm from $MIRROR, $((SECONDS - start)) s)"
