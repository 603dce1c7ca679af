// Sentencepiece-style BPE tokenizer over a GGUF vocabulary; see kvpool/engine/tokenizer.h.
#include "kvpool/engine/tokenizer.h"

#include <algorithm>
#include <cstdio>
#include <queue>

#include "absl/strings/str_cat.h"
#include "kvpool/common/status.h"

namespace kvpool::engine {
namespace {

constexpr std::string_view kSpace = "\xe2\x96\x81";  // "▁" U+2581, sentencepiece's space

// Length of the UTF-8 character starting at s[i]; 1 for an invalid or truncated sequence (the
// byte then becomes a symbol of its own and falls back to a byte token).
size_t Utf8CharLen(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  size_t n = 1;
  if (c >= 0xc2 && c <= 0xdf) {
    n = 2;
  } else if (c >= 0xe0 && c <= 0xef) {
    n = 3;
  } else if (c >= 0xf0 && c <= 0xf4) {
    n = 4;
  } else {
    return 1;
  }
  if (i + n > s.size()) {
    return 1;
  }
  for (size_t k = 1; k < n; ++k) {
    if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) {
      return 1;
    }
  }
  return n;
}

// Parses "<0xNN>" into NN; -1 otherwise.
int ParseBytePiece(std::string_view p) {
  if (p.size() != 6 || p.substr(0, 3) != "<0x" || p[5] != '>') {
    return -1;
  }
  int v = 0;
  for (int k = 3; k < 5; ++k) {
    const char c = p[k];
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (c >= 'A' && c <= 'F') {
      d = c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else {
      return -1;
    }
    v = v * 16 + d;
  }
  return v;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const GgufFile& gguf) {
  auto model = gguf.GetString("tokenizer.ggml.model");
  if (!model.ok()) {
    return absl::InvalidArgumentError(model.status().message());
  }
  if (*model != "llama") {
    return absl::FailedPreconditionError(absl::StrCat("metadata key 'tokenizer.ggml.model' is '",
                                                      *model, "'; only 'llama' is supported"));
  }
  auto pieces = gguf.GetStringArray("tokenizer.ggml.tokens");
  if (!pieces.ok()) {
    return absl::InvalidArgumentError(pieces.status().message());
  }
  std::vector<float> scores;
  if (gguf.FindValue("tokenizer.ggml.scores") != nullptr) {
    KVPOOL_ASSIGN_OR_RETURN(scores, gguf.GetFloatArray("tokenizer.ggml.scores"));
  }
  std::vector<int> types;
  if (gguf.FindValue("tokenizer.ggml.token_type") != nullptr) {
    KVPOOL_ASSIGN_OR_RETURN(std::vector<int64_t> t, gguf.GetIntArray("tokenizer.ggml.token_type"));
    types.reserve(t.size());
    for (int64_t x : t) {
      types.push_back(x < 0 || x > 6 ? 0 : static_cast<int>(x));  // 0 = invalid, checked below
    }
  }
  auto id = [&](std::string_view key, int fallback) -> absl::StatusOr<int> {
    if (gguf.FindValue(key) == nullptr) {
      return fallback;
    }
    KVPOOL_ASSIGN_OR_RETURN(uint64_t v, gguf.GetUint(key));
    if (v > static_cast<uint64_t>(INT32_MAX)) {
      return absl::InvalidArgumentError(
          absl::StrCat("metadata key '", std::string(key), "' is ", v, ", out of range"));
    }
    return static_cast<int>(v);
  };
  KVPOOL_ASSIGN_OR_RETURN(int bos, id("tokenizer.ggml.bos_token_id", 1));
  KVPOOL_ASSIGN_OR_RETURN(int eos, id("tokenizer.ggml.eos_token_id", 2));
  KVPOOL_ASSIGN_OR_RETURN(int unk, id("tokenizer.ggml.unknown_token_id", 0));
  return Create(std::move(*pieces), std::move(scores), std::move(types), bos, eos, unk);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Create(std::vector<std::string> pieces,
                                                             std::vector<float> scores,
                                                             std::vector<int> types, int bos_id,
                                                             int eos_id, int unk_id) {
  const size_t n = pieces.size();
  if (n == 0 || n > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer.ggml.tokens has ", n, " pieces (need 1..2^31-1)"));
  }
  if (scores.empty()) {
    scores.assign(n, 0.0f);
  }
  if (scores.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.ggml.scores has ", scores.size(),
                                                   " entries, tokenizer.ggml.tokens ", n));
  }
  if (!types.empty() && types.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.ggml.token_type has ", types.size(),
                                                   " entries, tokenizer.ggml.tokens ", n));
  }
  const int vocab = static_cast<int>(n);
  for (auto [name, v] :
       {std::pair<const char*, int>{"bos", bos_id}, {"eos", eos_id}, {"unknown", unk_id}}) {
    if (v < 0 || v >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.ggml.", name, "_token_id is ", v,
                                                     ", outside the vocabulary of ", vocab));
    }
  }
  auto tok = std::unique_ptr<Tokenizer>(new Tokenizer());
  tok->bos_id_ = bos_id;
  tok->eos_id_ = eos_id;
  tok->unk_id_ = unk_id;
  tok->byte_to_id_.fill(-1);
  tok->types_.resize(n);
  for (int i = 0; i < vocab; ++i) {
    TokenType t;
    if (!types.empty()) {
      if (types[i] < 1 || types[i] > 6) {
        return absl::InvalidArgumentError(
            absl::StrCat("tokenizer.ggml.token_type[", i, "] is not a token type (1..6)"));
      }
      t = static_cast<TokenType>(types[i]);
    } else if (ParseBytePiece(pieces[i]) >= 0) {
      t = TokenType::kByte;
    } else if (i == bos_id || i == eos_id) {
      t = TokenType::kControl;
    } else if (i == unk_id) {
      t = TokenType::kUnknown;
    } else {
      t = TokenType::kNormal;
    }
    tok->types_[i] = t;
    if (t == TokenType::kByte) {
      const int b = ParseBytePiece(pieces[i]);
      if (b < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tokenizer.ggml.tokens[", i, "] has type BYTE but is not of the form <0xNN>"));
      }
      if (tok->byte_to_id_[b] < 0) {
        tok->byte_to_id_[b] = i;
      }
    } else if ((t == TokenType::kNormal || t == TokenType::kUserDefined) && !pieces[i].empty()) {
      tok->piece_to_id_.emplace(pieces[i], i);  // the first id wins for duplicate pieces
      tok->max_piece_bytes_ = std::max(tok->max_piece_bytes_, pieces[i].size());
    }
  }
  tok->pieces_ = std::move(pieces);
  tok->scores_ = std::move(scores);
  return tok;
}

