// MixedKvCache: OSCAR mixed-precision paged KV cache (see the header and docs/WORKER.md).
#include "kvpool/worker/mixed_kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvpool/common/status.h"
#include "kvpool/kernels/attention.h"
#include "kvpool/kernels/numeric.h"
#include "kvpool/kernels/quantize.h"

namespace kvpool::worker {

const char* HistoryPrecisionName(HistoryPrecision p) {
  return p == HistoryPrecision::kBf16 ? "bf16" : "int2";
}

absl::StatusOr<HistoryPrecision> ParseHistoryPrecision(const std::string& name, const char* field) {
  if (name == "int2") {
    return HistoryPrecision::kInt2;
  }
  if (name == "bf16") {
    return HistoryPrecision::kBf16;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, " '", name, "' must be \"int2\" or \"bf16\""));
}

// ---- construction ----------------------------------------------------------------------------

namespace {
bool IsPow2(int x) { return x > 0 && (x & (x - 1)) == 0; }
}  // namespace

MixedKvCache::MixedKvCache(int n_layers, const engine::AttentionShape& shape,
                           std::shared_ptr<const RotationSet> rotations,
                           const MixedCacheOptions& options)
    : shape_(shape),
      n_layers_(n_layers),
      options_(options),
      geometry_{.num_layers = static_cast<uint32_t>(n_layers),
                .num_kv_heads = static_cast<uint32_t>(shape.n_kv_heads),
                .head_dim = static_cast<uint32_t>(shape.head_dim),
                .page_size = static_cast<uint32_t>(options.page_size)},
      rotations_(std::move(rotations)),
      sink_blocks_(options.sink_tokens / options.page_size),
      recent_blocks_((options.recent_tokens + options.page_size - 1) / options.page_size),
      length_(n_layers, 0) {
  const int d = shape.head_dim;
  row_bf16_.resize(d);
  codes_scratch_.resize(static_cast<size_t>(options.page_size) * d / 4);
  params_scratch_.resize(static_cast<size_t>(options.page_size) * 2 * geometry_.GroupsPerRow());
  const size_t q_dim = static_cast<size_t>(shape.q_dim());
  q_rot_.resize(q_dim);
  acc_.resize(q_dim);
  part_.resize(q_dim);
  acc_lse_.resize(shape.n_heads);
  part_lse_.resize(shape.n_heads);
}

absl::StatusOr<std::unique_ptr<MixedKvCache>> MixedKvCache::Create(
    int n_layers, const engine::AttentionShape& shape, std::shared_ptr<const RotationSet> rotations,
    const MixedCacheOptions& options) {
  if (n_layers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("n_layers ", n_layers, " must be >= 1"));
  }
  if (shape.n_heads < 1 || shape.n_kv_heads < 1 || shape.n_heads % shape.n_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("shape.n_heads ", shape.n_heads,
                                                   " must be a positive multiple of n_kv_heads ",
                                                   shape.n_kv_heads));
  }
  KVPOOL_RETURN_IF_ERROR(
      ValidateHeadDim(static_cast<uint32_t>(std::max(shape.head_dim, 0)), "shape.head_dim"));
  // Engines page in 16..256 tokens (ENGINES.md in ../shared/design); far beyond that a "page" is a
  // whole prompt and the sink/recent multiples below would blame the wrong flag.
  constexpr int kMaxPageSize = 1024;
  if (!IsPow2(options.page_size) || options.page_size > kMaxPageSize) {
    return absl::InvalidArgumentError(absl::StrCat("page_size ", options.page_size,
                                                   " must be a power of two in 1..", kMaxPageSize));
  }
  if (options.sink_tokens < 0 || options.sink_tokens % options.page_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("sink_tokens ", options.sink_tokens,
                                                   " must be a non-negative multiple of page_size ",
                                                   options.page_size));
  }
  if (options.recent_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("recent_tokens ", options.recent_tokens, " must be >= 0"));
  }
  // Blocks are allocated as positions are written, so the bound is the GGUF reader's on
  // llama.context_length (2^24), which kvpool-worker passes: the old 2^20 refused models the
  // reader and kvpool-engine accept (newcomer s8 N12).
  if (options.capacity < 1 || options.capacity > (1 << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("capacity ", options.capacity, " must be in [1, 2^24]"));
  }
  KVPOOL_RETURN_IF_ERROR(ValidateClipRatio(options.clip_ratio_k, "clip_ratio_k"));
  KVPOOL_RETURN_IF_ERROR(ValidateClipRatio(options.clip_ratio_v, "clip_ratio_v"));
  if (rotations == nullptr) {
    return absl::InvalidArgumentError("rotations is null");
  }
  if (rotations->num_layers() != static_cast<uint32_t>(n_layers) ||
      rotations->head_dim() != static_cast<uint32_t>(shape.head_dim) ||
      rotations->num_kv_heads() != static_cast<uint32_t>(shape.n_kv_heads)) {
    return absl::FailedPreconditionError(
        absl::StrCat("rotation set (num_layers ", rotations->num_layers(), ", num_kv_heads ",
                     rotations->num_kv_heads(), ", head_dim ", rotations->head_dim(),
                     ") does not match the model (num_layers ", n_layers, ", num_kv_heads ",
                     shape.n_kv_heads, ", head_dim ", shape.head_dim, ")"));
  }
  return std::unique_ptr<MixedKvCache>(
      new MixedKvCache(n_layers, shape, std::move(rotations), options));
}

