#include "kvpool/common/process.h"

#include <signal.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

namespace kvpool {
namespace {

// The first line of /proc file `path` ("" when it cannot be read).
std::string FirstLine(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Polls `done` every millisecond until it holds or `timeout` has passed; its last answer.
template <typename Done>
bool PollUntil(std::chrono::milliseconds timeout, Done done) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (!done()) {
    if (std::chrono::steady_clock::now() >= end) return done();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace

std::optional<char> ProcStatState(std::string_view stat_line) {
  const size_t paren = stat_line.rfind(')');
  if (paren == std::string_view::npos || paren + 2 >= stat_line.size() ||
      stat_line[paren + 1] != ' ') {
    return std::nullopt;
  }
  const char state = stat_line[paren + 2];
  if (!((state >= 'A' && state <= 'Z') || (state >= 'a' && state <= 'z'))) return std::nullopt;
  return state;
}

std::optional<char> ProcessState(int pid) {
  return ProcStatState(FirstLine("/proc/" + std::to_string(pid) + "/stat"));
}

std::optional<std::string> ProcessComm(int pid) {
  if (pid <= 0) return std::nullopt;
  std::ifstream in("/proc/" + std::to_string(pid) + "/comm");
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  return line;
}

bool ProcessRuns(int pid, std::string_view name) {
  const std::optional<std::string> comm = ProcessComm(pid);
  if (!comm.has_value()) return false;
  if (*comm == name) return true;
  std::error_code ec;
  const std::filesystem::path exe =
      std::filesystem::read_symlink("/proc/" + std::to_string(pid) + "/exe", ec);
  return !ec && exe.filename() == name;
}

bool AllThreadsStopped(int pid) {
  std::error_code ec;
  int threads = 0;
  for (const auto& t :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    const std::optional<char> state = ProcStatState(FirstLine(t.path() / "stat"));
    if (state != 'T' && state != 't') return false;
    ++threads;
  }
  return !ec && threads > 0;
}

bool StopProcessAndWait(int pid, std::chrono::milliseconds timeout) {
  if (pid <= 0 || ::kill(pid, SIGSTOP) != 0) return false;  // 0, -1: a group, every process
  return PollUntil(timeout, [pid] { return AllThreadsStopped(pid); });
}

bool KillProcessAndWait(int pid, std::chrono::milliseconds timeout) {
  if (pid <= 0 || ::kill(pid, SIGKILL) != 0) return false;
  return PollUntil(timeout, [pid] {
    const std::optional<char> state = ProcessState(pid);
    return !state.has_value() || *state == 'Z' || *state == 'X';
  });
}

}  // namespace kvpool
