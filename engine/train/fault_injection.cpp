#include "engine/train/fault_injection.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace dsrun {

namespace {

const char* variable_of(Fault fault) {
  switch (fault) {
    case Fault::CrashAt: return "DSRUN_TEST_CRASH_AT";
    case Fault::HangAt: return "DSRUN_TEST_HANG_AT";
    case Fault::StopAt: return "DSRUN_TEST_STOP_AT";
    case Fault::CrashInSave: return "DSRUN_TEST_CRASH_IN_SAVE";
    case Fault::NanLossAt: return "DSRUN_TEST_NAN_LOSS_AT";
  }
  return "";
}

}  // namespace

bool fault_requested(Fault fault, int rank, int64_t step) {
  const char* v = std::getenv(variable_of(fault));
  const char* restart = std::getenv("DSRUN_RESTART");
  if (!v || (restart && std::atoi(restart) > 0 && !std::strstr(v, ":always"))) return false;
  int r = -1;
  long long s = -1;
  return std::sscanf(v, "%d:%lld", &r, &s) == 2 && r == rank && s == step;
}

int64_t test_file_size_limit(int64_t step) {
  const char* v = std::getenv("DSRUN_TEST_FILE_SIZE_LIMIT");
  long long s = -1, bytes = 0;
  if (!v || std::sscanf(v, "%lld:%lld", &s, &bytes) != 2 || s != step) return 0;
  return bytes;
}

}  // namespace dsrun
