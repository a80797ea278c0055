#!/usr/bin/env bash
# Builds .device_carry/fp8mla_py/: the fp8mla Python package (python/fp8mla + its nanobind
# module) with the CUDA backend (nvcc, -gencode for sm_90a), installed as a plain tree for the
# device's Python 3.12, so a device call imports it from PYTHONPATH instead of compiling it there.
# It is the same build tests/python/run.sh makes with FP8MLA_PY_CUDA=ON (pip install . with
# CMAKE_ARGS=-DFP8MLA_CUDA=ON, no build isolation), installed with --target instead of into an
# interpreter. Rebuild it whenever the library's sources change: it is a snapshot of the tree it
# was built from (CARRY.txt beside it names the commit and whether the tree was dirty).
#
# Usage: scripts/device/carry_fp8mla_py.sh     (from anywhere; builds the repo it lives in)
# Environment:
#   PYTHON312   a Python 3.12 interpreter (default: python3.12 on PATH, else pyenv's 3.12.x); a
#               venv with nanobind and scikit-build-core is made in build-python/venv-carry312
#   FP8MLA_OUT  output folder (default <repo>/.device_carry/fp8mla_py; replaced)
#   CMAKE_BUILD_PARALLEL_LEVEL  build jobs (default: all cores)
#   CUDA_HOME   toolkit (default /usr/local/cuda)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
out=${FP8MLA_OUT:-$root/.device_carry/fp8mla_py}
cuda=${CUDA_HOME:-/usr/local/cuda}
export PATH="$cuda/bin:$PATH"

py=${PYTHON312:-}
if [[ -z "$py" ]]; then
  if command -v python3.12 >/dev/null 2>&1 && python3.12 --version >/dev/null 2>&1; then
    py=python3.12
  else
    py=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python3.12 2>/dev/null | tail -1)
  fi
fi
[[ -n "$py" ]] || { echo "carry_fp8mla_py: no Python 3.12 found (set PYTHON312)" >&2; exit 1; }
"$py" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' ||
  { echo "carry_fp8mla_py: $py is not Python 3.12 (the device's)" >&2; exit 1; }

venv="$root/build-python/venv-carry312"
if [[ ! -x "$venv/bin/python" ]]; then
  echo "== creating $venv"
  "$py" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --disable-pip-version-check -q "nanobind>=2.2" \
  "scikit-build-core>=0.10"

echo "== building fp8mla (FP8MLA_CUDA=ON) into $out"
rm -rf "$out"
start=$SECONDS
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
CMAKE_ARGS="-DFP8MLA_CUDA=ON ${CMAKE_ARGS:-}" "$venv/bin/python" -m pip install \
  --disable-pip-version-check --no-build-isolation --no-deps -q --target "$out" .
rm -rf "${out:?}/bin"
{
  echo "fp8mla $(git -C "$root" rev-parse --short HEAD)$(git -C "$root" diff --quiet HEAD -- src include python CMakeLists.txt || echo ' + uncommitted changes'), CUDA backend, sm_90a"
  echo "built by scripts/device/carry_fp8mla_py.sh on $(date -u +%Y-%m-%dT%H:%MZ) in $((SECONDS - start)) s with $("$py" --version)"
} > "$out/CARRY.txt"
(cd /tmp && PYTHONPATH="$out" "$venv/bin/python" -c \
  "import fp8mla; print('   import fp8mla', fp8mla.version(), 'cuda_available', fp8mla.cuda_available())")
echo "== $out: $(du -sh "$out" | cut -f1)"
