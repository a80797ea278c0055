#!/usr/bin/env bash
# Checks that a CUDA build of libfp8mla holds machine code for every architecture it promises:
# sm_80, sm_86, sm_89, sm_90a, sm_100 and sm_120 (or the FP8MLA_CUDA_ARCHS it was configured
# with), and the PTX of the newest. Lists the library's cubins with cuobjdump (the CUDA
# toolkit's, or PyPI's nvidia-cuda-cuobjdump, which scripts/setup.sh installs next to nvcc).
#   bash scripts/check_cubins.sh LIBRARY [ARCHS] [PTX]     (ARCHS: "80;86;89;90a;100;120")
set -euo pipefail
lib=$1
archs=${2:-80;86;89;90a;100;120}
ptx=${3-120}
cuobjdump=$(command -v cuobjdump || true)
[ -n "$cuobjdump" ] || [ ! -x /usr/local/cuda/bin/cuobjdump ] || cuobjdump=/usr/local/cuda/bin/cuobjdump
if [ -z "$cuobjdump" ]; then
  cuobjdump=$(python3 -c 'import nvidia, pathlib; print(next(p for d in nvidia.__path__ for p in pathlib.Path(d).glob("*/bin/cuobjdump")))' 2>/dev/null || true)
fi
[ -n "$cuobjdump" ] || { echo "check_cubins: no cuobjdump (pip install nvidia-cuda-cuobjdump)" >&2; exit 2; }
elfs=$("$cuobjdump" --list-elf "$lib")
ptxs=$("$cuobjdump" --list-ptx "$lib" 2>/dev/null || true)
status=0
IFS=';' read -ra want <<< "$archs"
for a in "${want[@]}"; do
  n=$(grep -c "\.sm_${a}\." <<< "$elfs" || true)
  echo "sm_${a}: ${n} cubins"
  [ "$n" -gt 0 ] || { echo "check_cubins: no sm_${a} machine code in $lib" >&2; status=1; }
done
if [ -n "$ptx" ]; then
  n=$(grep -c "\.sm_${ptx}\.ptx" <<< "$ptxs" || true)
  echo "compute_${ptx} PTX: ${n} modules"
  [ "$n" -gt 0 ] || { echo "check_cubins: no compute_${ptx} PTX in $lib" >&2; status=1; }
fi
exit $status
