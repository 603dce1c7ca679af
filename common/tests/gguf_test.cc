// Tests for the validating GGUF reader: the real stories260K model (GGUF v1), synthetic v2/v3
// files with every metadata type, and many deliberately corrupted copies (truncations, bad
// magic, huge counts, bad offsets, overlapping tensors, unknown dtypes, random byte flips).
// Corrupted copies are made in memory (and a few on disk, for the Open path).
#include "kvpool/common/gguf.h"

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>

#include <gtest/gtest.h>

namespace kvpool {
namespace {

#ifndef KVPOOL_DATA_DIR
#define KVPOOL_DATA_DIR KVPOOL_SOURCE_DIR "/../shared/data"
#endif
#define KVPOOL_MODEL_PATH KVPOOL_DATA_DIR "/stories260K/stories260K-f32.gguf"

// gtest-only stand-in for gmock's HasSubstr (common_test links gtest without gmock).
::testing::AssertionResult HasSubstr(std::string_view haystack, std::string_view needle) {
  if (haystack.find(needle) != std::string_view::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "'" << haystack << "' does not contain '" << needle << "'";
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

const std::string& Model() {
  static const std::string* bytes = new std::string(ReadAll(KVPOOL_MODEL_PATH));
  return *bytes;
}

template <typename T>
void Put(std::string& s, T v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(v));
}
template <typename T>
void PutAt(std::string& s, size_t pos, T v) {
  ASSERT_LE(pos + sizeof(v), s.size());
  std::memcpy(s.data() + pos, &v, sizeof(v));
}
template <typename T>
T GetAt(const std::string& s, size_t pos) {
  T v;
  std::memcpy(&v, s.data() + pos, sizeof(v));
  return v;
}

// Position of the tensor-info entry of `name` in a v1 file (the byte after the name).
size_t V1TensorInfoEnd(const std::string& bytes, const std::string& name) {
  std::string needle;
  Put<uint32_t>(needle, static_cast<uint32_t>(name.size()));
  needle += name;
  const size_t p = bytes.find(needle);
  EXPECT_NE(p, std::string::npos) << name;
  return p + needle.size();
}
// v1 tensor info after the name: ndim u32, dims u32 x ndim, dtype u32, offset u64.
size_t V1DtypePos(const std::string& bytes, const std::string& name) {
  const size_t p = V1TensorInfoEnd(bytes, name);
  return p + 4 + 4 * GetAt<uint32_t>(bytes, p);
}

// Builds synthetic GGUF files (v1 counts are uint32, v2/v3 uint64).
class Builder {
 public:
  explicit Builder(uint32_t version) : version_(version) {}

  void Count(std::string& s, uint64_t n) const {
    if (version_ == 1) {
      Put<uint32_t>(s, static_cast<uint32_t>(n));
    } else {
      Put<uint64_t>(s, n);
    }
  }
  void Str(std::string& s, const std::string& v) const {
    Count(s, v.size());
    s += v;
  }
  template <typename T>
  void Kv(const std::string& key, GgufType type, T v) {
    Str(kv_, key);
    Put<uint32_t>(kv_, static_cast<uint32_t>(type));
    Put<T>(kv_, v);
    ++n_kv_;
  }
  void KvStr(const std::string& key, const std::string& v) {
    Str(kv_, key);
    Put<uint32_t>(kv_, static_cast<uint32_t>(GgufType::kString));
    Str(kv_, v);
    ++n_kv_;
  }
  template <typename T>
  void KvArray(const std::string& key, GgufType elem, const std::vector<T>& v) {
    Str(kv_, key);
    Put<uint32_t>(kv_, static_cast<uint32_t>(GgufType::kArray));
    Put<uint32_t>(kv_, static_cast<uint32_t>(elem));
    Count(kv_, v.size());
    for (const T& x : v) Put<T>(kv_, x);
    ++n_kv_;
  }
  void KvStrArray(const std::string& key, const std::vector<std::string>& v) {
    Str(kv_, key);
    Put<uint32_t>(kv_, static_cast<uint32_t>(GgufType::kArray));
    Put<uint32_t>(kv_, static_cast<uint32_t>(GgufType::kString));
    Count(kv_, v.size());
    for (const auto& x : v) Str(kv_, x);
    ++n_kv_;
  }
  // Appends raw bytes as an entry (for malformed values); counts as one entry.
  void KvRaw(const std::string& raw) {
    kv_ += raw;
    ++n_kv_;
  }
  void Tensor(const std::string& name, std::vector<uint64_t> dims, uint32_t dtype, uint64_t offset,
              const std::string& data) {
    Str(ti_, name);
    Put<uint32_t>(ti_, static_cast<uint32_t>(dims.size()));
    for (uint64_t d : dims) Count(ti_, d);
    Put<uint32_t>(ti_, dtype);
    Put<uint64_t>(ti_, offset);
    ++n_tensors_;
    if (data_.size() < offset + data.size()) data_.resize(offset + data.size());
    data_.replace(offset, data.size(), data);
  }
  void set_alignment(uint32_t a) { alignment_ = a; }

  std::string Build() const {
    std::string s = "GGUF";
    Put<uint32_t>(s, version_);
    Count(s, n_tensors_);
    Count(s, n_kv_);
    s += kv_;
    s += ti_;
    if (n_tensors_ > 0) {
      s.resize((s.size() + alignment_ - 1) / alignment_ * alignment_);
      s += data_;
    }
    return s;
  }

 private:
  uint32_t version_;
  uint32_t alignment_ = 32;
  uint64_t n_kv_ = 0, n_tensors_ = 0;
  std::string kv_, ti_, data_;
};

std::string Floats(std::vector<float> v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

absl::Status ParseStatus(std::string bytes) { return GgufFile::Parse(std::move(bytes)).status(); }

void ExpectError(const std::string& bytes, absl::StatusCode code, const std::string& needle) {
  absl::Status s = ParseStatus(bytes);
  EXPECT_EQ(s.code(), code) << s;
  EXPECT_TRUE(HasSubstr(std::string(s.message()), needle));
}

// ---- the real model -------------------------------------------------------------------------

TEST(GgufTest, ReadsRealModelV1) {
  ASSERT_EQ(Model().size(), 1182656u) << "model missing at " << KVPOOL_MODEL_PATH;
  auto f = GgufFile::Open(KVPOOL_MODEL_PATH);
  ASSERT_TRUE(f.ok()) << f.status();
  const GgufFile& g = **f;
  EXPECT_EQ(g.version(), 1u);
  EXPECT_EQ(g.alignment(), 32u);
  EXPECT_EQ(g.data_offset(), 11456u);
  EXPECT_EQ(g.metadata().size(), 18u);
  EXPECT_EQ(g.tensors().size(), 48u);
  EXPECT_EQ(*g.GetString("general.architecture"), "llama");
  EXPECT_EQ(*g.GetUint("llama.block_count"), 5u);
  EXPECT_EQ(*g.GetUint("llama.context_length"), 512u);
  EXPECT_EQ(*g.GetUint("llama.attention.head_count_kv"), 4u);
  EXPECT_NEAR(*g.GetFloat("llama.attention.layer_norm_rms_epsilon"), 1e-5, 1e-9);
  auto tokens = g.GetStringArray("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  ASSERT_EQ(tokens->size(), 512u);
  EXPECT_EQ((*tokens)[1], "<s>");
  EXPECT_EQ((*tokens)[3], "<0x00>");
  auto scores = g.GetFloatArray("tokenizer.ggml.scores");
  ASSERT_TRUE(scores.ok());
  EXPECT_EQ(scores->back(), -252.0f);
  auto types = g.GetIntArray("tokenizer.ggml.token_type");
  ASSERT_TRUE(types.ok());
  EXPECT_EQ((*types)[3], 6);

  const GgufTensor* k = g.FindTensor("blk.0.attn_k.weight");
  ASSERT_NE(k, nullptr);
  EXPECT_EQ(k->dims, (std::vector<uint64_t>{64, 32}));
  EXPECT_EQ(k->dtype, GgufDType::kF32);
  EXPECT_EQ(k->offset, 147456u);
  EXPECT_EQ(k->num_bytes, 64u * 32u * 4u);
  auto w = g.ReadFloat32("output.weight");
  ASSERT_TRUE(w.ok());
  ASSERT_EQ(w->size(), 64u * 512u);
  // The last tensor ends exactly at the end of the file.
  EXPECT_EQ(w->back(), GetAt<float>(Model(), Model().size() - 4));

  // Wrong-type and absent lookups name the key.
  EXPECT_EQ(g.GetUint("general.architecture").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasSubstr(std::string(g.GetUint("general.architecture").status().message()),
                        "general.architecture"));
  EXPECT_EQ(g.GetUint("no.such.key").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(g.ReadFloat32("no.such.tensor").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(g.FindTensor("no.such.tensor"), nullptr);
}

TEST(GgufTest, ParseMatchesOpen) {
  auto f = GgufFile::Parse(Model());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->tensors().size(), 48u);
}

// ---- synthetic v2 / v3 files ----------------------------------------------------------------

TEST(GgufTest, ReadsEveryTypeInV2AndV3) {
  for (uint32_t version : {1u, 2u, 3u}) {
    SCOPED_TRACE(version);
    Builder b(version);
    b.Kv<uint8_t>("u8", GgufType::kUint8, 200);
    b.Kv<int8_t>("i8", GgufType::kInt8, -100);
    b.Kv<uint16_t>("u16", GgufType::kUint16, 60000);
    b.Kv<int16_t>("i16", GgufType::kInt16, -30000);
    b.Kv<uint32_t>("u32", GgufType::kUint32, 4000000000u);
    b.Kv<int32_t>("i32", GgufType::kInt32, -2000000000);
    b.Kv<float>("f32", GgufType::kFloat32, 1.5f);
    b.Kv<uint8_t>("bool", GgufType::kBool, 1);
    b.KvStr("str", "héllo");
    b.Kv<uint64_t>("u64", GgufType::kUint64, 1ull << 40);
    b.Kv<int64_t>("i64", GgufType::kInt64, -(1ll << 40));
    b.Kv<double>("f64", GgufType::kFloat64, 0.25);
    b.KvArray<int16_t>("ai16", GgufType::kInt16, {-1, 2, -3});
    b.KvArray<double>("af64", GgufType::kFloat64, {0.5, -2.0});
    b.KvStrArray("astr", {"a", "", "ccc"});
    b.Kv<uint32_t>("general.alignment", GgufType::kUint32, 64);
    b.set_alignment(64);
    // F32 [3,2], F16 [4], BF16 [2] tensors at aligned offsets.
    b.Tensor("w32", {3, 2}, 0, 0, Floats({1, 2, 3, 4, 5, 6}));
    std::string f16;
    for (uint16_t h : {0x3c00, 0xc000, 0x0001, 0x7bff}) Put<uint16_t>(f16, h);  // 1,-2,2^-24,65504
    b.Tensor("w16", {4}, 1, 64, f16);
    std::string bf16;
    for (uint16_t h : {0x3f80, 0xc0a0}) Put<uint16_t>(bf16, h);  // 1, -5
    b.Tensor("wbf", {2}, 30, 128, bf16);

    auto f = GgufFile::Parse(b.Build());
    ASSERT_TRUE(f.ok()) << f.status();
    const GgufFile& g = **f;
    EXPECT_EQ(g.version(), version);
    EXPECT_EQ(g.alignment(), 64u);
    EXPECT_EQ(g.data_offset() % 64, 0u);
    EXPECT_EQ(*g.GetUint("u8"), 200u);
    EXPECT_EQ(*g.GetInt("i8"), -100);
    EXPECT_EQ(*g.GetUint("u16"), 60000u);
    EXPECT_EQ(*g.GetInt("i16"), -30000);
    EXPECT_EQ(*g.GetUint("u32"), 4000000000u);
    EXPECT_EQ(*g.GetInt("i32"), -2000000000);
    EXPECT_EQ(*g.GetFloat("f32"), 1.5);
    EXPECT_EQ(*g.GetBool("bool"), true);
    EXPECT_EQ(*g.GetString("str"), "héllo");
    EXPECT_EQ(*g.GetUint("u64"), 1ull << 40);
    EXPECT_EQ(*g.GetInt("i64"), -(1ll << 40));
    EXPECT_EQ(*g.GetFloat("f64"), 0.25);
    EXPECT_EQ(g.GetUint("i8").status().code(), absl::StatusCode::kInvalidArgument);  // negative
    EXPECT_EQ(*g.GetIntArray("ai16"), (std::vector<int64_t>{-1, 2, -3}));
    EXPECT_EQ(*g.GetFloatArray("af64"), (std::vector<float>{0.5f, -2.0f}));
    EXPECT_EQ(*g.GetStringArray("astr"), (std::vector<std::string>{"a", "", "ccc"}));
    EXPECT_EQ(g.GetStringArray("ai16").status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(*g.ReadFloat32("w32"), (std::vector<float>{1, 2, 3, 4, 5, 6}));
    EXPECT_EQ(*g.ReadFloat32("w16"), (std::vector<float>{1.0f, -2.0f, 0x1p-24f, 65504.0f}));
    EXPECT_EQ(*g.ReadFloat32("wbf"), (std::vector<float>{1.0f, -5.0f}));
    EXPECT_EQ(g.FindTensor("w32")->dims, (std::vector<uint64_t>{3, 2}));
  }
}

TEST(GgufTest, EmptyFileWithNoTensorsIsValid) {
  Builder b(3);
  b.KvStr("general.architecture", "llama");
  auto f = GgufFile::Parse(b.Build());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE((*f)->tensors().empty());
}

TEST(GgufTest, HalfConversion) {
  EXPECT_EQ(HalfToFloat(0x0000), 0.0f);
  EXPECT_TRUE(std::signbit(HalfToFloat(0x8000)));
  EXPECT_EQ(HalfToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(HalfToFloat(0x0400), 0x1p-14f);      // smallest normal
  EXPECT_EQ(HalfToFloat(0x03ff), 0x1.ff8p-15f);  // largest subnormal
  EXPECT_TRUE(std::isinf(HalfToFloat(0x7c00)));
  EXPECT_TRUE(std::isnan(HalfToFloat(0x7e00)));
}

// ---- corrupted copies of the real model -----------------------------------------------------

TEST(GgufCorruptTest, TruncationAtEveryHeaderByteAndThroughTheData) {
  const std::string& m = Model();
  ASSERT_GT(m.size(), 11456u);
  size_t checked = 0;
  auto check = [&](size_t len) {
    absl::Status s = ParseStatus(m.substr(0, len));
    ASSERT_TRUE(s.code() == absl::StatusCode::kDataLoss ||
                s.code() == absl::StatusCode::kInvalidArgument)
        << "length " << len << ": " << s;
    ASSERT_FALSE(s.message().empty());
    ++checked;
  };
  for (size_t len = 0; len <= 11456 + 64; ++len) check(len);
  for (size_t len = 11456 + 64; len < m.size(); len += 4093) check(len);
  check(m.size() - 1);
  EXPECT_GT(checked, 11000u);
  // The tensor whose data is cut names itself.
  ExpectError(m.substr(0, m.size() - 1), absl::StatusCode::kDataLoss, "output.weight");
  ExpectError(m.substr(0, 10), absl::StatusCode::kDataLoss, "file ends at byte 10");
}

TEST(GgufCorruptTest, BadMagicAndVersion) {
  std::string m = Model();
  m[0] = 'X';
  ExpectError(m, absl::StatusCode::kInvalidArgument, "magic");
  for (uint32_t v : {0u, 4u, 1000u}) {
    std::string c = Model();
    PutAt<uint32_t>(c, 4, v);
    ExpectError(c, absl::StatusCode::kInvalidArgument, "unsupported version");
  }
  std::string be = Model();
  PutAt<uint32_t>(be, 4, 0x03000000u);
  ExpectError(be, absl::StatusCode::kInvalidArgument, "big-endian");
}

TEST(GgufCorruptTest, HugeCounts) {
  std::string c = Model();
  PutAt<uint32_t>(c, 8, 0xffffffffu);  // tensor count
  ExpectError(c, absl::StatusCode::kInvalidArgument, "tensor count 4294967295");
  c = Model();
  PutAt<uint32_t>(c, 12, 0xffffffffu);  // metadata count
  ExpectError(c, absl::StatusCode::kInvalidArgument, "metadata count 4294967295");
  c = Model();
  PutAt<uint32_t>(c, 12, 200000u);  // under the limit but more than the file holds
  ExpectError(c, absl::StatusCode::kDataLoss, "cannot fit");
  c = Model();
  PutAt<uint32_t>(c, 8, 1000u);  // more tensors than described: runs into the data
  EXPECT_FALSE(ParseStatus(c).ok());
}

TEST(GgufCorruptTest, HugeStringAndArrayLengths) {
  std::string c = Model();
  PutAt<uint32_t>(c, 16, 0xfffffff0u);  // length of the first key
  ExpectError(c, absl::StatusCode::kInvalidArgument, "metadata key length 4294967280");
  c = Model();
  PutAt<uint32_t>(c, 16, 0x03000000u);  // under the limit, beyond the file
  ExpectError(c, absl::StatusCode::kDataLoss, "metadata key");
  // The token array: key, type ARRAY, element type STRING, then the u32 length.
  const std::string key = "tokenizer.ggml.tokens";
  const size_t len_pos = V1TensorInfoEnd(Model(), key) + 4 + 4;
  ASSERT_EQ(GetAt<uint32_t>(Model(), len_pos), 512u);
  c = Model();
  PutAt<uint32_t>(c, len_pos, 0xffffffffu);
  ExpectError(c, absl::StatusCode::kInvalidArgument, "tokenizer.ggml.tokens");
  c = Model();
  PutAt<uint32_t>(c, len_pos, 100000000u);
  ExpectError(c, absl::StatusCode::kDataLoss, "tokenizer.ggml.tokens");
  // A string inside the array with a huge length names the key and the element.
  c = Model();
  PutAt<uint32_t>(c, len_pos + 4, 0x7fffffffu);
  ExpectError(c, absl::StatusCode::kInvalidArgument, "element 0");
}

TEST(GgufCorruptTest, BadValueTypes) {
  const size_t type_pos = V1TensorInfoEnd(Model(), "general.architecture");
  ASSERT_EQ(GetAt<uint32_t>(Model(), type_pos), 8u);
  std::string c = Model();
  PutAt<uint32_t>(c, type_pos, 99);
  ExpectError(c, absl::StatusCode::kInvalidArgument, "'general.architecture'");
  ExpectError(c, absl::StatusCode::kInvalidArgument, "unknown value type 99");
  // Nested arrays are refused.
  const size_t elem_pos = V1TensorInfoEnd(Model(), "tokenizer.ggml.scores") + 4;
  ASSERT_EQ(GetAt<uint32_t>(Model(), elem_pos), 6u);
  c = Model();
  PutAt<uint32_t>(c, elem_pos, 9);
  ExpectError(c, absl::StatusCode::kInvalidArgument, "nested arrays");
  c = Model();
  PutAt<uint32_t>(c, elem_pos, 77);
  ExpectError(c, absl::StatusCode::kInvalidArgument, "unknown array element type 77");

  Builder b(3);
  b.Kv<uint8_t>("flag", GgufType::kBool, 2);
  ExpectError(b.Build(), absl::StatusCode::kInvalidArgument, "'flag'");
  Builder d(3);
  d.Kv<uint32_t>("k", GgufType::kUint32, 1);
  d.Kv<uint32_t>("k", GgufType::kUint32, 2);
  ExpectError(d.Build(), absl::StatusCode::kInvalidArgument, "appears twice");
  for (uint32_t a : {0u, 3u, 1u << 20}) {
    Builder e(2);
    e.Kv<uint32_t>("general.alignment", GgufType::kUint32, a);
    ExpectError(e.Build(), absl::StatusCode::kInvalidArgument, "general.alignment");
  }
}

TEST(GgufCorruptTest, UnknownAndUnsupportedDtype) {
  const size_t pos = V1DtypePos(Model(), "blk.2.ffn_up.weight");
  ASSERT_EQ(GetAt<uint32_t>(Model(), pos), 0u);
  std::string c = Model();
  PutAt<uint32_t>(c, pos, 1234);
  ExpectError(c, absl::StatusCode::kInvalidArgument, "'blk.2.ffn_up.weight'");
  ExpectError(c, absl::StatusCode::kInvalidArgument, "unknown dtype 1234");
  c = Model();
  PutAt<uint32_t>(c, pos, 2);
  ExpectError(c, absl::StatusCode::kInvalidArgument, "Q4_0");
}

TEST(GgufCorruptTest, BadOffsetsAndOverlaps) {
  const std::string name = "blk.0.attn_k.weight";
  const size_t off_pos = V1DtypePos(Model(), name) + 4;
  ASSERT_EQ(GetAt<uint64_t>(Model(), off_pos), 147456u);
  std::string c = Model();
  PutAt<uint64_t>(c, off_pos, 1ull << 60);
  ExpectError(c, absl::StatusCode::kInvalidArgument, "lies outside the data section");
  ExpectError(c, absl::StatusCode::kInvalidArgument, name);
  c = Model();
  PutAt<uint64_t>(c, off_pos, 0xffffffffffffffe0ull);  // aligned, offset + size overflows
  ExpectError(c, absl::StatusCode::kInvalidArgument, name);
  c = Model();
  PutAt<uint64_t>(c, off_pos, 147456u + 4);  // not a multiple of 32
  ExpectError(c, absl::StatusCode::kInvalidArgument, "not a multiple of the alignment");
  c = Model();
  PutAt<uint64_t>(c, off_pos, 131072u + 32);  // inside blk.0.attn_q.weight
  ExpectError(c, absl::StatusCode::kInvalidArgument, "overlaps");
  ExpectError(c, absl::StatusCode::kInvalidArgument, "blk.0.attn_q.weight");
  c = Model();
  // Last tensor pushed past the end of the file by one alignment step.
  const size_t last = V1DtypePos(Model(), "output.weight") + 4;
  PutAt<uint64_t>(c, last, GetAt<uint64_t>(Model(), last) + 32);
  ExpectError(c, absl::StatusCode::kDataLoss, "'output.weight'");
}

TEST(GgufCorruptTest, BadDims) {
  const std::string name = "blk.1.attn_v.weight";
  const size_t ndim_pos = V1TensorInfoEnd(Model(), name);
  std::string c = Model();
  PutAt<uint32_t>(c, ndim_pos, 0);
  ExpectError(c, absl::StatusCode::kInvalidArgument, "ndim 0");
  c = Model();
  PutAt<uint32_t>(c, ndim_pos, 5);
  ExpectError(c, absl::StatusCode::kInvalidArgument, "ndim 5");
  c = Model();
  PutAt<uint32_t>(c, ndim_pos + 4, 0);
  ExpectError(c, absl::StatusCode::kInvalidArgument, "dim 0 = 0");
  c = Model();
  PutAt<uint32_t>(c, ndim_pos + 4, 0x10000000u);  // 2^28 * 32 floats: past the file
  ExpectError(c, absl::StatusCode::kDataLoss, name);

  // Dims whose product overflows 64 bits (v3 has 64-bit dims).
  Builder b(3);
  b.Tensor("big", {1ull << 40, 1ull << 40}, 0, 0, Floats({1}));
  ExpectError(b.Build(), absl::StatusCode::kInvalidArgument, "absurdly large");
  Builder d(3);
  d.Tensor("t", {1}, 0, 0, Floats({1}));
  d.Tensor("t", {1}, 0, 32, Floats({2}));
  ExpectError(d.Build(), absl::StatusCode::kInvalidArgument, "appears twice");
}

// Random single-byte and multi-byte corruptions of the header: the reader must either refuse
// with a message or return a file whose every tensor lies inside the file (ASan checks reads).
TEST(GgufCorruptTest, RandomByteFlipsNeverReadOutOfBounds) {
  std::mt19937 rng(12345);
  const std::string& m = Model();
  int ok = 0, refused = 0;
  for (int iter = 0; iter < 1500; ++iter) {
    std::string c = m;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      const size_t pos = rng() % 11456;
      c[pos] = static_cast<char>(rng() & 0xff);
    }
    auto f = GgufFile::Parse(c);
    if (!f.ok()) {
      ++refused;
      EXPECT_FALSE(f.status().message().empty());
      continue;
    }
    ++ok;
    const GgufFile& g = **f;
    for (const GgufTensor& t : g.tensors()) {
      ASSERT_LE(g.data_offset() + t.offset + t.num_bytes, g.file_size()) << t.name;
      // Reading every element of every accepted tensor stays in bounds (ASan checks).
      auto values = g.ReadFloat32(t.name);
      ASSERT_TRUE(values.ok()) << values.status();
      ASSERT_EQ(values->size(), t.num_elements);
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_EQ(ok + refused, 1500);
}

TEST(GgufOpenTest, MissingDirectoryAndTruncatedFiles) {
  auto missing = GgufFile::Open("/nonexistent/model.gguf");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(HasSubstr(std::string(missing.status().message()), "/nonexistent/model.gguf"));
  EXPECT_EQ(GgufFile::Open("/tmp").status().code(), absl::StatusCode::kNotFound);

  const std::string dir = ::testing::TempDir();
  const std::string path = dir + "/gguf_test_truncated." + std::to_string(getpid()) + ".gguf";
  for (size_t len : {size_t{0}, size_t{3}, size_t{5000}, Model().size() - 100}) {
    {
      std::ofstream out(path, std::ios::binary | std::ios::trunc);
      out.write(Model().data(), static_cast<std::streamsize>(len));
    }
    auto f = GgufFile::Open(path);
    EXPECT_EQ(f.status().code(), absl::StatusCode::kDataLoss) << len << ": " << f.status();
    EXPECT_TRUE(HasSubstr(std::string(f.status().message()), path));
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kvpool
