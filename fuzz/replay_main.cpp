// Replays inputs through a fuzz target without libFuzzer: each argument is a file or a folder of
// files, each file one call of LLVMFuzzerTestOneInput. The normal build (any compiler) runs the
// committed corpus this way in ctest, so the reproducers in fuzz/corpus stay fixed between the
// sanitizer job's fuzzing runs.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

int replay(const std::filesystem::path& file) {
  std::ifstream f(file, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(f)), {});
  return LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
}

}  // namespace

int main(int argc, char** argv) {
  int files = 0;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path arg(argv[i]);
    if (std::filesystem::is_directory(arg)) {
      for (const auto& entry : std::filesystem::directory_iterator(arg)) {
        if (entry.is_regular_file()) {
          replay(entry.path());
          ++files;
        }
      }
    } else {
      replay(arg);
      ++files;
    }
  }
  std::printf("replayed %d inputs\n", files);
  return files > 0 ? 0 : 1;  // an empty corpus is a mistake, not a pass
}
