#include "memory_limit.h"

#include <algorithm>
#include <fstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace kvpool::kvstore {
namespace {

// The number on the first line of `path` (a cgroup file); false when absent, unreadable or not
// a number ("max").
bool ReadNumber(const std::string& path, uint64_t* out) {
  std::ifstream f(path);
  std::string line;
  return f && std::getline(f, line) && absl::SimpleAtoi(line, out);
}

// Folders from `root + rel` up to `root` itself, deepest first ("/a/b" → root/a/b, root/a, root).
std::vector<std::string> SelfAndParents(const std::string& root, absl::string_view rel) {
  std::vector<std::string> out;
  std::string dir(absl::StripSuffix(rel, "/"));
  for (;;) {
    out.push_back(root + dir);
    if (dir.empty()) break;
    const size_t slash = dir.rfind('/');
    dir.resize(slash == std::string::npos ? 0 : slash);
  }
  return out;
}

}  // namespace

MemoryLimit ProcessMemoryLimit(uint64_t physical_bytes, const std::string& proc_self_cgroup,
                               const std::string& cgroup_root) {
  MemoryLimit best{.bytes = physical_bytes, .source = "physical memory"};
  auto consider = [&](const std::string& dir, const char* limit_file, const char* usage_file) {
    const std::string file = dir + "/" + limit_file;
    uint64_t bytes = 0;
    if (!ReadNumber(file, &bytes) || bytes == 0) return;  // absent, "max", unreadable: no limit
    if (best.bytes != 0 && bytes >= best.bytes) return;   // v1 "unlimited" is ~2^63
    uint64_t used = 0;
    if (!ReadNumber(dir + "/" + usage_file, &used)) used = 0;
    best = {.bytes = bytes, .source = "cgroup limit " + file, .used = used};
  };
  std::ifstream f(proc_self_cgroup);
  std::string line;
  while (f && std::getline(f, line)) {
    // "hierarchy-id:controllers:path"; v2 is "0::path", v1 names its controllers.
    std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (parts.size() != 3 || parts[2].empty() || parts[2][0] != '/') continue;
    if (parts[1].empty()) {
      for (const std::string& dir : SelfAndParents(cgroup_root, parts[2])) {
        consider(dir, "memory.max", "memory.current");
      }
      continue;
    }
    const std::vector<absl::string_view> controllers = absl::StrSplit(parts[1], ',');
    if (std::find(controllers.begin(), controllers.end(), "memory") == controllers.end()) continue;
    for (const std::string& dir : SelfAndParents(cgroup_root + "/memory", parts[2])) {
      consider(dir, "memory.limit_in_bytes", "memory.usage_in_bytes");
    }
  }
  return best;
}

uint64_t MemAvailableBytes(const std::string& meminfo) {
  std::ifstream f(meminfo);
  std::string line;
  while (f && std::getline(f, line)) {
    absl::string_view rest(line);
    if (!absl::ConsumePrefix(&rest, "MemAvailable:")) continue;
    rest = absl::StripAsciiWhitespace(rest);
    uint64_t kib = 0;
    if (absl::ConsumeSuffix(&rest, "kB") &&
        absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &kib)) {
      return kib << 10;
    }
    return 0;
  }
  return 0;
}

}  // namespace kvpool::kvstore
