set -uo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
t=build-cuda/tests/fp8mla_tests
b=build-cuda/tools/fp8mla/fp8mla
timeout 200 $t --gtest_filter='*Cuda*' --gtest_brief=1 > $OUT/gpu_tests.txt 2>&1; echo "tests rc=$?"; grep -E "FAILED|PASSED|Failure|rel_l2|Which is|Expected" $OUT/gpu_tests.txt | head -40
A="--no-baselines --no-progress --page-size 64,1 --format fp8_e4m3,bf16"
timeout 100 $b bench $A --batch 1 --heads 8,16,128 --context 4096,32768,131072 > $OUT/bench1.txt 2>&1; echo "bench rc=$?"
timeout 150 $b bench $A --batch 64,128 --heads 8,16,128 --context 4096,8192 > $OUT/bench2.txt 2>&1; echo "bench rc=$?"
cat $OUT/bench1.txt; grep -v ceilings $OUT/bench2.txt
