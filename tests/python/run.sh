#!/usr/bin/env bash
# The Python suite: builds and installs the fp8mla package, then runs pytest on tests/python.
# Run from anywhere; CI calls it from the repo root. The exit code is pytest's (never 5: an
# empty run counts as a failure).
#
# Default (CI, a fresh machine with network): a venv in build-python/venv gets numpy, pytest,
# nanobind and scikit-build-core from PyPI, then `pip install .` builds the module with
# FP8MLA_CUDA=OFF (the CPU backend; for CI speed: the CUDA backend is tested on the device).
#
# Environment:
#   FP8MLA_PY_WHEEL=PATH      install this wheel (scripts/check_wheel.sh builds one) instead of
#                             building the package: scripts/test.sh tests the wheel it built
#   FP8MLA_PY_CUDA=AUTO|ON|OFF CUDA backend of the module's build (default OFF; a separate
#                             name so CI's FP8MLA_CUDA for the C++ build does not leak in)
#   FP8MLA_PY_TORCH=0         do not install torch (tests/python/requirements-torch.txt) into the
#                             venv: the tests that need it skip
#   FP8MLA_PY_ENGINES=0       do not install sglang (tests/python/requirements-sglang.txt, after
#                             torch) nor download the FlashInfer wheels whose signatures the
#                             tests read: the SGLang plugin and signature tests skip
#   FP8MLA_PY_OFFLINE=1       no venv and no downloads: use $PYTHON (default python3) as it is
#                             (it must already have nanobind, scikit-build-core, numpy, pytest;
#                             torch for the GPU tests), e.g. on a device without network;
#                             fp8mla is installed into that interpreter
#   PYTHON                    interpreter for the venv or the offline run (default python3)
#   CMAKE_BUILD_PARALLEL_LEVEL build jobs (default: all cores)
#   CMAKE_ARGS                extra CMake arguments (appended; they win)
#   PYTEST_ARGS               extra pytest arguments
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"
if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

if [[ "${FP8MLA_PY_OFFLINE:-0}" != "1" ]]; then
  venv="$root/build-python/venv"
  if [[ ! -x "$venv/bin/python" ]]; then
    echo "== creating $venv"
    "$python" -m venv "$venv"
  fi
  python="$venv/bin/python"
  echo "== installing test dependencies"
  "$python" -m pip install --disable-pip-version-check -q \
    numpy pytest matplotlib "nanobind>=2.2" "scikit-build-core>=0.10"
  if [[ "${FP8MLA_PY_TORCH:-1}" != "0" ]]; then
    echo "== installing torch (tests/python/requirements-torch.txt)"
    "$python" -m pip install --disable-pip-version-check -q -r tests/python/requirements-torch.txt
    if [[ "${FP8MLA_PY_ENGINES:-1}" != "0" ]]; then
      # sglang and only what its imports need, exact versions installed without resolving
      # further requirements (the file says why).
      echo "== installing sglang (tests/python/requirements-sglang.txt)"
      "$python" -m pip install --disable-pip-version-check -q --no-deps \
        -r tests/python/requirements-sglang.txt
    fi
  fi
  if [[ "${FP8MLA_PY_ENGINES:-1}" != "0" ]]; then
    # FlashInfer's wheels, read (not installed) by test_flashinfer_signatures.py.
    wheels="$root/build-python/flashinfer-wheels"
    for v in 0.6.18.post1 0.7.4; do
      if ! compgen -G "$wheels/flashinfer_python-$v-*.whl" >/dev/null; then
        echo "== downloading flashinfer-python $v (read by test_flashinfer_signatures.py)"
        "$python" -m pip download --disable-pip-version-check -q --no-deps \
          -d "$wheels" "flashinfer-python==$v"
      fi
    done
    export FP8MLA_FLASHINFER_WHEELS="$wheels"
  fi
else
  # Installing into an interpreter as it is (maybe a distribution's, marked externally managed).
  export PIP_BREAK_SYSTEM_PACKAGES=1
fi

if [[ -n "${FP8MLA_PY_WHEEL:-}" ]]; then
  echo "== installing $FP8MLA_PY_WHEEL"
  "$python" -m pip install --disable-pip-version-check --no-deps --force-reinstall -q \
    "$FP8MLA_PY_WHEEL"
else
  echo "== building and installing fp8mla (FP8MLA_CUDA=${FP8MLA_PY_CUDA:-OFF})"
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
  CMAKE_ARGS="-DFP8MLA_CUDA=${FP8MLA_PY_CUDA:-OFF} ${CMAKE_ARGS:-}" \
    "$python" -m pip install --disable-pip-version-check --no-build-isolation --no-deps -q .
fi

echo "== python -c 'import fp8mla'"
(cd /tmp && "$python" -c "import fp8mla; print('fp8mla', fp8mla.version(), \
'cuda_available', fp8mla.cuda_available())")

echo "== pytest tests/python"
set +e
# shellcheck disable=SC2086
"$python" -m pytest -q -p no:cacheprovider -rs tests/python ${PYTEST_ARGS:-}
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "tests/python: pytest collected no tests" >&2
  exit 1
fi
exit $rc
