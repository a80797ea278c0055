#!/usr/bin/env bash
# The sanitizer and fuzzing job (CPU only, clang from the distribution):
#   asan  AddressSanitizer + UndefinedBehaviorSanitizer build of the library, the C++ tests and the
#         fuzz targets (build-sanitize/asan); ctest over them (GoogleTest and the replay of every
#         committed fuzz input). Any report fails the run (-fno-sanitize-recover=all).
#   fuzz  each libFuzzer target (fuzz/: plan + shard_context, run arguments + merge_states, cache
#         + codecs, fill_page_table) for FUZZ_SECONDS from its committed corpus
#         (fuzz/corpus/<name>); a crash, a sanitizer report, a leak, an allocation over 2 GiB or an
#         input slower than 10 s fails.
#         New inputs go to a scratch folder; a finding's input is kept as
#         build-sanitize/findings/<target>-crash-... (add it to fuzz/corpus once fixed).
#   tsan  ThreadSanitizer build of the library and the C++ tests (build-sanitize/tsan); runs the
#         tests that use threads (one plan from many threads, the CPU backend's splits and merges,
#         context parallelism's ranks).
# Installs clang and compiler-rt (Debian: clang libclang-rt-dev) when missing.
#
#   bash scripts/sanitize.sh               # all three steps
#   bash scripts/sanitize.sh asan tsan     # some of them
#
# Environment: FUZZ_SECONDS (45 a target), JOBS (all cores), SANITIZE_DIR (build-sanitize).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(asan fuzz tsan)
jobs=${JOBS:-$(nproc)}
fuzz_seconds=${FUZZ_SECONDS:-45}
dir=${SANITIZE_DIR:-build-sanitize}
start=$SECONDS
log() { echo "[sanitize] $*"; }

# ---- clang with compiler-rt (the sanitizer and libFuzzer runtimes) ----
have_clang() {
  command -v clang++ >/dev/null 2>&1 || return 1
  local fuzzer
  fuzzer=$(clang++ -print-file-name=libclang_rt.fuzzer-x86_64.a 2>/dev/null)
  [ -f "$fuzzer" ] || [ -f "$(clang++ -print-resource-dir)/lib/linux/libclang_rt.fuzzer-$(uname -m).a" ]
}
if ! have_clang; then
  command -v apt-get >/dev/null 2>&1 || { echo "sanitize.sh: install clang and compiler-rt (libFuzzer) by hand" >&2; exit 1; }
  sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  log "installing clang libclang-rt-dev"
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends clang libclang-rt-dev >/dev/null
  have_clang || { echo "sanitize.sh: clang has no libFuzzer runtime after installing" >&2; exit 1; }
fi
log "$(clang++ --version | head -n1)"

# configure DIR FLAGS [cmake args...]: a CPU-only clang build with FLAGS on everything.
configure() {
  local build=$1 flags=$2
  shift 2
  local generator=()
  [ -f "$build/CMakeCache.txt" ] || generator=(-G Ninja)
  cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -gline-tables-only" -DCMAKE_CXX_FLAGS="$flags" \
    -DCMAKE_EXE_LINKER_FLAGS="$flags" -DFP8MLA_CUDA=OFF -DFP8MLA_BUILD_TOOLS=OFF "$@" >/dev/null
}

timings=()
timed() {  # timed NAME COMMAND...: runs it and records its wall time
  local name=$1 t0=$SECONDS
  shift
  "$@"
  timings+=("$(printf '%-24s %5d s' "$name" $((SECONDS - t0)))")
}

asan_flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
asan_env=(ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:strict_string_checks=1
          UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1)

build_asan() {
  # fuzzer-no-link: the library carries libFuzzer's coverage hooks, so the fuzz step links its
  # targets against this same build.
  configure "$dir/asan" "$asan_flags -fsanitize=fuzzer-no-link" -DFP8MLA_FUZZ=ON
  cmake --build "$dir/asan" -j "$jobs"
}
build_tsan() {
  configure "$dir/tsan" "-fsanitize=thread -fno-omit-frame-pointer"
  cmake --build "$dir/tsan" -j "$jobs" --target fp8mla_tests
}

for step in "${steps[@]}"; do
  case "$step" in
    asan)
      log "asan: build ($dir/asan)"
      timed asan-build build_asan
      log "asan: ctest"
      timed asan-ctest env "${asan_env[@]}" ctest --test-dir "$dir/asan" --output-on-failure \
        -j "$jobs"
      ;;
    fuzz)
      [ -x "$dir/asan/fuzz/fp8mla_fuzz_plan" ] || { echo "sanitize.sh: run the asan step first" >&2; exit 1; }
      mkdir -p "$dir/findings"
      pids=()
      # The targets run side by side (each single-threaded): FUZZ_SECONDS of wall time in all.
      targets=(plan run cache page_table)
      for target in "${targets[@]}"; do
        scratch="$dir/fuzz-scratch/$target"
        rm -rf "$scratch"
        mkdir -p "$scratch"
        log "fuzz: $target for $fuzz_seconds s"
        env "${asan_env[@]}" "$dir/asan/fuzz/fp8mla_fuzz_$target" -max_total_time="$fuzz_seconds" \
          -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
          -artifact_prefix="$dir/findings/$target-" "$scratch" "fuzz/corpus/$target" \
          >"$dir/fuzz-$target.log" 2>&1 &
        pids+=($!)
      done
      t0=$SECONDS
      failed=()
      for i in "${!pids[@]}"; do
        target=${targets[$i]}
        if ! wait "${pids[$i]}"; then
          failed+=("$target")
          tail -n 60 "$dir/fuzz-$target.log" >&2
        fi
        grep -E "^stat::number_of_executed_units|^Done" "$dir/fuzz-$target.log" | tr '\n' ' ' |
          sed "s/^/[sanitize] fuzz $target: /"
        echo
      done
      timings+=("$(printf '%-24s %5d s' fuzz $((SECONDS - t0)))")
      if [ ${#failed[@]} -gt 0 ]; then
        echo "sanitize.sh: fuzz findings in ${failed[*]} (inputs in $dir/findings)" >&2
        exit 1
      fi
      ;;
    tsan)
      log "tsan: build ($dir/tsan)"
      timed tsan-build build_tsan
      log "tsan: threaded tests"
      timed tsan-tests env TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
        "$dir/tsan/tests/fp8mla_tests" \
        --gtest_filter='ConcurrentRuns.*:CpuBackendSplit.*:CpuBackendMerge.*:ContextParallel.*'
      ;;
    *)
      echo "sanitize.sh: unknown step '$step' (expected asan, fuzz, tsan)" >&2
      exit 2
      ;;
  esac
done

echo
log "done in $((SECONDS - start)) s"
printf '  %s\n' "${timings[@]}"
