// xxh3_64 known answers (the xxHash project's published values for "" and "abc") and the
// streaming form's equivalence to the one-shot form.
#include "kvpool/common/checksum.h"

#include <gtest/gtest.h>

#include <vector>

namespace kvpool {
namespace {

TEST(ChecksumTest, KnownAnswers) {
  EXPECT_EQ(Xxh3(nullptr, 0), 0x2D06800538D394C2ull);
  EXPECT_EQ(Xxh3("abc"), 0x78AF5F94892F3950ull);
}

TEST(ChecksumTest, StreamingMatchesOneShot) {
  std::vector<unsigned char> b(1000);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<unsigned char>(i * 7 + 3);
  const uint64_t one = Xxh3(b.data(), b.size());
  EXPECT_EQ(one, 0x6c4f14bd97bd9e82ull);
  Xxh3Stream s;
  s.Update(b.data(), 1);
  s.Update(b.data() + 1, 0);
  s.Update(b.data() + 1, 500);
  s.Update(b.data() + 501, 499);
  EXPECT_EQ(s.Digest(), one);
  b[999] ^= 1;
  EXPECT_NE(Xxh3(b.data(), b.size()), one);
}

}  // namespace
}  // namespace kvpool
