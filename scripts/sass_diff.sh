#!/usr/bin/env bash
# Checks that moving CUDA code between files, namespaces and translation units left every
# kernel's machine code as it was: builds libfp8mla (CUDA on) from BASE (a git ref) and from the
# working tree, dumps each kernel's SASS and resource usage (cuobjdump -sass / -res-usage),
# renames the base's kernels to their names in the tree (the map below), and diffs kernel by
# kernel. Exit 0 when every kernel matches apart from its name. No GPU needed.
#
# Usage: scripts/sass_diff.sh [BASE] [OUT_DIR]
#   BASE     git ref of the tree before the moves (default: main)
#   OUT_DIR  builds, dumps and the venv with cuobjdump / nvdisasm (default: build-sass)
# cuobjdump and nvdisasm come from PyPI (nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm) into
# OUT_DIR/venv unless they are on PATH. Environment: JOBS (2), NVCC (/usr/local/cuda/bin/nvcc).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)
base=${1:-main}
out=$(mkdir -p "${2:-build-sass}" && cd "${2:-build-sass}" && pwd)
jobs=${JOBS:-2}
nvcc=${NVCC:-/usr/local/cuda/bin/nvcc}

if ! command -v cuobjdump >/dev/null || ! command -v nvdisasm >/dev/null; then
  if [ ! -x "$out/venv/bin/python" ]; then
    python3 -m venv "$out/venv"
    "$out/venv/bin/pip" install -q --disable-pip-version-check nvidia-cuda-cuobjdump \
      nvidia-cuda-nvdisasm
  fi
  bin=$(dirname "$(find "$out/venv" -name cuobjdump -type f | head -1)")
  export PATH="$bin:$PATH"
fi

build_lib() {  # build_lib SOURCE_DIR BUILD_DIR
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFP8MLA_CUDA=ON \
    -DFP8MLA_BUILD_TESTS=OFF -DFP8MLA_BUILD_TOOLS=OFF -DCMAKE_CUDA_COMPILER="$nvcc" >/dev/null
  cmake --build "$2" -j "$jobs" --target fp8mla >/dev/null
}

base_commit=$(git rev-parse "$base^{commit}")
if [ "$(cat "$out/base-src/.commit" 2>/dev/null)" != "$base_commit" ]; then
  rm -rf "$out/base-src" "$out/base"
  mkdir -p "$out/base-src"
  git archive "$base_commit" | tar -x -C "$out/base-src"
  echo "$base_commit" >"$out/base-src/.commit"
fi
echo "building $base ($(git rev-parse --short "$base_commit"))"
build_lib "$out/base-src" "$out/base"
echo "building the working tree"
build_lib "$root" "$out/tree"

# One file per kernel: its SASS without the name line, then its resource line.
split_kernels() {  # split_kernels LIB DIR
  rm -rf "$2"
  mkdir -p "$2"
  cuobjdump -sass "$1" >"$2.sass"
  cuobjdump -res-usage "$1" >"$2.res"
  python3 - "$2" <<'EOF'
import re, subprocess, sys
d = sys.argv[1]
def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return out.stdout.split("\n")
# Base names -> names in the tree (one name per kernel family; see src/core/dispatch.h).
renames = [
    (r"mla_decode_kernel<", "shared_tile::shared_tile_kernel<"),
    (r"mla_decode_fp8_kernel\(", "fp8_exact::fp8_exact_kernel("),
    (r"mla_decode_fp8_tma_kernel\(", "fp8_tma::fp8_tma_kernel("),
    (r"mla_decode_fp8_gather_kernel\(", "fp8_gather::fp8_gather_kernel("),
    (r"mla_decode_bf16_tma_kernel<false>\(", "bf16_tma::bf16_tma_kernel("),
    (r"mla_decode_bf16_tma_kernel<true>\(", "bf16_gather::bf16_gather_kernel("),
    (r"mla_decode_wgmma_ws_kernel<", "wide_rows::wide_rows_kernel<"),
    (r"mla_decode_bf16_seesaw_kernel\(", "bf16_wide_rows::bf16_wide_rows_kernel("),
    (r"(?<!merge::)split_merge_kernel<", "merge::split_merge_kernel<"),
    (r"(?<!merge::)merge_states_kernel<", "merge::merge_states_kernel<"),
    (r"(?<!cache::)append_kernel<", "cache::append_kernel<"),
]
def normal(name):
    name = name.replace("(anonymous namespace)::", "").replace("fp8mla::detail::", "")
    name = re.sub(r"^void ", "", name)  # templates demangle with their return type
    for old, new in renames:
        name = re.sub(old, new, name)
    return name
blocks, names, cur = [], [], None
for line in open(d + ".sass"):
    m = re.match(r"\s*Function : (\S+)", line)
    if m:
        cur = []
        blocks.append(cur)
        names.append(m.group(1))
    elif cur is not None:
        cur.append(line)
        if re.match(r"\s*\.{10}\s*$", line):  # the function's end
            cur = None
res = {}
name = None
for line in open(d + ".res"):
    m = re.match(r"\s*Function (\S+):", line)
    if m:
        name = m.group(1)
    elif name and "REG:" in line:
        res[name] = line.strip()
        name = None
plain = demangle(names)
for mangled, pretty, body in zip(names, plain, blocks):
    key = normal(pretty)
    fname = re.sub(r"[^A-Za-z0-9_<>,.-]+", "_", key)[:200]
    with open(f"{d}/{fname}.txt", "w") as f:
        f.write(key + "\n" + res.get(mangled, "no resource line") + "\n" + "".join(body))
EOF
}
split_kernels "$out/base/src/libfp8mla.a" "$out/base-kernels"
split_kernels "$out/tree/src/libfp8mla.a" "$out/tree-kernels"

# Per kernel: its instructions (with their encodings; runs of blanks collapsed, as cuobjdump pads
# columns to the widest line of its dump) and its resource line.
status=0
n=0
changed=0
for f in "$out"/base-kernels/*.txt; do
  k=$(basename "$f")
  t="$out/tree-kernels/$k"
  n=$((n + 1))
  name=$(head -1 "$f")
  if [ ! -f "$t" ]; then
    echo "MISSING in the tree: $name"
    status=1
  elif ! cmp -s <(sed 1,2d "$f" | tr -s ' ') <(sed 1,2d "$t" | tr -s ' '); then
    echo "DIFFERS:   $name"
    diff <(sed 1,2d "$f" | tr -s ' ') <(sed 1,2d "$t" | tr -s ' ') | head -20 || true
    status=1
  elif [ "$(sed -n 2p "$f")" != "$(sed -n 2p "$t")" ]; then
    echo "same code, resources differ: $name"
    echo "    base: $(sed -n 2p "$f")"
    echo "    tree: $(sed -n 2p "$t")"
    changed=$((changed + 1))
  else
    echo "identical: $name  [$(sed -n 2p "$f" | cut -d' ' -f1-3)]"
  fi
done
for f in "$out"/tree-kernels/*.txt; do
  [ -f "$out/base-kernels/$(basename "$f")" ] || echo "NEW in the tree: $(head -1 "$f")"
done
if [ $status = 0 ]; then
  echo "$n kernels of $base: the same instructions apart from names ($changed with other resources)"
else
  echo "$n kernels of $base: differences above"
fi
exit $status
