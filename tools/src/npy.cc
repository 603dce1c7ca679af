// .npy float32 reader/writer (see npy.h).
#include "npy.h"

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvpool/common/bounded_file.h"

namespace kvpool::tools {
namespace {

absl::Status Bad(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("npy: ", what));
}

// Finds `'key':` in the header dict and returns the position just after the colon.
absl::StatusOr<size_t> FindKey(const std::string& h, const std::string& key) {
  for (const char q : {'\'', '"'}) {
    const std::string k = std::string(1, q) + key + std::string(1, q);
    size_t p = h.find(k);
    if (p == std::string::npos) continue;
    p += k.size();
    while (p < h.size() && h[p] == ' ') ++p;
    if (p >= h.size() || h[p] != ':') return Bad(absl::StrCat("header key '", key, "' has no ':'"));
    ++p;
    while (p < h.size() && h[p] == ' ') ++p;
    return p;
  }
  return Bad(absl::StrCat("header has no '", key, "'"));
}

}  // namespace

absl::StatusOr<NpyArray> ParseNpyF32(const std::string& b) {
  if (b.size() < 10 || std::memcmp(b.data(), "\x93NUMPY", 6) != 0) {
    return Bad("bad magic (not a .npy file)");
  }
  const uint8_t major = static_cast<uint8_t>(b[6]);
  uint64_t hlen, start;
  if (major == 1) {
    hlen = static_cast<uint8_t>(b[8]) | (static_cast<uint64_t>(static_cast<uint8_t>(b[9])) << 8);
    start = 10;
  } else if (major == 2 || major == 3) {
    if (b.size() < 12) return absl::DataLossError("npy: truncated header length");
    hlen = 0;
    for (int i = 3; i >= 0; --i) hlen = (hlen << 8) | static_cast<uint8_t>(b[8 + i]);
    start = 12;
  } else {
    return Bad(absl::StrCat("unsupported version ", int(major)));
  }
  if (hlen > b.size() - start) return absl::DataLossError("npy: header runs past the end");
  const std::string h = b.substr(start, hlen);
  // descr
  auto p = FindKey(h, "descr");
  if (!p.ok()) return p.status();
  const std::string rest = h.substr(*p);
  if (rest.rfind("'<f4'", 0) != 0 && rest.rfind("\"<f4\"", 0) != 0) {
    return Bad(absl::StrCat("descr must be '<f4' (little-endian float32), got ",
                            rest.substr(0, rest.find_first_of(",}"))));
  }
  p = FindKey(h, "fortran_order");
  if (!p.ok()) return p.status();
  if (h.compare(*p, 5, "False") != 0) return Bad("fortran_order must be False (C order)");
  p = FindKey(h, "shape");
  if (!p.ok()) return p.status();
  size_t i = *p;
  if (i >= h.size() || h[i] != '(') return Bad("shape is not a tuple");
  const size_t close = h.find(')', i);
  if (close == std::string::npos) return Bad("shape tuple is not closed");
  NpyArray out;
  std::string inner = h.substr(i + 1, close - i - 1);
  uint64_t elems = 1;
  std::stringstream ss(inner);
  std::string tok;
  while (std::getline(ss, tok, ',')) {
    size_t a = tok.find_first_not_of(' '), z = tok.find_last_not_of(' ');
    if (a == std::string::npos) continue;  // trailing comma of a 1-tuple
    tok = tok.substr(a, z - a + 1);
    uint64_t v = 0;
    for (char c : tok) {
      if (c < '0' || c > '9') return Bad(absl::StrCat("shape entry '", tok, "' is not an integer"));
      if (v > (UINT64_MAX - 9) / 10) return Bad("shape entry overflows");
      v = v * 10 + (c - '0');
    }
    if (v != 0 && elems > UINT64_MAX / 4 / v) return Bad("shape product overflows");
    elems *= v;
    out.shape.push_back(v);
  }
  const uint64_t data_start = start + hlen;
  const uint64_t have = b.size() - data_start;
  if (have != elems * 4) {
    return absl::DataLossError(absl::StrCat("npy: shape (", absl::StrJoin(out.shape, ","),
                                            ") needs ", elems * 4, " data bytes, file has ", have));
  }
  out.data.resize(elems);
  if (elems) std::memcpy(out.data.data(), b.data() + data_start, elems * 4);
  return out;
}

absl::StatusOr<NpyArray> ReadNpyF32(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return absl::NotFoundError(absl::StrCat("cannot open '", path, "'", RelativePathNote(path)));
  std::ostringstream ss;
  ss << in.rdbuf();
  auto r = ParseNpyF32(ss.str());
  if (!r.ok())
    return absl::Status(r.status().code(), absl::StrCat(path, ": ", r.status().message()));
  return r;
}

absl::StatusOr<std::string> SerializeNpyF32(absl::Span<const uint64_t> shape,
                                            absl::Span<const float> data) {
  uint64_t elems = 1;
  for (uint64_t s : shape) elems *= s;
  if (elems != data.size()) {
    return Bad(absl::StrCat("data holds ", data.size(), " floats, shape needs ", elems));
  }
  std::string dims = absl::StrJoin(shape, ", ");
  if (shape.size() == 1) dims += ",";
  std::string header =
      absl::StrCat("{'descr': '<f4', 'fortran_order': False, 'shape': (", dims, "), }");
  while ((10 + header.size() + 1) % 64 != 0) header.push_back(' ');
  header.push_back('\n');
  std::string out = "\x93NUMPY";
  out.push_back(1);
  out.push_back(0);
  out.push_back(static_cast<char>(header.size() & 0xff));
  out.push_back(static_cast<char>(header.size() >> 8));
  out += header;
  out.append(reinterpret_cast<const char*>(data.data()), data.size() * 4);
  return out;
}

absl::Status WriteNpyF32(const std::string& path, absl::Span<const uint64_t> shape,
                         absl::Span<const float> data) {
  auto bytes = SerializeNpyF32(shape, data);
  if (!bytes.ok()) return bytes.status();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::InternalError(absl::StrCat("cannot create '", path, "'"));
  out.write(bytes->data(), static_cast<std::streamsize>(bytes->size()));
  if (!out.flush()) return absl::InternalError(absl::StrCat("cannot write '", path, "'"));
  return absl::OkStatus();
}

}  // namespace kvpool::tools
