#!/usr/bin/env bash
# One device lease's GPU checks, as named steps run in the order STEPS gives (a call that runs
# out of time loses only the last ones). Records are packed into $OUT/records.tgz (a call brings
# back at most 8 files).
#
# Steps (default: all, in the order of the list below but for stress, which runs after racecheck):
#   tests               the GPU suite as the dispatch table chooses, then the block format's tests
#                       on shared_tile and on wide_rows (<= 16 rows served when forced)
#   memcheck            compute-sanitizer memcheck over the bad-input, sparse, large-pool and PDL-input tests
#   racecheck           compute-sanitizer racecheck over the sparse grid's 8- and 64-head rows (both
#                       formats: fp8_gather and wide_rows as the table chooses), the sparse decode
#                       tests and the late-written inputs (CudaPdlInputs)
#   portable            the suite with the portable family forced (FP8MLA_KERNEL_FAMILY), with its
#                       fp8 products forced, and with one cp.async stage as on 99-KB GPUs
#   sparse              fp8mla bench --sparse: the sparse top-k grid (SPARSE_ARGS, e.g. --quick)
#   bench               the table's choice beside the portable family on the grid's main shapes
#   python              the GPU pytest (tests/python/test_gpu*.py, test_context_parallel.py, the
#                       SGLang plugin's, its DSA sparse plans', its page table) on the binary wheel in dist/
#                       (carry dist), else on the carried package tree (.device_carry/fp8mla_py)
#   port                FlashInfer's own MLA wrapper tests, ported (test_flashinfer_deepseek_mla.py),
#                       on the GPU (FP8MLA_PORT_DEVICE=cuda), on the same package as python
#   sglang              the SGLang plugin's tests on the GPU (FP8MLA_SGLANG_DEVICE=cuda) with sglang
#                       and the packages its imports need installed from carried wheels (.whl,
#                       tests/python/requirements-sglang.txt less what the device has)
#   step                bench/replan_host.py (replan_step's host time), then bench/sglang_step.py:
#                       one SGLang decode step (plan + every layer) the plugin's way, SGLang's
#                       cast-pool way (on FlashInfer's fa3 when .device_carry/flashinfer came
#                       along) and the gathered cast, in CUDA graphs, and extend chunks (STEP_ARGS
#                       replaces its default grid)
#   dsa_step            bench/sglang_dsa_step.py: one DSA decode step (top-k sparse attention of
#                       every layer over the 656-byte pool) the plugin's way against SGLang's
#                       FlashMLA way (heads padded to 64) when .device_carry/flashmla came along
#                       (DSA_STEP_ARGS replaces its grid), then extend chunks of one request
#                       (DSA_EXTEND_ARGS)
#   peers               the peer benchmark (bench/peers) when FlashInfer's carry came along
#   traces              CUDA traces of the three strategies, as tests/audit/traces/cuda holds them
#   sanitize_portable   memcheck and racecheck of the portable kernels on a small grid
#   stress              the dense and sparse benches at 8-16 heads (every <= 16-row family at
#                       full load, where a stage race shows now and then; memcheck serializes
#                       it away), STRESS_ROUNDS times (default 3): any CUDA error or mismatch
#
# Run from the repo root on the device with the binaries carried in .device_carry/bin
# (fp8mla_tests, fp8mla, and libsimdjson.so.* which the command links). LIMIT: seconds the
# script may take (default 580).
set -uo pipefail
out=${OUT:-/tmp/fp8mla-out}
mkdir -p "$out"
bin=${BIN:-.device_carry/bin}
export LD_LIBRARY_PATH=$PWD/$bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
t=$bin/fp8mla_tests
f=$bin/fp8mla
steps=${STEPS:-tests memcheck racecheck stress portable sparse bench python port sglang step dsa_step peers traces sanitize_portable}
left() { echo $((${LIMIT:-580} - SECONDS)); }
section() { echo "== $* ($(left) s left)"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
small='Grid/CudaDecodeGrid.MatchesReference/*_0:Grid/CudaDecodeGrid.MatchesReference/*_1:Grid/CudaDecodeGrid.MatchesReference/*_9:Grid/CudaDecodeGrid.MatchesReference/*_10:Grid/CudaDecodeGrid.MatchesReference/*_19:Grid/CudaDecodeGrid.MatchesReference/*_23:Grid/CudaDecodeGrid.MatchesReference/*_24:Grid/CudaDecodeGrid.MatchesReference/*_25:Grid/CudaDecodeGrid.MatchesReference/*_26:CudaDecodeSparse*:CudaDecodeSplit.LongContext*'

suite() {  # suite NAME [ENV...]: the GPU tests (FILTER, default *Cuda*) under an environment
  local name=$1
  shift
  section "tests: $name"
  env "$@" timeout 150 "$t" --gtest_filter="${FILTER:-*Cuda*}" --gtest_brief=1 > "$out/tests_$name.txt" 2>&1
  echo "rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/tests_$name.txt" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]' "$out/tests_$name.txt" | head -8
}
sanitize() {  # sanitize TOOL FILTER [ENV...]: compute-sanitizer over some tests, into sanitizer.txt
  local tool=$1 filter=$2
  shift 2
  { echo "\$ $* compute-sanitizer --tool $tool $t --gtest_filter='$filter'"
    env "$@" timeout $(($(left) / 2)) compute-sanitizer --tool "$tool" "$t" --gtest_filter="$filter" --gtest_brief=1
  } >> "$out/sanitizer.txt" 2>&1
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^\[  (PASSED|FAILED)" "$out/sanitizer.txt" | tail -2
}
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

# The Python package: the binary wheel when dist/ came along (scripts/check_wheel.sh with the
# device's Python), else the carried package tree.
pkg=$PWD/.device_carry/fp8mla_py
whl=$(ls dist/fp8mla-*-cp3*-manylinux*.whl 2>/dev/null | head -1)
if [ -n "$whl" ]; then
  pkg=/tmp/fp8mla-wheel && rm -rf "$pkg" && python3 -m zipfile -e "$whl" "$pkg"
fi

for step in $steps; do
  case $step in
    tests)
      suite default
      FILTER='*fp8_e4m3_block*' suite block_shared_tile FP8MLA_KERNEL_FAMILY=shared_tile
      FILTER='*fp8_e4m3_block*' suite block_wide_rows FP8MLA_KERNEL_FAMILY=wide_rows ;;
    memcheck)
      section "memcheck: bad input, sparse, large pool, late-written inputs"
      sanitize memcheck 'CudaHostile*:*CudaSparse*:CudaDecodeSparse*:CudaPdlInputs*' ;;
    racecheck)
      section "racecheck: the sparse rows of 8 and 64 heads, late-written inputs"
      sanitize racecheck '*CudaSparseGrid*h8_qo1*:*CudaSparseGrid*h64_qo1*:CudaDecodeSparse*:CudaPdlInputs*' ;;
    portable)
      suite portable FP8MLA_KERNEL_FAMILY=portable
      suite portable_fp8 FP8MLA_KERNEL_FAMILY=portable_fp8
      suite portable_one_stage FP8MLA_KERNEL_FAMILY=portable FP8MLA_PORTABLE_STAGES=1 ;;
    sparse)
      if [ "$(left)" -lt 120 ]; then echo "sparse skipped"; continue; fi
      section "bench --sparse ${SPARSE_ARGS:-}"
      timeout $(($(left) - 60)) "$f" bench --sparse ${SPARSE_ARGS:-} --no-progress \
        --json "$out/bench_sparse.json" --plot "$out/bench_sparse.svg" > "$out/bench_sparse.txt" 2>&1
      echo "rc=$?"; grep -E "ceil|FAILED" "$out/bench_sparse.txt" | head; tail -4 "$out/bench_sparse.txt" ;;
    bench)
      bench table
      bench portable FP8MLA_KERNEL_FAMILY=portable ;;
    python)
      if [ ! -d "$pkg" ] || [ "$(left)" -lt 90 ]; then echo "python skipped"; continue; fi
      section "GPU pytest (${whl:-$pkg})"
      PYTHONPATH=$pkg timeout $(($(left) - 60)) python3 -m pytest -q -rs \
        -p no:cacheprovider tests/python/test_gpu.py tests/python/test_gpu_engines.py \
        tests/python/test_context_parallel.py tests/python/test_sglang_plugin.py \
        tests/python/test_sparse_plans.py tests/python/test_page_table.py \
        > "$out/tests_python.txt" 2>&1
      echo "rc=$?"; tail -3 "$out/tests_python.txt" ;;
    port)
      if [ ! -d "$pkg" ] || [ "$(left)" -lt 90 ]; then echo "port skipped"; continue; fi
      section "FlashInfer's MLA tests on the GPU"
      FP8MLA_PORT_DEVICE=cuda PYTHONPATH=$pkg timeout $(($(left) - 60)) python3 -m pytest -q -rs \
        -p no:cacheprovider tests/python/test_flashinfer_deepseek_mla.py \
        > "$out/tests_port.txt" 2>&1
      echo "rc=$?"; tail -3 "$out/tests_port.txt" ;;
    sglang)
      if [ ! -d "$pkg" ] || [ ! -d .whl ] || [ "$(left)" -lt 90 ]; then echo "sglang skipped"; continue; fi
      section "the SGLang plugin's tests on the GPU"
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/sglang-site .whl/*.whl > "$out/tests_sglang.txt" 2>&1
      FP8MLA_SGLANG_DEVICE=cuda PYTHONPATH=$pkg:/tmp/sglang-site timeout $(($(left) - 60)) \
        python3 -m pytest -q -rs -p no:cacheprovider tests/python/test_sglang_plugin.py \
        >> "$out/tests_sglang.txt" 2>&1
      echo "rc=$?"; tail -3 "$out/tests_sglang.txt" ;;
    step)
      if [ ! -d "$pkg" ] || [ "$(left)" -lt 120 ]; then echo "step skipped"; continue; fi
      section "SGLang decode step: plugin vs cast pool"
      # replan_step's host time alone, in parts, then the step; the cast way runs FlashInfer's fa3
      # bf16 kernel when its carry came along (JIT-compiled here), else fp8mla's bf16 path.
      PYTHONPATH=$pkg timeout 60 python3 bench/replan_host.py > "$out/bench_replan_host.txt" 2>&1
      echo "replan_host rc=$?"; grep -E "^bs|replan_step " "$out/bench_replan_host.txt"
      PYTHONPATH=$PWD/.device_carry/flashinfer:$pkg PYTHONUNBUFFERED=1 MAX_JOBS=16 \
        timeout $(($(left) - 40)) python3 bench/sglang_step.py \
        ${STEP_ARGS:---layers 61 --page-size 1 64 --batch 1 16 64 128 --ctx 4096 32768 --extend --pool-tokens 1500000} \
        --json "$out/bench_sglang_step.json" > "$out/bench_sglang_step.txt" 2>&1
      echo "rc=$?"; tail -30 "$out/bench_sglang_step.txt" ;;
    dsa_step)
      if [ ! -d "$pkg" ] || [ "$(left)" -lt 90 ]; then echo "dsa_step skipped"; continue; fi
      section "SGLang DSA decode step: plugin vs FlashMLA"
      PYTHONPATH=$PWD/.device_carry/flashmla:$pkg PYTHONUNBUFFERED=1 timeout $(($(left) - 30)) \
        python3 bench/sglang_dsa_step.py \
        ${DSA_STEP_ARGS:---layers 61 78 --heads 8 16 64 128 --batch 1 16 64 128 --topk 2048} \
        --json "$out/bench_sglang_dsa_step.json" > "$out/bench_sglang_dsa_step.txt" 2>&1
      echo "rc=$?"; grep -E "^dsa|^fp8mla|Error|off" "$out/bench_sglang_dsa_step.txt" | cut -c1-200
      if [ "$(left)" -gt 90 ]; then  # extend chunks: one layer, the tokens of one request's 32K
        PYTHONPATH=$PWD/.device_carry/flashmla:$pkg PYTHONUNBUFFERED=1 timeout $(($(left) - 30)) \
          python3 bench/sglang_dsa_step.py \
          ${DSA_EXTEND_ARGS:---layers 1 --heads 8 16 64 128 --batch 1024 4096 --topk 2048 --context 32768} \
          --json "$out/bench_sglang_dsa_extend.json" > "$out/bench_sglang_dsa_extend.txt" 2>&1
        echo "rc=$?"; grep -E "^dsa|Error|off" "$out/bench_sglang_dsa_extend.txt" | cut -c1-200
      fi ;;
    peers)
      if [ -d .device_carry/flashinfer ] && [ "$(left)" -gt 150 ]; then
        section "peers"
        PEERS_BUDGET_S=$(($(left) - ${AFTER_PEERS_S:-130})) bash scripts/device/run_peers.sh ${PEERS_ARGS:-}
      fi ;;
    traces)
      if [ -d "$pkg" ] && [ "$(left)" -gt 120 ]; then
        section "CUDA traces"
        PYTHONPATH=$pkg timeout 60 python3 scripts/record_traces.py \
          --device cuda --out "$out/cuda" --pool 262144 --context 2048 --batch 16 --heads 16 \
          --layers 8 --steps 4 > "$out/traces.txt" 2>&1
        echo "rc=$?"; tail -3 "$out/traces.txt"
      fi ;;
    sanitize_portable)
      if [ "$(left)" -lt 60 ]; then echo "sanitize_portable skipped"; continue; fi
      section "sanitizers (portable)"
      sanitize memcheck "$small" FP8MLA_KERNEL_FAMILY=portable
      sanitize racecheck "$small" FP8MLA_KERNEL_FAMILY=portable ;;
    stress)
      section "stress: dense and sparse benches at 8-16 heads"
      for r in $(seq "${STRESS_ROUNDS:-3}"); do
        [ "$(left)" -lt 60 ] && { echo "stress stopped after $((r - 1)) rounds"; break; }
        for mode in dense sparse; do
          if [ $mode = dense ]; then
            a="--quick --no-baselines --heads 8,16"
          else
            a="--sparse --heads 8,16 --batch 64,128 --topk 2048 --page-size 1,64 --qo-len 1,2"
          fi
          timeout 60 "$f" bench $a --no-progress --format fp8_e4m3,fp8_e4m3_block \
            > "$out/stress.txt" 2>&1
          echo "round $r $mode: rc=$? $(grep -E 'rror|FAIL|mismatch' "$out/stress.txt" | head -2)"
        done
      done
      rm -f "$out/stress.txt" ;;
    *) echo "unknown step '$step' (steps: tests memcheck racecheck portable sparse bench python port sglang step peers traces sanitize_portable stress)"; exit 2 ;;
  esac
done
# Only what this call wrote (a name tar cannot find fails the whole pack).
(cd "$out" && shopt -s nullglob && f=() &&
  for x in ./tests_*.txt ./bench_* ./sanitizer.txt ./env.txt ./flashinfer_load.txt ./peers.* ./traces.txt ./cuda; do
    [ -e "$x" ] && f+=("$x")
  done
  [ ${#f[@]} -gt 0 ] && tar czf records.tgz --remove-files "${f[@]}") && echo "packed: records.tgz"
