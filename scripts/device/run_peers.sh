#!/usr/bin/env bash
# The device command of the MLA peer benchmark (bench/peers/mla_peers.py): fp8mla (576-byte and
# 656-byte block-scaled caches) beside FlashInfer 0.7.4's fa3 backend with an FP8 e4m3 cache and
# FlashMLA's sparse FP8 decode, on one GPU, inside one 10-minute call.
# Run from the repo root on the device with the carried folders (a missing one makes its peer
# "not importable"):
#   .device_carry/flashinfer  (scripts/device/carry_flashinfer.sh: trimmed FlashInfer + tvm-ffi,
#                              with the fa3 FP8 module prebuilt for sm_90a when it was built so)
#   .device_carry/flashmla    (scripts/device/carry_flashmla.sh: vLLM's prebuilt FlashMLA as the
#                              package flashmla_vllm)
#   .device_carry/fp8mla_py   (scripts/device/carry_fp8mla_py.sh: fp8mla with the CUDA backend);
#                              when it is missing, fp8mla is built here (offline, 16 jobs)
# Steps, with their output under $OUT: env.txt (GPU, driver, versions, the carried folders'
# CARRY.txt), flashinfer_load.txt (scripts/device/check_flashinfer_carry.py: FlashInfer's import
# and first plan, i.e. the module's load or JIT compile, timed; skipped when --peers leaves
# flashinfer out), peers.txt and peers.json (the benchmark). Arguments are passed to
# mla_peers.py (e.g. --quick, --cases sparse, --peers fp8mla,fp8mla_block,flashmla).
#
# Environment: OUT (default /tmp/peers-out), PEERS_BUDGET_S (seconds this script may take in
# all, default 560: a 600-s call less a margin; the benchmark starts no case in its last 60 s).
set -uo pipefail
start=$SECONDS
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root" || exit 1
out=${OUT:-/tmp/peers-out}
mkdir -p "$out"
budget=${PEERS_BUDGET_S:-560}
export PYTHONUNBUFFERED=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$CUDA_HOME/bin:$PATH"
export LD_LIBRARY_PATH="$CUDA_HOME/lib64:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
export MAX_JOBS=${MAX_JOBS:-16}  # FlashInfer's JIT (ninja) jobs
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/fi-workspace}
py=${PYTHON:-python3}

fp8=.device_carry/fp8mla_py
if [[ ! -d "$fp8/fp8mla" ]]; then
  echo "== no carried fp8mla build: building it here (FP8MLA_CUDA=ON, offline)"
  fp8=/tmp/fp8mla_py
  t=$SECONDS
  CMAKE_BUILD_PARALLEL_LEVEL=16 CMAKE_ARGS="-DFP8MLA_CUDA=ON" "$py" -m pip install \
    --disable-pip-version-check --no-build-isolation --no-deps -q --target "$fp8" . \
    > "$out/fp8mla_build.txt" 2>&1 || { echo "fp8mla build failed:"; tail -20 "$out/fp8mla_build.txt"; }
  echo "   built in $((SECONDS - t)) s"
fi
fp8=$(cd "$fp8" 2>/dev/null && pwd || echo "$fp8")
export PYTHONPATH="$root/.device_carry/flashinfer:$root/.device_carry/flashmla:$fp8:${PYTHONPATH:-}"
# tvm-ffi JIT-builds a torch DLPack addon at import unless torch exports the DLPack exchange API
# itself; without it tvm-ffi's plain torch path is used (same stream handling, slower per call,
# which CUDA-graph replay does not see).
if ! "$py" -c 'import sys, torch; t = torch.Tensor; sys.exit(0 if hasattr(t, "__dlpack_c_exchange_api__") or hasattr(t, "__c_dlpack_exchange_api__") else 1)'; then
  export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
fi

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv
  nvcc --version | tail -2
  "$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
  cat .device_carry/flashinfer/CARRY.txt .device_carry/flashmla/CARRY.txt "$fp8/CARRY.txt" 2>/dev/null
  echo "TVM_FFI_DISABLE_TORCH_C_DLPACK=${TVM_FFI_DISABLE_TORCH_C_DLPACK:-0} MAX_JOBS=$MAX_JOBS"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

# Whether the peers asked for include flashinfer (all do without --peers).
want_flashinfer=1
prev=""
for a in "$@"; do
  peers=""
  [[ "$prev" == --peers ]] && peers=$a
  [[ "$a" == --peers=* ]] && peers=${a#--peers=}
  if [[ -n "$peers" && ",$peers," != *,flashinfer,* ]]; then want_flashinfer=0; fi
  prev=$a
done
if [[ $want_flashinfer == 1 ]]; then
  echo "== FlashInfer: import and first plan (the fa3 FP8 module's load, or its JIT compile)"
  t=$SECONDS
  timeout $((budget / 2)) "$py" -W ignore::DeprecationWarning scripts/device/check_flashinfer_carry.py \
    > "$out/flashinfer_load.txt" 2>&1
  echo "   rc=$? in $((SECONDS - t)) s"
  tail -3 "$out/flashinfer_load.txt"
fi

left=$((budget - (SECONDS - start)))
limit=$((left > 120 ? left - 60 : 60))
echo "== bench/peers/mla_peers.py $* (${left} s left; no case starts in the last 60 s)"
timeout "$left" "$py" bench/peers/mla_peers.py --json "$out/peers.json" \
  --time-limit "$limit" "$@" 2>&1 | tee "$out/peers.txt"
echo "mla_peers rc=${PIPESTATUS[0]}; total $((SECONDS - start)) s"
