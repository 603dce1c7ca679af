// kvpool/common/keys.h — deterministic, domain-separated block keys (`kvpool-keys-v1`).
//
// Implements docs/KEYS.md (FORMAT.md §5): key(-1) = SHA-256 of the encoded namespace;
// key(i) = SHA-256(key(i-1) ‖ u32 token_count ‖ token ids as u32 little-endian). Client, pool and
// the Python tools compute identical keys (golden vectors in common/tests/keys_test.cc and
// python/tests/test_keys.py).
//
//   kvpool::KeyNamespace ns{.model_id = "stories260K", .revision = "r1", .num_layers = 5,
//                           .num_kv_heads = 4, .head_dim = 8, .rotation_id = rot};
//   KVPOOL_ASSIGN_OR_RETURN(kvpool::BlockKey root, kvpool::NamespaceKey(ns));
//   KVPOOL_ASSIGN_OR_RETURN(std::vector<kvpool::BlockKey> keys,
//                           kvpool::ChainKeys(root, tokens, ns.page_size));
//
// Every function is thread-safe: the only state is one SHA-256 context per calling thread
// (reused, freed at thread exit) and the algorithm fetched once per process. SHA-256 comes from
// OpenSSL's EVP interface (only the .cc includes it).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvpool {

// A SHA-256 digest: a block key, a namespace key (key(-1)) or a rotation id. 32 raw bytes.
using Digest = std::array<uint8_t, 32>;
using BlockKey = Digest;

inline constexpr uint32_t kKeyFormatVersion = 1;
inline constexpr std::string_view kBlockLayoutName = "kvpool-block-v1";

// Tensor-parallel shard identity; absent (std::nullopt) means "canonical" (docs/KEYS.md #15).
struct TensorParallelShard {
  uint32_t rank = 0;
  uint32_t size = 1;
};

// Every field of the namespace, in docs/KEYS.md order. Defaults are the documented ones.
struct KeyNamespace {
  uint32_t key_format_version = kKeyFormatVersion;     // #1
  std::string block_layout{kBlockLayoutName};          // #2
  std::string tenant = "default";                      // #3
  std::string model_id;                                // #4
  std::string revision;                                // #5
  uint32_t num_layers = 0;                             // #6
  uint32_t num_kv_heads = 0;                           // #7
  uint32_t head_dim = 0;                               // #8
  Digest rotation_id{};                                // #9, SHA-256 of the rotation file
  uint32_t page_size = 16;                             // #10
  uint32_t sink_tokens = 64;                           // #11
  float clip_ratio_k = 0.96f;                          // #12, encoded as IEEE binary32 bits
  float clip_ratio_v = 0.92f;                          // #13
  std::string history_precision = "int2";              // #14, "int2" or "bf16"
  std::optional<TensorParallelShard> tensor_parallel;  // #15, nullopt = "canonical"
};

// Identity strings of a namespace (tenant, model_id, revision) as the pool registers them
// (docs/PROTOCOL.md "Registration"): 1..kMaxIdentityBytes bytes, each printable ASCII
// (0x20..0x7e). The pool's RegisterModel and the worker's flag checks apply the same rule.
inline constexpr size_t kMaxIdentityBytes = 256;
// The index of the first byte of `v` outside printable ASCII (0x20..0x7e), or npos if none.
size_t FirstNonPrintableAscii(std::string_view v);

// The namespace bytes of docs/KEYS.md: each field as u32 length (LE) ‖ bytes. Never fails
// (validation is NamespaceKey's job).
std::string EncodeNamespace(const KeyNamespace& ns);

// key(-1) = SHA-256(EncodeNamespace(ns)).
// Errors: INVALID_ARGUMENT naming the field when model_id is empty, page_size is not a power of
// two, history_precision is not "int2"/"bf16", or tensor_parallel.rank >= size.
absl::StatusOr<Digest> NamespaceKey(const KeyNamespace& ns);

// SHA-256 of `bytes` (any length). Used for rotation ids.
Digest Sha256(std::string_view bytes);

// key(i) from key(i-1) and the block's token ids (count = tokens.size(), normally page_size).
BlockKey NextBlockKey(const BlockKey& prev, absl::Span<const uint32_t> tokens);

// Keys of the full blocks of `tokens` (the partial tail is ignored), chained from `root`
// (key(-1)). Returns at most `max_blocks` keys when max_blocks > 0.
// Errors: INVALID_ARGUMENT "page_size" when page_size == 0.
absl::StatusOr<std::vector<BlockKey>> ChainKeys(const Digest& root,
                                                absl::Span<const uint32_t> tokens,
                                                uint32_t page_size, size_t max_blocks = 0);

// Lower-case hex (64 characters).
std::string ToHex(const Digest& d);

// Parses 64 hex characters (either case). Errors: INVALID_ARGUMENT naming `field`.
absl::StatusOr<Digest> DigestFromHex(std::string_view hex, std::string_view field = "key");

// Copies 32 raw bytes. Errors: INVALID_ARGUMENT naming `field` when bytes.size() != 32.
absl::StatusOr<Digest> DigestFromBytes(std::string_view bytes, std::string_view field = "key");

// The raw bytes as a std::string (for protobuf `bytes` fields).
inline std::string DigestBytes(const Digest& d) {
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

// Hash functor for unordered containers keyed by Digest (uses the digest's own first 8 bytes:
// SHA-256 output is already uniformly distributed).
struct DigestHash {
  size_t operator()(const Digest& d) const noexcept {
    uint64_t h = 0;
    for (int i = 0; i < 8; ++i) {
      h |= uint64_t(d[i]) << (8 * i);
    }
    return static_cast<size_t>(h);
  }
};

}  // namespace kvpool
