#include "engine/train/report.hpp"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>

namespace dsrun {

RankReporter::RankReporter(int rank, int fd) : rank_(rank), fd_(fd) {}

void RankReporter::send(nlohmann::json message) {
  message["rank"] = rank_;
  message["time"] = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::string line = message.dump() + "\n";
  if (fd_ < 0) {
    std::fputs(line.c_str(), stderr);
    return;
  }
  // One write per line (under PIPE_BUF for ordinary messages), so lines never interleave.
  size_t done = 0;
  while (done < line.size()) {
    ssize_t n = ::write(fd_, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return;  // the launcher is gone; it stops this rank itself
    done += static_cast<size_t>(n);
  }
}

}  // namespace dsrun
