#!/usr/bin/env bash
# Builds .device_carry/flashinfer/: a trimmed FlashInfer 0.7.4 and apache-tvm-ffi that a device
# call can carry (the 0.7.4 wheel is 101 MB, over the 64 MiB a call carries; the device has no
# network). What it holds is what `from flashinfer.mla import BatchMLAPagedAttentionWrapper`
# and the fa3 backend's plan()/run() with bf16 queries and an FP8 e4m3 cache need:
#
#   flashinfer/                 the Python package: every top-level module, the packages jit/,
#                               mla/, autotuner/, trace/ whole (*.py), cute_dsl/*.py (the
#                               wrapper imports its availability checks); nothing else
#   flashinfer/__init__.py      REPLACED (patch 1 below)
#   flashinfer/data/csrc/       batch_mla_config.jinja, batch_mla_sm90_{plan,run,binding}.cu,
#                               tvm_ffi_utils.h: the sources of the JIT module
#                               batch_mla_attention_dtype_q_bf16_dtype_kv_e4m3_dtype_o_bf16_
#                               dtype_idx_i32_head_dim_ckv_512_head_dim_kpe_64_profiler_False_
#                               planabi2_sm90 (flashinfer/jit/attention/modules.py,
#                               gen_batch_mla_module("fa3", ...))
#   flashinfer/data/include, data/cccl, data/cutlass
#                               the headers that module includes, found with `nvcc -M` on its
#                               sources under the JIT's own flags: flashinfer's and CCCL's whole
#                               folders that hold one (cheap margin), CUTLASS/CuTe's exact files
#   flashinfer/data/aot/<module>/<module>.so
#                               (with FI_AOT_PYTHON) the module prebuilt here for sm_90a: FlashInfer
#                               loads data/aot/<name>/<name>.so before it JIT-compiles
#                               (jit/env.py get_aot_artifacts), so the device skips the ~3-minute
#                               compile; without it (or if it fails to load) the device compiles
#                               from the carried headers with its own nvcc
#   tvm_ffi/, apache_tvm_ffi-*.dist-info/
#                               the apache-tvm-ffi wheel (cp312, the device's Python) unpacked,
#                               less 3rdparty/libbacktrace and src/ (sources; core.so links lib/libtvm_ffi_testing.so, kept)
#
# Patches to the carried copy (nothing else is changed):
#   1. flashinfer/__init__.py is replaced by one that imports only .version. The wheel's imports
#      every subsystem (MoE, GEMM, comm, cuDNN, CuTe-DSL kernels, ...), which would need the
#      whole 700 MB tree; flashinfer.mla imports what it needs itself. The original is kept as
#      flashinfer/__init__.py.orig for reference (not imported).
#
# Usage: scripts/device/carry_flashinfer.sh            (from anywhere; writes <repo>/.device_carry)
# Environment:
#   FI_WHEELS      folder with flashinfer_python-0.7.4-py3-none-any.whl and the
#                  apache_tvm_ffi-*-cp312-*.whl (default /tmp/fi-peers; downloaded there with
#                  pip when missing)
#   FI_OUT         output folder (default <repo>/.device_carry/flashinfer; replaced)
#   FI_AOT_PYTHON  a Python 3.12 with torch (CPU or CUDA): also compile the fa3 FP8 module here
#                  (nvcc, sm_90a, ~3 min on 2 cores) into data/aot/, which also proves the carried
#                  headers complete. Unset: headers only; the device compiles (MAX_JOBS=16).
#   CUDA_HOME      toolkit for nvcc -M and the AOT build (default /usr/local/cuda)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
wheels=${FI_WHEELS:-/tmp/fi-peers}
out=${FI_OUT:-$root/.device_carry/flashinfer}
cuda=${CUDA_HOME:-/usr/local/cuda}
nvcc="$cuda/bin/nvcc"
fi_version=0.7.4
tvm_spec='apache-tvm-ffi==0.1.15.post2'

mkdir -p "$wheels"
fi_whl="$wheels/flashinfer_python-$fi_version-py3-none-any.whl"
if [[ ! -f "$fi_whl" ]]; then
  python3 -m pip download -q --no-deps -d "$wheels" "flashinfer-python==$fi_version"
