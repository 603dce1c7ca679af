// kvpool-server --commit-device: documented in --help, bad values are usage errors (exit 1), and
// `gpu` without a usable GPU stops start-up with exit 2 naming the reason (encoder.h).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <string>

#include "kvpool/kvstore/encoder.h"

namespace kvpool::kvstore {
namespace {

// Runs the server binary with `args` (stderr merged into stdout) to its exit; returns the exit
// code (-1 when it did not exit normally) and its output.
std::pair<int, std::string> RunServer(const std::string& args) {
  const std::string cmd = std::string(KVPOOL_SERVER_BIN) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) {
    return {-1, "popen failed"};
  }
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) {
    out.append(buf, n);
  }
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

TEST(CommitDeviceFlagTest, HelpAndUsageErrors) {
  auto [help_code, help] = RunServer("--help");
  EXPECT_EQ(help_code, 0);
  EXPECT_NE(help.find("--commit-device"), std::string::npos) << help;
  EXPECT_NE(help.find("{auto,cpu,gpu}=auto"), std::string::npos) << help;
  auto [code, out] = RunServer("--commit-device cuda");
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("--commit-device"), std::string::npos) << out;
}

TEST(CommitDeviceFlagTest, GpuWithoutUsableDeviceFailsStartUp) {
  absl::StatusOr<std::unique_ptr<BlockEncoder>> gpu = CreateEncoder(CommitDevice::kGpu);
  if (gpu.ok()) {
    GTEST_SKIP() << "this machine has a usable GPU: --commit-device gpu would start a server";
  }
  auto [code, out] = RunServer(
      "--commit-device gpu --listen 127.0.0.1:0 --metrics-port -1 --data-plane none "
      "--capacity 1MiB");
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find(std::string(gpu.status().message())), std::string::npos)
      << "expected the reason \"" << gpu.status().message() << "\" in:\n"
      << out;
  EXPECT_NE(out.find("FAILED_PRECONDITION"), std::string::npos) << out;
}

}  // namespace
}  // namespace kvpool::kvstore
