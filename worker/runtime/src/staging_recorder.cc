// StagingRecorder: un-rotated BF16 staging bytes of a prefill (see the header).
#include "kvpool/worker/staging_recorder.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvpool/kernels/numeric.h"

namespace kvpool::worker {

StagingRecorder::StagingRecorder(engine::KvCacheView* inner, const BlockGeometry& geometry)
    : inner_(inner), geometry_(geometry) {}

absl::Status StagingRecorder::Append(int layer, int pos, absl::Span<const float> k,
                                     absl::Span<const float> v) {
  const size_t kv_dim = size_t{geometry_.num_kv_heads} * geometry_.head_dim;
  if (layer < 0 || layer >= static_cast<int>(geometry_.num_layers)) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " outside [0, ", geometry_.num_layers, ")"));
  }
  if (k.size() != kv_dim || v.size() != kv_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("k/v have ", k.size(), "/", v.size(), " floats; expected H_kv*d = ", kv_dim));
  }
  if (pos < 0) {
    return absl::InvalidArgumentError(absl::StrCat("pos ", pos, " < 0"));
  }
  const uint32_t P = geometry_.page_size;
  const uint32_t d = geometry_.head_dim;
  const int b = pos / static_cast<int>(P);
  const uint32_t t = static_cast<uint32_t>(pos) % P;
  if (static_cast<int>(blocks_.size()) <= b) {
    blocks_.resize(b + 1);
  }
  std::vector<uint8_t>& blk = blocks_[b];
  if (blk.empty()) {
    blk.assign(geometry_.Bf16FormBytes(), 0);
  }
  for (uint32_t h = 0; h < geometry_.num_kv_heads; ++h) {
    uint8_t* chunk = blk.data() + geometry_.Bf16ChunkOffset(layer, h);
    auto* kr = reinterpret_cast<uint16_t*>(chunk) + size_t{t} * d;
    auto* vr = reinterpret_cast<uint16_t*>(chunk + geometry_.Bf16VOffset()) + size_t{t} * d;
    for (uint32_t j = 0; j < d; ++j) {
      kr[j] = Fp32ToBf16(k[h * d + j]);
      vr[j] = Fp32ToBf16(v[h * d + j]);
    }
  }
  absl::Status s = inner_->Append(layer, pos, k, v);
  if (!s.ok()) {
    return s;
  }
  if (t == P - 1 && on_layer_complete_) {
    on_layer_complete_(b, layer);
  }
  return absl::OkStatus();
}

const uint8_t* StagingRecorder::Staging(int block) const {
  if (block < 0 || block >= static_cast<int>(blocks_.size()) || blocks_[block].empty()) {
    return nullptr;
  }
  return blocks_[block].data();
}

int StagingRecorder::FullBlocks() const {
  int len = inner_->Length(0);
  for (uint32_t l = 1; l < geometry_.num_layers; ++l) {
    len = std::min(len, inner_->Length(l));
  }
  return len / static_cast<int>(geometry_.page_size);
}

}  // namespace kvpool::worker