// ---- geometry helpers ------------------------------------------------------------------------

int MixedKvCache::RecentStartBlock(int length) const {
  const int full = length / options_.page_size;
  return std::min(full, std::max(sink_blocks_, full - recent_blocks_));
}

Segment MixedKvCache::SegmentOf(int block, int length) const {
  const int full = length / options_.page_size;
  if (block < sink_blocks_ && block < full) {
    return Segment::kSink;
  }
  if (block >= RecentStartBlock(length)) {
    return Segment::kRecent;
  }
  return Segment::kHistory;
}

absl::Status MixedKvCache::CheckLayer(int layer) const {
  if (layer < 0 || layer >= n_layers_) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " outside [0, ", n_layers_, ")"));
  }
  return absl::OkStatus();
}

int MixedKvCache::Length(int layer) const {
  return layer < 0 || layer >= n_layers_ ? 0 : length_[layer];
}

MixedKvCache::Block& MixedKvCache::EnsureBlock(int b) {
  while (static_cast<int>(blocks_.size()) <= b) {
    Block blk;
    blk.has_bf16.assign(n_layers_, 0);
    blk.has_int2.assign(n_layers_, 0);
    blk.int2_fail.assign(n_layers_, 0);
    blocks_.push_back(std::move(blk));
  }
  return blocks_[b];
}

const uint8_t* MixedKvCache::Bf16Form(int block) const {
  if (block < 0 || block >= static_cast<int>(blocks_.size())) {
    return nullptr;
  }
  return blocks_[block].bf16.empty() ? nullptr : blocks_[block].bf16.data();
}

const uint8_t* MixedKvCache::Int2Form(int block) const {
  if (block < 0 || block >= static_cast<int>(blocks_.size())) {
    return nullptr;
  }
  return blocks_[block].int2.empty() ? nullptr : blocks_[block].int2.data();
}

bool MixedKvCache::HasBf16Form(int block) const {
  if (block < 0 || block >= static_cast<int>(blocks_.size())) {
    return false;
  }
  const auto& v = blocks_[block].has_bf16;
  return std::all_of(v.begin(), v.end(), [](uint8_t x) { return x != 0; });
}

bool MixedKvCache::HasInt2Form(int block) const {
  if (block < 0 || block >= static_cast<int>(blocks_.size())) {
    return false;
  }
  const auto& v = blocks_[block].has_int2;
  return std::all_of(v.begin(), v.end(), [](uint8_t x) { return x != 0; });
}

// ---- forms ------------------------------------------------------------------------------

