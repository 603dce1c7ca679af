// kvpool/common/process.h: the state letter of a /proc stat line (also with ')' and spaces in
// the command name), and SIGSTOP / SIGKILL waits on a forked child.
#include "kvpool/common/process.h"

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

namespace kvpool {
namespace {

TEST(ProcStatStateTest, TheLetterAfterTheLastParenthesis) {
  EXPECT_EQ(ProcStatState("1234 (kvpool-server) S 1 1234 1234 0 -1"), 'S');
  EXPECT_EQ(ProcStatState("77 (a) b) T 1 2"), 'T');      // comm "a) b"
  EXPECT_EQ(ProcStatState("77 (x (y)) t 1 2"), 't');     // comm "x (y)"
  EXPECT_EQ(ProcStatState("9 (sh) Z"), 'Z');             // nothing after the state
  EXPECT_EQ(ProcStatState(""), std::nullopt);            // an unreadable file
  EXPECT_EQ(ProcStatState("9 (sh)"), std::nullopt);      // cut after comm
  EXPECT_EQ(ProcStatState("9 (sh) "), std::nullopt);     // cut after the space
  EXPECT_EQ(ProcStatState("9 (sh)S 1"), std::nullopt);   // no space
  EXPECT_EQ(ProcStatState("9 (sh) 1 2"), std::nullopt);  // not a letter
  EXPECT_EQ(ProcStatState("9 sh S 1"), std::nullopt);    // no parenthesis
}

TEST(ProcessCommTest, NamesThisProcessAndRefusesOthers) {
  const std::optional<std::string> comm = ProcessComm(::getpid());
  ASSERT_TRUE(comm.has_value());
  EXPECT_FALSE(comm->empty());
  EXPECT_EQ(comm->find('\n'), std::string::npos);
  EXPECT_TRUE(ProcessRuns(::getpid(), *comm));
  EXPECT_FALSE(ProcessRuns(::getpid(), "kvpool-server"));  // this is the test binary
  EXPECT_EQ(ProcessComm(0), std::nullopt);
  EXPECT_EQ(ProcessComm(-1), std::nullopt);
  EXPECT_FALSE(ProcessRuns(0, *comm));
  // A reaped child is no process.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_EQ(ProcessComm(child), std::nullopt);
  EXPECT_FALSE(ProcessRuns(child, *comm));
}

TEST(ProcessStateTest, ThisProcessRunsAndAReapedOneIsGone) {
  EXPECT_EQ(ProcessState(::getpid()), 'R');  // reading its own stat, it is running
  EXPECT_FALSE(AllThreadsStopped(::getpid()));
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_EQ(ProcessState(child), std::nullopt);
  EXPECT_FALSE(AllThreadsStopped(child));
  EXPECT_FALSE(StopProcessAndWait(child, std::chrono::milliseconds(100)));
  EXPECT_FALSE(KillProcessAndWait(child, std::chrono::milliseconds(100)));
  // 0 and -1 would name a process group or every process: nothing is sent.
  EXPECT_FALSE(StopProcessAndWait(0, std::chrono::milliseconds(10)));
  EXPECT_FALSE(KillProcessAndWait(-1, std::chrono::milliseconds(10)));
}

TEST(ProcessStateTest, StopContinueAndKillAChildWithThreads) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Threads besides the main one, so that every one of them has to stop (they sleep in
    // short steps: not to load the machine).
    for (int i = 0; i < 3; ++i) {
      std::thread([] {
        for (;;) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }).detach();
    }
    for (;;) ::pause();
  }
  // Sleeping threads: not stopped.
  EXPECT_FALSE(AllThreadsStopped(child));
  ASSERT_TRUE(StopProcessAndWait(child, std::chrono::seconds(5)));
  EXPECT_TRUE(AllThreadsStopped(child));
  EXPECT_EQ(ProcessState(child), 'T');
  ASSERT_EQ(::kill(child, SIGCONT), 0);
  for (int i = 0; i < 5000 && AllThreadsStopped(child); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_FALSE(AllThreadsStopped(child));
  ASSERT_TRUE(KillProcessAndWait(child, std::chrono::seconds(5)));
  EXPECT_EQ(ProcessState(child), 'Z');  // not reaped yet: a zombie
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  EXPECT_EQ(ProcessState(child), std::nullopt);
}

}  // namespace
}  // namespace kvpool
