// StatusText: the code once, the message without repeated code names.
#include "kvpool/common/status_text.h"

#include <gtest/gtest.h>

namespace kvpool {
namespace {

TEST(StatusTextTest, CodeThenMessage) {
  EXPECT_EQ(StatusText(absl::FailedPreconditionError("revision r: page_size differs")),
            "FAILED_PRECONDITION: revision r: page_size differs");
}

TEST(StatusTextTest, RepeatedCodeDropped) {
  EXPECT_EQ(StatusText(absl::UnavailableError("UNAVAILABLE: DNS resolution failed")),
            "UNAVAILABLE: DNS resolution failed");
  EXPECT_EQ(StatusText(absl::UnavailableError("UNAVAILABLE: UNAVAILABLE: x")), "UNAVAILABLE: x");
  EXPECT_EQ(StatusText(absl::CancelledError("CANCELLED")), "CANCELLED");
  EXPECT_EQ(StatusText(absl::CancelledError("")), "CANCELLED");
}

TEST(StatusTextTest, OtherCodeInMessageKept) {
  // Only the status's own code is dropped; a different code in the message is information.
  EXPECT_EQ(StatusText(absl::UnavailableError("FAILED_PRECONDITION: x")),
            "UNAVAILABLE: FAILED_PRECONDITION: x");
  EXPECT_EQ(StatusText(absl::OkStatus()), "OK");
}

}  // namespace
}  // namespace kvpool
