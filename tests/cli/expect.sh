#!/bin/sh
# A ctest case of the fp8mla command that checks its exit status and its output together:
#   expect.sh STATUS REGEX COMMAND [ARGS...]
# passes when COMMAND exits with STATUS and its output (stdout and stderr) matches REGEX, an
# extended regular expression (grep -E). With EXPECT_WITHOUT_GPU=1 in the environment the case
# is skipped (exit 77: ctest's SKIP_RETURN_CODE) when `COMMAND --version` reports a visible CUDA
# device, since it checks what the command says without one.
status=$1
regex=$2
shift 2
if [ "${EXPECT_WITHOUT_GPU:-}" = 1 ] && "$1" --version | grep -Eq '[1-9][0-9]* devices? visible'; then
  echo "skipped: a CUDA device is visible"
  exit 77
fi
out=$("$@" 2>&1)
got=$?
printf '%s\n' "$out"
if [ "$got" -ne "$status" ]; then
  echo "expect.sh: exit status $got, expected $status" >&2
  exit 1
fi
if ! printf '%s\n' "$out" | grep -Eq -- "$regex"; then
  echo "expect.sh: the output does not match '$regex'" >&2
  exit 1
fi
