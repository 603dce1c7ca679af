// Shared helpers of kvstore_test: a tiny model, its rotation file, and deterministic K/V.
#pragma once

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kvpool/common/checksum.h"
#include "kvpool/kernels/numeric.h"
#include "kvpool/kernels/rotation.h"
#include "kvpool/kernels/rotation_file.h"
#include "kvpool/kvstore/store.h"

namespace kvpool::kvstore::testing {

// L=2, H=2, d=8, P=4: BF16 form 512 bytes, INT2 form 192 bytes. Sink 4 tokens (1 block),
// recent 8 tokens (2 blocks).
inline ModelSpec TinySpec(HistoryPrecision p = HistoryPrecision::kInt2) {
  ModelSpec s;
  s.model_id = "tiny";
  s.revision = "r1";
  s.geometry = BlockGeometry{.num_layers = 2, .num_kv_heads = 2, .head_dim = 8, .page_size = 4};
  s.sink_tokens = 4;
  s.recent_tokens = 8;
  s.history_precision = p;
  return s;
}

// A Hadamard rotation file matching `spec` (clip ratios included in its metadata).
inline std::string RotationFileFor(const ModelSpec& spec) {
  RotationMetadata meta;
  meta.model_name = spec.model_id;
  meta.head_dim = spec.geometry.head_dim;
  meta.num_layers = spec.geometry.num_layers;
  meta.num_kv_heads = spec.geometry.num_kv_heads;
  meta.clip_ratio_k = spec.clip_ratio_k;
  meta.clip_ratio_v = spec.clip_ratio_v;
  auto rot = RotationSet::Hadamard(meta);
  if (!rot.ok()) {
    std::abort();
  }
  return SerializeRotations(*rot);
}

// Un-rotated BF16 form of block `index` of sequence `seq`: smooth deterministic values.
inline std::vector<uint8_t> BlockBytes(const BlockGeometry& g, uint32_t seq, uint32_t index) {
  std::vector<uint8_t> out(g.Bf16FormBytes());
  for (size_t i = 0; i < out.size() / 2; ++i) {
    float x = std::sin(0.37f * float(i) + 1.3f * float(seq) + 0.11f * float(index)) *
              (1.0f + 0.25f * float((i + seq) % 5));
    uint16_t b = Fp32ToBf16(x);
    std::memcpy(out.data() + 2 * i, &b, 2);
  }
  return out;
}

// Tokens of sequence `seq` (n tokens); sequences share a prefix of `shared` tokens.
inline std::vector<uint32_t> Tokens(uint32_t seq, uint32_t n, uint32_t shared = 0) {
  std::vector<uint32_t> t(n);
  for (uint32_t i = 0; i < n; ++i) {
    t[i] = i < shared ? 1000 + i : seq * 100000 + i;
  }
  return t;
}

}  // namespace kvpool::kvstore::testing
