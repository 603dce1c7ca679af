// In-process fake of Transport (see fake_transport.h). Bytes move with memcpy on a worker
// thread per transport, so tests see asynchronous completion like with UCX.
#include "kvpool/transport/fake_transport.h"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "envelope.h"
#include "kvpool/common/status.h"
#include "validate.h"

namespace kvpool::transport {

// ---- FakeFabric ----
FakeFabric::~FakeFabric() = default;

std::string FakeFabric::AddPeer(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string address = absl::StrCat("fake:", name, "#", next_id_++);
  peers_[address].name = name;
  return address;
}

void FakeFabric::RemovePeer(const std::string& address) {
  std::lock_guard<std::mutex> lock(mu_);
  peers_.erase(address);
}

bool FakeFabric::PeerAlive(const std::string& address) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(address);
  return it != peers_.end() && !it->second.dead;
}

int FakeFabric::KillPeer(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  int n = 0;
  for (auto& [addr, peer] : peers_) {
    if (peer.name == name && !peer.dead) {
      peer.dead = true;
      ++n;
    }
  }
  return n;
}

void FakeFabric::FailNextOps(int count) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_next_ = count;
}

uint64_t FakeFabric::ops_executed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ops_executed_;
}

uint64_t FakeFabric::AddRegion(const std::string& address, uint8_t* data, size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t id = next_id_++;
  peers_[address].regions[id] = RegionEntry{data, size};
  return id;
}

void FakeFabric::RemoveRegion(const std::string& address, uint64_t region_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = peers_.find(address);
  if (it != peers_.end()) it->second.regions.erase(region_id);
}

absl::Status FakeFabric::Copy(const std::string& peer, uint64_t region_id, uint64_t remote_addr,
                              uint8_t* local, size_t length, bool is_get) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fail_next_ > 0) {
    --fail_next_;
    return absl::UnavailableError("injected failure");
  }
  auto it = peers_.find(peer);
  if (it == peers_.end() || it->second.dead) return absl::UnavailableError("peer is gone");
  auto r = it->second.regions.find(region_id);
  if (r == it->second.regions.end()) return absl::NotFoundError("remote region deregistered");
  const uint64_t base = reinterpret_cast<uint64_t>(r->second.data);
  if (remote_addr < base || remote_addr - base > r->second.size ||
      length > r->second.size - (remote_addr - base)) {
    return absl::OutOfRangeError("remote range outside the remote key's region");
  }
  uint8_t* remote = r->second.data + (remote_addr - base);
  if (is_get) {
    std::memmove(local, remote, length);
  } else {
    std::memmove(remote, local, length);
  }
  ++ops_executed_;
  return absl::OkStatus();
}

namespace {

class FakeRegion final : public MemoryRegion {
 public:
  FakeRegion(FakeFabric* fabric, std::string address, uint8_t* data, size_t size, bool owned)
      : fabric_(fabric), address_(std::move(address)), data_(data), size_(size), owned_(owned) {
    id_ = fabric_->AddRegion(address_, data_, size_);
    rkey_ = internal::Seal('R', absl::StrCat("fakerkey:", address_, "|", id_));
  }
  ~FakeRegion() override {
    fabric_->RemoveRegion(address_, id_);
    if (owned_) delete[] data_;
  }
  uint8_t* data() const override { return data_; }
  size_t size() const override { return size_; }
  const std::string& packed_rkey() const override { return rkey_; }

 private:
  FakeFabric* fabric_;
  std::string address_;
  uint8_t* data_;
  size_t size_;
  bool owned_;
  uint64_t id_ = 0;
  std::string rkey_;
};

class FakeTransport final : public Transport {
 public:
  FakeTransport(FakeFabric* fabric, const std::string& name)
      : fabric_(fabric), address_(fabric->AddPeer(name)) {
    worker_ = std::thread([this] { Loop(); });
  }
  ~FakeTransport() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
    fabric_->RemovePeer(address_);
  }

  std::string Name() const override { return "fake"; }
  std::string WorkerAddress() const override { return internal::Seal('A', address_); }
  bool SupportsCudaMemory() const override { return false; }

  absl::StatusOr<std::shared_ptr<MemoryRegion>> RegisterMemory(void* addr, size_t length) override {
    if (addr == nullptr) return absl::InvalidArgumentError("addr: null");
    if (length == 0) return absl::InvalidArgumentError("length: zero");
    return std::shared_ptr<MemoryRegion>(std::make_shared<FakeRegion>(
        fabric_, address_, static_cast<uint8_t*>(addr), length, false));
  }

  absl::StatusOr<std::shared_ptr<MemoryRegion>> AllocateMemory(size_t length) override {
    if (length == 0) return absl::InvalidArgumentError("length: zero");
    auto* p = new (std::nothrow) uint8_t[length]();
    if (p == nullptr) return absl::ResourceExhaustedError("length: allocation failed");
    return std::shared_ptr<MemoryRegion>(
        std::make_shared<FakeRegion>(fabric_, address_, p, length, true));
  }

  absl::StatusOr<EndpointId> Connect(std::string_view peer_worker_address) override {
    KVPOOL_ASSIGN_OR_RETURN(std::string_view peer,
                            internal::Unseal('A', peer_worker_address, "peer_worker_address"));
    if (!fabric_->PeerAlive(std::string(peer))) {
      return absl::UnavailableError(absl::StrCat("peer ", std::string(peer), " is not reachable"));
    }
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t id = next_id_++;
    endpoints_[id] = std::string(peer);
    return EndpointId{id};
  }

