// What a test run leaves on the machine: nothing in its temporary folder.
#include <algorithm>
#include <filesystem>

#include "io/files.h"
#include "test_util.h"

namespace apus {
namespace {

namespace fs = std::filesystem;

// This binary run on suites that write files (model copies, CLI outputs and logs, the per-process
// fixture folders, safetensors, images, clips, the mock hub's cache), given an empty temporary
// folder: afterwards the folder is empty again.
TEST(TestHygiene, ARunLeavesNothingInItsTemporaryFolder) {
  const std::string given = test::scratch_dir.path() + "given", log = test::scratch_dir.path() + "run.log";
  fs::create_directories(given);
  const std::string filter =
      "Safetensors.*:ModelDir.*:Robustness.InvalidUtf8*:Robustness.AtomicFile*:Robustness.UnwritableOutput*:"
      "Sa3Pipeline.UnsupportedOfficial*:Sa3Cli.BadInput*:CliErrors.BadInput*:InputImage.BadFiles*:Audio.*:"
      "Hub.RefusalsNameTheCause:Synth.ErrorsNameThePath:Bench.ReportRefuses*";
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  const int status =
      std::system(("env TMPDIR=" + test::shell_quote(given) + " TEST_TMPDIR=" + test::shell_quote(given) + " " +
                   test::shell_quote(self) + " --gtest_filter=" + test::shell_quote(filter) + " > " +
                   test::shell_quote(log) + " 2>&1")
                      .c_str());
  EXPECT_EQ(status, 0) << read_file(log);
  EXPECT_NE(read_file(log).find("PASSED"), std::string::npos) << read_file(log);
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(given)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  std::string names;
  for (const std::string& n : left) names += " " + n;
  EXPECT_TRUE(left.empty()) << "left in the temporary folder:" << names;
}

}  // namespace
}  // namespace apus
