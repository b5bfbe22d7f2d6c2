// Fault injection for dsrun's own tests, read from the DSRUN_TEST_* variables in this one place:
// what a test asks a rank to do to itself (die, hang, stop, crash mid-save, meet a full disk).
#pragma once

#include <cstdint>

namespace dsrun {

enum class Fault {
  CrashAt,      // DSRUN_TEST_CRASH_AT: SIGKILL when the rank reaches the step
  HangAt,       // DSRUN_TEST_HANG_AT: no progress from the step on
  StopAt,       // DSRUN_TEST_STOP_AT: SIGSTOP at the step (0: during start-up)
  CrashInSave,  // DSRUN_TEST_CRASH_IN_SAVE: SIGKILL after the rank's shard of the step's save, before its commit
  NanLossAt,    // DSRUN_TEST_NAN_LOSS_AT: the step's reported loss is NaN (training itself goes on)
};

// The fault's variable says "RANK:STEP" for this rank and step. Only in the first attempt: ranks the
// launcher restarts (DSRUN_RESTART > 0) run clean, as after a real fault, unless the value ends in
// ":always" (a fault that restarts cannot cure).
bool fault_requested(Fault fault, int rank, int64_t step);

// DSRUN_TEST_FILE_SIZE_LIMIT="STEP:BYTES": the file size cap (RLIMIT_FSIZE) to set before the save
// of `step`, standing in for a disk that fills where a test cannot mount a small filesystem; 0: none.
int64_t test_file_size_limit(int64_t step);

}  // namespace dsrun
