// End to end over the real data plane: a PoolServer whose memory is registered with UCX, and a
// client that writes staging and reads leased forms with UCX RMA (over TCP and over shared
// memory), verifying every byte against an independent encode of the same input.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <cstring>

#include "kvpool/common/checksum.h"
#include "kvpool/common/keys.h"
#include "kvpool/kvstore/encoder.h"
#include "kvpool/kvstore/server.h"
#include "kvpool/transport/transport.h"
#include "kvpool/transport/ucx_transport.h"
#include "kvpool/v1/pool.grpc.pb.h"
#include "test_util.h"

namespace kvpool::kvstore {
namespace {

namespace pb = ::kvpool::v1;
using transport::TransferKind;

class UcxEndToEndTest : public ::testing::TestWithParam<std::string> {};

TEST_P(UcxEndToEndTest, PutCommitAcquireGetByteExact) {
  PoolServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_port = -1;
  o.capacity_bytes = 8 << 20;
  o.data_plane = "ucx";
  o.ucx_tls = GetParam();
  o.transfer_initiator = "client";  // this test drives the RMA itself (tcp defaults to "pool")
  auto server = PoolServer::Create(o);
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*server)->grpc_port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = pb::KvPool::NewStub(channel);
  auto ctx = [] {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    return c;
  };

  // A model with head_dim 64 so forms are a few KiB: L=2, H=2, d=64, P=16 → BF16 16 KiB.
  ModelSpec spec = testing::TinySpec();
  spec.geometry =
      BlockGeometry{.num_layers = 2, .num_kv_heads = 2, .head_dim = 64, .page_size = 16};
  spec.sink_tokens = 16;
  spec.recent_tokens = 32;
  pb::RegisterModelRequest reg_req;
  reg_req.set_checksum_scheme(kvpool::kChecksumScheme);
  reg_req.mutable_identity()->set_model_id(spec.model_id);
  reg_req.mutable_identity()->set_revision(spec.revision);
  reg_req.mutable_geometry()->set_num_layers(2);
  reg_req.mutable_geometry()->set_num_kv_heads(2);
  reg_req.mutable_geometry()->set_head_dim(64);
  reg_req.mutable_geometry()->set_dtype(pb::KV_DTYPE_BF16);
  reg_req.set_page_size(16);
  reg_req.mutable_recipe()->set_sink_tokens(16);
  reg_req.mutable_recipe()->set_recent_tokens(32);
  reg_req.mutable_recipe()->set_clip_ratio_k(spec.clip_ratio_k);
  reg_req.mutable_recipe()->set_clip_ratio_v(spec.clip_ratio_v);
  reg_req.mutable_recipe()->set_history_precision(pb::HISTORY_PRECISION_INT2);
  reg_req.mutable_recipe()->set_block_format_version(1);
  const std::string rotation_file = testing::RotationFileFor(spec);
  reg_req.set_rotation_file(rotation_file);
  pb::RegisterModelResponse reg;
  grpc::Status st = stub->RegisterModel(ctx().get(), reg_req, &reg);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_FALSE(reg.ucx_worker_address().empty());

  // Client data plane.
  auto client = transport::CreateUcxTransport({.tls = GetParam()});
  ASSERT_TRUE(client.ok()) << client.status();
  auto ep = (*client)->Connect(reg.ucx_worker_address());
  ASSERT_TRUE(ep.ok()) << ep.status();

  constexpr uint32_t kBlocks = 5;  // sink, 2 history, 2 recent
  const uint64_t bf16 = spec.geometry.Bf16FormBytes();
  std::vector<uint8_t> src(kBlocks * bf16);
  for (uint32_t i = 0; i < kBlocks; ++i) {
    auto b = testing::BlockBytes(spec.geometry, 7, i);
    std::memcpy(src.data() + i * bf16, b.data(), bf16);
  }
  auto src_region = (*client)->RegisterMemory(src.data(), src.size());
  ASSERT_TRUE(src_region.ok()) << src_region.status();

