// xxh3_64 known answers (the xxHash project's published values for "" and "abc"), the streaming
// form's equivalence to the one-shot form, and the chunked form checksum of
// docs/BLOCK_FORMAT.md "Checksums" against golden values computed outside this code base (the
// Python `xxhash` package: xxh3_64 of each 16 KiB chunk, then xxh3_64 of the little-endian
// digests).
#include "kvpool/common/checksum.h"

#include <gtest/gtest.h>

#include <thread>
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
  s.Reset();
  s.Update(b.data(), b.size());
  EXPECT_EQ(s.Digest(), one);
  b[999] ^= 1;
  EXPECT_NE(Xxh3(b.data(), b.size()), one);
}

// The one-shot form (on x86-64 with AVX2 the AVX2 build of xxh3, checksum_avx2.cc) and the
// streaming form (libxxhash's own, runtime-dispatched) agree at every length class xxh3 has
// (0, 1-3, 4-8, 9-16, 17-128, 129-240, longer: stripes, blocks of 1 KiB, a partial last
// stripe) and at unaligned starts.
TEST(ChecksumTest, OneShotMatchesStreamingAtEveryLengthAndAlignment) {
  std::vector<unsigned char> b(70000 + 64);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (auto& c : b) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    c = static_cast<unsigned char>(x);
  }
  std::vector<size_t> sizes;
  for (size_t n = 0; n <= 300; ++n) sizes.push_back(n);
  for (size_t n : {1023, 1024, 1025, 4096, 16383, 16384, 16385, 65536, 70000}) sizes.push_back(n);
  int bad = 0;
  for (size_t n : sizes) {
    for (size_t off : {0, 1, 3, 8, 31}) {
      Xxh3Stream s;
      s.Update(b.data() + off, n);
      if (Xxh3(b.data() + off, n) != s.Digest()) {
        ADD_FAILURE() << "size " << n << " offset " << off;
        if (++bad > 10) return;
      }
    }
  }
}

// b[i] = (31·i + ⌊i / 256⌋) mod 256: no two 16 KiB chunks alike.
std::vector<unsigned char> Pattern(size_t n) {
  std::vector<unsigned char> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<unsigned char>(i * 31 + (i >> 8));
  return b;
}

TEST(FormChecksumTest, GoldenValues) {
  EXPECT_EQ(kChecksumChunkBytes, 16384u);
  // No chunks: xxh3_64 of zero digest bytes.
  EXPECT_EQ(FormChecksum(nullptr, 0), 0x2D06800538D394C2ull);
  // One chunk "abc": digest 0x78AF5F94892F3950, hashed as its 8 LE bytes 50 39 2f 89 94 5f af 78.
  EXPECT_EQ(FormChecksum("abc", 3), 0xF267CDA02014E7EBull);
  const unsigned char le[8] = {0x50, 0x39, 0x2f, 0x89, 0x94, 0x5f, 0xaf, 0x78};
  EXPECT_EQ(Xxh3(le, 8), 0xF267CDA02014E7EBull);
  // 40000 bytes: chunks of 16384, 16384 and 7232 bytes.
  const std::vector<unsigned char> b = Pattern(40000);
  EXPECT_EQ(Xxh3(b.data(), 16384), 0x3FDCEB295FAFBFB8ull);
  EXPECT_EQ(Xxh3(b.data() + 16384, 16384), 0x537C51B2EACA2214ull);
  EXPECT_EQ(Xxh3(b.data() + 32768, 7232), 0x5EF513695F59A783ull);
  const uint64_t digests[3] = {0x3FDCEB295FAFBFB8ull, 0x537C51B2EACA2214ull, 0x5EF513695F59A783ull};
  EXPECT_EQ(CombineChunkDigests(digests, 3), 0xDDEFC0D40BF87780ull);
  EXPECT_EQ(FormChecksum(b.data(), b.size()), 0xDDEFC0D40BF87780ull);
  EXPECT_NE(FormChecksum(b.data(), b.size()), Xxh3(b.data(), b.size()));
  // 5 MiB: 320 chunks (more than the one-shot's stack buffer and the combiner's batch).
  const std::vector<unsigned char> big = Pattern(5 << 20);
  EXPECT_EQ(ChecksumChunks(big.size()), 320u);
  EXPECT_EQ(FormChecksum(big.data(), big.size()), 0xF62DF4330874DD09ull);
}

