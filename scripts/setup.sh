#!/usr/bin/env bash
# Installs what building fp8mla needs (Debian/Ubuntu packages: cmake, ninja-build, g++, libgtest-dev;
# libsimdjson-dev, zlib1g-dev for `fp8mla audit`; ccache where nvcc is), then configures and
# builds it in build/.
# Idempotent: installs only what is missing, and a second run only rebuilds what changed.
#
#   bash scripts/setup.sh              # packages + configure + build
#   bash scripts/setup.sh --deps-only  # packages only (what .ci/run uses before scripts/test.sh)
#
# Environment: BUILD_DIR (build), FP8MLA_CUDA (AUTO: the CUDA backend when nvcc is found),
# JOBS (all cores). Python packages are scripts of their own (see docs/python.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

deps_only=0
for arg in "$@"; do
  case "$arg" in
    --deps-only) deps_only=1 ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "setup.sh: unknown argument '$arg' (expected --deps-only)" >&2; exit 2 ;;
  esac
done

log() { echo "[setup] $*"; }

# ---- packages ----
missing=()
has_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v ninja >/dev/null 2>&1 || missing+=(ninja-build)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
if command -v dpkg-query >/dev/null 2>&1; then
  for pkg in libgtest-dev libsimdjson-dev zlib1g-dev; do
    has_pkg "$pkg" || missing+=("$pkg")
  done
else
  [ -f /usr/include/gtest/gtest.h ] || missing+=(libgtest-dev)
  [ -f /usr/include/simdjson.h ] || missing+=(libsimdjson-dev)
  [ -f /usr/include/zlib.h ] || missing+=(zlib1g-dev)
fi
# ccache with the CUDA backend: scripts/test.sh builds the library, then the binary wheel from the
# same objects (scripts/check_wheel.sh).
if { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; } &&
   ! command -v ccache >/dev/null 2>&1; then
  missing+=(ccache)
fi

if [ ${#missing[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup.sh: missing ${missing[*]} and no apt-get to install them: install them by hand" >&2
    exit 1
  fi
  sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "setup.sh: need root (or sudo) to install ${missing[*]}" >&2; exit 1; }
    sudo=(sudo)
  fi
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  log "packages present: cmake ninja-build g++ libgtest-dev libsimdjson-dev zlib1g-dev"
fi

# CMake >= 3.25 (Debian 12 ships 3.25.1).
cmake_version=$(cmake --version | head -n1 | awk '{print $3}')
if [ "$(printf '%s\n' 3.25 "$cmake_version" | sort -V | head -n1)" != 3.25 ]; then
  echo "setup.sh: cmake $cmake_version is older than 3.25 (pip install cmake gives a newer one)" >&2
  exit 1
fi

# cuobjdump for the CUDA build's cubin check (scripts/check_cubins.sh): the toolkit's, else
# PyPI's package of it.
if { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; } &&
   ! command -v cuobjdump >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/cuobjdump ] &&
   ! python3 -c 'import nvidia, pathlib, sys; sys.exit(not any(p.is_file() for d in nvidia.__path__ for p in pathlib.Path(d).glob("*/bin/cuobjdump")))' 2>/dev/null; then
  log "installing cuobjdump (pip: nvidia-cuda-cuobjdump)"
  python3 -m pip install -q --disable-pip-version-check nvidia-cuda-cuobjdump
fi

[ "$deps_only" -eq 1 ] && exit 0

# ---- configure + build ----
# nvcc often lives outside PATH; with it visible, FP8MLA_CUDA=AUTO builds the CUDA backend.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
build_dir=${BUILD_DIR:-build}
jobs=${JOBS:-$(nproc)}
generator=()
# The generator is fixed when a build dir is first configured; asking again would fail.
[ -f "$build_dir/CMakeCache.txt" ] || generator=(-G Ninja)
log "configuring $build_dir (FP8MLA_CUDA=${FP8MLA_CUDA:-AUTO})"
cmake -S . -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DFP8MLA_CUDA="${FP8MLA_CUDA:-AUTO}"
log "building with $jobs jobs"
cmake --build "$build_dir" -j "$jobs"
log "built $build_dir/tools/fp8mla/fp8mla"
