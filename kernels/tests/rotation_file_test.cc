// Rotation-file orthogonality validation (kvpool/kernels/rotation_file.h): a file whose matrices
// are not rotations is refused by the shared reader that the pool, worker and tools all use.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "kvpool/common/keys.h"
#include "kvpool/common/safetensors.h"
#include "kvpool/kernels/rotation.h"
#include "kvpool/kernels/rotation_file.h"

namespace kvpool {
namespace {

RotationMetadata HadamardMeta(uint32_t version, uint32_t d, uint32_t layers, uint32_t heads) {
  RotationMetadata m;
  m.format_version = version;
  m.objective = "hadamard";
  m.composition = "H";
  m.model_name = "m";
  m.head_dim = d;
  m.num_layers = layers;
  m.num_kv_heads = heads;
  return m;
}

// [layers][hr][d][d] Hadamard matrices as floats.
std::vector<float> HadamardStack(uint32_t d, uint32_t count) {
  const std::vector<double> h = HadamardMatrix(d);
  std::vector<float> out;
  for (uint32_t c = 0; c < count; ++c)
    for (double x : h) out.push_back(static_cast<float>(x));
  return out;
}

TEST(RotationFileOrthogonalityTest, Float32HadamardAccepted) {
  auto rot = RotationSet::Hadamard(HadamardMeta(1, 128, 2, 1));
  ASSERT_TRUE(rot.ok()) << rot.status();
  auto parsed = ParseRotations(SerializeRotations(*rot));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_LE(parsed->MaxOrthogonalityError(), kRotationOrthogonalityTolerance);
}

TEST(RotationFileOrthogonalityTest, OneCorruptElementRefusedWithTensorAndError) {
  const uint32_t d = 16;
  std::vector<float> k = HadamardStack(d, 2), v = HadamardStack(d, 2);
  v[d * d + 3 * d + 5] = 7.0f;  // layers.1.v.rotation[3][5]
  auto rot = RotationSet::FromMatrices(HadamardMeta(1, d, 2, 1), k, v);
  ASSERT_TRUE(rot.ok()) << rot.status();
  const std::string bytes = SerializeRotations(*rot);
  auto parsed = ParseRotations(bytes);
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(parsed.status().message());
  EXPECT_NE(msg.find("'layers.1.v.rotation'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not orthogonal"), std::string::npos) << msg;
  // The measured error: row 3 · row 3 = 1 - 0.25² ... + 7² -> far above tolerance.
  char want[32];
  std::snprintf(want, sizeof(want), "%.3e", rot->OrthogonalityError(KvKind::kValue, 1, 0));
  EXPECT_NE(msg.find(want), std::string::npos) << msg << " (want " << want << ")";

  // Through the file reader too (the path the pool, worker and tools take).
  const std::string path = ::testing::TempDir() + "/bad_rotations.safetensors";
  {
    std::ofstream out(path, std::ios::binary);
    out << bytes;
  }
  auto read = ReadRotationFile(path);
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(read.status().message().find("layers.1.v.rotation"), std::string::npos);
  std::remove(path.c_str());
}

TEST(RotationFileMetadataTest, TensorsBeyondTheMetadataLayerCountAreRefused) {
  // A file holding 2 layers whose metadata claims 1 (same-length edit of the JSON header) used to
  // load as a 1-layer file and silently drop layer 1.
  auto rot = RotationSet::Hadamard(HadamardMeta(1, 16, 2, 1));
  ASSERT_TRUE(rot.ok()) << rot.status();
  std::string bytes = SerializeRotations(*rot);
  const std::string claim = "\"num_layers\":\"2\"";
  const size_t at = bytes.find(claim);
  ASSERT_NE(at, std::string::npos) << "header layout changed; update the edit";
  bytes[at + claim.size() - 2] = '1';
  auto parsed = ParseRotations(bytes);
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(parsed.status().message());
  EXPECT_NE(msg.find("'layers.1."), std::string::npos) << msg;
  EXPECT_NE(msg.find("not described by the metadata (num_layers 1)"), std::string::npos) << msg;
}

// Newcomer report 11 F4: a negative eigenvalue (impossible for the PSD targets C_Q / C_S) was
// accepted by `kvpool rotations inspect` and the worker; NaN was refused. Rounding-size
// negatives (what an eigensolver returns for a singular target) stay accepted.
TEST(RotationFileEigenvalueTest, NegativeEigenvaluesAreRefusedNamingTheTensor) {
  const uint32_t d = 8;
  auto make = [&](float bad, size_t at) {
    std::vector<float> ke(2 * 2 * d), ve(2 * 2 * d);  // 1 layer x 2 heads (v2) x d, twice
    for (size_t i = 0; i < ke.size(); ++i) ke[i] = ve[i] = 1.0f + static_cast<float>(i % d);
    ve[at] = bad;
    auto rot = RotationSet::FromMatrices(HadamardMeta(2, d, 2, 2), HadamardStack(d, 4),
                                         HadamardStack(d, 4), ke, ve);
    EXPECT_TRUE(rot.ok()) << rot.status();
    return ParseRotations(SerializeRotations(*rot));
  };
  // Layer 1 (elements 16..31), head 1, element 3: largest eigenvalue of that slice is 8.
  auto neg = make(-5.0f, 2 * d + d + 3);
  ASSERT_FALSE(neg.ok()) << "a negative eigenvalue was accepted";
  EXPECT_EQ(neg.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(neg.status().message());
  EXPECT_NE(msg.find("tensor 'layers.1.v.eigenvalues' element 11 is -5"), std::string::npos) << msg;
  EXPECT_NE(msg.find("largest, 8)"), std::string::npos) << msg;
  // -1e-5 x the largest (8) is rounding: accepted; -1e-3 x 8 is not.
  EXPECT_TRUE(make(-8e-5f, 2 * d + d + 3).ok());
  EXPECT_FALSE(make(-8e-3f, 2 * d + d + 3).ok());
  EXPECT_TRUE(make(0.0f, 0).ok());
  auto nan = make(std::nanf(""), 1);
  ASSERT_FALSE(nan.ok());
  EXPECT_NE(nan.status().message().find("'layers.0.v.eigenvalues' element 1 is not finite"),
            std::string::npos)
      << nan.status();
}

// Newcomer report 11b F6: a NaN in a rotation matrix was reported as "k rotations element 137"
// (an index across all layers), not by tensor and entry as the orthogonality check does.
TEST(RotationFileFiniteTest, ANonFiniteRotationEntryNamesTheTensorAndItsIndex) {
  const uint32_t d = 8;
  // 2 layers x 2 heads, a matrix per head (format v2): tensors [2, d, d].
  auto rot =
      RotationSet::FromMatrices(HadamardMeta(2, d, 2, 2), HadamardStack(d, 4), HadamardStack(d, 4));
  ASSERT_TRUE(rot.ok()) << rot.status();
  std::string bytes = SerializeRotations(*rot);
  uint64_t header = 0;
  std::memcpy(&header, bytes.data(), sizeof(header));  // safetensors: u64 LE header length
  auto file = SafetensorsFile::Parse(bytes);
  ASSERT_TRUE(file.ok()) << file.status();
  const SafetensorsTensor* t = (*file)->Find("layers.1.k.rotation");
  ASSERT_NE(t, nullptr);
  // Head 1, row 2, column 3 of layer 1's K rotation.
  const float nan = std::nanf("");
  std::memcpy(&bytes[8 + header + t->begin + sizeof(float) * (d * d + 2 * d + 3)], &nan,
              sizeof(nan));
  auto parsed = ParseRotations(bytes);
  ASSERT_FALSE(parsed.ok()) << "a NaN rotation entry was accepted";
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find(
                "tensor 'layers.1.k.rotation' element [1][2][3] is not finite"),
            std::string::npos)
      << parsed.status();
}

// Newcomer report 11 F2: the model_name was never compared with anything. It is advisory (the
// pool's model id is the operator's choice): a differing name gives a warning naming both.
TEST(RotationFileMetadataTest, AModelNameThatDiffersGivesAWarningNamingBoth) {
  auto rot = RotationSet::Hadamard(HadamardMeta(1, 16, 2, 1));  // model_name "m"
  ASSERT_TRUE(rot.ok()) << rot.status();
  EXPECT_EQ(RotationModelNameMismatch(*rot, "m"), "");
  const std::string note = RotationModelNameMismatch(*rot, "other-model");
  EXPECT_NE(note.find("calibrated for model 'm', not 'other-model'"), std::string::npos) << note;
  EXPECT_NE(note.find("head_dim 16, 2 layers, 1 KV heads"), std::string::npos) << note;
  RotationMetadata unnamed = HadamardMeta(1, 16, 2, 1);
  unnamed.model_name.clear();
  auto anon = RotationSet::Hadamard(unnamed);
  ASSERT_TRUE(anon.ok()) << anon.status();
  EXPECT_EQ(RotationModelNameMismatch(*anon, "other-model"), "");
}

TEST(RotationFileMetadataTest, LayerCountBeyondUint32IsOutOfRangeNotMalformed) {
  auto rot = RotationSet::Hadamard(HadamardMeta(1, 16, 1, 1));
  ASSERT_TRUE(rot.ok()) << rot.status();
  const std::string bytes = SerializeRotations(*rot);
  // safetensors: 8-byte little-endian header length, the JSON header, then the tensor data
  // (offsets relative to the data), so the header may grow if its length is rewritten.
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  std::string header = bytes.substr(8, header_len);
  const std::string claim = "\"num_layers\":\"1\"";
  const size_t at = header.find(claim);
  ASSERT_NE(at, std::string::npos) << "header layout changed; update the edit";
  header.replace(at, claim.size(), "\"num_layers\":\"99999999999\"");
  const uint64_t new_len = header.size();
  std::string edited(8, '\0');
  std::memcpy(edited.data(), &new_len, 8);
  edited += header + bytes.substr(8 + header_len);
  auto parsed = ParseRotations(edited);
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(parsed.status().message());
  EXPECT_NE(msg.find("'num_layers' = '99999999999' is out of range"), std::string::npos) << msg;
}

TEST(RotationFileOrthogonalityTest, PerHeadFileNamesTheHead) {
  const uint32_t d = 8;
  std::vector<float> k = HadamardStack(d, 2), v = HadamardStack(d, 2);
  k[d * d + 0] *= 1.01f;  // layer 0, head 1, element [0][0]: error ≈ 2e-3·(1/8)
  auto rot = RotationSet::FromMatrices(HadamardMeta(2, d, 1, 2), k, v);
  ASSERT_TRUE(rot.ok()) << rot.status();
  auto parsed = ParseRotations(SerializeRotations(*rot));
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find("'layers.0.k.rotation[1]'"), std::string::npos)
      << parsed.status();
}

TEST(RotationFileOrthogonalityTest, TinyPerturbationWithinToleranceAccepted) {
  const uint32_t d = 8;
  std::vector<float> k = HadamardStack(d, 1), v = HadamardStack(d, 1);
  k[2] += 1e-6f;  // well under 1e-4
  auto rot = RotationSet::FromMatrices(HadamardMeta(1, d, 1, 1), k, v);
  ASSERT_TRUE(rot.ok());
  auto parsed = ParseRotations(SerializeRotations(*rot));
  EXPECT_TRUE(parsed.ok()) << parsed.status();
}

}  // namespace
}  // namespace kvpool

