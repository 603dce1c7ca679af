// The main() of every kvpool test binary (linked by kvpool_add_test instead of gtest_main).
//
// ctest runs each discovered test case as its own process, in parallel (`make test` uses -j).
// Many tests write fixed names under ::testing::TempDir() ("kvpool_rotation_source", config
// files, rotation files); with one shared TempDir those processes delete each other's files.
// So each process gets its own fresh directory: created with mkdtemp under $TEST_TMPDIR,
// $TMPDIR or /tmp, exported as TEST_TMPDIR (which ::testing::TempDir() returns, and which child
// processes inherit), and removed with everything in it when the tests end.
// KVPOOL_KEEP_TEST_TMPDIR=1 keeps it (its path is printed) for debugging a failure.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>

namespace {

// A new private directory under the usual temporary root; empty string if that fails (the
// tests then fall back to gtest's own TempDir()).
std::string MakeProcessTempDir() {
  const char* base = nullptr;
  for (const char* var : {"TEST_TMPDIR", "TMPDIR"}) {
    const char* v = getenv(var);
    if (v != nullptr && v[0] != '\0') {
      base = v;
      break;
    }
  }
  std::string templ = std::string(base != nullptr ? base : "/tmp") + "/kvpool_test.XXXXXX";
  if (mkdtemp(templ.data()) == nullptr) {
    std::fprintf(stderr, "test_main: mkdtemp(%s) failed: %s; using the shared temp dir\n",
                 templ.c_str(), std::strerror(errno));
    return "";
  }
  return templ;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = MakeProcessTempDir();
  if (!dir.empty()) setenv("TEST_TMPDIR", dir.c_str(), /*overwrite=*/1);
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  if (!dir.empty()) {
    const char* keep = getenv("KVPOOL_KEEP_TEST_TMPDIR");
    if (keep != nullptr && std::strcmp(keep, "1") == 0) {
      std::fprintf(stderr, "test_main: kept %s\n", dir.c_str());
    } else {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  }
  return rc;
}
