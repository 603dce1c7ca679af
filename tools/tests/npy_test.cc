// Tests of the .npy float32 reader/writer.
#include "npy.h"

#include <gtest/gtest.h>

namespace kvpool::tools {
namespace {

TEST(NpyTest, RoundTrip) {
  std::vector<float> data = {1, 2, 3, 4, 5, 6};
  for (std::vector<uint64_t> shape : {std::vector<uint64_t>{6}, {2, 3}, {1, 2, 3}}) {
    auto bytes = SerializeNpyF32(shape, data);
    ASSERT_TRUE(bytes.ok());
    EXPECT_EQ((bytes->size() - data.size() * 4) % 64, 0u);  // header aligned to 64
    auto back = ParseNpyF32(*bytes);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->shape, shape);
    EXPECT_EQ(back->data, data);
  }
  EXPECT_EQ(SerializeNpyF32({4}, data).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(NpyTest, ParsesNumpyStyleHeader) {
  // As numpy 1.x writes it (version 1.0, 1-tuple with a trailing comma).
  std::string h = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }";
  while ((10 + h.size() + 1) % 64) h.push_back(' ');
  h.push_back('\n');
  std::string b = std::string("\x93NUMPY\x01\x00", 8);
  b.push_back(static_cast<char>(h.size()));
  b.push_back(0);
  b += h;
  const float v[2] = {1.5f, -2.0f};
  b.append(reinterpret_cast<const char*>(v), 8);
  auto a = ParseNpyF32(b);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->data, (std::vector<float>{1.5f, -2.0f}));
}

TEST(NpyTest, RejectsBadFiles) {
  auto good = *SerializeNpyF32({2, 2}, std::vector<float>{1, 2, 3, 4});
  auto expect = [](const std::string& b, absl::StatusCode code, const std::string& needle) {
    auto r = ParseNpyF32(b);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), code) << r.status();
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status();
  };
  expect("hello", absl::StatusCode::kInvalidArgument, "magic");
  std::string f8 = good;
  f8.replace(f8.find("<f4"), 3, "<f8");
  expect(f8, absl::StatusCode::kInvalidArgument, "descr must be '<f4'");
  std::string fo = good;
  fo.replace(fo.find("False"), 5, "True ");
  expect(fo, absl::StatusCode::kInvalidArgument, "fortran_order");
  expect(good.substr(0, good.size() - 1), absl::StatusCode::kDataLoss, "needs 16 data bytes");
  std::string sh = good;
  sh.replace(sh.find("(2, 2)"), 6, "(2, x)");
  expect(sh, absl::StatusCode::kInvalidArgument, "not an integer");
  std::string v9 = good;
  v9[6] = 9;
  expect(v9, absl::StatusCode::kInvalidArgument, "version");
  EXPECT_EQ(ReadNpyF32("/nonexistent.npy").status().code(), absl::StatusCode::kNotFound);
  // A relative path names the directory it was taken from (newcomer s9 A12); an absolute one not.
  const absl::Status rel = ReadNpyF32("no_such_dir_s9/x.npy").status();
  EXPECT_EQ(rel.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(rel.message().find("'no_such_dir_s9/x.npy' (relative to the current directory /"),
            std::string::npos)
      << rel;
  EXPECT_EQ(ReadNpyF32("/nonexistent.npy").status().message().find("relative to"),
            std::string::npos);
}

}  // namespace
}  // namespace kvpool::tools
