// Validating GGUF reader; see kvpool/common/gguf.h for the format summary and the contract.
//
// Format reference: the GGUF specification in the ggml repository (docs/gguf.md) and, for v1,
// /work/shared/data/stories260K/README.md (uint32 counts/lengths/dims). Written from the
// specification; no code taken from ggml.
#include "kvpool/common/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvpool/common/bounded_file.h"
#include "kvpool/common/status.h"

namespace kvpool {

static_assert(std::endian::native == std::endian::little,
              "the GGUF reader assumes a little-endian host");

namespace {

// Debian's Abseil has its own string_view type; StrCat needs it.
absl::string_view Sv(std::string_view s) { return absl::string_view(s.data(), s.size()); }

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian uint32
constexpr uint32_t kDefaultAlignment = 32;
constexpr uint32_t kMaxDims = 4;

// Size in bytes of a scalar metadata type; 0 for STRING/ARRAY/unknown.
uint64_t ScalarSize(uint32_t type) {
  switch (static_cast<GgufType>(type)) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kBool:
      return 1;
    case GgufType::kUint16:
    case GgufType::kInt16:
      return 2;
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kFloat32:
      return 4;
    case GgufType::kUint64:
    case GgufType::kInt64:
    case GgufType::kFloat64:
      return 8;
    default:
      return 0;
  }
}

bool IsKnownType(uint32_t type) { return type <= static_cast<uint32_t>(GgufType::kFloat64); }

bool IsIntegerType(GgufType t) {
  switch (t) {
    case GgufType::kUint8:
    case GgufType::kInt8:
    case GgufType::kUint16:
    case GgufType::kInt16:
    case GgufType::kUint32:
    case GgufType::kInt32:
    case GgufType::kUint64:
    case GgufType::kInt64:
      return true;
    default:
      return false;
  }
}

bool IsSignedType(GgufType t) {
  return t == GgufType::kInt8 || t == GgufType::kInt16 || t == GgufType::kInt32 ||
         t == GgufType::kInt64;
}

// Element size of a supported tensor dtype; 0 when unsupported.
uint64_t DTypeSize(uint32_t dtype) {
  switch (dtype) {
    case static_cast<uint32_t>(GgufDType::kF32):
      return 4;
    case static_cast<uint32_t>(GgufDType::kF16):
    case static_cast<uint32_t>(GgufDType::kBF16):
      return 2;
    default:
      return 0;
  }
}

// Names of ggml types we know of but do not read (so the error can say "Q4_0" rather than
// just a number). Numbers from ggml's type enum.
std::string DTypeLabel(uint32_t dtype) {
  static const char* const kNames[] = {
      "F32",     "F16",    "Q4_0",    "Q4_1",  "Q4_2",   "Q4_3",  "Q5_0",  "Q5_1",
      "Q8_0",    "Q8_1",   "Q2_K",    "Q3_K",  "Q4_K",   "Q5_K",  "Q6_K",  "Q8_K",
      "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS",
      "I8",      "I16",    "I32",     "I64",   "F64",    "IQ1_M", "BF16"};
  if (dtype < sizeof(kNames) / sizeof(kNames[0])) {
    return absl::StrCat(kNames[dtype], " (", dtype, ")");
  }
  return absl::StrCat("unknown dtype ", dtype);
}

// Bounds-checked little-endian cursor over the file image. Every read checks the remaining
// length first; a failed read returns DATA_LOSS naming what was being read and where.
class Cursor {
 public:
  Cursor(const uint8_t* base, uint64_t size, bool wide_counts, uint64_t start = 0)
      : base_(base), size_(size), wide_(wide_counts), pos_(start) {}

  uint64_t pos() const { return pos_; }
  uint64_t remaining() const { return size_ - pos_; }

  absl::Status Need(uint64_t n, std::string_view what) const {
    if (n > remaining()) {
      return absl::DataLossError(absl::StrFormat(
          "file ends at byte %d while reading %s at offset %d (%d bytes needed, %d left)", size_,
          what, pos_, n, remaining()));
    }
    return absl::OkStatus();
  }

