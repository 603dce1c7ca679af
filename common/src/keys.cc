// Block keys: docs/KEYS.md.
#include "kvpool/common/keys.h"

#include <openssl/evp.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"

namespace kvpool {
namespace {

void AppendU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) {
    out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
}

void AppendField(std::string& out, std::string_view bytes) {
  AppendU32(out, static_cast<uint32_t>(bytes.size()));
  out.append(bytes);
}

void AppendU32Field(std::string& out, uint32_t v) {
  AppendU32(out, 4);
  AppendU32(out, v);
}

struct MdCtxDeleter {
  void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
};

// SHA-256 through one EVP_MD_CTX per thread, reused for every digest that thread computes, with
// the algorithm fetched once per process. Before, each digest created and freed a context and
// EVP_DigestInit_ex(EVP_sha256()) fetched the implementation again (OpenSSL 3: a read-locked
// lookup in the default library context plus reference-count atomics shared by every thread):
// ChainKeys of 64 blocks took 47 us on one thread and 84 us per thread with two threads hashing
// at once (2-core VM, session 10), where the hashing itself is a few hundred nanoseconds a
// block. Re-initialising a context with the digest it already holds (EVP_DigestInit_ex2 with a
// null type) allocates nothing and takes no lock. The context is the calling thread's own, so
// the functions stay thread-safe; it is freed when the thread exits.
class Sha256Hasher {
 public:
  Sha256Hasher() : ctx_(EVP_MD_CTX_new()) {
    // These calls fail only on allocation failure inside OpenSSL; treat that as fatal.
    if (!ctx_ || EVP_DigestInit_ex2(ctx_.get(), Md(), nullptr) != 1) std::abort();
  }
  void Begin() {
    if (EVP_DigestInit_ex2(ctx_.get(), nullptr, nullptr) != 1) std::abort();
  }
  void Update(const void* data, size_t size) {
    if (EVP_DigestUpdate(ctx_.get(), data, size) != 1) std::abort();
  }
  Digest Finish() {
    Digest out{};
    unsigned int len = 0;
    if (EVP_DigestFinal_ex(ctx_.get(), out.data(), &len) != 1 || len != out.size()) std::abort();
    return out;
  }

  // The calling thread's hasher.
  static Sha256Hasher& ThreadLocal() {
    thread_local Sha256Hasher hasher;
    return hasher;
  }

 private:
  // Fetched once, never freed (a process-lifetime constant shared read-only by all threads).
  static const EVP_MD* Md() {
    static const EVP_MD* md = [] {
      EVP_MD* m = EVP_MD_fetch(nullptr, "SHA256", nullptr);
      if (m == nullptr) std::abort();
      return m;
    }();
    return md;
  }

  std::unique_ptr<EVP_MD_CTX, MdCtxDeleter> ctx_;
};

// SHA-256 over the concatenation of `parts`.
Digest Sha256Parts(std::initializer_list<std::string_view> parts) {
  Sha256Hasher& h = Sha256Hasher::ThreadLocal();
  h.Begin();
  for (std::string_view p : parts) h.Update(p.data(), p.size());
  return h.Finish();
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') {
    return c - '0';
  }
  if (c >= 'a' && c <= 'f') {
    return c - 'a' + 10;
  }
  if (c >= 'A' && c <= 'F') {
    return c - 'A' + 10;
  }
  return -1;
}

}  // namespace

std::string EncodeNamespace(const KeyNamespace& ns) {
  std::string out;
  out.reserve(256);
  AppendU32Field(out, ns.key_format_version);
  AppendField(out, ns.block_layout);
  AppendField(out, ns.tenant);
  AppendField(out, ns.model_id);
  AppendField(out, ns.revision);
  AppendU32Field(out, ns.num_layers);
  AppendU32Field(out, ns.num_kv_heads);
  AppendU32Field(out, ns.head_dim);
  AppendField(out, std::string_view(reinterpret_cast<const char*>(ns.rotation_id.data()),
                                    ns.rotation_id.size()));
  AppendU32Field(out, ns.page_size);
  AppendU32Field(out, ns.sink_tokens);
  AppendU32Field(out, std::bit_cast<uint32_t>(ns.clip_ratio_k));
  AppendU32Field(out, std::bit_cast<uint32_t>(ns.clip_ratio_v));
  AppendField(out, ns.history_precision);
  if (ns.tensor_parallel.has_value()) {
    std::string tp;
    AppendU32(tp, ns.tensor_parallel->rank);
    AppendU32(tp, ns.tensor_parallel->size);
    AppendField(out, tp);
  } else {
    AppendField(out, "canonical");
  }
  return out;
}

