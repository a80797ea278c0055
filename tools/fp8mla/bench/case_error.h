// A bench case's run with the case named in any error it throws: a CUDA error in a grid of
// hundreds of launches then says which case it came from, with or without --progress.
#pragma once

#include <string>
#include <utility>

#include "fp8mla/error.h"

namespace fp8mla::bench {

// f()'s result; an fp8mla::Error from it comes back with the same code and "case <label>: "
// before its message.
template <class F>
decltype(auto) run_named_case(const std::string& label, F&& f) {
  try {
    return std::forward<F>(f)();
  } catch (const Error& e) {
    throw Error(e.code(), "", "case " + label + ": " + e.what());
  }
}

}  // namespace fp8mla::bench
