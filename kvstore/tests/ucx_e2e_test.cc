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
    c->set_xxh3(Xxh3(src.data() + b.index() * bf16, bf16));
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
    EXPECT_EQ(Xxh3(dst.data() + e.offset, e.size), e.xxh3);
    ASSERT_EQ(e.bytes.size(), e.size);
    EXPECT_EQ(0, std::memcmp(dst.data() + e.offset, e.bytes.data(), e.size));
  }
  pb::ReleaseRequest rel;
  rel.set_lease_id(lease.lease_id());
  pb::ReleaseResponse released;
  EXPECT_TRUE(stub->Release(ctx().get(), rel, &released).ok());
  (*server)->Shutdown(absl::Seconds(1));
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxEndToEndTest, ::testing::Values("tcp", "sm"),
                         [](const auto& info) {
                           return info.param == "tcp" ? std::string("tcp") : std::string("shm");
                         });

}  // namespace
}  // namespace kvpool::kvstore