void MixedKvCache::DemoteChunk(int b, int layer) {
  Block& blk = blocks_[b];
  if (blk.has_int2[layer] || blk.int2_fail[layer]) {
    return;
  }
  if (blk.int2.empty()) {
    blk.int2.assign(geometry_.Int2FormBytes(), 0);
  }
  const uint32_t P = geometry_.page_size;
  const uint32_t d = geometry_.head_dim;
  uint64_t overflow = 0;
  for (uint32_t h = 0; h < geometry_.num_kv_heads; ++h) {
    const uint8_t* chunk = blk.bf16.data() + geometry_.Bf16ChunkOffset(layer, h);
    uint8_t* q = blk.int2.data() + geometry_.Int2ChunkOffset(layer, h);
    for (int kv = 0; kv < 2; ++kv) {
      const auto* rows =
          reinterpret_cast<const uint16_t*>(chunk + (kv ? geometry_.Bf16VOffset() : 0));
      uint8_t* codes = q + (kv ? geometry_.Int2VCodesOffset() : geometry_.Int2KCodesOffset());
      auto* params = reinterpret_cast<uint16_t*>(
          q + (kv ? geometry_.Int2VParamsOffset() : geometry_.Int2KParamsOffset()));
      QuantizeRowsResult r;
      // The rows are finite bf16 values written by Append/LoadBlocks, so the only possible
      // non-OK outcome is the fp16 overflow counted in r.
      absl::Status s = QuantizeRowsBf16(
          rows, P, d, kv ? options_.clip_ratio_v : options_.clip_ratio_k, codes, params, &r);
      if (!s.ok()) {
        r.overflow_rows = std::max<uint64_t>(r.overflow_rows, 1);
      }
      overflow += r.overflow_rows;
    }
  }
  if (overflow > 0) {
    blk.int2_fail[layer] = 1;
    ++stats_.int2_overflow_chunks;
  } else {
    blk.has_int2[layer] = 1;
    ++stats_.demoted_chunks;
  }
}

bool MixedKvCache::UsesInt2(int b, int layer) const {
  if (options_.history != HistoryPrecision::kInt2) {
    return false;
  }
  const Segment seg = SegmentOf(b, length_[layer]);
  const Block& blk = blocks_[b];
  if (seg == Segment::kRecent) {
    // Loaded INT2-only as history of a planned length (LoadBlocks): demoted early.
    return !blk.has_bf16[layer] && blk.has_int2[layer];
  }
  if (seg != Segment::kHistory) {
    return false;
  }
  if (blk.has_int2[layer]) {
    return true;
  }
  return !blk.has_bf16[layer];  // no BF16 to fall back to: CheckForms reports the gap
}

absl::Status MixedKvCache::CheckForms(int b, int layer) const {
  if (b * options_.page_size >= length_[layer]) {
    return absl::OkStatus();
  }
  const Block& blk = blocks_[b];
  if (UsesInt2(b, layer)) {
    if (!blk.has_int2[layer]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "block ", b, " layer ", layer, " is history but has neither an INT2 nor a BF16 form"));
    }
    return absl::OkStatus();
  }
  if (!blk.has_bf16[layer]) {
    const Segment seg = SegmentOf(b, length_[layer]);
    const char* name = seg == Segment::kSink     ? "sink"
                       : seg == Segment::kRecent ? "recent"
                                                 : "bf16 history";
    return absl::FailedPreconditionError(
        absl::StrCat("block ", b, " layer ", layer, " is ", name, " but has no BF16 form"));
  }
  return absl::OkStatus();
}

// ---- KvCacheView ------------------------------------------------------------------------------

