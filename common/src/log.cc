#include "kvpool/common/log.h"

#include <cstdlib>
#include <memory>
#include <string>

#include <spdlog/sinks/stdout_color_sinks.h>

namespace kvpool {
namespace {

std::shared_ptr<spdlog::logger> MakeLogger() {
  auto logger = spdlog::stderr_color_mt("kvpool");
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%L%$ %v");
  logger->set_level(spdlog::level::info);
  if (const char* env = std::getenv("KVPOOL_LOG_LEVEL")) {
    auto lvl = spdlog::level::from_str(env);
    logger->set_level(lvl);
  }
  return logger;
}

}  // namespace

spdlog::logger& Logger() {
  static std::shared_ptr<spdlog::logger> logger = MakeLogger();
  return *logger;
}

bool SetLogLevel(std::string_view level) {
  static const char* kNames[] = {"trace", "debug", "info", "warn", "error", "off"};
  for (const char* n : kNames) {
    if (level == n) {
      Logger().set_level(spdlog::level::from_str(std::string(level)));
      return true;
    }
  }
  return false;
}

}  // namespace kvpool