  absl::Status Bytes(void* out, uint64_t n, std::string_view what) {
    KVPOOL_RETURN_IF_ERROR(Need(n, what));
    if (n > 0) {
      std::memcpy(out, base_ + pos_, n);
    }
    pos_ += n;
    return absl::OkStatus();
  }

  absl::Status U32(uint32_t* out, std::string_view what) { return Bytes(out, 4, what); }
  absl::Status U64(uint64_t* out, std::string_view what) { return Bytes(out, 8, what); }

  // A count / length / dim field: uint32 in GGUF v1, uint64 from v2 on.
  absl::Status Count(uint64_t* out, std::string_view what) {
    if (wide_) {
      return U64(out, what);
    }
    uint32_t v = 0;
    KVPOOL_RETURN_IF_ERROR(U32(&v, what));
    *out = v;
    return absl::OkStatus();
  }
  uint64_t count_size() const { return wide_ ? 8 : 4; }

  // A length-prefixed string of at most `max` bytes (not NUL-terminated in the file).
  absl::Status String(std::string* out, uint64_t max, std::string_view what) {
    uint64_t len = 0;
    KVPOOL_RETURN_IF_ERROR(Count(&len, absl::StrCat(Sv(what), " length")));
    if (len > max) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s length %d at offset %d exceeds the limit of %d bytes", what, len,
                          pos_ - count_size(), max));
    }
    KVPOOL_RETURN_IF_ERROR(Need(len, what));
    out->assign(reinterpret_cast<const char*>(base_ + pos_), len);
    pos_ += len;
    return absl::OkStatus();
  }

 private:
  const uint8_t* base_;
  uint64_t size_;
  bool wide_;
  uint64_t pos_;
};

std::string Quote(std::string_view s) {
  // Keys/names come from the file: keep messages one line and bounded.
  std::string out = "'";
  for (char c : s.substr(0, 120)) {
    out += (c >= 0x20 && c < 0x7f) ? c : '?';
  }
  if (s.size() > 120) {
    out += "...";
  }
  out += "'";
  return out;
}

absl::Status ReadValue(Cursor& cur, uint32_t type, const GgufLimits& limits, GgufValue* v) {
  if (!IsKnownType(type)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown value type ", type));
  }
  v->type = static_cast<GgufType>(type);
  if (v->type == GgufType::kString) {
    return cur.String(&v->str, limits.max_string_bytes, "string");
  }
  if (v->type != GgufType::kArray) {
    const uint64_t n = ScalarSize(type);
    KVPOOL_RETURN_IF_ERROR(cur.Bytes(&v->scalar_bits, n, "value"));
    if (v->type == GgufType::kBool && v->scalar_bits > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("BOOL value is ", v->scalar_bits, " (must be 0 or 1)"));
    }
    return absl::OkStatus();
  }
  uint32_t elem = 0;
  KVPOOL_RETURN_IF_ERROR(cur.U32(&elem, "array element type"));
  if (elem == static_cast<uint32_t>(GgufType::kArray)) {
    return absl::InvalidArgumentError("nested arrays (ARRAY of ARRAY) are not supported");
  }
  if (!IsKnownType(elem)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown array element type ", elem));
  }
  v->array_type = static_cast<GgufType>(elem);
  KVPOOL_RETURN_IF_ERROR(cur.Count(&v->array_length, "array length"));
  const uint64_t n = v->array_length;
  if (n > limits.max_array_length) {
    return absl::InvalidArgumentError(
        absl::StrCat("array length ", n, " exceeds the limit of ", limits.max_array_length));
  }
  if (v->array_type == GgufType::kString) {
    // Each element needs at least its length field: refuse counts the file cannot hold
    // before reserving memory for them.
    if (n > cur.remaining() / cur.count_size()) {
      return absl::DataLossError(absl::StrCat("array of ", n, " strings cannot fit in the ",
                                              cur.remaining(), " bytes left in the file"));
    }
    v->array_strings.resize(n);
    for (uint64_t i = 0; i < n; ++i) {
      absl::Status s = cur.String(&v->array_strings[i], limits.max_string_bytes, "string");
      if (!s.ok()) {
        return Annotate(s, absl::StrCat("element ", i));
      }
    }
    return absl::OkStatus();
  }
  const uint64_t esize = ScalarSize(elem);
  if (n > cur.remaining() / esize) {
    return absl::DataLossError(absl::StrCat("array of ", n, " ", GgufTypeName(v->array_type),
                                            " cannot fit in the ", cur.remaining(),
                                            " bytes left in the file"));
  }
  v->array_bytes.resize(n * esize);
  KVPOOL_RETURN_IF_ERROR(cur.Bytes(v->array_bytes.data(), n * esize, "array data"));
  if (v->array_type == GgufType::kBool) {
    for (uint64_t i = 0; i < n; ++i) {
      if (static_cast<uint8_t>(v->array_bytes[i]) > 1) {
        return absl::InvalidArgumentError(absl::StrCat("BOOL element ", i, " is ",
                                                       static_cast<uint8_t>(v->array_bytes[i]),
                                                       " (must be 0 or 1)"));
      }
    }
  }
  return absl::OkStatus();
}

