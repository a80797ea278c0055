// Fuzz target: PagedLatentCache (a sequence of allocate / release / append / read_token calls
// with hostile counts, ids, slots and views) and the codecs (encode_token / decode_token on
// spans of any size, parse_format, make_view with any shape).
//
// Findings: a crash or sanitizer report, an exception other than fp8mla::Error, a failed call
// that changed the cache (allocate and release are all-or-nothing, append writes nothing when it
// throws), a free-page count that disagrees with what was handed out, or a token that does not
// decode to what its encoder stored.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "fp8mla/cache.h"
#include "fp8mla/error.h"
#include "fp8mla/format.h"
#include "fuzz/fuzz_input.h"
#include "fuzz/fuzz_tensor.h"

namespace {

using fp8mla::DType;
using fp8mla::Error;
using fp8mla::fuzz::Input;
using fp8mla::fuzz::require;
using fp8mla::fuzz::Tensor;

std::vector<std::uint8_t> bytes_of(const fp8mla::PagedLatentCache& c) {
  const fp8mla::TensorView s = c.storage();
  const auto* p = s.as<const std::uint8_t>();
  return {p, p + s.shape[0] * s.shape[1] * s.shape[2]};
}

void fuzz_cache(Input& in) {
  fp8mla::CacheConfig config;
  config.num_pages = in.int64_in(1, 16);
  config.page_size = in.int_in(1, 8);
  config.format = static_cast<fp8mla::KvFormat>(in.u8() % 4);
  config.scale = in.flag() ? in.f32() : 1.0f;
  // A pool is the caller's size to ask for: beyond what the fuzzer backs, skip (the library
  // checks the config, then allocates exactly num_pages x page_size x token bytes).
  const bool valid_size = config.num_pages >= 1 && config.page_size >= 1 &&
                          config.page_size <= 128 &&
                          config.num_pages <= (std::int64_t{1} << 31) / config.page_size;
  if (valid_size && config.num_pages * config.page_size * 1152 > (std::int64_t{64} << 20)) return;
  fp8mla::PagedLatentCache cache(config);
  std::set<std::int32_t> held;
  for (int op = 0; op < 8 && !in.exhausted(); ++op) {
    const std::int64_t free_before = cache.free_pages();
    const std::vector<std::uint8_t> before = bytes_of(cache);
    bool failed = false;
    try {
      switch (in.u8() % 4) {
        case 0: {
          const std::vector<std::int32_t> got = cache.allocate(in.int64_in(-1, 20));
          for (const std::int32_t page : got) require(held.insert(page).second);
          break;
        }
        case 1: {
          const std::vector<std::int32_t> pages = in.array(16, -1, 17);
          cache.release(pages);
          for (const std::int32_t page : pages) held.erase(page);
          break;
        }
        case 2: {
          const std::int64_t n = in.int64_in(0, 12);
          const DType type = static_cast<DType>(in.u8() % 7);
          Tensor slots = fp8mla::fuzz::tensor(in, DType::i32, {n});
          Tensor ckv = fp8mla::fuzz::tensor(in, type, {n, 512});
          Tensor kpe = fp8mla::fuzz::tensor(in, type, {n, 64});
          if (!slots.safe || !ckv.safe || !kpe.safe) break;
          // Slot ids from the input (in the pool or not, allocated or not), where the view
          // has its elements.
          const fp8mla::TensorView& v = slots.view;
          if (fp8mla::fuzz::reach_bytes(v) > 0 && v.ndim == 1 && v.dtype == DType::i32) {
            for (std::int64_t i = 0; i < v.shape[0] && i < 64; ++i) {
              const std::int32_t id = in.int_in(-1, 200);
              std::memcpy(slots.storage.get() + i * v.stride[0] * 4, &id, sizeof id);
            }
          }
          const fp8mla::NanPolicy nan =
              in.flag() ? fp8mla::NanPolicy::error : fp8mla::NanPolicy::propagate;
          cache.append(slots.view, ckv.view, kpe.view, nan);
          break;
        }
        default: {
          std::vector<float> token(in.size_in(600));
          cache.read_token(in.int64_in(-1, 200), token);
          break;
        }
      }
    } catch (const Error&) {
      failed = true;
    }
    require(cache.free_pages() + static_cast<std::int64_t>(held.size()) == config.num_pages);
    if (failed) {
      require(cache.free_pages() == free_before);
      require(bytes_of(cache) == before);
    }
  }
}

void fuzz_codecs(Input& in) {
  const auto format = static_cast<fp8mla::KvFormat>(in.u8() % 4);
  const float scale = in.flag() ? in.f32() : 1.0f;
  std::vector<float> values(in.size_in(700));
  for (float& v : values) v = in.flag() ? in.f32() : static_cast<float>(in.u8()) - 128.0f;
  std::vector<std::uint8_t> token(in.size_in(700));
  const fp8mla::NanPolicy nan = in.flag() ? fp8mla::NanPolicy::error : fp8mla::NanPolicy::propagate;
  bool encoded = false;
  try {
    fp8mla::encode_token(format, scale, values, token, nan);
    encoded = true;
  } catch (const Error&) {
    for (const std::uint8_t b : token) require(b == 0);  // nothing written on failure
  }
  std::vector<float> decoded(fp8mla::kDimQk);
  if (encoded) {
    fp8mla::decode_token(format, scale, token, decoded);
    // Encoding what was decoded gives the same bytes back (the codecs are exact).
    std::vector<std::uint8_t> again(token.size());
    fp8mla::encode_token(format, scale, decoded, again);
    // (fp8_e4m3 with a scale far from 1 may round code x scale into float's subnormals.)
    const bool exact = format == fp8mla::KvFormat::bf16 ||
                       (format == fp8mla::KvFormat::fp8_e4m3 && std::fabs(std::log2(scale)) < 20);
    if (exact) {
      for (std::size_t i = 0; i < token.size(); ++i) {
        // NaN codes keep their NaN-ness (the payload of a bf16 NaN may change).
        require(again[i] == token[i] ||
                std::isnan(decoded[format == fp8mla::KvFormat::bf16 ? i / 2 : i]));
      }
    }
  }
  // Arbitrary bytes of any length decode or fail cleanly.
  std::vector<std::uint8_t> raw(in.size_in(700));
  for (std::uint8_t& b : raw) b = in.u8();
  std::vector<float> out(in.size_in(700));
  try {
    fp8mla::decode_token(format, scale, raw, out);
  } catch (const Error&) {
  }
  std::string name(static_cast<std::size_t>(in.u8() % 16), '\0');
  for (char& ch : name) ch = static_cast<char>(in.u8());
  try {
    (void)fp8mla::parse_format(name);
  } catch (const Error&) {
  }
  try {  // five dimensions: always an error
    (void)fp8mla::make_view(nullptr, DType::f32, {1, 1, 1, 1, 1});
    std::abort();
  } catch (const Error&) {
  }
  try {
    const fp8mla::TensorView t = fp8mla::make_strided_view(
        nullptr, static_cast<DType>(in.u8() % 6), {in.int64_in(-1, 9), in.int64_in(-1, 9)},
        {in.int64_in(-1, 9), in.int64_in(-1, 9)});
    require(t.shape[0] >= 0 && t.shape[1] >= 0 && t.stride[0] >= 0 && t.stride[1] >= 0);
    (void)t.describe();
    (void)t.is_contiguous();
  } catch (const Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  try {
    if (in.u8() % 2 == 0) {
      fuzz_cache(in);
    } else {
      fuzz_codecs(in);
    }
  } catch (const Error&) {
    // The documented outcome of bad input (a bad CacheConfig).
  }
  return 0;
}
