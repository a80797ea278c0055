// `fp8mla bench --cp N`: the launcher of its ranks (one process a GPU) and the text form of the
// NCCL id they share.
#pragma once

#include <span>
#include <string>
#include <string_view>

#include "fp8mla/context_parallel.h"

namespace fp8mla::cli {

// Starts `world` copies of this program as `fp8mla bench <args> --cp-rank R --cp-id HEX` for
// R = 0..world-1, with a fresh NCCL id (this process serves its bootstrap) and
// NCCL_NVLS_ENABLE=0 unless the environment sets it, and waits for them. When one fails, the
// others are stopped (they would wait for it forever). Returns the worst exit status. Throws
// fp8mla::Error (unsupported) with fewer than `world` visible GPUs or without NCCL.
int launch_ranks(int world, std::span<const std::string_view> args);

// 256 lowercase hex digits, and back (UsageError naming --cp-id for anything else).
std::string id_to_hex(const NcclId& id);
NcclId id_from_hex(std::string_view hex);

}  // namespace fp8mla::cli
