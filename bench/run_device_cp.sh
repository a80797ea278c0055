#!/usr/bin/env bash
# A multi-GPU lease (nvidia-h200-x2 or larger): the context-parallel GPU tests (worlds 1, 2, 4 as
# the GPUs allow) and CudaDevice (the caller's current device given back: two GPUs), then
# `fp8mla bench --cp N` for N = 2, 4, 8 up to the GPUs visible.
# Run from the repo root on the device machine with build-cuda/ carried; results go to $OUT.
set -uo pipefail
out=${OUT:-/tmp/fp8mla-out}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
. bench/nccl_env.sh
gpus=$(nvidia-smi -L | wc -l)
{ nvidia-smi topo -m; timeout 300 build-cuda/tests/fp8mla_tests --gtest_filter='*ContextParallel*:CudaDevice.*'; } \
  > "$out/cp_tests.txt" 2>&1
echo "cp tests rc=$? ($gpus GPUs)"; grep -E "OK|FAILED|SKIPPED|not run" "$out/cp_tests.txt" | head -20
for n in 2 4 8; do
  [ "$n" -le "$gpus" ] || break
  timeout 300 build-cuda/tools/fp8mla/fp8mla bench --cp "$n" ${CP_ARGS:-} --json "$out/cp$n.json" \
    --no-progress > "$out/cp$n.txt" 2>&1
  echo "bench --cp $n rc=$?"; cat "$out/cp$n.txt"
done
