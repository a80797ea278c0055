#!/usr/bin/env bash
# Builds .device_carry/flashmla/: FlashMLA's prebuilt CUDA extension and its Python interface as
# vLLM's x86_64 wheel ships them, as the package flashmla_vllm, for bench/peers/peer_flashmla.py
# on the device (which has no network). The wheel (about 300 MB) is not downloaded: its two
# members are read from PyPI with HTTP range requests (the zip's central directory, then each
# member; about 1.6 MB in all), their CRC-32 checked by zipfile.
#
#   flashmla_vllm/_flashmla_C.abi3.so        vllm/_flashmla_C.abi3.so: FlashMLA built on torch's
#                                            stable ABI (vLLM 0.26.0: torch 2.11, CUDA 13,
#                                            sm_90a and sm_100f); it registers torch.ops._flashmla_C
#   flashmla_vllm/flash_mla_interface.py     vllm/third_party/flashmla/flash_mla_interface.py,
#                                            its `import vllm._flashmla_C` replaced (sed) by
#                                            torch.ops.load_library of the .so beside it
#   flashmla_vllm/__init__.py                exports get_mla_metadata, flash_mla_with_kvcache
#                                            and FlashMLASchedMeta
#   LICENSE.vllm                             the wheel's license file (FlashMLA itself is MIT)
#   CARRY.txt                                what, from where: wheel URL and sha256, the .so's
#                                            sha256
#
# Usage: scripts/device/carry_flashmla.sh     (from anywhere; needs network and python3)
# Environment:
#   VLLM_VERSION  the vLLM release to read (default 0.26.0)
#   WHEEL_URL     read this wheel instead of looking the release up on PyPI
#   FLASHMLA_OUT  output folder (default <repo>/.device_carry/flashmla; replaced)
#   PYTHON        interpreter for the range reader (default python3; standard library only)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
out=${FLASHMLA_OUT:-$root/.device_carry/flashmla}
version=${VLLM_VERSION:-0.26.0}
py=${PYTHON:-python3}
pkg="$out/flashmla_vllm"

rm -rf "$out"
mkdir -p "$pkg"
echo "== reading FlashMLA from vLLM $version's x86_64 wheel (HTTP range requests)"
"$py" - "$version" "${WHEEL_URL:-}" "$out" <<'PY'
"""Finds the wheel, then reads the members below out of it with HTTP range requests."""
import io
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
import zipfile

version, url, out = sys.argv[1], sys.argv[2], sys.argv[3]
MEMBERS = {  # wheel member -> path under out
    "vllm/_flashmla_C.abi3.so": "flashmla_vllm/_flashmla_C.abi3.so",
    "vllm/third_party/flashmla/flash_mla_interface.py": "flashmla_vllm/flash_mla_interface.py",
    f"vllm-{version}.dist-info/licenses/LICENSE": "LICENSE.vllm",
}


