// Calibration and evaluation on the real model (stories260K) through the reference engine.
#include "model_eval.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>

#include <gtest/gtest.h>

#include "kvpool/common/bounded_file.h"
#include "kvpool/kernels/rotation_file.h"

namespace kvpool::tools {
namespace {

CalibrateOptions Opts(bool per_head) {
  CalibrateOptions o;
  o.model_path = KVPOOL_MODEL_PATH;
  o.text_path = std::string(KVPOOL_TOOLS_DATA) + "/calibration.txt";
  o.max_tokens = 600;
  o.per_head = per_head;
  return o;
}

TEST(ModelEvalTest, CalibrateIsDeterministicAndValid) {
  for (bool per_head : {false, true}) {
    auto a = CalibrateModel(Opts(per_head));
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->num_layers(), 5u);
    EXPECT_EQ(a->num_kv_heads(), 4u);
    EXPECT_EQ(a->head_dim(), 8u);
    EXPECT_EQ(a->per_head(), per_head);
    EXPECT_EQ(a->metadata().model_name, "stories260K-f32");
    EXPECT_LT(a->MaxOrthogonalityError(), 1e-6);
    auto b = CalibrateModel(Opts(per_head));
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(SerializeRotations(*a), SerializeRotations(*b));
  }
}

TEST(ModelEvalTest, EvaluateComparesRotations) {
  auto oscar = CalibrateModel(Opts(false));
  ASSERT_TRUE(oscar.ok());
  auto meta = ModelRotationMetadata(KVPOOL_MODEL_PATH);
  ASSERT_TRUE(meta.ok());
  auto none = RotationSet::Identity(*meta);
  auto had = RotationSet::Hadamard(*meta);
  EvaluateOptions e;
  e.model_path = KVPOOL_MODEL_PATH;
  e.text_path = std::string(KVPOOL_TOOLS_DATA) + "/evaluation.txt";
  e.max_tokens = 300;
  auto res = EvaluateModel(e, {{"none", &*none}, {"hadamard", &*had}, {"oscar", &*oscar}});
  ASSERT_TRUE(res.ok()) << res.status();
  ASSERT_EQ(res->size(), 3u);
  for (const auto& r : *res) {
    ASSERT_EQ(r.layers.size(), 5u);
    for (const auto& l : r.layers) {
      EXPECT_GT(l.logit(), 0.0) << r.name;  // INT2 is lossy
      EXPECT_LT(l.logit(), 1.0) << r.name;
      EXPECT_GT(l.output(), 0.0) << r.name;
      EXPECT_TRUE(std::isfinite(l.output()));
    }
  }
  // A rotation set of another geometry is refused, naming the field.
  RotationMetadata wrong = *meta;
  wrong.num_layers = 3;
  auto bad = RotationSet::Identity(wrong);
  auto r = EvaluateModel(e, {{"bad", &*bad}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("num_layers 3 != 5"), std::string::npos) << r.status();
}

TEST(ModelEvalTest, MissingFilesAreNotFound) {
  CalibrateOptions o = Opts(false);
  o.text_path = "/nonexistent.txt";
  EXPECT_EQ(CalibrateModel(o).status().code(), absl::StatusCode::kNotFound);
  o = Opts(false);
  o.model_path = "/nonexistent.gguf";
  EXPECT_FALSE(CalibrateModel(o).ok());
}

// --text was read with an ifstream after the flag's parse-time path check: a directory or
// device read as empty text (or, for /dev/zero or a FIFO swapped in after the check, without
// end), and no size limit applied. It now goes through the shared bounded reader.
TEST(ModelEvalTest, TextIsReadThroughTheBoundedReader) {
  CalibrateOptions o = Opts(false);
  o.text_path = "/dev/null";
  auto r = CalibrateModel(o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("'/dev/null' is a character device, not a regular file"),
            std::string::npos)
      << r.status();
  o.text_path = KVPOOL_TOOLS_DATA;  // a directory
  r = CalibrateModel(o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("is a directory, not a regular file"), std::string::npos)
      << r.status();
  const std::string big = ::testing::TempDir() + "/kvpool_big_text.txt";
  FILE* f = std::fopen(big.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  ASSERT_EQ(truncate(big.c_str(), static_cast<off_t>(kMaxTextFileBytes + 1)), 0);  // sparse
  o.text_path = big;
  r = CalibrateModel(o);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(r.status().message().find("above the limit of 64 MiB"), std::string::npos)
      << r.status();
  std::remove(big.c_str());
}

}  // namespace
}  // namespace kvpool::tools
