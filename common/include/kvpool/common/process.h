// kvpool/common/process.h — the state of another process as Linux reports it in /proc, and
// signals that wait until they took effect: SIGSTOP stops a process asynchronously (a thread
// already running may still answer a call sent right after kill()), and SIGKILL leaves a zombie
// until the parent reaps it. Used by the worker's fault hooks (kvpool-worker --fault) and the
// pool integration tests.
//
//   if (!kvpool::StopProcessAndWait(pool_pid, std::chrono::seconds(2))) { ... }
//
// Linux only (/proc). Thread-safe: each function reads /proc (and sends its signal) only.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <string_view>

namespace kvpool {

// The state letter of a /proc/PID/stat (or /proc/PID/task/TID/stat) line: the character after
// "(comm) " — found after the last ')', since comm may itself hold ')' and spaces. 'R' running,
// 'S' sleeping, 'D' disk sleep, 'T' stopped by a signal, 't' stopped by a tracer, 'Z' zombie,
// 'X' dead, ... (proc(5)). nullopt when the line has no ')' followed by a space and a letter.
std::optional<char> ProcStatState(std::string_view stat_line);

// The state of process `pid` from /proc/PID/stat; nullopt when it does not exist (reaped, never
// was) or cannot be read.
std::optional<char> ProcessState(int pid);

// Whether every thread of process `pid` is stopped ('T' or 't' in /proc/PID/task/TID/stat):
// false when one is not, or the process is gone or cannot be read.
bool AllThreadsStopped(int pid);

// The command name of process `pid`: /proc/PID/comm without its newline (the executable's
// file name, cut by the kernel to 15 bytes; a thread may rename itself) — else, when comm
// cannot be read, nullopt (no such process, `pid` <= 0).
std::optional<std::string> ProcessComm(int pid);

// Whether process `pid` runs the program named `name` (<= 15 bytes, e.g. "kvpool-server"):
// its /proc/PID/comm equals `name`, or the file name of its /proc/PID/exe link does (readable
// for a process of the same user). False when it does not exist. The worker's fault hooks check
// their --fault-pool-pid with it before signalling (a typo killed an unrelated process).
bool ProcessRuns(int pid, std::string_view name);

// Sends SIGSTOP to `pid` and waits, up to `timeout`, until AllThreadsStopped. True when they all
// are by then; false when the signal cannot be sent (no such process, no permission; `pid` <= 0,
// which kill() would take for a process group or every process, sends nothing) or the time runs
// out.
bool StopProcessAndWait(int pid, std::chrono::milliseconds timeout);

// Sends SIGKILL to `pid` and waits, up to `timeout`, until the process is gone or a zombie or
// dead ('Z', 'X': it runs no more; its parent still has to reap a zombie). True when it ended by
// then; false when the signal cannot be sent (as for StopProcessAndWait, `pid` <= 0 included) or
// the time runs out.
bool KillProcessAndWait(int pid, std::chrono::milliseconds timeout);

}  // namespace kvpool
