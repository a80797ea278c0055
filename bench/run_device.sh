#!/usr/bin/env bash
# One device lease: GPU tests, sanitizers on a small grid, the full bench (NO_BENCH=1 skips it),
# the GPU demo, `fp8mla bench --cp 1 --quick`, a short multi-token (MTP) bench (NO_MTP=1 skips);
# PACK=1 packs the records into one archive.
# Run from the repo root on the device machine with build-cuda/ carried; results go to $OUT.
set -uo pipefail
out=${OUT:-/tmp/fp8mla-out}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
. bench/nccl_env.sh  # the context-parallel tests' world 1 (one GPU)
t=build-cuda/tests/fp8mla_tests
small='Grid/CudaDecodeGrid.MatchesReference/*_25:Grid/CudaDecodeGrid.MatchesReference/*_26:Grid/CudaDecodeGrid.MatchesReference/*_28:Grid/CudaDecodeGrid.MatchesReference/*_24:Grid/CudaDecodeGrid.MatchesReference/*_9:Grid/CudaDecodeGrid.MatchesReference/*_23:Grid/CudaDecodeGrid.MatchesReference/*_0:Grid/CudaDecodeGrid.MatchesReference/*_1:Grid/CudaDecodeGrid.MatchesReference/*_19:CudaDecodeFp16*:Grid/CudaDecodeGrid.MatchesReference/*_10:Grid/CudaDecodeGrid.MatchesReference/*_30:Grid/CudaDecodeGrid.MatchesReference/*_33:CudaDecodeSparse.RunTime*:CudaMerge*:CudaCache*'
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv; $t --gtest_filter='*Cuda*' --gtest_brief=1; } \
  > "$out/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?"; tail -4 "$out/gpu_tests.txt"
{ echo "\$ compute-sanitizer --tool memcheck $t --gtest_filter='$small:CudaDecodeSplit*:CudaPlan.DevicePageTable*'"
  timeout 120 compute-sanitizer --tool memcheck $t --gtest_filter="$small:CudaDecodeSplit*:CudaPlan.DevicePageTable*" --gtest_brief=1
  echo "\$ compute-sanitizer --tool racecheck $t --gtest_filter='$small'"
  timeout 200 compute-sanitizer --tool racecheck $t --gtest_filter="$small" --gtest_brief=1; } > "$out/sanitizer.txt" 2>&1
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$out/sanitizer.txt"
if [ -z "${NO_BENCH:-}" ]; then
  timeout 300 build-cuda/tools/fp8mla/fp8mla bench ${BENCH_ARGS:-} --json "$out/bench.json" --no-progress > "$out/bench.txt" 2>&1
  echo "bench rc=$?"
fi
timeout 50 build-cuda/tools/fp8mla/fp8mla demo --device cuda --no-progress > "$out/demo_gpu.txt" 2>&1
echo "demo rc=$?"; tail -12 "$out/demo_gpu.txt"
# Context parallelism at world 1 (the launcher, the exchange and the merge on one GPU: their cost
# over a plain run; bench/run_device_cp.sh runs the multi-GPU worlds).
timeout 90 build-cuda/tools/fp8mla/fp8mla bench --cp 1 --quick --json "$out/cp1.json" --no-progress \
  > "$out/cp1.txt" 2>&1
echo "bench --cp 1 rc=$?"; tail -6 "$out/cp1.txt"
# Multi-token causal decode (MTP / speculative verify: 2 and 4 query tokens a request) next to
# plain decode at 1-64 requests: DeepSeek's 16 heads at TP8 and 128 (DP attention), fp8 cache;
# then the same with tiles of <= 16 rows (PlanOptions::max_tile_rows: more tiles, each reading
# the pages, on the <= 16-row kernels; docs/design/planner.md). Last, so a lease that runs out of
# time loses only these (NO_MTP=1 skips them).
mtp() {  # mtp NAME ARGS...: one short bench, to $out/NAME.{txt,json}, while the call has time
  local name=$1
  shift
  if [ "$SECONDS" -gt 490 ]; then echo "bench $name skipped: ${SECONDS} s into a 600-s call"; return; fi
  timeout 90 build-cuda/tools/fp8mla/fp8mla bench --quick --context 4096 --page-size 64 \
    --format fp8_e4m3 --no-baselines --no-progress --json "$out/$name.json" "$@" > "$out/$name.txt" 2>&1
  echo "bench $name rc=$?"
}
if [ -z "${NO_MTP:-}" ]; then
  mtp mtp --batch 1,4,16,64 --heads 8,16,128 --qo-len 1,2,4
  mtp mtp16 --batch 1,4,16,64 --heads 8,16 --qo-len 2,4 --max-tile-rows 16
fi
[ -f "$out/bench.txt" ] && grep -E "ceil|native" "$out/bench.txt" | head -60
[ -f "$out/mtp.txt" ] && grep native "$out/mtp.txt" "$out/mtp16.txt"
# Where the time goes in the bandwidth-target case (hardware counters; clocks left alone).
if [ -n "${NCU:-}" ]; then
  ncu --clock-control none --kernel-name regex:mla_decode --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    build-cuda/tools/fp8mla/fp8mla bench --batch 128 --heads 16 --context 8192 --page-size 64 \
    --format fp8_e4m3 --no-baselines --quick --no-progress > "$out/ncu.txt" 2>&1
  echo "ncu rc=$?"; grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Stall|Warp Cycles" "$out/ncu.txt" | head -20
fi
# PACK=1: the records as one archive (records.tgz), for a lease that brings back only a few files.
if [ -n "${PACK:-}" ]; then
  (cd "$out" && shopt -s nullglob && f=(./*.txt ./*.json) && tar czf records.tgz --remove-files "${f[@]}") &&
    echo "packed: $out/records.tgz"
fi
