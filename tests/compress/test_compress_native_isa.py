"""Every instruction-set version of the C kernels gives the torch path's bits.

The installed `compress._native` picks its AVX-512, AVX2 or baseline version when it loads, so one
machine runs only one of them. Here each is built on its own (`-DNATIVE_ONE_TARGET -march=...`)
and checked against the torch path; a version this CPU cannot run is skipped.
"""
import importlib.machinery
import importlib.util
import pathlib
import platform
import shlex
import shutil
import subprocess
import sysconfig

import pytest
import torch

import compress
from compress.codecs import blockwise

SOURCE = pathlib.Path(compress.__file__).parent / "_native.c"
#: -march and the CPU features (/proc/cpuinfo flags) it needs
TARGETS = {"x86-64": (), "x86-64-v3": ("avx2", "fma", "bmi2"),
           "x86-64-v4": ("avx512f", "avx512bw", "avx512dq", "avx512vl")}
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]  # as setup.py


def _cpu_flags() -> set[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":")[1].split()}


def _cc() -> list[str]:
    """The compiler command Python was built with (setup.py builds the kernels with it too)."""
    return shlex.split(sysconfig.get_config_var("CC") or "cc")


def _build(march: str, tmp: pathlib.Path):
    out = tmp / f"_native_{march}.so"
    subprocess.run([*_cc(), "-shared", "-fPIC", *FLAGS, "-DNATIVE_ONE_TARGET", f"-march={march}",
                    f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o", str(out)],
                   check=True, capture_output=True)
    loader = importlib.machinery.ExtensionFileLoader("compress._native", str(out))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("compress._native", loader))
    loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=list(TARGETS))
def one_target(request, tmp_path_factory):
    march = request.param
    if platform.machine() != "x86_64":
        pytest.skip(f"the versions are x86-64 ones; this machine is {platform.machine()}")
    if blockwise._native is None:
        pytest.skip("compress._native not built (pip install -e .), so no compiler was checked")
    missing = [f for f in TARGETS[march] if f not in _cpu_flags()]
    if missing:
        pytest.skip(f"this CPU lacks {missing}, which -march={march} needs")
    if not shutil.which(_cc()[0]):
        pytest.skip("no C compiler on PATH")
    return _build(march, tmp_path_factory.mktemp(march))


@pytest.mark.parametrize("name", ["int8", "int4", "fp4-e2m1", "fp4-e3m0", "lloyd4"])
def test_each_instruction_set_version_gives_the_torch_paths_bits(one_target, name, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    cases = [torch.randn(20011, generator=gen) * torch.rand(20011, generator=gen) ** 4,
             torch.randn(4096, generator=gen).mul(1e-30),  # tiny blocks: the scale floor
             torch.randint(-7, 8, (999,), generator=gen).float()]  # exact levels: ties
    codecs = [compress.get_codec(name)]
    if name != "int8":
        codecs.append(compress.get_codec(name, search=False))
        wide = compress.get_codec(name)
        wide.window = (2, 1)  # neither default window: the kernel's general path
        codecs.append(wide)
    monkeypatch.setattr(blockwise, "USE_NATIVE", True)
    for codec in codecs:
        for x in cases:
            monkeypatch.setattr(blockwise, "_native", None)
            frame, decoded = codec.encode_with_decoded(x)
            monkeypatch.setattr(blockwise, "_native", one_target)
            assert blockwise._native_for(x)
            got_frame, got_decoded = codec.encode_with_decoded(x)
            assert bytes(got_frame) == bytes(frame), (codec, x.numel())
            assert torch.equal(got_decoded.view(torch.int32), decoded.view(torch.int32))
            out = torch.empty_like(x)
            codec.decode(got_frame, out=out)
            assert torch.equal(out.view(torch.int32), decoded.view(torch.int32))