absl::Status MixedKvCache::Append(int layer, int pos, absl::Span<const float> k,
                                  absl::Span<const float> v) {
  KVPOOL_RETURN_IF_ERROR(CheckLayer(layer));
  const int kv_dim = shape_.kv_dim();
  if (k.size() != static_cast<size_t>(kv_dim) || v.size() != static_cast<size_t>(kv_dim)) {
    return absl::InvalidArgumentError(
        absl::StrCat("k/v have ", k.size(), "/", v.size(), " floats; expected H_kv*d = ", kv_dim));
  }
  if (pos < 0 || pos > length_[layer]) {
    return absl::InvalidArgumentError(
        absl::StrCat("pos ", pos, " outside [0, ", length_[layer], "] for layer ", layer));
  }
  if (pos >= options_.capacity) {
    return absl::ResourceExhaustedError(
        absl::StrCat("pos ", pos, " reaches the cache capacity of ", options_.capacity));
  }
  for (int j = 0; j < kv_dim; ++j) {
    if (!std::isfinite(k[j]) || !std::isfinite(v[j])) {
      return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " pos ", pos, " element ", j,
                                                     " of ", std::isfinite(k[j]) ? "v" : "k",
                                                     " is not finite"));
    }
  }
  const int P = options_.page_size;
  const int b = pos / P;
  const int t = pos % P;

  if (pos < length_[layer]) {
    // Truncate: rows >= pos of this layer are dropped. Check first, then mutate.
    const int first = RecentStartBlock(pos);
    for (int bb = first; bb <= b && bb < static_cast<int>(blocks_.size()); ++bb) {
      if (bb * P >= pos) {
        break;
      }
      if (!blocks_[bb].has_bf16[layer]) {
        return absl::FailedPreconditionError(
            absl::StrCat("truncating layer ", layer, " to ", pos, " would put block ", bb,
                         " (no BF16 form, fetched INT2-only) back into the recent window"));
      }
    }
    for (int bb = b; bb < static_cast<int>(blocks_.size()); ++bb) {
      blocks_[bb].has_int2[layer] = 0;
      blocks_[bb].int2_fail[layer] = 0;
      if (bb > b || t == 0) {
        blocks_[bb].has_bf16[layer] = 0;
      }
    }
    length_[layer] = pos;
    for (int bb = first; bb < b; ++bb) {
      KVPOOL_RETURN_IF_ERROR(CheckForms(bb, layer));
    }
  }

  Block& blk = EnsureBlock(b);
  if (blk.bf16.empty()) {
    blk.bf16.assign(geometry_.Bf16FormBytes(), 0);
  }
  if (t == 0) {
    blk.has_int2[layer] = 0;
    blk.int2_fail[layer] = 0;
  }
  const int d = shape_.head_dim;
  for (int h = 0; h < shape_.n_kv_heads; ++h) {
    uint8_t* chunk = blk.bf16.data() + geometry_.Bf16ChunkOffset(layer, h);
    for (int kv = 0; kv < 2; ++kv) {
      const float* src = (kv ? v.data() : k.data()) + h * d;
      for (int j = 0; j < d; ++j) {
        row_bf16_[j] = Fp32ToBf16(src[j]);  // what a client sends
      }
      auto* dst = reinterpret_cast<uint16_t*>(chunk + (kv ? geometry_.Bf16VOffset() : 0)) + t * d;
      const float* rot = rotations_->Matrix(kv ? KvKind::kValue : KvKind::kKey, layer, h);
      absl::Status s = RotateQuantizeRowsBf16(
          row_bf16_.data(), 1, d, rot, kv ? options_.clip_ratio_v : options_.clip_ratio_k, dst,
          codes_scratch_.data(), params_scratch_.data(), nullptr);
      if (!s.ok()) {
        return Annotate(s,
                        absl::StrCat("layer ", layer, " pos ", pos, " head ", h, kv ? " v" : " k"));
      }
    }
  }
  blk.has_bf16[layer] = 1;
  length_[layer] = pos + 1;

  // Block-granular demotion: completing a block moves the window by one block.
  if ((pos + 1) % P == 0) {
    const int leaving = RecentStartBlock(pos + 1) - 1;
    if (leaving >= 0 && SegmentOf(leaving, pos + 1) == Segment::kHistory &&
        options_.history == HistoryPrecision::kInt2) {
      DemoteChunk(leaving, layer);
      KVPOOL_RETURN_IF_ERROR(CheckForms(leaving, layer));
    }
  }
  return absl::OkStatus();
}

