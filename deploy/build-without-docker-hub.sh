#!/usr/bin/env bash
# Build deploy/Dockerfile where Docker Hub and PyTorch's index are out of reach but Debian's mirror
# and PyPI answer: the base image is made from Debian's packages (debootstrap) and torch comes from
# a local wheel served on 127.0.0.1. Needs root, debootstrap, buildah and podman (Debian: apt-get
# install debootstrap buildah podman).
#
#   bash deploy/build-without-docker-hub.sh /path/to/torch-2.13.0+cpu-cp311-...whl [TAG]
#
# Then run it (buildah's chroot isolation needs no daemon and no user namespaces):
#   ctr=$(buildah --storage-driver vfs from localhost/backfill:cpu)
#   buildah --storage-driver vfs run --isolation chroot --network host --user backfill \
#       -v "$PWD/cache:/var/cache/backfill" "$ctr" -- tini -- backfill serve --host 127.0.0.1 --port 8000
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=$(realpath "${1:?usage: build-without-docker-hub.sh TORCH_CPU_WHEEL [TAG]}")
tag=${2:-localhost/backfill:cpu}
base=localhost/debian-bookworm-python3:12
work=$(mktemp -d)
trap 'kill "${index_pid:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT

# The base: Debian 12's python3.11 with venv, g++ and tini; the host's CA bundle, so that pip and
# apt inside the build trust what the host trusts (a proxy's certificate included).
debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,g++,tini,ca-certificates \
    bookworm "$work/rootfs" http://deb.debian.org/debian
rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb
cp /etc/ssl/certs/ca-certificates.crt "$work/rootfs/etc/ssl/certs/ca-certificates.crt"
tar -C "$work/rootfs" -c . | podman --storage-driver vfs import \
    --change "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt" \
    --change "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" - "$base"

# A one-package index for torch on 127.0.0.1 (its dependencies come from PyPI).
mkdir -p "$work/index/simple/torch"
ln -s "$wheel" "$work/index/simple/torch/"
name=$(basename "$wheel")
printf '<!DOCTYPE html><html><body><a href="%s">%s</a></body></html>\n' "$name" "$name" \
    > "$work/index/simple/torch/index.html"
port=$(python3 -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
python3 -m http.server "$port" --bind 127.0.0.1 --directory "$work/index" >/dev/null 2>&1 &
index_pid=$!
sleep 1

buildah --storage-driver vfs bud --isolation chroot --network host --format docker -f deploy/Dockerfile \
    --build-arg BASE_IMAGE="$base" --build-arg TORCH_INDEX_URL="http://127.0.0.1:$port/simple" -t "$tag" .
buildah --storage-driver vfs images "$tag"
