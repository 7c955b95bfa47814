# syntax=docker/dockerfile:1
# The diloco image: the project in a virtual environment, run as a non-root user.
#
#   docker build -t diloco:cpu .                  # target cpu (the default): CPU-only torch
#   docker build --target cuda -t diloco:cuda .   # CUDA torch from PyPI; needs the NVIDIA runtime
#   docker run --rm diloco:cpu run --steps 20     # the embedded default, 20 steps
#
# Build arguments: PYTHON_IMAGE (a Debian-based image with python3 >= 3.10 and python3-venv),
# TORCH_VERSION, TORCH_CPU_INDEX, PIP_NO_INDEX. Wheels (e.g. an offline torch) can be given as the
# build context "wheels" (--build-context wheels=DIR); pip looks there first, and only there with
# --build-arg PIP_NO_INDEX=1.
# deploy/README.md says how this image was built offline and what the tests check.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM scratch AS wheels

FROM ${PYTHON_IMAGE} AS build
SHELL ["/bin/sh", "-eu", "-c"]
# gcc and Python's headers build the C kernels of compress/ (int8/int4/fp4 coding, the round
# hash): without them pip skips the extension and the codecs run the pure-torch path, tens of times slower
# for int4, so every target checks below that they were built. A python:* image has the headers;
# Debian's python3 (the offline build's base) needs python3-dev. Versions are whatever the base
# image's Debian release ships, so they are not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && if [ ! -e "$(python3 -c 'import sysconfig; print(sysconfig.get_path("include"))')/Python.h" ]; then \
        apt-get install -y --no-install-recommends python3-dev; fi \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
# PIP_NO_INDEX=1: install only from the "wheels" build context (an offline build)
ARG PIP_NO_INDEX=0
ENV PATH=/opt/venv/bin:$PATH \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_INDEX=${PIP_NO_INDEX}
WORKDIR /src

FROM build AS torch-cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
RUN --mount=type=bind,from=wheels,target=/wheels \
    pip install --find-links /wheels --extra-index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}"

FROM build AS torch-cuda
ARG TORCH_VERSION=2.13.0
RUN --mount=type=bind,from=wheels,target=/wheels \
    pip install --find-links /wheels "torch==${TORCH_VERSION}"

FROM torch-cpu AS project-cpu
COPY pyproject.toml setup.py README.md ./
COPY compress ./compress
COPY transport ./transport
COPY diloco ./diloco
RUN --mount=type=bind,from=wheels,target=/wheels \
    pip install --find-links /wheels . \
 && diloco --help > /dev/null \
 && COMPRESS_NATIVE=1 python -I -c "from compress.codecs import blockwise as b; import sys; \
sys.exit(0 if b.native_available() else 'compress: the C kernels were not built (no compiler or Python headers?)')"

FROM torch-cuda AS project-cuda
COPY pyproject.toml setup.py README.md ./
COPY compress ./compress
COPY transport ./transport
COPY diloco ./diloco
RUN --mount=type=bind,from=wheels,target=/wheels \
    pip install --find-links /wheels . \
 && diloco --help > /dev/null \
 && COMPRESS_NATIVE=1 python -I -c "from compress.codecs import blockwise as b; import sys; \
sys.exit(0 if b.native_available() else 'compress: the C kernels were not built (no compiler or Python headers?)')"

FROM ${PYTHON_IMAGE} AS runtime
SHELL ["/bin/sh", "-eu", "-c"]
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/diloco --shell /usr/sbin/nologin diloco
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/diloco
# 29400 coordinator gRPC, 9400 coordinator metrics/status, 9300+ worker metrics, 29401 torchrun store
EXPOSE 29400 9400 9300 29401
ENTRYPOINT ["diloco"]
CMD ["--help"]

# No NVIDIA_VISIBLE_DEVICES here: the GPUs a container sees are the ones it was given (Kubernetes'
# device plugin sets it per pod from nvidia.com/gpu; docker run --gpus does the same), never all of
# the host's.
FROM runtime AS cuda
COPY --from=project-cuda /opt/venv /opt/venv
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001

FROM runtime AS cpu
COPY --from=project-cpu /opt/venv /opt/venv
USER 10001:10001
