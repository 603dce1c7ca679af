// The quantizer's non-finite error names the element and its kind (nan, +inf or -inf), so a
// user can find the bad input value (kvpool/kernels/quantize.h, FORMAT.md §2.5).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "kvpool/kernels/quantize.h"

namespace kvpool {
namespace {

TEST(QuantizeNonFiniteMessageTest, NamesElementAndSignOfInfinity) {
  for (KernelIsa isa : {KernelIsa::kScalar, KernelIsa::kAuto}) {
    for (auto [value, kind] : {std::pair<float, const char*>{INFINITY, "+inf"},
                               std::pair<float, const char*>{-INFINITY, "-inf"},
                               std::pair<float, const char*>{NAN, "nan"}}) {
      std::vector<float> rows(4 * 128, 0.5f);
      rows[2 * 128 + 41] = value;
      std::vector<uint8_t> codes(4 * 32);
      std::vector<uint16_t> params(4 * 2);
      absl::Status s =
          QuantizeRows(rows.data(), 4, 128, 0.96f, codes.data(), params.data(), nullptr, isa);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
      const std::string want = std::string("row 2 element 41 is ") + kind;
      EXPECT_NE(s.message().find(want), std::string::npos) << s << " (want " << want << ")";
    }
  }
}

}  // namespace
}  // namespace kvpool
