// kvpool/common/room_shortage.h — the numbers of a pool's refusal for room, carried with the
// status instead of only in its message text.
//
// A BeginPut the pool refuses RESOURCE_EXHAUSTED because the put cannot commit with what is
// held now (kvstore BlockStore::CheckCommitFitsLocked) or its staging, or a commit's new forms,
// cannot be placed even once eviction freed all it may (AllocateAllLocked) carries a
// RoomShortage: the store sets it as an absl::Status payload, the
// pool sends it as the trailing metadata kRoomShortageTrailer (protocol v1.7: a serialized
// kvpool.v1.RoomShortage), and the C++ client sets the same payload on the status it returns,
// so a prefill node (kvpool::worker::RoomHeldByOthers) reads the numbers without parsing the
// message (which stays as it was, for people and older clients).
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/cord.h"

namespace kvpool {

struct RoomShortage {
  uint64_t need_bytes = 0;     // bytes the put needs at once (staging, plus new forms at commit)
  uint64_t room_bytes = 0;     // bytes eviction can make free now ("pool full": maybe in pieces)
  uint64_t staging_bytes = 0;  // staging held by (other) open puts
  uint64_t pinned_bytes = 0;   // forms of leased or pinned blocks
};

// The status payload's type URL; its value is the four fields, little-endian uint64 each.
inline constexpr char kRoomShortagePayload[] = "type.kvpool/room-shortage";
// The gRPC trailing metadata key of the pool's refusal (binary: a kvpool.v1.RoomShortage).
inline constexpr char kRoomShortageTrailer[] = "kvpool-room-shortage-bin";

// Sets `r` on `status` (a no-op on an OK status, which carries no payload).
inline void SetRoomShortage(absl::Status& status, const RoomShortage& r) {
  const uint64_t v[4] = {r.need_bytes, r.room_bytes, r.staging_bytes, r.pinned_bytes};
  char bytes[sizeof(v)];
  std::memcpy(bytes, v, sizeof(v));  // little-endian hosts only (x86-64, aarch64)
  status.SetPayload(kRoomShortagePayload, absl::Cord(std::string(bytes, sizeof(bytes))));
}

// The RoomShortage set on `status`; nullopt when none (or malformed).
inline std::optional<RoomShortage> GetRoomShortage(const absl::Status& status) {
  const auto p = status.GetPayload(kRoomShortagePayload);  // absl::optional<absl::Cord>
  if (!p.has_value() || p->size() != 4 * sizeof(uint64_t)) return std::nullopt;
  const std::string bytes(*p);
  uint64_t v[4];
  std::memcpy(v, bytes.data(), sizeof(v));
  return RoomShortage{v[0], v[1], v[2], v[3]};
}

}  // namespace kvpool