  pb::BeginPutRequest bp;
  bp.set_namespace_id(reg.namespace_id());
  for (uint32_t t : testing::Tokens(7, kBlocks * 16 + 3)) {
    bp.add_token_ids(t);
  }
  bp.set_num_blocks(kBlocks);
  pb::BeginPutResponse put;
  st = stub->BeginPut(ctx().get(), bp, &put);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(put.blocks_size(), int(kBlocks));
  auto rkey = (*client)->UnpackRemoteKey(*ep, put.blocks(0).rkey());
  ASSERT_TRUE(rkey.ok()) << rkey.status();
  // Layer by layer, as a prefill node would: one op per (block, layer).
  const uint64_t layer_bytes = spec.geometry.Bf16LayerBytes();
  pb::CommitPutRequest cp;
  cp.set_namespace_id(reg.namespace_id());
  cp.set_put_id(put.put_id());
  for (uint32_t l = 0; l < spec.geometry.num_layers; ++l) {
    transport::TransferRequest req{
        .kind = TransferKind::kPut, .endpoint = *ep, .remote_key = *rkey, .local = *src_region};
    for (const pb::PutBlock& b : put.blocks()) {
      ASSERT_EQ(b.action(), pb::PUT_BLOCK_ACTION_WRITE);
      req.ops.push_back({.local_offset = b.index() * bf16 + l * layer_bytes,
                         .remote_addr = b.staging_addr() + l * layer_bytes,
                         .length = layer_bytes});
    }
    absl::Status s = (*client)->Execute(std::move(req), absl::Now() + absl::Seconds(20));
    ASSERT_TRUE(s.ok()) << s;
  }
  for (const pb::PutBlock& b : put.blocks()) {
    auto* c = cp.add_checksums();
    c->set_index(b.index());
    c->set_xxh3(FormChecksum(src.data() + b.index() * bf16, bf16));
  }
  pb::CommitPutResponse committed;
  st = stub->CommitPut(ctx().get(), cp, &committed);
  ASSERT_TRUE(st.ok()) << st.error_message();

  pb::AcquireRequest ar;
  ar.set_namespace_id(reg.namespace_id());
  for (uint32_t t : testing::Tokens(7, kBlocks * 16)) {
    ar.add_token_ids(t);
  }
  pb::AcquireResponse lease;
  ASSERT_TRUE(stub->Acquire(ctx().get(), ar, &lease).ok());
  ASSERT_EQ(lease.num_blocks(), kBlocks);

