// kvpool/transport/fake_transport.h — an in-process Transport for tests (no UCX).
//
// A FakeFabric connects FakeTransports created from it: worker addresses, remote keys and
// transfers behave like the UCX implementation (same validation, same statuses), but bytes are
// copied with memcpy on a per-transport worker thread. Faults can be injected:
//
//   FakeFabric fabric;
//   auto server = fabric.CreateTransport("server");
//   auto client = fabric.CreateTransport("client");
//   ...
//   fabric.KillPeer("server");   // endpoints to it fail: UNAVAILABLE, in-flight ops too
//
// Thread-safe. The fabric must outlive its transports.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "kvpool/transport/transport.h"

namespace kvpool::transport {

class FakeFabric {
 public:
  FakeFabric() = default;
  FakeFabric(const FakeFabric&) = delete;
  FakeFabric& operator=(const FakeFabric&) = delete;
  ~FakeFabric();

  // Creates a transport whose WorkerAddress() is "fake:<name>#<n>" (unique per call).
  std::unique_ptr<Transport> CreateTransport(const std::string& name);

  // Marks every transport created with `name` as dead: endpoints to it report UNAVAILABLE and
  // transfers to it fail with UNAVAILABLE. Returns how many transports were marked.
  int KillPeer(const std::string& name);

  // Makes the next `count` transfer ops (any transport) fail with UNAVAILABLE.
  void FailNextOps(int count);

  // Count of ops executed (for tests that check that nothing moved).
  uint64_t ops_executed() const;

  // ---- used by FakeTransport (all thread-safe) ----
  std::string AddPeer(const std::string& name);  // returns the new unique address
  void RemovePeer(const std::string& address);
  bool PeerAlive(const std::string& address) const;
  uint64_t AddRegion(const std::string& address, uint8_t* data, size_t size);
  void RemoveRegion(const std::string& address, uint64_t region_id);
  // Copies one op between `local` and the peer's region `region_id` at `remote_addr`, under the
  // fabric lock (so a region cannot vanish mid-copy). UNAVAILABLE when the peer is dead or
  // gone, NOT_FOUND when the region was deregistered, OUT_OF_RANGE outside the region.
  absl::Status Copy(const std::string& peer, uint64_t region_id, uint64_t remote_addr,
                    uint8_t* local, size_t length, bool is_get);

 private:
  struct RegionEntry {
    uint8_t* data;
    size_t size;
  };
  struct Peer {
    std::string name;
    bool dead = false;
    std::map<uint64_t, RegionEntry> regions;
  };
  mutable std::mutex mu_;
  std::map<std::string, Peer> peers_;  // address → peer
  uint64_t next_id_ = 1;
  int fail_next_ = 0;
  uint64_t ops_executed_ = 0;
};

}  // namespace kvpool::transport
