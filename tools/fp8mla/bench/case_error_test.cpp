// run_named_case (case_error.h): a bench case's error names the case and keeps its code.
#include "tools/fp8mla/bench/case_error.h"

#include <gtest/gtest.h>

#include <string>

#include "fp8mla/error.h"

namespace fp8mla::bench {
namespace {

TEST(BenchCaseError, AnErrorNamesTheCaseAndKeepsItsCode) {
  try {
    run_named_case("bs=128 heads=8 page=64 fp8_e4m3_block", []() -> int {
      throw Error(ErrorCode::cuda_error, "cudaEventSynchronize(b)", "unspecified launch failure");
    });
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::cuda_error);
    EXPECT_EQ(std::string(e.what()),
              "case bs=128 heads=8 page=64 fp8_e4m3_block: cudaEventSynchronize(b): unspecified "
              "launch failure");
  }
}

TEST(BenchCaseError, AResultPassesThrough) {
  EXPECT_EQ(run_named_case("any", [] { return 42; }), 42);
}

}  // namespace
}  // namespace fp8mla::bench