fi
tvm_whl=$(ls "$wheels"/apache_tvm_ffi-*-cp312-*.whl 2>/dev/null | head -1 || true)
if [[ -z "$tvm_whl" ]]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$wheels" "$tvm_spec"
  tvm_whl=$(ls "$wheels"/apache_tvm_ffi-*-cp312-*.whl | head -1)
fi
[[ -x "$nvcc" ]] || { echo "carry_flashinfer: nvcc not found at $nvcc (set CUDA_HOME)" >&2; exit 1; }

stage=$(mktemp -d /tmp/fi-carry.XXXXXX)
trap 'rm -rf "$stage"' EXIT
echo "== unpacking $(basename "$fi_whl") and $(basename "$tvm_whl")"
python3 - "$fi_whl" "$stage/fi" "$tvm_whl" "$stage/tvm" <<'EOF'
import sys, zipfile
for whl, dest in ((sys.argv[1], sys.argv[2]), (sys.argv[3], sys.argv[4])):
    zipfile.ZipFile(whl).extractall(dest)
EOF
src="$stage/fi/flashinfer"
rm -rf "$out"
mkdir -p "$out/flashinfer"

echo "== python package"
# Every top-level module (small, and lazy `from ..utils import ...` style imports stay valid),
# then whole packages on the MLA path.
cp "$src"/*.py "$out/flashinfer/"
cp "$src"/py.typed "$out/flashinfer/" 2>/dev/null || true
for pkg in jit mla autotuner trace; do
  (cd "$src" && find "$pkg" -name '*.py') | while read -r f; do
    mkdir -p "$out/flashinfer/$(dirname "$f")"
    cp "$src/$f" "$out/flashinfer/$f"
  done
done
mkdir -p "$out/flashinfer/cute_dsl"
cp "$src"/cute_dsl/*.py "$out/flashinfer/cute_dsl/"

# Patch 1: a minimal package __init__ (see the header).
mv "$out/flashinfer/__init__.py" "$out/flashinfer/__init__.py.orig"
cat > "$out/flashinfer/__init__.py" <<'EOF'
"""FlashInfer, trimmed for fp8mla's peer benchmark (scripts/device/carry_flashinfer.sh).

The wheel's __init__ imports every subsystem; this carried copy holds only what
`from flashinfer.mla import BatchMLAPagedAttentionWrapper` (fa3 backend, FP8 KV cache) needs,
so it imports the version alone. The original is __init__.py.orig beside this file.
"""

from .version import __git_commit__ as __git_commit__
from .version import __git_version__ as __git_version__
from .version import __version__ as __version__
EOF

echo "== JIT sources and the headers they include"
mkdir -p "$out/flashinfer/data/csrc"
for f in batch_mla_config.jinja batch_mla_sm90_plan.cu batch_mla_sm90_run.cu \
  batch_mla_sm90_binding.cu tvm_ffi_utils.h; do
  cp "$src/data/csrc/$f" "$out/flashinfer/data/csrc/"
done
# The generated config (flashinfer/jit/attention/modules.py renders the jinja template with
# these types for bf16 q / e4m3 kv / bf16 out / int32 indices) and nvcc -M under the JIT's
# include order and defines (jit/cpp_ext.py): the header set of the real compile.
gen="$stage/gen"
mkdir -p "$gen"
cp "$src"/data/csrc/batch_mla_sm90_*.cu "$gen/"
sed -e 's/{{ dtype_q }}/nv_bfloat16/' -e 's/{{ dtype_kv }}/__nv_fp8_e4m3/' \
  -e 's/{{ dtype_o }}/nv_bfloat16/' -e 's/{{ dtype_idx }}/int32_t/' \
  -e 's/{{ head_dim_ckv }}/512/' -e 's/{{ head_dim_kpe }}/64/' \
  "$src/data/csrc/batch_mla_config.jinja" > "$gen/batch_mla_sm90_config.inc"
d="$src/data"
tvm_inc="$stage/tvm/tvm_ffi/include"
# shellcheck disable=SC2054  # the -gencode value holds a comma
flags=(-D_GLIBCXX_USE_CXX11_ABI=1 -I"$d/cccl/cub" -I"$d/cccl/libcudacxx/include" -I"$d/cccl/thrust"
  -isystem "$cuda/include" -isystem "$tvm_inc" -isystem "$d/include" -isystem "$d/csrc"
  -isystem "$d/cutlass/include" -isystem "$d/cutlass/tools/util/include"
  -isystem "$d/spdlog/include" --expt-relaxed-constexpr -std=c++17 -use_fast_math
  -DFLASHINFER_ENABLE_F16 -DFLASHINFER_ENABLE_BF16 -DFLASHINFER_ENABLE_FP8_E4M3
  -DFLASHINFER_ENABLE_FP8_E5M2 -DNDEBUG -O3 -gencode=arch=compute_90a,code=sm_90a
  -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -DFLASHINFER_ENABLE_FP8_E8M0
  -DFLASHINFER_ENABLE_FP4_E2M1)
: > "$gen/deps"
for f in "$gen"/batch_mla_sm90_{plan,run,binding}.cu; do
  "$nvcc" "${flags[@]}" -M "$f" -o "$gen/one.d" 2>/dev/null
  cat "$gen/one.d" >> "$gen/deps"
done
tr ' \\' '\n\n' < "$gen/deps" | grep "^$d/" | grep -v ':$' | sed "s#^$d/##" | sort -u > "$gen/files"
echo "   $(wc -l < "$gen/files") header files under data/ from nvcc -M"
# flashinfer's and CCCL's headers: each folder that holds one, whole (no subfolders); CUTLASS
# and CuTe: the exact files (their folders hold large unrelated architectures).
{
  grep -E '^(include|cccl)/' "$gen/files" | xargs -n1 dirname | sort -u | while read -r dir; do
    (cd "$d" && find "$dir" -maxdepth 1 -type f)
  done
  grep -E '^(cutlass|csrc)/' "$gen/files"
} | sort -u > "$gen/copy"
(cd "$d" && tar cf - -T "$gen/copy") | (cd "$out/flashinfer/data" && tar xf -)
# The JIT's include flags name these folders; empty ones are fine for the compiler.
mkdir -p "$out/flashinfer/data/cccl/cub" "$out/flashinfer/data/cccl/thrust" \
  "$out/flashinfer/data/cutlass/tools/util/include" "$out/flashinfer/data/spdlog/include"

echo "== apache-tvm-ffi"
cp -r "$stage/tvm/tvm_ffi" "$out/"
cp -r "$stage"/tvm/apache_tvm_ffi-*.dist-info "$out/"
rm -rf "$out/tvm_ffi/3rdparty/libbacktrace" "$out/tvm_ffi/src"
find "$out" -name '__pycache__' -prune -exec rm -rf {} +

if [[ -n "${FI_AOT_PYTHON:-}" ]]; then
  echo "== prebuilding the fa3 FP8 module for sm_90a with $FI_AOT_PYTHON (from the carried headers)"
  ws="$stage/ws"
  mkdir -p "$ws"
  PATH="$cuda/bin:$PATH" CUDA_HOME="$cuda" FLASHINFER_CUDA_ARCH_LIST=9.0a \
    FLASHINFER_WORKSPACE_BASE="$ws" MAX_JOBS="${MAX_JOBS:-2}" PYTHONPATH="$out" \
    TVM_FFI_DISABLE_TORCH_C_DLPACK=1 "$FI_AOT_PYTHON" - "$out" <<'EOF'
import pathlib, shutil, sys, time
import torch
from flashinfer.jit import gen_batch_mla_module

spec = gen_batch_mla_module("fa3", torch.bfloat16, torch.float8_e4m3fn, torch.bfloat16,
                            torch.int32, 512, 64, False)
t0 = time.time()
spec.build(verbose=False)
dest = pathlib.Path(sys.argv[1]) / "flashinfer" / "data" / "aot" / spec.name
dest.mkdir(parents=True, exist_ok=True)
shutil.copy2(spec.jit_library_path, dest / f"{spec.name}.so")
print(f"   built {spec.name}.so in {time.time() - t0:.0f} s")
EOF
fi

{
  echo "flashinfer-python $fi_version (trimmed), $(basename "$tvm_whl")"
  echo "built by scripts/device/carry_flashinfer.sh on $(date -u +%Y-%m-%dT%H:%MZ)"
  echo "PYTHONPATH=<this folder>; import flashinfer.mla"
} > "$out/CARRY.txt"
echo "== $out: $(du -sh "$out" | cut -f1) in $(find "$out" -type f | wc -l) files"
du -sh "$out"/flashinfer "$out"/flashinfer/data "$out"/tvm_ffi