absl::Status MixedKvCache::Attend(int layer, int pos, absl::Span<const float> q,
                                  absl::Span<float> out) {
  KVPOOL_RETURN_IF_ERROR(CheckLayer(layer));
  if (pos < 0 || pos >= length_[layer]) {
    return absl::InvalidArgumentError(
        absl::StrCat("pos ", pos, " outside [0, ", length_[layer], ") for layer ", layer));
  }
  if (q.size() != static_cast<size_t>(shape_.q_dim()) ||
      out.size() != static_cast<size_t>(shape_.q_dim())) {
    return absl::InvalidArgumentError(absl::StrCat("q/out have ", q.size(), "/", out.size(),
                                                   " floats; expected H_q*d = ", shape_.q_dim()));
  }
  const int P = options_.page_size;
  const int n = pos + 1;
  const uint32_t d = geometry_.head_dim;
  const uint32_t hq = static_cast<uint32_t>(shape_.n_heads);
  const uint32_t group = hq / geometry_.num_kv_heads;
  const int sink_end = std::min(sink_blocks_, n / P);
  const int recent_start = RecentStartBlock(n);
  const int last_block = (n - 1) / P;

  // Segments in token order: sink, history (split into runs of one form: a single run unless a
  // block kept BF16 after an fp16 overflow), recent. Only the very last page can be partial.
  std::vector<SegmentView> segments;
  int prev_kind = -1;
  for (int b = 0; b <= last_block; ++b) {
    const int seg = b < sink_end ? 0 : b < recent_start ? 1 : 2;
    SegmentForm form = SegmentForm::kBf16;
    if (seg == 1) {
      KVPOOL_RETURN_IF_ERROR(CheckForms(b, layer));
      if (UsesInt2(b, layer)) {
        form = SegmentForm::kInt2;
      }
    } else if (seg == 2 && UsesInt2(b, layer)) {
      form = SegmentForm::kInt2;  // loaded INT2-only for a planned length (LoadBlocks)
    } else if (!blocks_[b].has_bf16[layer]) {
      return absl::FailedPreconditionError(absl::StrCat("block ", b, " layer ", layer, " is ",
                                                        seg == 0 ? "sink" : "recent",
                                                        " but has no BF16 form"));
    }
    const int kind = seg * 2 + (form == SegmentForm::kInt2 ? 1 : 0);
    if (kind != prev_kind) {
      segments.push_back(SegmentView{form, {}, 0});
    }
    prev_kind = kind;
    const Block& blk = blocks_[b];
    segments.back().pages.push_back(form == SegmentForm::kInt2 ? blk.int2.data() : blk.bf16.data());
    segments.back().last_page_len = static_cast<uint32_t>(std::min(P, n - b * P));
  }

  // The reference decode attention's steps (kvpool/kernels/attention.h), over these segments.
  DecodeAttentionParams params{.geometry = geometry_,
                               .layer = static_cast<uint32_t>(layer),
                               .num_q_heads = hq,
                               .softmax_scale = 1.0f / std::sqrt(static_cast<float>(d))};
  for (uint32_t i = 0; i < hq; ++i) {
    RotateRows(q.data() + uint64_t{i} * d, 1, d, rotations_->Matrix(KvKind::kKey, layer, i / group),
               q_rot_.data() + uint64_t{i} * d, KernelIsa::kScalar);
  }
  std::fill(acc_.begin(), acc_.end(), 0.0f);
  std::fill(acc_lse_.begin(), acc_lse_.end(), -std::numeric_limits<float>::infinity());
  for (const SegmentView& seg : segments) {
    KVPOOL_RETURN_IF_ERROR(
        AttendSegment(params, seg, q_rot_.data(), part_.data(), part_lse_.data()));
    MergeAttentionStates(hq, d, acc_.data(), acc_lse_.data(), part_.data(), part_lse_.data());
  }
  for (uint32_t i = 0; i < hq; ++i) {
    RotateRowsTransposed(acc_.data() + uint64_t{i} * d, 1, d,
                         rotations_->Matrix(KvKind::kValue, layer, i / group),
                         out.data() + uint64_t{i} * d);
  }
  return absl::OkStatus();
}

// ---- pool integration -------------------------------------------------------------------------

