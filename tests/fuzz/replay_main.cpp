// Replays every file of the fuzz corpus through the fuzz target, so CI catches regressions
// on known-tricky inputs without clang or libFuzzer. Prints the plain closing line CI reads.
#include <dirent.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  DIR* dir = opendir(argv[1]);
  if (!dir) {
    std::perror(argv[1]);
    return 2;
  }
  std::vector<std::string> files;
  while (dirent* e = readdir(dir))
    if (e->d_name[0] != '.') files.push_back(std::string(argv[1]) + "/" + e->d_name);
  closedir(dir);
  int passed = 0;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    std::string bytes = ss.str();
    try {
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      ++passed;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: escaped exception: %s\n", f.c_str(), e.what());
      std::printf("%d passed, %zu failed\n", passed, files.size() - passed);
      return 1;
    }
  }
  if (files.empty()) {
    std::fprintf(stderr, "empty corpus\n");
    return 1;
  }
  std::printf("corpus: %d passed, 0 failed\n", passed);
  return 0;
}
