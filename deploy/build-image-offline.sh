#!/usr/bin/env bash
# Build the CPU image without any image registry, then run `diloco run --steps 20` inside it.
#
#   sudo deploy/build-image-offline.sh            # TAG=localhost/diloco:cpu by default
#
# Needs root, Debian's podman, buildah and mmdebstrap, a Debian mirror and a Python package index
# (pip download runs on the host, so the host's pip settings and CA certificates apply). Steps:
# a bookworm root file system with python3 (mmdebstrap) becomes the base image (podman import);
# pip downloads torch and every dependency for the host's Python into a wheel folder; podman builds
# the Dockerfile with that base and only those wheels (PIP_NO_INDEX=1); buildah runs the image.
# The base image is kept (BASE_IMAGE) and reused by the next run.
# --isolation chroot and buildah run: in a sandbox without CAP_SYS_RESOURCE, crun cannot set the
# containers' rlimits, so `podman run` fails there (deploy/README.md).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${WORK:-$(mktemp -d)}
tag=${TAG:-localhost/diloco:cpu}
base=${BASE_IMAGE:-localhost/diloco-base:bookworm}
torch=${TORCH_VERSION:-2.13.0}

if ! podman image exists "$base"; then
    mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$work/rootfs.tar"
    podman import "$work/rootfs.tar" "$base"
fi
pip download --quiet --dest "$work/wheels" "torch==$torch" "setuptools>=64" wheel "$repo"
podman build --isolation chroot --build-arg PYTHON_IMAGE="$base" --build-arg PIP_NO_INDEX=1 \
    --build-arg TORCH_VERSION="$torch" --build-context wheels="$work/wheels" --target cpu -t "$tag" "$repo"
ctr=$(buildah from "$tag")
trap 'buildah rm "$ctr" > /dev/null' EXIT
buildah run --isolation chroot --uts host --network host "$ctr" id
buildah run --isolation chroot --uts host --network host "$ctr" diloco run --steps 20 --no-progress