absl::Status MixedKvCache::LoadBlocks(absl::Span<const BlockForms> blocks, int planned_length) {
  const int P = options_.page_size;
  const int len0 = length_[0];
  for (int l = 0; l < n_layers_; ++l) {
    if (length_[l] != len0) {
      return absl::FailedPreconditionError(
          absl::StrCat("LoadBlocks: layers hold different lengths (layer 0: ", len0, ", layer ", l,
                       ": ", length_[l], ")"));
    }
  }
  if (len0 % P != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "LoadBlocks: the cache ends in a partial block (", len0, " tokens, page_size ", P, ")"));
  }
  const int b0 = len0 / P;
  const int n = static_cast<int>(blocks.size());
  const int final_len = (b0 + n) * P;
  if (final_len > options_.capacity) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "LoadBlocks: ", final_len, " tokens exceed the capacity of ", options_.capacity));
  }
  if (planned_length < 0 ||
      (planned_length > 0 && (planned_length < final_len || planned_length > options_.capacity))) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoadBlocks: planned_length ", planned_length, " outside [", final_len, ", ",
                     options_.capacity, "] (the length after loading, the capacity) and not 0"));
  }
  const int planned = planned_length > 0 ? planned_length : final_len;
  const bool int2_mode = options_.history == HistoryPrecision::kInt2;
  for (int i = 0; i < n; ++i) {
    const int b = b0 + i;
    if (blocks[i].bf16 == nullptr && blocks[i].int2 == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("blocks[", i, "] has no form"));
    }
    const Segment seg = SegmentOf(b, final_len);
    // History now, or by the planned length (then attended from INT2 until it leaves the window).
    const bool history = seg == Segment::kHistory || SegmentOf(b, planned) == Segment::kHistory;
    const bool needs_bf16 = !history || !int2_mode;
    if (needs_bf16 && blocks[i].bf16 == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("block ", b, " is in the ",
                                                        seg == Segment::kSink     ? "sink"
                                                        : seg == Segment::kRecent ? "recent window"
                                                                                  : "history",
                                                        " but was given no BF16 form"));
    }
  }
  // Existing blocks that become bf16 history keep their BF16 forms (they were appended or
  // loaded with one), so no check is needed for them.
  for (int i = 0; i < n; ++i) {
    Block& blk = EnsureBlock(b0 + i);
    if (blocks[i].bf16 != nullptr) {
      blk.bf16.assign(blocks[i].bf16, blocks[i].bf16 + geometry_.Bf16FormBytes());
      std::fill(blk.has_bf16.begin(), blk.has_bf16.end(), 1);
    } else {
      blk.bf16.clear();
      std::fill(blk.has_bf16.begin(), blk.has_bf16.end(), 0);
    }
    if (blocks[i].int2 != nullptr) {
      blk.int2.assign(blocks[i].int2, blocks[i].int2 + geometry_.Int2FormBytes());
      std::fill(blk.has_int2.begin(), blk.has_int2.end(), 1);
    } else {
      blk.int2.clear();
      std::fill(blk.has_int2.begin(), blk.has_int2.end(), 0);
    }
    std::fill(blk.int2_fail.begin(), blk.int2_fail.end(), 0);
  }
  stats_.loaded_blocks += n;
  for (int l = 0; l < n_layers_; ++l) {
    length_[l] = final_len;
    for (int b = 0; b < b0 + n; ++b) {
      if (int2_mode && SegmentOf(b, final_len) == Segment::kHistory && blocks_[b].has_bf16[l]) {
        DemoteChunk(b, l);
      }
      KVPOOL_RETURN_IF_ERROR(CheckForms(b, l));
    }
  }
  return absl::OkStatus();
}

absl::Status MixedKvCache::set_history_precision(HistoryPrecision p) {
  if (p == HistoryPrecision::kBf16) {
    for (int l = 0; l < n_layers_; ++l) {
      const int nb = (length_[l] + options_.page_size - 1) / options_.page_size;
      for (int b = 0; b < nb; ++b) {
        // History, or a window block loaded INT2-only for a planned length (LoadBlocks).
        if (SegmentOf(b, length_[l]) != Segment::kSink && !blocks_[b].has_bf16[l]) {
          return absl::FailedPreconditionError(
              absl::StrCat("history precision bf16 needs block ", b, " layer ", l,
                           " in BF16, but it was fetched INT2-only"));
        }
      }
    }
  }
  options_.history = p;
  for (int l = 0; l < n_layers_; ++l) {
    const int nb = (length_[l] + options_.page_size - 1) / options_.page_size;
    for (int b = 0; b < nb; ++b) {
      if (p == HistoryPrecision::kInt2 && SegmentOf(b, length_[l]) == Segment::kHistory &&
          blocks_[b].has_bf16[l]) {
        DemoteChunk(b, l);
      }
      KVPOOL_RETURN_IF_ERROR(CheckForms(b, l));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvpool::worker
