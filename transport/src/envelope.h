// Internal: a checked envelope around opaque UCX bytes that travel over gRPC (worker addresses
// and packed remote keys), so that truncated or foreign bytes are refused with INVALID_ARGUMENT
// before they reach UCX (which does not validate them and may read out of bounds).
//
// Layout (little-endian): "KVPT" (4 bytes) | kind (1 byte: 'A' address, 'R' rkey)
//                         | u32 payload length | u64 xxh3_64(payload, seed 0) | payload.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include <xxhash.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace kvpool::transport::internal {

inline constexpr size_t kEnvelopeHeader = 4 + 1 + 4 + 8;

inline std::string Seal(char kind, std::string_view payload) {
  std::string out;
  out.resize(kEnvelopeHeader + payload.size());
  std::memcpy(out.data(), "KVPT", 4);
  out[4] = kind;
  const uint32_t len = static_cast<uint32_t>(payload.size());
  const uint64_t hash = XXH3_64bits(payload.data(), payload.size());
  std::memcpy(out.data() + 5, &len, 4);
  std::memcpy(out.data() + 9, &hash, 8);
  std::memcpy(out.data() + kEnvelopeHeader, payload.data(), payload.size());
  return out;
}

// Returns the payload of a sealed string of `kind`; INVALID_ARGUMENT naming `field` otherwise.
inline absl::StatusOr<std::string_view> Unseal(char kind, std::string_view sealed,
                                               const char* field) {
  if (sealed.size() < kEnvelopeHeader || std::memcmp(sealed.data(), "KVPT", 4) != 0 ||
      sealed[4] != kind) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": not a kvpool transport blob"));
  }
  uint32_t len = 0;
  uint64_t hash = 0;
  std::memcpy(&len, sealed.data() + 5, 4);
  std::memcpy(&hash, sealed.data() + 9, 8);
  if (len == 0 || len != sealed.size() - kEnvelopeHeader) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": truncated or padded"));
  }
  std::string_view payload = sealed.substr(kEnvelopeHeader);
  if (XXH3_64bits(payload.data(), payload.size()) != hash) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": checksum mismatch"));
  }
  return payload;
}

}  // namespace kvpool::transport::internal