// Reads element i of a numeric array as raw 64-bit pattern, sign-extended for signed types.
int64_t IntElement(const GgufValue& v, uint64_t i, GgufType t) {
  const char* p = v.array_bytes.data() + i * ScalarSize(static_cast<uint32_t>(t));
  switch (t) {
    case GgufType::kUint8:
      return static_cast<uint8_t>(*p);
    case GgufType::kInt8:
      return static_cast<int8_t>(*p);
    case GgufType::kUint16: {
      uint16_t x;
      std::memcpy(&x, p, 2);
      return x;
    }
    case GgufType::kInt16: {
      int16_t x;
      std::memcpy(&x, p, 2);
      return x;
    }
    case GgufType::kUint32: {
      uint32_t x;
      std::memcpy(&x, p, 4);
      return x;
    }
    case GgufType::kInt32: {
      int32_t x;
      std::memcpy(&x, p, 4);
      return x;
    }
    case GgufType::kUint64:
    case GgufType::kInt64: {
      int64_t x;
      std::memcpy(&x, p, 8);
      return x;
    }
    default:
      return 0;
  }
}

// Sign-extends scalar bits of an integer type.
int64_t ScalarAsInt(const GgufValue& v) {
  switch (v.type) {
    case GgufType::kInt8:
      return static_cast<int8_t>(v.scalar_bits);
    case GgufType::kInt16:
      return static_cast<int16_t>(v.scalar_bits);
    case GgufType::kInt32:
      return static_cast<int32_t>(v.scalar_bits);
    default:
      return static_cast<int64_t>(v.scalar_bits);
  }
}

}  // namespace

std::string GgufTypeName(GgufType type) {
  static const char* const kNames[] = {"UINT8",  "INT8",    "UINT16", "INT16",  "UINT32",
                                       "INT32",  "FLOAT32", "BOOL",   "STRING", "ARRAY",
                                       "UINT64", "INT64",   "FLOAT64"};
  const auto t = static_cast<uint32_t>(type);
  if (t < sizeof(kNames) / sizeof(kNames[0])) {
    return kNames[t];
  }
  return absl::StrCat("TYPE(", t, ")");
}

