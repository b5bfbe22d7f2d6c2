// How a rank tells the launcher what happens: one JSON object per line on an inherited pipe
// (DSRUN_REPORT_FD). Without a launcher (torchrun, Slurm) the lines go to the rank's log instead.
#pragma once

#include <nlohmann/json.hpp>

namespace dsrun {

class RankReporter {
 public:
  RankReporter(int rank, int fd);  // fd < 0: write to stderr
  void send(nlohmann::json message);  // adds "rank" and "time"

 private:
  int rank_;
  int fd_;
};

}  // namespace dsrun
