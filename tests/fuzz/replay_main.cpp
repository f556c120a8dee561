// Runs a fuzz harness over files without libFuzzer: the regression test that replays the
// committed corpus (tests/fuzz/corpus/<harness>/) in every build, sanitizer builds included.
// Each input runs in its own child process, so that one failing input does not hide the others.
//   usage: replay FILE_OR_DIRECTORY...   (fails when given nothing to run)
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

namespace fs = std::filesystem;

int main(int argc, char **argv) {
  std::vector<fs::path> files;
  for (int i = 1; i < argc; ++i) {
    const fs::path arg = argv[i];
    if (fs::is_directory(arg)) {
      for (const auto &entry : fs::directory_iterator(arg))
        if (entry.is_regular_file()) files.push_back(entry.path());
    } else if (fs::is_regular_file(arg)) {
      files.push_back(arg);
    } else {
      std::fprintf(stderr, "%s: no such file or directory\n", argv[i]);
      return 2;
    }
  }
  if (files.empty()) {
    std::fprintf(stderr, "no inputs: give the corpus directory\n");
    return 2;
  }
  std::sort(files.begin(), files.end());
  std::vector<std::string> failed;
  for (const fs::path &file : files) {
    std::ifstream stream(file, std::ios::binary);
    const std::vector<uint8_t> data{std::istreambuf_iterator<char>(stream), std::istreambuf_iterator<char>()};
    std::fflush(nullptr);
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("fork");
      return 2;
    }
    if (pid == 0) {
      LLVMFuzzerTestOneInput(data.data(), data.size());
      std::exit(0);  // exit, not _exit: LeakSanitizer checks the child at exit
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "FAILED: %s (%zu bytes)\n\n", file.filename().c_str(), data.size());
      failed.push_back(file.filename().string());
    }
  }
  std::printf("%zu inputs replayed, %zu failed\n", files.size(), failed.size());
  for (const std::string &name : failed) std::printf("  failed: %s\n", name.c_str());
  return failed.empty() ? 0 : 1;
}