std::string_view GgufDTypeName(GgufDType dtype) {
  switch (dtype) {
    case GgufDType::kF32:
      return "F32";
    case GgufDType::kF16:
      return "F16";
    case GgufDType::kBF16:
      return "BF16";
  }
  return "?";
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);  // normal: rebias 15 -> 127
  } else if (mant == 0) {
    bits = sign;  // +-0
  } else {
    // Subnormal half: normalize the mantissa.
    exp = 113;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

float Bf16ToFloat(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

GgufFile::~GgufFile() {
  if (map_ != nullptr) {
    munmap(map_, size_);
  }
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Open(const std::string& path,
                                                         const GgufLimits& limits) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    return absl::NotFoundError(
        absl::StrCat(path, ": cannot open: ", std::strerror(err), RelativePathNote(path)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::NotFoundError(absl::StrCat(path, ": not a regular file"));
  }
  auto file = std::unique_ptr<GgufFile>(new GgufFile());
  file->label_ = path;
  file->size_ = static_cast<uint64_t>(st.st_size);
  if (file->size_ > 0) {
    void* m = mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat(path, ": mmap failed: ", std::strerror(err)));
    }
    file->map_ = m;
    file->base_ = static_cast<const uint8_t*>(m);
  }
  ::close(fd);
  KVPOOL_RETURN_IF_ERROR(file->ParseAll(limits));
  return file;
}

absl::StatusOr<std::unique_ptr<GgufFile>> GgufFile::Parse(std::string bytes,
                                                          const GgufLimits& limits) {
  auto file = std::unique_ptr<GgufFile>(new GgufFile());
  file->label_ = "gguf";
  file->owned_ = std::move(bytes);
  file->base_ = reinterpret_cast<const uint8_t*>(file->owned_.data());
  file->size_ = file->owned_.size();
  KVPOOL_RETURN_IF_ERROR(file->ParseAll(limits));
  return file;
}

absl::Status GgufFile::ParseAll(const GgufLimits& limits) {
  auto fail = [this](const absl::Status& s) { return Annotate(s, label_); };

  // ---- header -----------------------------------------------------------------------------
  Cursor head(base_, size_, /*wide_counts=*/false);
  uint32_t magic = 0;
  if (auto s = head.U32(&magic, "magic"); !s.ok()) {
    return fail(s);
  }
  if (magic != kMagic) {
    return fail(absl::InvalidArgumentError(absl::StrFormat(
        "bad magic 0x%08x (expected 0x%08x \"GGUF\"): not a GGUF file", magic, kMagic)));
  }
  if (auto s = head.U32(&version_, "version"); !s.ok()) {
    return fail(s);
  }
  if (version_ < 1 || version_ > 3) {
    if (version_ != 0 && (version_ & 0xffffu) == 0) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("version field 0x", absl::Hex(version_),
                       " looks big-endian; big-endian GGUF is not supported")));
    }
    return fail(absl::InvalidArgumentError(
        absl::StrCat("unsupported version ", version_, " (supported: 1, 2, 3)")));
  }
  // The rest of the header uses the version's count width (v1: uint32, v2+: uint64).
  Cursor body(base_, size_, /*wide_counts=*/version_ >= 2, /*start=*/head.pos());

  uint64_t n_tensors = 0, n_kv = 0;
  if (auto s = body.Count(&n_tensors, "tensor count"); !s.ok()) {
    return fail(s);
  }
  if (auto s = body.Count(&n_kv, "metadata count"); !s.ok()) {
    return fail(s);
  }
  if (n_tensors > limits.max_tensors) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("tensor count ", n_tensors, " exceeds the limit of ", limits.max_tensors)));
  }
  if (n_kv > limits.max_metadata) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("metadata count ", n_kv, " exceeds the limit of ", limits.max_metadata)));
  }
  // Smallest possible entries: a key/name of 1 byte + type + 1-byte value; a tensor info of
  // a 1-byte name + ndim + one dim + dtype + offset. Refuse counts the file cannot hold.
  const uint64_t min_kv = body.count_size() + 1 + 4 + 1;
  const uint64_t min_tensor = body.count_size() + 1 + 4 + body.count_size() + 4 + 8;
  if (n_kv > body.remaining() / min_kv ||
      n_tensors > (body.remaining() - n_kv * min_kv) / min_tensor) {
    return fail(absl::DataLossError(absl::StrCat("header declares ", n_kv, " metadata entries and ",
                                                 n_tensors, " tensors, which cannot fit in the ",
                                                 body.remaining(), " bytes left in the file")));
  }

  // ---- metadata ---------------------------------------------------------------------------
  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key;
    if (auto s = body.String(&key, limits.max_string_bytes, "metadata key"); !s.ok()) {
      return fail(Annotate(s, absl::StrCat("metadata entry ", i)));
    }
    if (key.empty()) {
      return fail(
          absl::InvalidArgumentError(absl::StrCat("metadata entry ", i, " has an empty key")));
    }
    const std::string where = absl::StrCat("metadata key ", Quote(key));
    if (metadata_.count(key) != 0) {
      return fail(absl::InvalidArgumentError(absl::StrCat(where, " appears twice")));
    }
    uint32_t type = 0;
    if (auto s = body.U32(&type, "value type"); !s.ok()) {
      return fail(Annotate(s, where));
    }
    GgufValue value;
    if (auto s = ReadValue(body, type, limits, &value); !s.ok()) {
      return fail(Annotate(s, where));
    }
    metadata_.emplace(std::move(key), std::move(value));
  }

  alignment_ = kDefaultAlignment;
  if (FindValue("general.alignment") != nullptr) {
    auto a = GetUint("general.alignment");
    if (!a.ok()) {
      return fail(a.status());
    }
    if (*a == 0 || (*a & (*a - 1)) != 0 || *a > limits.max_alignment) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("metadata key 'general.alignment' is ", *a,
                       " (must be a power of two <= ", limits.max_alignment, ")")));
    }
    alignment_ = static_cast<uint32_t>(*a);
  }

  // ---- tensor infos -----------------------------------------------------------------------
  tensors_.reserve(n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensor t;
    if (auto s = body.String(&t.name, limits.max_string_bytes, "tensor name"); !s.ok()) {
      return fail(Annotate(s, absl::StrCat("tensor ", i)));
    }
    if (t.name.empty()) {
      return fail(absl::InvalidArgumentError(absl::StrCat("tensor ", i, " has an empty name")));
    }
    const std::string where = absl::StrCat("tensor ", Quote(t.name));
    if (tensor_index_.count(t.name) != 0) {
      return fail(absl::InvalidArgumentError(absl::StrCat(where, " appears twice")));
    }
    uint32_t ndim = 0;
    if (auto s = body.U32(&ndim, "ndim"); !s.ok()) {
      return fail(Annotate(s, where));
    }
    if (ndim < 1 || ndim > kMaxDims) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat(where, " has ndim ", ndim, " (must be 1..", kMaxDims, ")")));
    }
    t.dims.resize(ndim);
    for (uint32_t d = 0; d < ndim; ++d) {
      if (auto s = body.Count(&t.dims[d], "dim"); !s.ok()) {
        return fail(Annotate(s, where));
      }
    }
    uint32_t dtype = 0;
    if (auto s = body.U32(&dtype, "dtype"); !s.ok()) {
      return fail(Annotate(s, where));
    }
    if (auto s = body.U64(&t.offset, "offset"); !s.ok()) {
      return fail(Annotate(s, where));
    }

    const uint64_t esize = DTypeSize(dtype);
    if (esize == 0) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat(where, " has dtype ", DTypeLabel(dtype),
                       ", which is not supported (supported: F32, F16, BF16)")));
    }
    t.dtype = static_cast<GgufDType>(dtype);
    // Product of dims without overflow: keep num_bytes below 2^62.
    uint64_t n = 1;
    for (uint32_t d = 0; d < ndim; ++d) {
      if (t.dims[d] == 0) {
        return fail(absl::InvalidArgumentError(absl::StrCat(where, " has dim ", d, " = 0")));
      }
      if (t.dims[d] > (uint64_t{1} << 62) / esize / n) {
        return fail(absl::InvalidArgumentError(
            absl::StrCat(where, " is absurdly large (dims overflow 2^62 bytes)")));
      }
      n *= t.dims[d];
    }
    t.num_elements = n;
    t.num_bytes = n * esize;
    if (t.offset % alignment_ != 0) {
      return fail(absl::InvalidArgumentError(absl::StrCat(
          where, " offset ", t.offset, " is not a multiple of the alignment ", alignment_)));
    }
    tensor_index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
  }

  // ---- data section -----------------------------------------------------------------------
  const uint64_t table_end = body.pos();
  data_offset_ = (table_end + alignment_ - 1) / alignment_ * alignment_;  // no overflow: < size
  if (tensors_.empty()) {
    return absl::OkStatus();
  }
  if (data_offset_ > size_) {
    return fail(absl::DataLossError(absl::StrCat(
        "file ends at byte ", size_, " before the data section at offset ", data_offset_)));
  }
  const uint64_t data_size = size_ - data_offset_;
  for (GgufTensor& t : tensors_) {
    const std::string where = absl::StrCat("tensor ", Quote(t.name));
    if (t.offset > data_size) {
      return fail(absl::InvalidArgumentError(absl::StrCat(
          where, " offset ", t.offset, " lies outside the data section (", data_size, " bytes)")));
    }
    if (t.num_bytes > data_size - t.offset) {
      return fail(absl::DataLossError(absl::StrCat(
          where, " data [", t.offset, ", ", t.offset + t.num_bytes,
          ") extends past the end of the file (data section holds ", data_size, " bytes)")));
    }
    t.data = base_ + data_offset_ + t.offset;
  }
  std::vector<size_t> order(tensors_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(),
            [this](size_t a, size_t b) { return tensors_[a].offset < tensors_[b].offset; });
  for (size_t k = 1; k < order.size(); ++k) {
    const GgufTensor& a = tensors_[order[k - 1]];
    const GgufTensor& b = tensors_[order[k]];
    if (a.offset + a.num_bytes > b.offset) {
      return fail(absl::InvalidArgumentError(absl::StrCat(
          "tensor ", Quote(a.name), " [", a.offset, ", ", a.offset + a.num_bytes,
          ") overlaps tensor ", Quote(b.name), " [", b.offset, ", ", b.offset + b.num_bytes, ")")));
    }
  }
  return absl::OkStatus();
}