namespace kvpool {
namespace {

// WriteRotationFile goes through kvpool::WriteFileAtomically: through a symbolic link (the link
// stays), the id is the SHA-256 of the bytes written, and a failed write names the path and
// leaves the id alone.
TEST(RotationFileWriteTest, WritesAtomicallyThroughALinkAndSetsTheIdOnlyOnSuccess) {
  namespace fs = std::filesystem;
  const std::string dir = ::testing::TempDir() + "/kvpool_rotation_write";
  fs::remove_all(dir);
  fs::create_directories(dir + "/real");
  { std::ofstream(dir + "/real/rot.safetensors") << "old"; }
  fs::create_symlink("real/rot.safetensors", dir + "/rot.safetensors");
  auto rot = RotationSet::Hadamard(HadamardMeta(1, 16, 2, 1));
  ASSERT_TRUE(rot.ok()) << rot.status();
  rot->set_rotation_id_hex("unchanged");
  const absl::Status bad = WriteRotationFile(&*rot, dir + "/missing/rot.safetensors");
  EXPECT_EQ(bad.code(), absl::StatusCode::kInternal);
  EXPECT_NE(bad.message().find(dir + "/missing/rot.safetensors"), std::string::npos) << bad;
  EXPECT_EQ(rot->rotation_id_hex(), "unchanged");

  ASSERT_TRUE(WriteRotationFile(&*rot, dir + "/rot.safetensors").ok());
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(dir + "/rot.safetensors")));
  std::ifstream in(dir + "/real/rot.safetensors", std::ios::binary);
  const std::string bytes(std::istreambuf_iterator<char>(in), {});
  EXPECT_EQ(bytes, SerializeRotations(*rot));
  EXPECT_EQ(rot->rotation_id_hex(), ToHex(Sha256(bytes)));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir + "/real"), {}), 1);  // no temporary file
  auto read = ReadRotationFile(dir + "/rot.safetensors");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->rotation_id_hex(), rot->rotation_id_hex());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvpool

namespace kvpool {
namespace {

// A rotation file that cannot be opened: NOT_FOUND naming it, and for a relative path the
// directory it was taken from (newcomer s9 A12); an absolute path gets no such note.
TEST(RotationFileReadTest, MissingFileNamesItAndItsDirectory) {
  const absl::Status rel = ReadRotationFile("no_such_dir_s9/rot.safetensors").status();
  EXPECT_EQ(rel.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(rel.message().find("cannot open rotation file 'no_such_dir_s9/rot.safetensors' "
                               "(relative to the current directory /"),
            std::string::npos)
      << rel;
  const absl::Status abs = ReadRotationFile("/no_such_dir_s9/rot.safetensors").status();
  EXPECT_EQ(abs.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(abs.message().find("relative to"), std::string::npos) << abs;
}

TEST(RotationFileReadTest, AGgufModelIsNamedAsOneNotAsAnOversizedHeader) {
  // The first bytes of any GGUF file: magic, version 3, counts. Read as safetensors they
  // would be a header length of ~5e9 bytes.
  std::string gguf("GGUF\x03\x00\x00\x00", 8);
  gguf.append(64, '\0');
  const absl::Status s = ParseRotations(gguf).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("is a GGUF file (a model, for --model)"), std::string::npos) << s;
  EXPECT_NE(s.message().find("kvpool calibrate"), std::string::npos) << s;
  EXPECT_EQ(s.message().find("header length"), std::string::npos) << s;
}

}  // namespace
}  // namespace kvpool