absl::StatusOr<Digest> NamespaceKey(const KeyNamespace& ns) {
  if (ns.model_id.empty()) {
    return absl::InvalidArgumentError("model_id: must not be empty");
  }
  if (ns.page_size == 0 || (ns.page_size & (ns.page_size - 1)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("page_size: must be a power of two, got ", ns.page_size));
  }
  if (ns.history_precision != "int2" && ns.history_precision != "bf16") {
    return absl::InvalidArgumentError(absl::StrCat(
        "history_precision: must be \"int2\" or \"bf16\", got \"", ns.history_precision, "\""));
  }
  if (ns.tensor_parallel.has_value() && ns.tensor_parallel->rank >= ns.tensor_parallel->size) {
    return absl::InvalidArgumentError(absl::StrCat("tensor_parallel: rank ",
                                                   ns.tensor_parallel->rank, " must be < size ",
                                                   ns.tensor_parallel->size));
  }
  return Sha256(EncodeNamespace(ns));
}

Digest Sha256(std::string_view bytes) { return Sha256Parts({bytes}); }

BlockKey NextBlockKey(const BlockKey& prev, absl::Span<const uint32_t> tokens) {
  // The body (u32 count, then the ids, little-endian) goes to the hash in pieces of at most
  // kChunk ids from a stack buffer: no allocation per block.
  constexpr size_t kChunk = 64;
  unsigned char buf[4 * kChunk];
  auto put = [&buf](size_t at, uint32_t v) {
    for (int i = 0; i < 4; ++i) buf[4 * at + i] = static_cast<unsigned char>((v >> (8 * i)) & 0xff);
  };
  Sha256Hasher& h = Sha256Hasher::ThreadLocal();
  h.Begin();
  h.Update(prev.data(), prev.size());
  put(0, static_cast<uint32_t>(tokens.size()));
  h.Update(buf, 4);
  for (size_t i = 0; i < tokens.size(); i += kChunk) {
    const size_t n = std::min(kChunk, tokens.size() - i);
    for (size_t j = 0; j < n; ++j) put(j, tokens[i + j]);
    h.Update(buf, 4 * n);
  }
  return h.Finish();
}

absl::StatusOr<std::vector<BlockKey>> ChainKeys(const Digest& root,
                                                absl::Span<const uint32_t> tokens,
                                                uint32_t page_size, size_t max_blocks) {
  if (page_size == 0) {
    return absl::InvalidArgumentError("page_size: must be > 0");
  }
  size_t n = tokens.size() / page_size;
  if (max_blocks > 0 && n > max_blocks) {
    n = max_blocks;
  }
  std::vector<BlockKey> keys;
  keys.reserve(n);
  BlockKey prev = root;
  for (size_t i = 0; i < n; ++i) {
    prev = NextBlockKey(prev, tokens.subspan(i * page_size, page_size));
    keys.push_back(prev);
  }
  return keys;
}

size_t FirstNonPrintableAscii(std::string_view v) {
  for (size_t i = 0; i < v.size(); ++i) {
    const auto c = static_cast<unsigned char>(v[i]);
    if (c < 0x20 || c > 0x7e) return i;
  }
  return std::string_view::npos;
}

std::string ToHex(const Digest& d) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s(64, '0');
  for (size_t i = 0; i < d.size(); ++i) {
    s[2 * i] = kHex[d[i] >> 4];
    s[2 * i + 1] = kHex[d[i] & 0xf];
  }
  return s;
}

absl::StatusOr<Digest> DigestFromHex(std::string_view hex, std::string_view field) {
  if (hex.size() != 64) {
    return absl::InvalidArgumentError(absl::StrCat(absl::string_view(field.data(), field.size()),
                                                   ": expected 64 hex characters, got ",
                                                   hex.size()));
  }
  Digest d{};
  for (size_t i = 0; i < d.size(); ++i) {
    int hi = HexValue(hex[2 * i]);
    int lo = HexValue(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) {
      return absl::InvalidArgumentError(absl::StrCat(absl::string_view(field.data(), field.size()),
                                                     ": non-hex character at offset ",
                                                     hi < 0 ? 2 * i : 2 * i + 1));
    }
    d[i] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return d;
}

absl::StatusOr<Digest> DigestFromBytes(std::string_view bytes, std::string_view field) {
  if (bytes.size() != 32) {
    return absl::InvalidArgumentError(absl::StrCat(absl::string_view(field.data(), field.size()),
                                                   ": expected 32 bytes, got ", bytes.size()));
  }
  Digest d{};
  std::memcpy(d.data(), bytes.data(), d.size());
  return d;
}

}  // namespace kvpool
