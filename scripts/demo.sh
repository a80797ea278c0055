#!/usr/bin/env bash
# Installs what is missing, builds, and runs `fp8mla demo` (arguments are passed on to it:
# bash scripts/demo.sh --help lists them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec "${BUILD_DIR:-build}/tools/fp8mla/fp8mla" demo "$@"