TEST(FormChecksumTest, EveryChunkCounts) {
  std::vector<unsigned char> b = Pattern(40000);
  const uint64_t good = FormChecksum(b.data(), b.size());
  for (size_t at : {size_t{0}, size_t{16383}, size_t{16384}, size_t{30000}, size_t{39999}}) {
    b[at] ^= 0x40;
    EXPECT_NE(FormChecksum(b.data(), b.size()), good) << "byte " << at;
    b[at] ^= 0x40;
  }
  // Swapping two whole chunks changes it too (the digests are combined in order).
  std::vector<unsigned char> swapped(b);
  std::copy(b.begin(), b.begin() + 16384, swapped.begin() + 16384);
  std::copy(b.begin() + 16384, b.begin() + 32768, swapped.begin());
  EXPECT_NE(FormChecksum(swapped.data(), swapped.size()), good);
}

TEST(FormChecksumTest, BuilderMatchesOneShotForAnyPieces) {
  const std::vector<unsigned char> b = Pattern(100000);
  const uint64_t want = FormChecksum(b.data(), b.size());
  // Pieces of many sizes, in order (crossing chunk boundaries).
  for (size_t piece : {size_t{1}, size_t{1000}, size_t{8192}, size_t{16384}, size_t{24576},
                       size_t{40000}, size_t{100000}}) {
    FormChecksumBuilder f(b.size());
    for (size_t off = 0; off < b.size(); off += piece) {
      f.Add(off, b.data() + off, std::min(piece, b.size() - off));
    }
    EXPECT_EQ(f.Finish(), want) << "pieces of " << piece;
  }
  // Whole chunks out of order, the partial last chunk in two pieces, digests set directly.
  FormChecksumBuilder f(b.size());
  f.Add(5 * 16384, b.data() + 5 * 16384, 1000);
  f.Add(5 * 16384 + 1000, b.data() + 5 * 16384 + 1000, b.size() - 5 * 16384 - 1000);
  for (size_t c : {size_t{4}, size_t{0}, size_t{2}}) {
    f.Add(c * 16384, b.data() + c * 16384, 16384);
  }
  f.Add(16384, b.data() + 16384, 16384);
  f.SetChunkDigest(3, Xxh3(b.data() + 3 * 16384, 16384));
  EXPECT_EQ(f.Finish(), want);
}

TEST(FormChecksumTest, WholeChunksFromSeveralThreads) {
  const std::vector<unsigned char> b = Pattern(64 * 16384 + 77);
  const uint64_t want = FormChecksum(b.data(), b.size());
  FormChecksumBuilder f(b.size());
  const uint64_t chunks = ChecksumChunks(b.size());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (uint64_t c = t; c < chunks; c += 4) {
        const uint64_t off = c * 16384;
        f.Add(off, b.data() + off, std::min<uint64_t>(16384, b.size() - off));
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(f.Finish(), want);
}

TEST(FormChecksumDeathTest, MisuseAborts) {
  const std::vector<unsigned char> b = Pattern(40000);
  EXPECT_DEATH(
      {
        FormChecksumBuilder f(b.size());
        f.Add(39000, b.data(), 2000);
      },
      "beyond");
  EXPECT_DEATH(
      {
        FormChecksumBuilder f(b.size());
        f.Add(100, b.data() + 100, 100);  // chunk 0 must start at its first byte
      },
      "out of order");
}

}  // namespace
}  // namespace kvpool
