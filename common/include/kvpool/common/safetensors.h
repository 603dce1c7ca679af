// kvpool/common/safetensors.h — a validating reader and a deterministic writer for the
// safetensors container (used for rotation files, FORMAT.md §4).
//
// Layout: u64 little-endian header length N, N bytes of UTF-8 JSON, then the raw little-endian
// tensor bytes. The JSON maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]}
// (offsets relative to the first byte after the header) plus an optional "__metadata__" object
// whose values are all strings.
//
// The reader validates everything before exposing a byte (FORMAT.md §4): header length
// (≤ 100 MB and inside the file), JSON syntax and types, known dtype, non-negative integer
// shape whose element count × itemsize equals end − begin (no overflow), offsets inside the data
// section, no two tensors overlapping, the tensors' bytes tiling the data section exactly (no gap,
// no byte after the last tensor), metadata values strings. Errors:
//   - INVALID_ARGUMENT: a malformed or inconsistent field (message names the tensor/field);
//   - DATA_LOSS: the file is shorter than its header promises;
//   - NOT_FOUND: file missing (ReadFile) or tensor absent (Find returns nullptr instead).
//
//   KVPOOL_ASSIGN_OR_RETURN(auto st, SafetensorsFile::ReadFile("rot.safetensors"));
//   const SafetensorsTensor* t = st->Find("layers.0.k.rotation");
//   absl::Span<const uint8_t> bytes = st->Data(*t);
//
//   SafetensorsWriter w;
//   w.SetMetadata("format", "kvpool-rotations");
//   KVPOOL_RETURN_IF_ERROR(w.AddTensor("x", SafetensorsDtype::kF32, {2, 2}, bytes));
//   std::string file = w.Serialize();   // same inputs -> same bytes
//
// Thread-safety: a SafetensorsFile is immutable after parsing (const methods are thread-safe);
// a SafetensorsWriter is not thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvpool {

// The dtypes of the safetensors specification.
enum class SafetensorsDtype {
  kBool,
  kU8,
  kI8,
  kU16,
  kI16,
  kF16,
  kBF16,
  kU32,
  kI32,
  kF32,
  kU64,
  kI64,
  kF64,
};

// "F32", "BF16", ... as written in headers.
const char* SafetensorsDtypeName(SafetensorsDtype dtype);
// Bytes per element.
uint32_t SafetensorsDtypeSize(SafetensorsDtype dtype);

// Largest header accepted by the reader (FORMAT.md §4).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100ull * 1000 * 1000;

struct SafetensorsTensor {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::kF32;
  std::vector<uint64_t> shape;  // empty = scalar (one element)
  uint64_t begin = 0;           // offsets into the data section, end - begin = bytes
  uint64_t end = 0;
  uint64_t NumElements() const;
};

class SafetensorsFile {
 public:
  // Parses and validates `bytes` (the whole file), taking ownership.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Parse(std::string bytes);
  // Reads the file at `path` (NOT_FOUND when it cannot be opened) and parses it.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> ReadFile(const std::string& path);

  // The whole file as read (for hashing: the rotation id is SHA-256 of these bytes).
  const std::string& bytes() const { return bytes_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Tensors sorted by name.
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  // nullptr when absent.
  const SafetensorsTensor* Find(std::string_view name) const;
  // The tensor's bytes (validated to lie inside the file). Valid while *this lives.
  absl::Span<const uint8_t> Data(const SafetensorsTensor& t) const;
  // Copies an F32 tensor out (INVALID_ARGUMENT if the dtype is not F32, NOT_FOUND if absent).
  absl::StatusOr<std::vector<float>> ReadF32(std::string_view name) const;

 private:
  SafetensorsFile() = default;
  std::string bytes_;
  uint64_t data_start_ = 0;
  std::map<std::string, std::string> metadata_;
  std::vector<SafetensorsTensor> tensors_;
};

class SafetensorsWriter {
 public:
  // Adds a tensor; `data` is copied. INVALID_ARGUMENT if the name is empty, "__metadata__" or
  // already used, or data.size() != product(shape) × itemsize.
  absl::Status AddTensor(const std::string& name, SafetensorsDtype dtype,
                         std::vector<uint64_t> shape, absl::Span<const uint8_t> data);
  absl::Status AddF32(const std::string& name, std::vector<uint64_t> shape,
                      absl::Span<const float> data);
  void SetMetadata(const std::string& key, const std::string& value);

  // The file bytes. Deterministic: tensors laid out in name order, JSON keys sorted, header
  // padded with spaces to a multiple of 8 bytes.
  std::string Serialize() const;
  // Writes Serialize() to `path` atomically, through a symbolic link
  // (kvpool::WriteFileAtomically, kvpool/common/atomic_file.h). INTERNAL on I/O failure naming
  // the path.
  absl::Status WriteFile(const std::string& path) const;

 private:
  struct Entry {
    SafetensorsDtype dtype;
    std::vector<uint64_t> shape;
    std::string data;
  };
  std::map<std::string, Entry> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace kvpool