  auto rot = ParseRotations(rotation_file);
  ASSERT_TRUE(rot.ok());
  std::vector<uint8_t> dst(kBlocks * 2 * bf16);
  auto dst_region = (*client)->RegisterMemory(dst.data(), dst.size());
  ASSERT_TRUE(dst_region.ok());
  transport::TransferRequest get{
      .kind = TransferKind::kGet, .endpoint = *ep, .remote_key = *rkey, .local = *dst_region};
  uint64_t at = 0;
  struct Expect {
    uint64_t offset, size, xxh3;
    std::vector<uint8_t> bytes;
  };
  std::vector<Expect> expects;
  int forms = 0;
  for (const pb::LeasedBlock& b : lease.blocks()) {
    std::vector<uint8_t> want_bf16(bf16), want_int2(spec.geometry.Int2FormBytes());
    EncodeResult r;
    ASSERT_TRUE(EncodeBlock(spec.geometry, *rot, spec.clip_ratio_k, spec.clip_ratio_v,
                            src.data() + b.index() * bf16, want_bf16.data(), want_int2.data(), &r)
                    .ok());
    for (const pb::FormLocation& f : b.forms()) {
      get.ops.push_back({.local_offset = at, .remote_addr = f.remote_addr(), .length = f.size()});
      expects.push_back(
          {at, f.size(), f.xxh3(), f.form() == pb::FORM_BF16 ? want_bf16 : want_int2});
      at += f.size();
      ++forms;
    }
  }
  EXPECT_EQ(forms, 1 + 2 + 2 * 2);
  absl::Status s = (*client)->Execute(std::move(get), absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(s.ok()) << s;
  for (const Expect& e : expects) {
    EXPECT_EQ(FormChecksum(dst.data() + e.offset, e.size), e.xxh3);
    ASSERT_EQ(e.bytes.size(), e.size);
    EXPECT_EQ(0, std::memcmp(dst.data() + e.offset, e.bytes.data(), e.size));
  }
  pb::ReleaseRequest rel;
  rel.set_lease_id(lease.lease_id());
  pb::ReleaseResponse released;
  EXPECT_TRUE(stub->Release(ctx().get(), rel, &released).ok());
  (*server)->Shutdown(absl::Seconds(1));
}

// A client that sends the pool's own worker address with WritePut or
// ReadLeased used to make the pool connect to itself: its own worker then served the RMA
// against its own memory — a get from address 0x10 killed the process (every stored block lost),
// a put to a chosen address overwrote other models' blocks. Over real UCX tcp (where the pool
// initiates transfers): every such request is INVALID_ARGUMENT naming the field, the pool hands
// out no key or staging address in this mode, and the stored blocks stay byte-exact.
TEST(UcxPoolInitiatedTest, ThePoolsOwnWorkerIsRefusedAndNothingIsDamaged) {
  PoolServerOptions o;
  o.listen = "127.0.0.1:0";
  o.metrics_port = -1;
  o.capacity_bytes = 8 << 20;
  o.data_plane = "ucx";
  o.ucx_tls = "tcp";  // auto → the pool initiates
  auto server = PoolServer::Create(o);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string own = (*server)->ucx_worker_address();
  ASSERT_FALSE(own.empty());
  auto stub = pb::KvPool::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", (*server)->grpc_port()), grpc::InsecureChannelCredentials()));
  auto ctx = [] {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    return c;
  };
  const ModelSpec spec = testing::TinySpec();
  const uint64_t bf16 = spec.geometry.Bf16FormBytes();
  pb::RegisterModelRequest rr;
  rr.set_checksum_scheme(kvpool::kChecksumScheme);
  rr.mutable_identity()->set_model_id(spec.model_id);
  rr.mutable_identity()->set_revision(spec.revision);
  rr.mutable_geometry()->set_num_layers(spec.geometry.num_layers);
  rr.mutable_geometry()->set_num_kv_heads(spec.geometry.num_kv_heads);
  rr.mutable_geometry()->set_head_dim(spec.geometry.head_dim);
  rr.mutable_geometry()->set_dtype(pb::KV_DTYPE_BF16);
  rr.set_page_size(spec.geometry.page_size);
  rr.mutable_recipe()->set_sink_tokens(spec.sink_tokens);
  rr.mutable_recipe()->set_recent_tokens(spec.recent_tokens);
  rr.mutable_recipe()->set_clip_ratio_k(spec.clip_ratio_k);
  rr.mutable_recipe()->set_clip_ratio_v(spec.clip_ratio_v);
  rr.mutable_recipe()->set_history_precision(pb::HISTORY_PRECISION_INT2);
  rr.mutable_recipe()->set_block_format_version(1);
  rr.set_rotation_file(testing::RotationFileFor(spec));
  pb::RegisterModelResponse reg;
  ASSERT_TRUE(stub->RegisterModel(ctx().get(), rr, &reg).ok());
  ASSERT_TRUE(reg.pool_initiates_transfers());
  EXPECT_TRUE(reg.ucx_worker_address().empty());  // clients never connect to it in this mode
  EXPECT_TRUE(reg.arena_rkey().empty());

  // A legitimate put of 2 blocks from the client's region, pulled by the pool.
  auto client = transport::CreateUcxTransport({.tls = "tcp"});
  ASSERT_TRUE(client.ok()) << client.status();
  auto src = (*client)->AllocateMemory(2 * bf16);
  ASSERT_TRUE(src.ok()) << src.status();
  pb::BeginPutRequest bp;
  bp.set_namespace_id(reg.namespace_id());
  for (uint32_t t : testing::Tokens(9, 2 * spec.geometry.page_size)) bp.add_token_ids(t);
  bp.set_num_blocks(2);
  pb::BeginPutResponse put;
  ASSERT_TRUE(stub->BeginPut(ctx().get(), bp, &put).ok());
  ASSERT_EQ(put.blocks_size(), 2);
  pb::WritePutRequest wp;
  wp.set_namespace_id(reg.namespace_id());
  wp.set_put_id(put.put_id());
  wp.set_client_worker_address((*client)->WorkerAddress());
  wp.set_source_rkey((*src)->packed_rkey());
  pb::CommitPutRequest cp;
  cp.set_namespace_id(reg.namespace_id());
  cp.set_put_id(put.put_id());
  for (const pb::PutBlock& b : put.blocks()) {
    EXPECT_TRUE(b.rkey().empty());    // no key to the pool's memory
    EXPECT_EQ(b.staging_addr(), 0u);  // nor where its staging lies
    auto bytes = testing::BlockBytes(spec.geometry, 9, b.index());
    std::memcpy((*src)->data() + b.index() * bf16, bytes.data(), bf16);
    pb::PutSource* s = wp.add_sources();
    s->set_index(b.index());
    s->set_length(bf16);
    s->set_source_addr((*src)->address() + b.index() * bf16);
    auto* c = cp.add_checksums();
    c->set_index(b.index());
    c->set_xxh3(FormChecksum(bytes.data(), bf16));
  }

  auto refused_put = [&](pb::WritePutRequest bad, const std::string& field) {
    pb::WritePutResponse r;
    grpc::Status st = stub->WritePut(ctx().get(), bad, &r);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field << st.error_message();
    EXPECT_NE(st.error_message().find(field), std::string::npos) << st.error_message();
  };
  // The crash of the newcomer's crash_writeput.py: own address, an unmapped source address.
  pb::WritePutRequest bad = wp;
  bad.set_client_worker_address(own);
  bad.mutable_sources(0)->set_source_addr(0x10);
  refused_put(bad, "client_worker_address");
  // The same worker re-sealed with a changed tail (its UCX uuid is what gives it away).
  std::string payload = own.substr(17);
  payload.push_back('\x01');
  std::string resealed = own.substr(0, 5);
  const uint32_t len = static_cast<uint32_t>(payload.size());
  const uint64_t hash = Xxh3(payload.data(), payload.size());
  resealed.append(reinterpret_cast<const char*>(&len), 4);
  resealed.append(reinterpret_cast<const char*>(&hash), 8);
  resealed += payload;
  bad.set_client_worker_address(resealed);
  refused_put(bad, "client_worker_address");
  bad = wp;
  bad.set_client_worker_address("");
  refused_put(bad, "client_worker_address");
  // (Refusing the pool's own packed key as well is not possible: over tcp a packed key was
  // found to be the same bytes in every worker — UCX's software RMA checks none — so the
  // client's own key equals the pool's.)

  pb::WritePutResponse written;
  grpc::Status st = stub->WritePut(ctx().get(), wp, &written);
  ASSERT_TRUE(st.ok()) << st.error_message();
  pb::CommitPutResponse committed;
  st = stub->CommitPut(ctx().get(), cp, &committed);
  ASSERT_TRUE(st.ok()) << st.error_message();

  pb::AcquireRequest ar;
  ar.set_namespace_id(reg.namespace_id());
  for (uint32_t t : testing::Tokens(9, 2 * spec.geometry.page_size)) ar.add_token_ids(t);
  pb::AcquireResponse lease;
  ASSERT_TRUE(stub->Acquire(ctx().get(), ar, &lease).ok());
  ASSERT_EQ(lease.num_blocks(), 2u);
  const pb::FormLocation& f0 = lease.blocks(0).forms(0);
  for (const pb::LeasedBlock& b : lease.blocks()) {
    for (const pb::FormLocation& f : b.forms()) EXPECT_TRUE(f.rkey().empty());
  }
  // The overwrite of overwrite.py / fz6.py: own address, the destination another form's slot
  // (or address 0x10).
  auto refused_read = [&](pb::ReadLeasedRequest req, const std::string& field) {
    pb::ReadLeasedResponse r;
    grpc::Status s = stub->ReadLeased(ctx().get(), req, &r);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << field << s.error_message();
    EXPECT_NE(s.error_message().find(field), std::string::npos) << s.error_message();
  };
  auto dst = (*client)->AllocateMemory(64 << 10);
  ASSERT_TRUE(dst.ok()) << dst.status();
  for (uint64_t dest : {f0.remote_addr() + f0.size(), uint64_t{0x10}}) {
    pb::ReadLeasedRequest rl;
    rl.set_lease_id(lease.lease_id());
    rl.set_client_worker_address(own);
    pb::LeasedRead* r = rl.add_reads();
    r->set_remote_addr(f0.remote_addr());
    r->set_size(f0.size());
    r->set_dest_addr(dest);
    r->set_dest_rkey((*dst)->packed_rkey());
    refused_read(rl, "client_worker_address");
  }

  // Nothing stored was damaged: every form read back matches its checksum.
  pb::ReadLeasedRequest rl;
  rl.set_lease_id(lease.lease_id());
  rl.set_client_worker_address((*client)->WorkerAddress());
  std::vector<std::pair<uint64_t, const pb::FormLocation*>> placed;
  uint64_t at = 0;
  for (const pb::LeasedBlock& b : lease.blocks()) {
    for (const pb::FormLocation& f : b.forms()) {
      pb::LeasedRead* r = rl.add_reads();
      r->set_remote_addr(f.remote_addr());
      r->set_size(f.size());
      r->set_dest_addr((*dst)->address() + at);
      r->set_dest_rkey((*dst)->packed_rkey());
      placed.emplace_back(at, &f);
      at += f.size();
    }
  }
  pb::ReadLeasedResponse read;
  st = stub->ReadLeased(ctx().get(), rl, &read);
  ASSERT_TRUE(st.ok()) << st.error_message();
  ASSERT_EQ(read.results_size(), rl.reads_size());
  for (size_t i = 0; i < placed.size(); ++i) {
    EXPECT_EQ(read.results(static_cast<int>(i)).code(), 0) << read.results(i).message();
    EXPECT_EQ(FormChecksum((*dst)->data() + placed[i].first, placed[i].second->size()),
              placed[i].second->xxh3());
  }
  const StoreStats stats = (*server)->store().Stats();
  EXPECT_EQ(stats.blocks, 2u);
  (*server)->Shutdown(absl::Seconds(1));
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxEndToEndTest, ::testing::Values("tcp", "sm"),
                         [](const auto& info) {
                           return info.param == "tcp" ? std::string("tcp") : std::string("shm");
                         });

}  // namespace
}  // namespace kvpool::kvstore