const GgufValue* GgufFile::FindValue(std::string_view key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

const GgufTensor* GgufFile::FindTensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

namespace {

absl::StatusOr<const GgufValue*> Lookup(const GgufFile& f, std::string_view key) {
  const GgufValue* v = f.FindValue(key);
  if (v == nullptr) {
    return absl::NotFoundError(absl::StrCat("metadata key '", Sv(key), "' is absent"));
  }
  return v;
}

absl::Status WrongType(std::string_view key, const GgufValue& v, std::string_view wanted) {
  std::string have = GgufTypeName(v.type);
  if (v.type == GgufType::kArray) {
    absl::StrAppend(&have, " of ", GgufTypeName(v.array_type));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("metadata key '", Sv(key), "' has type ", have, ", expected ", Sv(wanted)));
}

}  // namespace

absl::StatusOr<int64_t> GgufFile::GetInt(std::string_view key) const {
  KVPOOL_ASSIGN_OR_RETURN(const GgufValue* v, Lookup(*this, key));
  if (!IsIntegerType(v->type)) {
    return WrongType(key, *v, "an integer");
  }
  if (v->type == GgufType::kUint64 && v->scalar_bits > uint64_t{INT64_MAX}) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata key '", Sv(key), "' value ", v->scalar_bits, " does not fit int64"));
  }
  return ScalarAsInt(*v);
}