def get_json(address):
    req = urllib.request.Request(address, headers={"Accept": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def release_files(version):
    """The release's files from PyPI's JSON API, each url made absolute: the version's own page,
    else the project page's releases (a mirror may serve only that one, with relative urls)."""
    page = f"https://pypi.org/pypi/vllm/{version}/json"
    try:
        files = get_json(page)["urls"]
    except urllib.error.HTTPError as e:
        print(f"   {page}: HTTP {e.code}; using the project page")
        page = "https://pypi.org/pypi/vllm/json"
        releases = get_json(page)["releases"]
        if version not in releases:
            sys.exit(f"carry_flashmla: vLLM {version} is not on PyPI")
        files = releases[version]
    return [dict(f, url=urllib.parse.urljoin(page, f["url"])) for f in files]


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over an HTTP URL: each read is one Range request."""

    def __init__(self, address):
        self.address, self.pos, self.fetched = address, 0, 0
        req = urllib.request.Request(address, method="HEAD")
        with urllib.request.urlopen(req, timeout=60) as r:
            self.size = int(r.headers["Content-Length"])

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=0):
        base = {0: 0, 1: self.pos, 2: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def readinto(self, buf):
        n = min(len(buf), self.size - self.pos)
        if n <= 0:
            return 0
        req = urllib.request.Request(
            self.address, headers={"Range": f"bytes={self.pos}-{self.pos + n - 1}"})
        with urllib.request.urlopen(req, timeout=120) as r:
            if r.status != 206:
                raise OSError(f"{self.address}: no range support (HTTP {r.status})")
            data = r.read()
        buf[:len(data)] = data
        self.pos += len(data)
        self.fetched += len(data)
        return len(data)


sha256 = ""
if not url:
    wheels = [f for f in release_files(version)
              if f["filename"].endswith(".whl") and "x86_64" in f["filename"]]
    if len(wheels) != 1:
        sys.exit(f"carry_flashmla: expected one x86_64 wheel of vLLM {version}, found "
                 f"{[f['filename'] for f in wheels]}")
    url, sha256 = wheels[0]["url"], wheels[0]["digests"]["sha256"]
raw = RangeFile(url)
with zipfile.ZipFile(io.BufferedReader(raw, buffer_size=1 << 20)) as z:
    names = set(z.namelist())
    missing = [m for m in MEMBERS if m not in names]
    if missing:
        sys.exit(f"carry_flashmla: {url} has no {', '.join(missing)}")
    for member, dest in MEMBERS.items():
        data = z.read(member)  # zipfile checks the member's CRC-32
        with open(os.path.join(out, dest), "wb") as f:
            f.write(data)
        print(f"   {member}: {len(data)} bytes")
print(f"   read {raw.fetched} of the wheel's {raw.size} bytes")
with open(os.path.join(out, ".wheel"), "w") as f:
    f.write(f"{url}\n{sha256 or 'not known (WHEEL_URL given)'}\n{raw.size}\n")
PY

# The interface imports vllm._flashmla_C (the extension registering torch.ops._flashmla_C); the
# carried package loads the .so beside it instead, so no vllm package is needed.
iface="$pkg/flash_mla_interface.py"
[[ $(grep -c '^import vllm\._flashmla_C$' "$iface") == 1 ]] ||
  { echo "carry_flashmla: $iface has no single 'import vllm._flashmla_C' line" >&2; exit 1; }
sed -i -e "1i # From the vLLM $version wheel: vllm/third_party/flashmla/flash_mla_interface.py (FlashMLA, MIT)." \
  -e '1i # scripts/device/carry_flashmla.sh replaced its extension import by the load_library below.' \
  -e 's|^import vllm\._flashmla_C$|import os as _os\ntorch.ops.load_library(_os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "_flashmla_C.abi3.so"))|' \
  "$iface"
grep -q '^import vllm' "$iface" && { echo "carry_flashmla: $iface still imports vllm" >&2; exit 1; }
cat > "$pkg/__init__.py" <<'EOF'
"""FlashMLA's Python interface over its prebuilt extension, both from vLLM's wheel (../CARRY.txt
says which); loading it registers torch.ops._flashmla_C."""
from .flash_mla_interface import (  # noqa: F401
    FlashMLASchedMeta,
    flash_mla_with_kvcache,
    get_mla_metadata,
)
EOF

# The interface this peer calls: flash_mla_with_kvcache with the sparse FP8 arguments and out=.
"$py" - "$iface" <<'PY'
import ast
import sys

tree = ast.parse(open(sys.argv[1]).read())
funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
need = {"get_mla_metadata": set(),
        "flash_mla_with_kvcache": {"indices", "is_fp8_kvcache", "softmax_scale", "out"}}
for name, args in need.items():
    if name not in funcs:
        sys.exit(f"carry_flashmla: the interface has no {name}()")
    have = {a.arg for a in funcs[name].args.args + funcs[name].args.kwonlyargs}
    if args - have:
        sys.exit(f"carry_flashmla: {name}() lacks {sorted(args - have)}")
print("   interface: get_mla_metadata(), flash_mla_with_kvcache(..., indices, is_fp8_kvcache, "
      "out) present")
PY

{ read -r url; read -r wheel_sha; read -r wheel_size; } < "$out/.wheel"
rm -f "$out/.wheel"
{
  echo "FlashMLA from vLLM $version's wheel: vllm/_flashmla_C.abi3.so (torch stable ABI, CUDA 13, sm_90a/sm_100f) + vllm/third_party/flashmla/flash_mla_interface.py"
  echo "wheel: $url"
  echo "wheel sha256 (PyPI): $wheel_sha ($wheel_size bytes; members read by HTTP range, CRC-32 checked)"
  echo "_flashmla_C.abi3.so sha256: $(sha256sum "$pkg/_flashmla_C.abi3.so" | cut -d' ' -f1)"
  echo "flash_mla_interface.py: its 'import vllm._flashmla_C' replaced by torch.ops.load_library of the .so beside it"
  echo "needs on the device: torch 2.11 (stable ABI), libcudart.so.13; built by scripts/device/carry_flashmla.sh on $(date -u +%Y-%m-%dT%H:%MZ)"
} > "$out/CARRY.txt"
cat "$out/CARRY.txt"
echo "== $out: $(du -sh "$out" | cut -f1)"
