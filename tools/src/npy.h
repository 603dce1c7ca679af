// tools/src/npy.h — a small validating reader/writer for NumPy .npy files holding float32
// C-order arrays (the only kind the kvpool CLI exchanges).
//
// Format (NumPy NEP 1): magic "\x93NUMPY", major/minor version (1.0: u16 header length;
// 2.0/3.0: u32), an ASCII Python-dict header {'descr': '<f4', 'fortran_order': False,
// 'shape': (a, b, ...), } padded with spaces and a newline, then the raw data.
//
//   KVPOOL_ASSIGN_OR_RETURN(NpyArray x, ReadNpyF32("x.npy"));
//   KVPOOL_RETURN_IF_ERROR(WriteNpyF32("y.npy", x.shape, x.data));
//
// Errors: NOT_FOUND (cannot open), INVALID_ARGUMENT naming the bad field (magic, version,
// descr other than '<f4', fortran_order True, malformed shape), DATA_LOSS (file shorter than
// the shape needs, or longer). Thread-safety: reentrant.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace kvpool::tools {

struct NpyArray {
  std::vector<uint64_t> shape;
  std::vector<float> data;  // product(shape) floats, C order
};

// Parses .npy bytes.
absl::StatusOr<NpyArray> ParseNpyF32(const std::string& bytes);
// Reads `path` and parses it. NOT_FOUND "cannot open 'P'" when it cannot be opened, plus
// RelativePathNote(P) (" (relative to the current directory DIR)") for a relative path.
absl::StatusOr<NpyArray> ReadNpyF32(const std::string& path);

// The .npy (version 1.0) bytes of a float32 C-order array. INVALID_ARGUMENT when
// data.size() != product(shape).
absl::StatusOr<std::string> SerializeNpyF32(absl::Span<const uint64_t> shape,
                                            absl::Span<const float> data);
absl::Status WriteNpyF32(const std::string& path, absl::Span<const uint64_t> shape,
                         absl::Span<const float> data);

}  // namespace kvpool::tools
