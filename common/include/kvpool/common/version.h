// kvpool/common/version.h — build identity, for --version and benchmark JSON.
#pragma once

namespace kvpool {
extern const char* const kVersion;  // "0.1.0"
extern const char* const kGitSha;   // short SHA of the build's commit, or "unknown"
}  // namespace kvpool
