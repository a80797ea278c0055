// The colours the command's pictures share, so that a cast is the same red in every plot.
#pragma once

namespace fp8mla::svg::palette {

inline constexpr const char* kKvCast = "#d62728";     // the KV cast: what the pictures point at
inline constexpr const char* kCast = "#f5a35c";       // other casts and copies
inline constexpr const char* kGather = "#e377c2";     // gathers of KV pages
inline constexpr const char* kAttention = "#1f77b4";  // attention
inline constexpr const char* kGemm = "#2ca02c";       // GEMMs
inline constexpr const char* kComm = "#9467bd";       // communication
inline constexpr const char* kOther = "#b8b8b8";      // everything else
inline constexpr const char* kIdle = "#f0f0f0";       // GPU idle inside a step
inline constexpr const char* kNative = "#17becf";     // fp8mla reading FP8 natively
inline constexpr const char* kCeiling = "#555555";    // measured ceilings

}  // namespace fp8mla::svg::palette
