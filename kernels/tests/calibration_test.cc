// Tests of calibration statistics, rotation fitting (FORMAT.md §1) and rotation files (§4).
#include "kvpool/kernels/calibration.h"

#include <cmath>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "kvpool/common/safetensors.h"
#include "kvpool/kernels/rotation.h"
#include "kvpool/kernels/rotation_file.h"

namespace kvpool {
namespace {

TEST(RotationTest, HadamardSignsAndOrthogonality) {
  const uint32_t d = 16;
  auto h = HadamardMatrix(d);
  const double s = 0.25;
  EXPECT_EQ(h[3 * d + 5], -s);  // 3 & 5 = 1: one bit
  EXPECT_EQ(h[3 * d + 3], s);   // 3 & 3 = 3: two bits
  EXPECT_EQ(h[7 * d + 7], -s);  // three bits
  for (uint32_t i = 0; i < d; ++i)
    for (uint32_t j = 0; j < d; ++j) {
      double dot = 0;
      for (uint32_t k = 0; k < d; ++k) dot += h[i * d + k] * h[j * d + k];
      EXPECT_NEAR(dot, i == j ? 1.0 : 0.0, 1e-15);
    }
}

TEST(RotationTest, BitReversalPermutationFollowsFormat) {
  EXPECT_EQ(BitReverse(1, 128), 64u);
  EXPECT_EQ(BitReverse(2, 128), 32u);
  EXPECT_EQ(BitReverse(3, 128), 96u);
  EXPECT_EQ(BitReverse(1, 8), 4u);
  // eigenvalues ascending 0..127: strongest direction is index 127
  std::vector<double> ev(128);
  for (int i = 0; i < 128; ++i) ev[i] = i;
  auto perm = BitReversalPermutation(ev);
  EXPECT_EQ(perm[0], 127u);  // strongest in slot 0
  EXPECT_EQ(perm[64], 126u);
  EXPECT_EQ(perm[32], 125u);
  EXPECT_EQ(perm[96], 124u);
  EXPECT_EQ(perm[16], 123u);
  // ties broken by ascending index
  std::vector<double> tie = {1, 1, 1, 1, 1, 1, 1, 1};
  auto p2 = BitReversalPermutation(tie);
  EXPECT_EQ(p2[0], 0u);
  EXPECT_EQ(p2[4], 1u);
  EXPECT_EQ(p2[2], 2u);
}

std::vector<double> RandomSpd(std::mt19937& rng, uint32_t d) {
  std::normal_distribution<double> n01;
  std::vector<double> a(d * d), c(d * d, 0);
  for (auto& v : a) v = n01(rng);
  for (uint32_t i = 0; i < d; ++i)
    for (uint32_t j = 0; j < d; ++j)
      for (uint32_t k = 0; k < d; ++k) c[i * d + j] += a[i * d + k] * a[j * d + k] * (k + 1);
  return c;
}

TEST(RotationTest, FitRotationIsUHPWithSignRule) {
  std::mt19937 rng(3);
  const uint32_t d = 16;
  auto c = RandomSpd(rng, d);
  auto fit = FitRotation(c, d);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_LT(fit->orthogonality_error, 1e-6);
  for (uint32_t i = 1; i < d; ++i) EXPECT_LE(fit->eigenvalues[i - 1], fit->eigenvalues[i]);
  // Recover U = R·P_brᵀ·Hᵀ: column perm[j] of U·H is column j of R.
  std::vector<double> ev(fit->eigenvalues.begin(), fit->eigenvalues.end());
  auto perm = BitReversalPermutation(ev);
  auto h = HadamardMatrix(d);
  std::vector<double> uh(d * d);
  for (uint32_t i = 0; i < d; ++i)
    for (uint32_t j = 0; j < d; ++j) uh[i * d + perm[j]] = fit->rotation[i * d + j];
  std::vector<double> u(d * d, 0);  // U = (U·H)·Hᵀ (H symmetric and orthogonal)
  for (uint32_t i = 0; i < d; ++i)
    for (uint32_t j = 0; j < d; ++j)
      for (uint32_t k = 0; k < d; ++k) u[i * d + j] += uh[i * d + k] * h[j * d + k];
  for (uint32_t col = 0; col < d; ++col) {
    // eigenvector: C u = λ u
    for (uint32_t i = 0; i < d; ++i) {
      double cu = 0;
      for (uint32_t k = 0; k < d; ++k) cu += c[i * d + k] * u[k * d + col];
      EXPECT_NEAR(cu, fit->eigenvalues[col] * u[i * d + col],
                  1e-4 * std::fabs(fit->eigenvalues.back()));
    }
    // sign rule: largest-magnitude component positive
    uint32_t best = 0;
    for (uint32_t i = 1; i < d; ++i)
      if (std::fabs(u[i * d + col]) > std::fabs(u[best * d + col])) best = i;
    EXPECT_GT(u[best * d + col], 0.0) << col;
  }
}

// Fills random GQA activations.
struct Acts {
  std::vector<float> q, k, v;
};
Acts RandomActs(std::mt19937& rng, uint64_t n, uint32_t hq, uint32_t hkv, uint32_t d) {
  std::normal_distribution<float> n01;
  Acts a;
  a.q.resize(n * hq * d);
  a.k.resize(n * hkv * d);
  a.v.resize(n * hkv * d);
  for (auto& x : a.q) x = n01(rng);
  for (size_t i = 0; i < a.k.size(); ++i) {
    a.k[i] = n01(rng) * (i % d == 3 ? 5.0f : 1.0f);
    a.v[i] = n01(rng);
  }
  return a;
}

TEST(CalibrationTest, TargetsMatchDefinitions) {
  std::mt19937 rng(5);
  const uint32_t hq = 4, hkv = 2, d = 8;
  const uint64_t n = 5;
  Acts a = RandomActs(rng, n, hq, hkv, d);
  auto acc = CalibrationAccumulator::Create(1, hq, hkv, d);
  ASSERT_TRUE(acc.ok());
  ASSERT_TRUE((*acc)->AddQueries(0, a.q.data(), n).ok());
  ASSERT_TRUE((*acc)->FreezeKeyTargets().ok());
  ASSERT_TRUE((*acc)->AddKeysValues(0, a.k.data(), a.v.data(), n).ok());
  for (uint32_t h = 0; h < hkv; ++h) {
    // C_Q,h = Σ over tokens and the 2 query heads of group h of q qᵀ / (n·g)
    std::vector<double> cq(d * d, 0);
    for (uint64_t t = 0; t < n; ++t)
      for (uint32_t i = 2 * h; i < 2 * h + 2; ++i)
        for (uint32_t r = 0; r < d; ++r)
          for (uint32_t c = 0; c < d; ++c)
            cq[r * d + c] +=
                double(a.q[(t * hq + i) * d + r]) * a.q[(t * hq + i) * d + c] / (n * 2);
    auto got = (*acc)->KeyTarget(0, h);
    for (uint32_t i = 0; i < d * d; ++i) ASSERT_NEAR(got[i], cq[i], 1e-12);
    // C_S,h = Σ w v vᵀ / Σ w with w = k C_Q kᵀ
    std::vector<double> cs(d * d, 0);
    double sw = 0;
    for (uint64_t t = 0; t < n; ++t) {
      const float* k = &a.k[(t * hkv + h) * d];
      const float* v = &a.v[(t * hkv + h) * d];
      double w = 0;
      for (uint32_t r = 0; r < d; ++r)
        for (uint32_t c = 0; c < d; ++c) w += k[r] * cq[r * d + c] * k[c];
      sw += w;
      for (uint32_t r = 0; r < d; ++r)
        for (uint32_t c = 0; c < d; ++c) cs[r * d + c] += w * v[r] * v[c];
    }
    auto gs = (*acc)->ValueTarget(0, h);
    for (uint32_t i = 0; i < d * d; ++i) ASSERT_NEAR(gs[i], cs[i] / sw, 1e-10);
  }
}

TEST(CalibrationTest, PhasesAndErrors) {
  auto acc = CalibrationAccumulator::Create(2, 4, 2, 8);
  ASSERT_TRUE(acc.ok());
  std::vector<float> x(4 * 8, 1.0f);
  EXPECT_EQ((*acc)->AddKeysValues(0, x.data(), x.data(), 1).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*acc)->AddQueries(2, x.data(), 1).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE((*acc)->AddQueries(0, x.data(), 1).ok());
  EXPECT_EQ((*acc)->FreezeKeyTargets().code(), absl::StatusCode::kFailedPrecondition);  // layer 1
  x[9] = NAN;
  absl::Status s = (*acc)->AddQueries(1, x.data(), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("layer 1 token 0 head 1 element 1"), std::string::npos) << s;
  EXPECT_EQ(CalibrationAccumulator::Create(1, 3, 2, 8).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CalibrationAccumulator::Create(1, 4, 2, 12).status().code(),
            absl::StatusCode::kInvalidArgument);
}

std::unique_ptr<CalibrationAccumulator> Calibrate(const Acts& a, uint64_t n, uint32_t layers,
                                                  uint32_t hq, uint32_t hkv, uint32_t d,
                                                  uint64_t chunk) {
  auto acc = *CalibrationAccumulator::Create(layers, hq, hkv, d);
  for (uint32_t l = 0; l < layers; ++l)
    for (uint64_t t = 0; t < n; t += chunk)
      EXPECT_TRUE(acc->AddQueries(l, &a.q[t * hq * d], std::min(chunk, n - t)).ok());
  EXPECT_TRUE(acc->FreezeKeyTargets().ok());
  for (uint32_t l = 0; l < layers; ++l)
    for (uint64_t t = 0; t < n; t += chunk)
      EXPECT_TRUE(
          acc->AddKeysValues(l, &a.k[t * hkv * d], &a.v[t * hkv * d], std::min(chunk, n - t)).ok());
  return acc;
}

TEST(CalibrationTest, DeterministicRefitGivesSameFileBytes) {
  std::mt19937 rng(8);
  const uint32_t hq = 4, hkv = 2, d = 32, layers = 2;
  const uint64_t n = 200;
  Acts a = RandomActs(rng, n, hq, hkv, d);
  for (bool per_head : {false, true}) {
    FitOptions opt;
    opt.per_head = per_head;
    opt.model_name = "synthetic";
    auto r1 = FitOscarRotations(*Calibrate(a, n, layers, hq, hkv, d, 1), opt);
    auto r2 = FitOscarRotations(*Calibrate(a, n, layers, hq, hkv, d, 17), opt);
    ASSERT_TRUE(r1.ok()) << r1.status();
    ASSERT_TRUE(r2.ok());
    EXPECT_EQ(r1->metadata().format_version, per_head ? 2u : 1u);
    EXPECT_LT(r1->MaxOrthogonalityError(), 1e-6);
    const std::string b1 = SerializeRotations(*r1), b2 = SerializeRotations(*r2);
    EXPECT_EQ(b1, b2);
    EXPECT_EQ(Sha256Hex(b1), Sha256Hex(b2));
  }
}

TEST(CalibrationTest, MergeEqualsSingleAccumulator) {
  std::mt19937 rng(9);
  const uint32_t hq = 2, hkv = 1, d = 16;
  const uint64_t n = 100;
  Acts a = RandomActs(rng, n, hq, hkv, d);
  auto whole = Calibrate(a, n, 1, hq, hkv, d, 10);
  // phase 1 split in two, merged, copied; phase 2 split, merged
  auto p1a = *CalibrationAccumulator::Create(1, hq, hkv, d);
  auto p1b = *CalibrationAccumulator::Create(1, hq, hkv, d);
  ASSERT_TRUE(p1a->AddQueries(0, a.q.data(), 60).ok());
  ASSERT_TRUE(p1b->AddQueries(0, &a.q[60 * hq * d], 40).ok());
  ASSERT_TRUE(p1a->Merge(*p1b).ok());
  ASSERT_TRUE(p1a->FreezeKeyTargets().ok());
  auto p2b = p1a->Clone();
  EXPECT_EQ(p1a->Merge(*p1b).code(), absl::StatusCode::kFailedPrecondition);  // phases differ
  ASSERT_TRUE(p1a->AddKeysValues(0, a.k.data(), a.v.data(), 30).ok());
  ASSERT_TRUE(p2b->AddKeysValues(0, &a.k[30 * hkv * d], &a.v[30 * hkv * d], 70).ok());
  ASSERT_TRUE(p1a->Merge(*p2b).ok());
  auto k1 = whole->KeyTarget(0, 0), k2 = p1a->KeyTarget(0, 0);
  auto v1 = whole->ValueTarget(0, 0), v2 = p1a->ValueTarget(0, 0);
  for (size_t i = 0; i < k1.size(); ++i) {
    EXPECT_NEAR(k1[i], k2[i], 1e-12 * (1 + std::fabs(k1[i])));
    EXPECT_NEAR(v1[i], v2[i], 1e-12 * (1 + std::fabs(v1[i])));
  }
  EXPECT_EQ(p1a->value_tokens(0), 100u);
}

RotationMetadata Meta(uint32_t d, uint32_t layers, uint32_t heads) {
  RotationMetadata m;
  m.model_name = "m";
  m.head_dim = d;
  m.num_layers = layers;
  m.num_kv_heads = heads;
  return m;
}

TEST(RotationFileTest, RoundTripAndId) {
  std::mt19937 rng(10);
  Acts a = RandomActs(rng, 50, 4, 2, 16);
  FitOptions opt;
  opt.per_head = true;
  opt.model_name = "m";
  opt.source_hash = "abc";
  auto rot = FitOscarRotations(*Calibrate(a, 50, 3, 4, 2, 16, 50), opt);
  ASSERT_TRUE(rot.ok());
  const std::string path = std::string(::testing::TempDir()) + "/rot_test.safetensors";
  ASSERT_TRUE(WriteRotationFile(&*rot, path).ok());
  auto back = ReadRotationFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->rotation_id_hex(), rot->rotation_id_hex());
  EXPECT_EQ(back->rotation_id_hex().size(), 64u);
  EXPECT_EQ(back->matrices(KvKind::kKey), rot->matrices(KvKind::kKey));
  EXPECT_EQ(back->matrices(KvKind::kValue), rot->matrices(KvKind::kValue));
  EXPECT_EQ(back->eigenvalues(KvKind::kValue), rot->eigenvalues(KvKind::kValue));
  EXPECT_EQ(back->metadata().clip_ratio_k, 0.96f);
  EXPECT_EQ(back->metadata().clip_ratio_v, 0.92f);
  EXPECT_EQ(back->metadata().format_version, 2u);
  EXPECT_EQ(back->metadata().source_hash, "abc");
  auto id = RotationIdFromHex(back->rotation_id_hex());
  ASSERT_TRUE(id.ok());
  std::remove(path.c_str());
  // identity/hadamard sets have no eigenvalues and still round-trip
  auto had = RotationSet::Hadamard(Meta(16, 2, 2));
  ASSERT_TRUE(had.ok());
  auto hb = ParseRotations(SerializeRotations(*had));
  ASSERT_TRUE(hb.ok()) << hb.status();
  EXPECT_EQ(hb->metadata().objective, "hadamard");
  EXPECT_LT(hb->MaxOrthogonalityError(), 1e-6);
}

TEST(RotationFileTest, MismatchedMetadataListsFields) {
  auto rot = RotationSet::Identity(Meta(16, 2, 2));
  ASSERT_TRUE(rot.ok());
  ExpectedRotationModel e{.model_name = "other",
                          .head_dim = 128,
                          .num_layers = 2,
                          .num_kv_heads = 8,
                          .clip_ratio_k = 0.9f};
  absl::Status s = CheckRotationsMatch(*rot, e);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  for (const char* f : {"model_name", "head_dim 16 != 128", "num_kv_heads 2 != 8", "clip_ratio_k"})
    EXPECT_NE(s.message().find(f), std::string::npos) << f << ": " << s;
  EXPECT_EQ(s.message().find("num_layers"), std::string::npos);
  EXPECT_TRUE(CheckRotationsMatch(
                  *rot, {.model_name = "m", .head_dim = 16, .num_layers = 2, .num_kv_heads = 2})
                  .ok());
}

TEST(RotationFileTest, MalformedFilesRefused) {
  auto rot = RotationSet::Identity(Meta(8, 1, 1));
  ASSERT_TRUE(rot.ok());
  const std::string good = SerializeRotations(*rot);
  ASSERT_TRUE(ParseRotations(good).ok());
  // wrong format string
  {
    SafetensorsWriter w;
    w.SetMetadata("format", "something");
    EXPECT_NE(ParseRotations(w.Serialize()).status().message().find("format"), std::string::npos);
  }
  // missing tensor and bad metadata
  auto make = [](std::string head_dim, bool with_v, std::vector<uint64_t> kshape) {
    SafetensorsWriter w;
    w.SetMetadata("format", kRotationFileFormat);
    w.SetMetadata("format_version", "1");
    w.SetMetadata("head_dim", head_dim);
    w.SetMetadata("num_layers", "1");
    w.SetMetadata("num_kv_heads", "1");
    w.SetMetadata("clip_ratio_k", "0.96");
    w.SetMetadata("clip_ratio_v", "0.92");
    uint64_t n = 1;
    for (auto s : kshape) n *= s;
    std::vector<float> m(n, 0.0f);
    (void)w.AddF32("layers.0.k.rotation", kshape, m);
    std::vector<float> e(64, 0.0f);
    if (with_v) (void)w.AddF32("layers.0.v.rotation", {8, 8}, e);
    return w.Serialize();
  };
  auto s1 = ParseRotations(make("8", false, {8, 8})).status();
  EXPECT_NE(s1.message().find("layers.0.v.rotation' missing"), std::string::npos) << s1;
  auto s2 = ParseRotations(make("eight", true, {8, 8})).status();
  EXPECT_NE(s2.message().find("head_dim"), std::string::npos) << s2;
  auto s3 = ParseRotations(make("12", true, {12, 12})).status();
  EXPECT_NE(s3.message().find("power of two"), std::string::npos) << s3;
  auto s4 = ParseRotations(make("8", true, {4, 16})).status();
  EXPECT_NE(s4.message().find("expected F32 [8,8]"), std::string::npos) << s4;
  // truncated file
  EXPECT_EQ(ParseRotations(good.substr(0, good.size() - 4)).status().code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(ReadRotationFile("/nonexistent/x.safetensors").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvpool
