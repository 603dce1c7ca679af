// kvpool/common/gguf.h — a validating reader for GGUF model files (versions 1, 2 and 3).
//
// GGUF (the ggml project's model format) is: a header (magic "GGUF", version, tensor count,
// metadata count), a list of typed key/value metadata, a table of tensor descriptors (name,
// dims, dtype, offset), then the tensor data section starting at the next multiple of the
// alignment (metadata `general.alignment`, default 32) after the table.
//   - v1: counts, string lengths, array lengths and tensor dims are uint32.
//   - v2, v3: those fields are uint64 (v3 only adds big-endian variants, which are refused).
// Everything else is little-endian; tensor offsets are uint64 in every version.
//
// Every field is checked before use: magic, version, counts against the bytes left in the file,
// string lengths, metadata value types (nested arrays are refused), tensor ndim (1..4), dims
// (>= 1, product without overflow), dtype (F32, F16, BF16 supported; anything else is refused
// naming the tensor), offsets (aligned, inside the data section, no two tensors overlapping),
// duplicate keys / tensor names. A malformed file yields a status, never a crash or an
// out-of-bounds read:
//   - INVALID_ARGUMENT: a field holds an impossible or unsupported value (message names the
//     field, key or tensor and the offending value);
//   - DATA_LOSS: the file ends before a field or a tensor's data that its header promises;
//   - NOT_FOUND: the file cannot be opened / a key or tensor asked for is absent.
//
//   KVPOOL_ASSIGN_OR_RETURN(std::unique_ptr<GgufFile> f, GgufFile::Open(path));
//   KVPOOL_ASSIGN_OR_RETURN(uint64_t layers, f->GetUint("llama.block_count"));
//   KVPOOL_ASSIGN_OR_RETURN(std::vector<float> w, f->ReadFloat32("token_embd.weight"));
//
// Thread-safety: a GgufFile is immutable after Open/Parse; const methods may be called from
// any number of threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvpool {

// Metadata value types, numbered as in the GGUF specification.
enum class GgufType : uint32_t {
  kUint8 = 0,
  kInt8 = 1,
  kUint16 = 2,
  kInt16 = 3,
  kUint32 = 4,
  kInt32 = 5,
  kFloat32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kUint64 = 10,
  kInt64 = 11,
  kFloat64 = 12,
};

// "UINT32", "STRING", ... or "TYPE(n)" for a number outside the enum.
std::string GgufTypeName(GgufType type);

// Tensor element types this reader accepts (ggml type numbers). Quantized ggml types are
// refused with INVALID_ARGUMENT naming the tensor.
enum class GgufDType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kBF16 = 30,
};

// "F32", "F16", "BF16".
std::string_view GgufDTypeName(GgufDType dtype);

// One metadata value. Scalars keep their value in `scalar_bits` (the little-endian bits of the
// stored value, zero-extended to 64 bits); strings in `str`; arrays of numbers/bools keep their
// raw little-endian element bytes in `array_bytes`; arrays of strings their elements in
// `array_strings`. Use the typed getters on GgufFile instead of reading these directly.
struct GgufValue {
  GgufType type = GgufType::kUint8;
  uint64_t scalar_bits = 0;
  std::string str;
  GgufType array_type = GgufType::kUint8;  // element type when type == kArray
  uint64_t array_length = 0;               // element count when type == kArray
  std::string array_bytes;                 // array_length * element size bytes (numeric)
  std::vector<std::string> array_strings;  // array_length strings (array of kString)
};

// One tensor descriptor, validated. `data` points into the file mapping owned by the GgufFile
// and is valid as long as that GgufFile lives; it is not necessarily aligned for the dtype
// beyond the file's alignment (use memcpy or ReadFloat32).
struct GgufTensor {
  std::string name;
  GgufDType dtype = GgufDType::kF32;
  // GGUF order: dims[0] is the innermost (contiguous) dimension. A matrix with dims
  // [cols, rows] is `rows` rows of `cols` elements (row-major W with y = W·x).
  std::vector<uint64_t> dims;
  uint64_t num_elements = 0;  // product of dims
  uint64_t num_bytes = 0;     // num_elements * element size
  uint64_t offset = 0;        // offset from the start of the data section, in bytes
  const uint8_t* data = nullptr;
};

