// Internal: the memory a pool process may use, for kvpool-server's --capacity check. No gRPC
// header here.
#pragma once

#include <cstdint>
#include <string>

namespace kvpool::kvstore {

struct MemoryLimit {
  uint64_t bytes = 0;  // 0 = not known
  // What set `bytes`, for messages: "physical memory", or the cgroup file that did (e.g.
  // "cgroup limit /sys/fs/cgroup/kubepods/pod1/memory.max").
  std::string source;
  // What that cgroup uses now (its memory.current / memory.usage_in_bytes beside the limit
  // file); 0 for physical memory or when unreadable. limit - used is what a new allocation may
  // take before the cgroup's OOM killer acts (newcomer report 13b: MemAvailable ignores it).
  uint64_t used = 0;
};

// The lower of `physical_bytes` (0 = not known) and every memory limit of the cgroups this
// process is in: cgroup v2 `memory.max` and v1 `memory.limit_in_bytes` of its own cgroup (from
// `proc_self_cgroup`, the format of /proc/self/cgroup) and of each parent up to `cgroup_root`
// (v2 mounted at the root, v1 at root/memory). Folders that do not exist are skipped (a
// container without a cgroup namespace sees the host's path but its own cgroup at the root);
// "max", unreadable files and v1's "unlimited" value (any limit at or above physical memory)
// mean no limit. A pod's limits.memory is such a limit: more than it ends in the OOM killer
// with nothing logged (newcomer report 13 F1). Thread-safe (reads files only).
MemoryLimit ProcessMemoryLimit(uint64_t physical_bytes,
                               const std::string& proc_self_cgroup = "/proc/self/cgroup",
                               const std::string& cgroup_root = "/sys/fs/cgroup");

// MemAvailable of `meminfo` (the format of /proc/meminfo) in bytes; 0 when not found.
uint64_t MemAvailableBytes(const std::string& meminfo = "/proc/meminfo");

}  // namespace kvpool::kvstore
