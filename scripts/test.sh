#!/usr/bin/env bash
# Runs every test: configures build-ci/ with warnings as errors (and the CUDA backend when nvcc
# is found, so its sources are compiled even on a machine without a GPU; GPU tests skip there),
# builds, runs ctest, installs to a temporary prefix and builds + runs tests/consumer against it
# with find_package(fp8mla), then, with CUDA, the binary wheel (scripts/check_wheel.sh: built
# with every arch's kernels, installed into a fresh venv without the toolkit, its CPU path
# tested), then the Python tests when tests/python/run.sh exists: on that wheel when it was
# built, else on a CPU-only build of the package. With ccache on PATH the compiles go through it
# (scripts/ccache_env.sh), so the wheel reuses the objects this build compiled.
# Packages: run scripts/setup.sh --deps-only first (.ci/run does).
#
# Environment: BUILD_DIR (build-ci), FP8MLA_CUDA (AUTO), JOBS (all cores), FP8MLA_WHEEL=0 (no
# wheel; the Python tests build the CPU-only package).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)

if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi
source scripts/ccache_env.sh
build_dir=${BUILD_DIR:-build-ci}
jobs=${JOBS:-$(nproc)}
start=$SECONDS
timings=()
phase_start=$SECONDS
phase() {  # phase NAME: closes the previous phase's timer and announces the next
  echo
  echo "==== $1"
  phase_start=$SECONDS
}
done_phase() { timings+=("$(printf '%-28s %5d s' "$1" $((SECONDS - phase_start)))"); }

phase "configure $build_dir (FP8MLA_WERROR=ON, FP8MLA_CUDA=${FP8MLA_CUDA:-AUTO})"
generator=()
[ -f "$build_dir/CMakeCache.txt" ] || generator=(-G Ninja)
cmake -S . -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DFP8MLA_WERROR=ON \
  -DFP8MLA_CUDA="${FP8MLA_CUDA:-AUTO}"
done_phase configure

phase "build ($jobs jobs)"
cmake --build "$build_dir" -j "$jobs"
done_phase build

phase "ctest"
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs"
done_phase ctest

phase "install + find_package(fp8mla) consumer"
prefix=$(mktemp -d "${TMPDIR:-/tmp}/fp8mla-install.XXXXXX")
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build_dir" --prefix "$prefix" >/dev/null
consumer_build="$build_dir/consumer"
rm -rf "$consumer_build"
cmake -S tests/consumer -B "$consumer_build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$consumer_build"
"$consumer_build/fp8mla_consumer"
done_phase consumer

wheel=""
if [ "${FP8MLA_WHEEL:-1}" != 0 ] && [ "${FP8MLA_CUDA:-AUTO}" != OFF ] &&
   command -v nvcc >/dev/null 2>&1; then
  phase "binary wheel (scripts/check_wheel.sh)"
  # The library's compiler and flags as above (scikit-build-core would take Python's g++ for
  # CMake's c++), so that its objects come from ccache.
  cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:FILEPATH=//p' "$build_dir/CMakeCache.txt")
  CMAKE_ARGS="-DFP8MLA_WERROR=ON ${cxx:+-DCMAKE_CXX_COMPILER=$cxx} ${CMAKE_ARGS:-}" \
    CMAKE_BUILD_PARALLEL_LEVEL=$jobs bash scripts/check_wheel.sh
  cp=$(python3 -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
  wheel=$(ls "$root"/dist/fp8mla-*-"$cp"-*.whl)
  done_phase wheel
fi

if [ -f tests/python/run.sh ]; then
  phase "python tests (tests/python/run.sh${wheel:+ on the wheel})"
  # The command the trace tests run `fp8mla audit` with.
  FP8MLA_CLI="$root/$build_dir/tools/fp8mla/fp8mla" FP8MLA_PY_WHEEL="$wheel" \
    bash tests/python/run.sh
  done_phase python
fi

echo
echo "==== all tests passed in $((SECONDS - start)) s"
printf '  %s\n' "${timings[@]}"