int Tokenizer::Lookup(std::string_view text) const {
  auto it = piece_to_id_.find(std::string(text));
  return it == piece_to_id_.end() ? -1 : it->second;
}

std::vector<int> Tokenizer::Encode(std::string_view text, bool add_bos) const {
  std::vector<int> out;
  if (add_bos) {
    out.push_back(bos_id_);
  }
  if (text.empty()) {
    return out;
  }

  // 1. Dummy prefix and spaces → "▁".
  std::string norm(kSpace);
  for (char c : text) {
    if (c == ' ') {
      norm += kSpace;
    } else {
      norm += c;
    }
  }

  // 2. One symbol per UTF-8 character, as a doubly linked list of spans of `norm`.
  struct Symbol {
    size_t start, len;
    int prev, next;
  };
  std::vector<Symbol> sym;
  for (size_t i = 0; i < norm.size();) {
    const size_t len = Utf8CharLen(norm, i);
    const int idx = static_cast<int>(sym.size());
    sym.push_back({i, len, idx - 1, idx + 1});
    i += len;
  }
  sym.back().next = -1;

  // 3. Greedy merges by score: a max-heap of candidate pairs (score, then leftmost). An entry is
  //    stale when either side has changed since it was pushed (its total length differs).
  struct Pair {
    float score;
    int left;
    size_t len;
    bool operator<(const Pair& o) const {
      if (score != o.score) {
        return score < o.score;
      }
      return left > o.left;
    }
  };
  std::priority_queue<Pair> heap;
  auto try_pair = [&](int left) {
    if (left < 0 || sym[left].next < 0) {
      return;
    }
    const Symbol& a = sym[left];
    const Symbol& b = sym[a.next];
    const size_t len = a.len + b.len;
    const int id = Lookup(std::string_view(norm).substr(a.start, len));
    if (id >= 0) {
      heap.push({scores_[id], left, len});
    }
  };
  for (int i = 0; i + 1 < static_cast<int>(sym.size()); ++i) {
    try_pair(i);
  }
  while (!heap.empty()) {
    const Pair p = heap.top();
    heap.pop();
    Symbol& a = sym[p.left];
    if (a.len == 0 || a.next < 0 || a.len + sym[a.next].len != p.len) {
      continue;  // stale
    }
    Symbol& b = sym[a.next];
    a.len += b.len;
    b.len = 0;  // removed
    a.next = b.next;
    if (a.next >= 0) {
      sym[a.next].prev = p.left;
    }
    try_pair(a.prev);
    try_pair(p.left);
  }

  // 4. Emit pieces; symbols that are not pieces fall back to byte tokens.
  for (int i = 0; i >= 0 && i < static_cast<int>(sym.size()); i = sym[i].next) {
    const std::string_view s = std::string_view(norm).substr(sym[i].start, sym[i].len);
    const int id = Lookup(s);
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    for (unsigned char c : s) {
      out.push_back(byte_to_id_[c] >= 0 ? byte_to_id_[c] : unk_id_);
    }
  }
  return out;
}

std::string_view Tokenizer::piece(int id) const {
  if (id < 0 || id >= vocab_size()) {
    return {};
  }
  return pieces_[id];
}

Tokenizer::TokenType Tokenizer::type(int id) const {
  if (id < 0 || id >= vocab_size()) {
    return TokenType::kUnused;
  }
  return types_[id];
}

std::string Tokenizer::PieceText(int id) const {
  if (id < 0 || id >= vocab_size()) {
    return {};
  }
  switch (types_[id]) {
    case TokenType::kControl:
    case TokenType::kUnused:
      return {};
    case TokenType::kByte:
      return std::string(1, static_cast<char>(ParseBytePiece(pieces_[id])));
    default:
      break;
  }
  std::string out;
  const std::string& p = pieces_[id];
  for (size_t i = 0; i < p.size();) {
    if (p.compare(i, kSpace.size(), kSpace) == 0) {
      out += ' ';
      i += kSpace.size();
    } else {
      out += p[i++];
    }
  }
  return out;
}

std::string Tokenizer::DecodeNext(int prev, int token) const {
  std::string s = PieceText(token);
  if ((prev < 0 || prev == bos_id_) && !s.empty() && s[0] == ' ') {
    s.erase(0, 1);
  }
  return s;
}

std::string Tokenizer::Decode(absl::Span<const int> tokens) const {
  std::string out;
  int prev = -1;
  for (int t : tokens) {
    out += DecodeNext(prev, t);
    prev = t;
  }
  return out;
}

}  // namespace kvpool::engine
