#!/usr/bin/env bash
# Packs folders under .device_carry/ into one xz archive, .device_carry/packed/carry.tar.xz, so
# that one device call carries more than its 64 MiB: binaries and the carried Python packages
# compress about 10x (the CLI, the test binary, fp8mla_py, FlashInfer's trimmed package and
# FlashMLA, 115 MB, pack to 9 MB). Carry the folder `.device_carry/packed` and unpack it on the
# device, from the repository root, with the line this script prints (Python's tarfile: no xz
# binary needed there); the folders come back where they were.
#
# Usage: scripts/device/pack_carry.sh NAME [NAME ...]   (folders of .device_carry/, e.g. cli
#        fp8mla_py flashinfer flashmla)
# Environment: CARRY_DIR (the folders' parent, default <repo>/.device_carry), PACK_OUT (default
#              <repo>/.device_carry/packed/carry.tar.xz; replaced)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
carry=${CARRY_DIR:-$root/.device_carry}
out=${PACK_OUT:-$root/.device_carry/packed/carry.tar.xz}
if [[ $# -eq 0 ]]; then
  echo "usage: $0 NAME [NAME ...]  (folders of .device_carry/)" >&2
  exit 2
fi
for name in "$@"; do
  if [[ "$name" == */* || "$name" == .* || ! -d "$carry/$name" ]]; then
    echo "pack_carry: no folder .device_carry/$name" >&2
    exit 2
  fi
done
mkdir -p "$(dirname "$out")"
rm -f "$out"
tar -C "$carry" -cf - "$@" | xz -9 -T0 -c > "$out.tmp"
mv "$out.tmp" "$out"
rel=${out#"$root"/}
echo "packed $* into $rel ($(du -h "$out" | cut -f1)); unpack on the device with:"
echo "  python3 -c \"import tarfile; tarfile.open('$rel').extractall('.device_carry')\""