// Limits that reject absurd headers before any allocation. Defaults are far above any real
// model (Llama-3-405B has ~1.1K tensors, ~40 metadata keys, a 128K-entry vocabulary).
struct GgufLimits {
  uint64_t max_tensors = 1u << 20;         // tensor count in the header
  uint64_t max_metadata = 1u << 20;        // metadata key/value count in the header
  uint64_t max_string_bytes = 1u << 26;    // one string (key, value or array element)
  uint64_t max_array_length = 1ull << 28;  // elements of one metadata array
  uint32_t max_alignment = 1u << 16;       // general.alignment
};

class GgufFile {
 public:
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  // Memory-maps the file at `path` read-only and validates it (see the file comment).
  // Errors: NOT_FOUND (cannot open / not a regular file), INVALID_ARGUMENT, DATA_LOSS; every
  // message starts with the path.
  static absl::StatusOr<std::unique_ptr<GgufFile>> Open(const std::string& path,
                                                        const GgufLimits& limits = {});

  // Validates an in-memory file image; the GgufFile takes ownership of `bytes`. Same checks and
  // errors as Open (messages start with "gguf"). Used by tests and by callers that already
  // hold the bytes.
  static absl::StatusOr<std::unique_ptr<GgufFile>> Parse(std::string bytes,
                                                         const GgufLimits& limits = {});

  uint32_t version() const { return version_; }
  uint32_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // absolute offset of the data section
  uint64_t file_size() const { return size_; }

  // All metadata, by key (sorted). Keys are unique (duplicates are refused at parse time).
  const std::map<std::string, GgufValue, std::less<>>& metadata() const { return metadata_; }
  // Tensors in file order.
  const std::vector<GgufTensor>& tensors() const { return tensors_; }

  // nullptr when absent.
  const GgufValue* FindValue(std::string_view key) const;
  const GgufTensor* FindTensor(std::string_view name) const;

  // Typed metadata getters. NOT_FOUND when the key is absent; INVALID_ARGUMENT (naming the key)
  // when the stored type does not convert: GetUint accepts any integer type holding a value
  // >= 0; GetInt any integer type fitting int64; GetFloat FLOAT32/FLOAT64 and integers;
  // GetString STRING; GetBool BOOL.
  absl::StatusOr<uint64_t> GetUint(std::string_view key) const;
  absl::StatusOr<int64_t> GetInt(std::string_view key) const;
  absl::StatusOr<double> GetFloat(std::string_view key) const;
  absl::StatusOr<std::string> GetString(std::string_view key) const;
  absl::StatusOr<bool> GetBool(std::string_view key) const;
  // Arrays: GetStringArray needs ARRAY of STRING; GetFloatArray ARRAY of FLOAT32/FLOAT64/
  // integers; GetIntArray ARRAY of any integer type (values must fit int64).
  absl::StatusOr<std::vector<std::string>> GetStringArray(std::string_view key) const;
  absl::StatusOr<std::vector<float>> GetFloatArray(std::string_view key) const;
  absl::StatusOr<std::vector<int64_t>> GetIntArray(std::string_view key) const;

  // The tensor's elements converted to float32 (F16/BF16 widened exactly), in file order.
  // NOT_FOUND when absent.
  absl::StatusOr<std::vector<float>> ReadFloat32(std::string_view name) const;

 private:
  GgufFile() = default;
  absl::Status ParseAll(const GgufLimits& limits);

  // The file image: either mapped (map_ != nullptr) or owned in `owned_`.
  void* map_ = nullptr;
  std::string owned_;
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  std::string label_;  // path or "gguf", prefixed to error messages

  uint32_t version_ = 0;
  uint32_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::map<std::string, GgufValue, std::less<>> metadata_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

// Converts one IEEE half (binary16) / bfloat16 bit pattern to float, exactly.
float HalfToFloat(uint16_t bits);
float Bf16ToFloat(uint16_t bits);

}  // namespace kvpool