absl::StatusOr<uint64_t> GgufFile::GetUint(std::string_view key) const {
  KVPOOL_ASSIGN_OR_RETURN(const GgufValue* v, Lookup(*this, key));
  if (!IsIntegerType(v->type)) {
    return WrongType(key, *v, "an unsigned integer");
  }
  if (IsSignedType(v->type)) {
    const int64_t x = ScalarAsInt(*v);
    if (x < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("metadata key '", Sv(key), "' is negative (", x, ")"));
    }
    return static_cast<uint64_t>(x);
  }
  return v->scalar_bits;
}

absl::StatusOr<double> GgufFile::GetFloat(std::string_view key) const {
  KVPOOL_ASSIGN_OR_RETURN(const GgufValue* v, Lookup(*this, key));
  if (v->type == GgufType::kFloat32) {
    return static_cast<double>(std::bit_cast<float>(static_cast<uint32_t>(v->scalar_bits)));
  }
  if (v->type == GgufType::kFloat64) {
    return std::bit_cast<double>(v->scalar_bits);
  }
  if (IsIntegerType(v->type)) {
    if (v->type == GgufType::kUint64) {
      return static_cast<double>(v->scalar_bits);
    }
    return static_cast<double>(ScalarAsInt(*v));
  }
  return WrongType(key, *v, "a number");
}

