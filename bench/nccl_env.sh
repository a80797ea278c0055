# Sourced by the device scripts: the environment NCCL runs in there. NVLink multicast stays off
# (the device README: it can take the host's shared GPUs out of service), and fp8mla finds NCCL
# through FP8MLA_NCCL_LIBRARY: the device image has no system libnccl, only PyTorch's wheel's.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -z "${FP8MLA_NCCL_LIBRARY:-}" ]; then
  FP8MLA_NCCL_LIBRARY=$(python3 -c '
import glob, site
for d in site.getsitepackages():
    for f in sorted(glob.glob(d + "/nvidia/**/libnccl.so.2", recursive=True)):
        print(f)
        raise SystemExit
' 2>/dev/null)
  [ -n "$FP8MLA_NCCL_LIBRARY" ] && export FP8MLA_NCCL_LIBRARY
fi
echo "NCCL for fp8mla: ${FP8MLA_NCCL_LIBRARY:-libnccl.so.2, as the loader finds it}"
