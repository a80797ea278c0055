#!/usr/bin/env bash
# One device lease's GPU checks, in order of importance (a call that runs out of time loses only
# the last ones): the GPU test suite as the dispatch table chooses it, then with the portable
# family forced (FP8MLA_KERNEL_FAMILY), with its fp8 products forced, and with one cp.async
# stage as on 99-KB GPUs; a bench of the table's choice beside the portable family on the same
# cases; the peer benchmark (bench/peers) when its carries came along; memcheck and racecheck of
# the portable kernels on a small grid. Records are packed into $OUT/records.tgz (a call brings
# back at most 8 files).
# Run from the repo root on the device with the binaries carried in .device_carry/bin
# (fp8mla_tests, fp8mla). LIMIT: seconds the script may take (default 580).
set -uo pipefail
out=${OUT:-/tmp/fp8mla-out}
mkdir -p "$out"
bin=${BIN:-.device_carry/bin}
t=$bin/fp8mla_tests
f=$bin/fp8mla
left() { echo $((${LIMIT:-580} - SECONDS)); }
section() { echo "== $* ($(left) s left)"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
suite() {  # suite NAME [ENV...]: the GPU tests under an environment
  local name=$1
  shift
  section "tests: $name"
  env "$@" timeout 150 "$t" --gtest_filter='*Cuda*' --gtest_brief=1 > "$out/tests_$name.txt" 2>&1
  echo "rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/tests_$name.txt" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]' "$out/tests_$name.txt" | head -8
}
suite default
suite portable FP8MLA_KERNEL_FAMILY=portable
suite portable_fp8 FP8MLA_KERNEL_FAMILY=portable_fp8
suite portable_one_stage FP8MLA_KERNEL_FAMILY=portable FP8MLA_PORTABLE_STAGES=1
bench() {  # bench NAME [ENV...]: the decode grid's main shapes, fp8 and the block format
  local name=$1
  shift
  if [ "$(left)" -lt 90 ]; then echo "bench $name skipped"; return; fi
  section "bench: $name"
  env "$@" timeout $(($(left) - 20)) "$f" bench --quick --no-baselines --no-progress \
    --heads ${BENCH_HEADS:-8,16,128} --format fp8_e4m3,fp8_e4m3_block \
    --json "$out/bench_$name.json" > "$out/bench_$name.txt" 2>&1
  echo "rc=$?"
  grep -E "ceil|native" "$out/bench_$name.txt" | head -40
}
bench table
bench portable FP8MLA_KERNEL_FAMILY=portable
# The peer benchmark (bench/peers: FlashInfer's fa3 FP8 MLA beside fp8mla) when its carries
# came along and time is left.
if [ -d .device_carry/flashinfer ] && [ "$(left)" -gt 150 ]; then
  section "peers"
  PEERS_BUDGET_S=$(($(left) - ${AFTER_PEERS_S:-130})) bash scripts/device/run_peers.sh ${PEERS_ARGS:-}
fi
# CUDA traces of the three strategies for `fp8mla audit`'s fixtures (scripts/record_traces.py).
if [ -d .device_carry/fp8mla_py ] && [ "$(left)" -gt 120 ]; then
  section "CUDA traces"
  PYTHONPATH=$PWD/.device_carry/fp8mla_py LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} \
    timeout 60 python3 scripts/record_traces.py --device cuda --out "$out/cuda" --pool 262144 \
    --context 2048 --batch 16 --heads 16 --layers 8 --steps 4 > "$out/traces.txt" 2>&1
  echo "rc=$?"; tail -3 "$out/traces.txt"
fi
if [ "$(left)" -gt 60 ]; then
  section "sanitizers (portable)"
  small='Grid/CudaDecodeGrid.MatchesReference/*_0:Grid/CudaDecodeGrid.MatchesReference/*_1:Grid/CudaDecodeGrid.MatchesReference/*_9:Grid/CudaDecodeGrid.MatchesReference/*_10:Grid/CudaDecodeGrid.MatchesReference/*_19:Grid/CudaDecodeGrid.MatchesReference/*_23:Grid/CudaDecodeGrid.MatchesReference/*_24:Grid/CudaDecodeGrid.MatchesReference/*_25:Grid/CudaDecodeGrid.MatchesReference/*_26:CudaDecodeSparse*:CudaDecodeSplit.LongContext*'
  { echo "\$ FP8MLA_KERNEL_FAMILY=portable compute-sanitizer --tool memcheck $t --gtest_filter='$small'"
    FP8MLA_KERNEL_FAMILY=portable timeout $(($(left) / 2)) compute-sanitizer --tool memcheck "$t" --gtest_filter="$small" --gtest_brief=1
    echo "\$ FP8MLA_KERNEL_FAMILY=portable compute-sanitizer --tool racecheck $t --gtest_filter='$small'"
    FP8MLA_KERNEL_FAMILY=portable timeout $(($(left) - 5)) compute-sanitizer --tool racecheck "$t" --gtest_filter="$small" --gtest_brief=1
  } > "$out/sanitizer_portable.txt" 2>&1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$out/sanitizer_portable.txt"
fi
(cd "$out" && shopt -s nullglob && f=(./tests_*.txt ./bench_* ./sanitizer_*.txt ./env.txt ./flashinfer_load.txt ./peers.* ./traces.txt ./cuda) &&
  [ ${#f[@]} -gt 0 ] && tar czf records.tgz --remove-files "${f[@]}") && echo "packed: records.tgz"