absl::StatusOr<std::string> GgufFile::GetString(std::string_view key) const {
  KVPOOL_ASSIGN_OR_RETURN(const GgufValue* v, Lookup(*this, key));
  if (v->type != GgufType::kString) {
    return WrongType(key, *v, "STRING");
  }
  return v->str;
}

absl::StatusOr<bool> GgufFile::GetBool(std::string_view key) const {
  KVPOOL_ASSIGN_OR_RETURN(const GgufValue* v, Lookup(*this, key));
  if (v->type != GgufType::kBool) {
    return WrongType(key, *v, "BOOL");
  }
  return v->scalar_bits != 0;
}

absl::StatusOr<std::vector<std::string>> GgufFile::GetStringArray(std::string_view key) const {
  KVPOOL_ASSIGN_OR_RETURN(const GgufValue* v, Lookup(*this, key));
  if (v->type != GgufType::kArray || v->array_type != GgufType::kString) {
    return WrongType(key, *v, "ARRAY of STRING");
  }
  return v->array_strings;
}

absl::StatusOr<std::vector<float>> GgufFile::GetFloatArray(std::string_view key) const {
  KVPOOL_ASSIGN_OR_RETURN(const GgufValue* v, Lookup(*this, key));
  if (v->type != GgufType::kArray ||
      !(v->array_type == GgufType::kFloat32 || v->array_type == GgufType::kFloat64 ||
        IsIntegerType(v->array_type))) {
    return WrongType(key, *v, "ARRAY of numbers");
  }
  std::vector<float> out(v->array_length);
  for (uint64_t i = 0; i < v->array_length; ++i) {
    if (v->array_type == GgufType::kFloat32) {
      std::memcpy(&out[i], v->array_bytes.data() + 4 * i, 4);
    } else if (v->array_type == GgufType::kFloat64) {
      double d;
      std::memcpy(&d, v->array_bytes.data() + 8 * i, 8);
      out[i] = static_cast<float>(d);
    } else if (v->array_type == GgufType::kUint64) {
      out[i] = static_cast<float>(static_cast<uint64_t>(IntElement(*v, i, v->array_type)));
    } else {
      out[i] = static_cast<float>(IntElement(*v, i, v->array_type));
    }
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> GgufFile::GetIntArray(std::string_view key) const {
  KVPOOL_ASSIGN_OR_RETURN(const GgufValue* v, Lookup(*this, key));
  if (v->type != GgufType::kArray || !IsIntegerType(v->array_type)) {
    return WrongType(key, *v, "ARRAY of integers");
  }
  std::vector<int64_t> out(v->array_length);
  for (uint64_t i = 0; i < v->array_length; ++i) {
    out[i] = IntElement(*v, i, v->array_type);
    if (v->array_type == GgufType::kUint64 && out[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("metadata key '", Sv(key), "' element ", i, " does not fit int64"));
    }
  }
  return out;
}

absl::StatusOr<std::vector<float>> GgufFile::ReadFloat32(std::string_view name) const {
  const GgufTensor* t = FindTensor(name);
  if (t == nullptr) {
    return absl::NotFoundError(absl::StrCat("tensor '", Sv(name), "' is absent"));
  }
  std::vector<float> out(t->num_elements);
  switch (t->dtype) {
    case GgufDType::kF32:
      std::memcpy(out.data(), t->data, t->num_bytes);
      break;
    case GgufDType::kF16:
    case GgufDType::kBF16:
      for (uint64_t i = 0; i < t->num_elements; ++i) {
        uint16_t h;
        std::memcpy(&h, t->data + 2 * i, 2);
        out[i] = t->dtype == GgufDType::kF16 ? HalfToFloat(h) : Bf16ToFloat(h);
      }
      break;
  }
  return out;
}

}  // namespace kvpool