  absl::Status EndpointStatus(EndpointId endpoint) const override {
    std::string peer;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = endpoints_.find(endpoint.value);
      if (it == endpoints_.end()) return absl::NotFoundError("endpoint: unknown or disconnected");
      peer = it->second;
    }
    if (!fabric_->PeerAlive(peer)) return absl::UnavailableError("endpoint: peer failed");
    return absl::OkStatus();
  }

  absl::Status Disconnect(EndpointId endpoint) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (endpoints_.erase(endpoint.value) == 0) {
      return absl::NotFoundError("endpoint: unknown or disconnected");
    }
    for (auto it = rkeys_.begin(); it != rkeys_.end();) {
      it = it->second.endpoint == endpoint.value ? rkeys_.erase(it) : std::next(it);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<RemoteKeyId> UnpackRemoteKey(EndpointId endpoint,
                                              std::string_view packed_rkey) override {
    KVPOOL_ASSIGN_OR_RETURN(std::string_view payload,
                            internal::Unseal('R', packed_rkey, "packed_rkey"));
    KVPOOL_RETURN_IF_ERROR(EndpointStatus(endpoint));
    absl::string_view rest(payload.data(), payload.size());
    if (!absl::ConsumePrefix(&rest, "fakerkey:")) {
      return absl::InvalidArgumentError("packed_rkey: not a fake key");
    }
    std::pair<std::string, std::string> parts = absl::StrSplit(rest, '|');
    uint64_t region = 0;
    if (!absl::SimpleAtoi(parts.second, &region)) {
      return absl::InvalidArgumentError("packed_rkey: bad region id");
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (endpoints_[endpoint.value] != parts.first) {
      return absl::InvalidArgumentError("packed_rkey: key of another peer");
    }
    uint64_t id = next_id_++;
    rkeys_[id] = KeyEntry{endpoint.value, parts.first, region};
    return RemoteKeyId{id};
  }

  absl::StatusOr<std::shared_ptr<Transfer>> Prepare(TransferRequest request) override {
    KVPOOL_RETURN_IF_ERROR(internal::ValidateRequestShape(request));
    if (dynamic_cast<FakeRegion*>(request.local.get()) == nullptr) {
      return absl::InvalidArgumentError("local: region was not registered by a fake transport");
    }
    KVPOOL_RETURN_IF_ERROR(EndpointStatus(request.endpoint));
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = rkeys_.find(request.remote_key.value);
      if (it == rkeys_.end()) return absl::NotFoundError("remote_key: unknown or released");
      if (it->second.endpoint != request.endpoint.value) {
        return absl::InvalidArgumentError("remote_key: belongs to another endpoint");
      }
    }
    return std::make_shared<Transfer>(std::move(request));
  }

  absl::StatusOr<std::shared_ptr<Transfer>> PostFlush(EndpointId endpoint) override {
    KVPOOL_RETURN_IF_ERROR(EndpointStatus(endpoint));
    TransferRequest req;
    req.kind = TransferKind::kPut;
    req.endpoint = endpoint;
    auto transfer = std::make_shared<Transfer>(std::move(req));
    transfer->BeginPost();
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(transfer);  // FIFO: runs after every earlier transfer (copies are sync)
    }
    cv_.notify_all();
    return transfer;
  }

  absl::Status Post(const std::shared_ptr<Transfer>& transfer) override {
    if (transfer == nullptr) return absl::InvalidArgumentError("transfer: null");
    KVPOOL_RETURN_IF_ERROR(EndpointStatus(transfer->request().endpoint));
    if (!transfer->BeginPost()) return absl::FailedPreconditionError("transfer: already posted");
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(transfer);
    }
    cv_.notify_all();
    return absl::OkStatus();
  }

 private:
  struct KeyEntry {
    uint64_t endpoint;
    std::string peer;
    uint64_t region;
  };

  void Execute(const std::shared_ptr<Transfer>& t) {
    const TransferRequest& req = t->request();
    if (req.ops.empty()) {  // a flush: every earlier op already ran (copies are synchronous)
      t->MarkPosted(1);
      t->CompleteOne(std::numeric_limits<size_t>::max(),
                     EndpointStatus(req.endpoint).ok()
                         ? absl::OkStatus()
                         : absl::UnavailableError("endpoint: peer failed"));
      return;
    }
    KeyEntry key;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = rkeys_.find(req.remote_key.value);
      if (it == rkeys_.end()) {
        t->MarkPosted(1);
        t->CompleteOne(std::numeric_limits<size_t>::max(),
                       absl::NotFoundError("remote_key: released"));
        return;
      }
      key = it->second;
    }
    // Decide the count first (like UCX: ops handed to the network), then run them.
    const size_t attempted = t->cancelled() ? 0 : req.ops.size();
    t->MarkPosted(attempted);
    for (size_t i = 0; i < attempted; ++i) {
      const TransferOp& op = req.ops[i];
      absl::Status s =
          fabric_->Copy(key.peer, key.region, op.remote_addr, req.local->data() + op.local_offset,
                        op.length, req.kind == TransferKind::kGet);
      t->CompleteOne(i, std::move(s));
    }
  }

  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty() && stop_) return;
      auto t = queue_.front();
      queue_.pop_front();
      lock.unlock();
      Execute(t);
      lock.lock();
    }
  }

  FakeFabric* fabric_;
  std::string address_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::string> endpoints_;  // id → peer address
  std::map<uint64_t, KeyEntry> rkeys_;
  std::deque<std::shared_ptr<Transfer>> queue_;
  uint64_t next_id_ = 1;
  bool stop_ = false;
  std::thread worker_;
};

}  // namespace

std::unique_ptr<Transport> FakeFabric::CreateTransport(const std::string& name) {
  return std::make_unique<FakeTransport>(this, name);
}

}  // namespace kvpool::transport
