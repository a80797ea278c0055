// A trace `fp8mla audit` cannot read: missing, truncated, not gzip or JSON where it should be,
// or not a Chrome trace. The message names the file and, for bad content, the byte offset.
#pragma once

#include <stdexcept>

namespace fp8mla::audit {

class TraceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace fp8mla::audit
