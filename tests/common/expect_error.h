// expect_error(): a call must throw fp8mla::Error with a given code whose message contains given
// words (the argument's name, the offending value, the bound); error_of(): the Error a call
// throws, for tests that check its fields. Shared by the CPU and GPU suites.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <initializer_list>
#include <string>

#include "fp8mla/error.h"

namespace fp8mla::test {

// Calls f and expects an fp8mla::Error with `code` whose what() contains every needle. Any other
// exception, or none, is a failure (the library promises fp8mla::Error only).
inline void expect_error(const std::function<void()>& f, std::initializer_list<const char*> needles,
                         ErrorCode code = ErrorCode::invalid_argument) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(static_cast<int>(e.code()), static_cast<int>(code)) << e.what();
    for (const char* n : needles) {
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "message \"" << e.what() << "\" lacks \"" << n << "\"";
    }
    return;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "an exception other than fp8mla::Error escaped: " << e.what();
    return;
  }
  ADD_FAILURE() << "no fp8mla::Error thrown (expected one naming "
                << (needles.size() > 0 ? *needles.begin() : "?") << ")";
}

// Calls f and returns the fp8mla::Error it throws; a failure when it throws none (the returned
// Error then names "(none)").
inline Error error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "expected an fp8mla::Error";
  return Error(ErrorCode::internal, "(none)", "no error was thrown");
}

}  // namespace fp8mla::test
