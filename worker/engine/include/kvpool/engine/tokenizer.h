// kvpool/engine/tokenizer.h — the Llama (sentencepiece-style) tokenizer stored in GGUF metadata.
//
// Vocabulary from `tokenizer.ggml.tokens` (pieces), `tokenizer.ggml.scores` (merge priority,
// higher first) and `tokenizer.ggml.token_type` (1 normal, 2 unknown, 3 control, 4 user-defined,
// 5 unused, 6 byte). Spaces are written as "▁" (U+2581) inside pieces.
//
// Encode (the sentencepiece BPE scheme as llama.cpp / llama2.c apply it):
//   1. empty text → no tokens; otherwise prepend one space (the "dummy prefix") and replace
//      every ' ' by "▁";
//   2. split into UTF-8 characters (an invalid byte is a character of its own);
//   3. repeatedly merge the adjacent pair whose concatenation is a vocabulary piece with the
//      highest score (leftmost pair on ties) until no pair merges;
//   4. every remaining symbol that is not a piece is emitted as byte-fallback tokens "<0xNN>",
//      one per UTF-8 byte (the unknown token when the vocabulary lacks that byte piece).
// Decode: control tokens (BOS/EOS/...) produce nothing, byte tokens produce their byte, other
// pieces their text with "▁" → ' '; a leading space of a piece at the start or right after BOS (the
// dummy prefix) is dropped, so Decode(Encode(t)) == t.
//
//   KVPOOL_ASSIGN_OR_RETURN(auto tok, Tokenizer::FromGguf(gguf));
//   std::vector<int> ids = tok->Encode("Once upon a time", /*add_bos=*/true);
//   std::string text = tok->Decode(ids);   // "Once upon a time"
//
// Thread-safety: immutable after construction; all const methods are thread-safe.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvpool/common/gguf.h"

namespace kvpool::engine {

class Tokenizer {
 public:
  // Token types, numbered as in GGUF's tokenizer.ggml.token_type.
  enum class TokenType : int {
    kNormal = 1,
    kUnknown = 2,
    kControl = 3,
    kUserDefined = 4,
    kUnused = 5,
    kByte = 6
  };

  // Builds the tokenizer from a GGUF file's metadata. Requires `tokenizer.ggml.model` ==
  // "llama" and `tokenizer.ggml.tokens`; `scores` and `token_type` are optional (zeros / type
  // inferred: "<0xNN>" pieces are bytes) but must match the token count when present.
  // BOS/EOS/unknown ids from `tokenizer.ggml.{bos,eos,unknown}_token_id` (defaults 1, 2, 0).
  // Errors: INVALID_ARGUMENT naming the key (missing, wrong type, length mismatch, id out of
  // range), FAILED_PRECONDITION for a tokenizer model other than "llama".
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromGguf(const GgufFile& gguf);

  // Same, from explicit arrays (types may be empty). Errors as above.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Create(std::vector<std::string> pieces,
                                                           std::vector<float> scores,
                                                           std::vector<int> types, int bos_id,
                                                           int eos_id, int unk_id);

  // Token ids of `text` (any bytes; invalid UTF-8 falls back to byte tokens), preceded by BOS
  // when `add_bos`. Never fails. O(n log n) in the text length.
  std::vector<int> Encode(std::string_view text, bool add_bos) const;

  // Text of `tokens` (see the file comment). Ids outside [0, vocab_size) produce nothing.
  std::string Decode(absl::Span<const int> tokens) const;

  // Text of one token for streaming output, given the token before it (-1 at the start):
  // the dummy-prefix space is dropped when `prev` is -1 or BOS. Concatenating DecodeNext over a
  // sequence equals Decode of the sequence.
  std::string DecodeNext(int prev, int token) const;

  int vocab_size() const { return static_cast<int>(pieces_.size()); }
  // The longest piece Encode can emit, in bytes (>= 1: a byte-fallback token covers one byte).
  // Every token Encode emits (BOS aside) covers at least one and at most this many bytes of the
  // normalised text, which is at least as long as the input (the dummy prefix adds a "▁", each
  // space becomes a 3-byte "▁"), so Encode(text, false).size() >= ceil(text.size() /
  // max_piece_bytes()): a sound lower bound on a text's token count from its byte size alone
  // (kvpool-worker refuses a too-long --prompt-file with it before tokenizing).
  size_t max_piece_bytes() const { return max_piece_bytes_; }
  int bos_id() const { return bos_id_; }
  int eos_id() const { return eos_id_; }
  int unk_id() const { return unk_id_; }
  // The raw piece of `id` ("▁the", "<0x0A>", "<s>"); empty for an out-of-range id.
  std::string_view piece(int id) const;
  TokenType type(int id) const;

 private:
  Tokenizer() = default;
  // Id of the piece `text` when it may take part in encoding (normal / user-defined), else -1.
  int Lookup(std::string_view text) const;
  // Text of one token without the dummy-prefix rule.
  std::string PieceText(int id) const;

  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::vector<TokenType> types_;
  std::unordered_map<std::string, int> piece_to_id_;  // encodable pieces only
  std::array<int, 256> byte_to_id_{};                 // -1 when the vocabulary lacks it
  int bos_id_ = 1, eos_id_ = 2, unk_id_ = 0;
  size_t max_piece_bytes_ = 1;
};

}  // namespace kvpool::engine
