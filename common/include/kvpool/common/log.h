// kvpool/common/log.h — the logging facade. All logs go to standard error (standard output
// is reserved for a program's results). Backed by spdlog; only this header names it.
//
//   KVPOOL_LOG_INFO("pool ready on {} ({} MiB)", addr, mib);
//
// Thread-safe. Level from SetLogLevel() or the KVPOOL_LOG_LEVEL environment variable
// (trace, debug, info, warn, error, off); default info.
#pragma once

#include <string_view>

#include <spdlog/spdlog.h>

namespace kvpool {

// Sets the process-wide log level by name; returns false for an unknown name.
bool SetLogLevel(std::string_view level);

// Logger writing to standard error; created on first use. Never null.
spdlog::logger& Logger();

}  // namespace kvpool

#define KVPOOL_LOG_TRACE(...) ::kvpool::Logger().trace(__VA_ARGS__)
#define KVPOOL_LOG_DEBUG(...) ::kvpool::Logger().debug(__VA_ARGS__)
#define KVPOOL_LOG_INFO(...) ::kvpool::Logger().info(__VA_ARGS__)
#define KVPOOL_LOG_WARN(...) ::kvpool::Logger().warn(__VA_ARGS__)
#define KVPOOL_LOG_ERROR(...) ::kvpool::Logger().error(__VA_ARGS__)
