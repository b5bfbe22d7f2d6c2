// What a prepare leaves in its output directory (shard names, its lock), for prepare itself and
// for the token reader. Apart from prepare.cpp so that ranks, which read corpora, link no tokenizer.
#include "engine/data/prepare_directory.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"

#include <sys/file.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>

namespace dsrun {

// "shard-<digits>.<tokens|docs|json>": the shard number, else -1. `temporary`: the same name with
// ".tmp.<pid>" after it (write_file_atomic's, left by a prepare that was killed while writing).
int64_t shard_number(const std::string& name, bool* temporary) {
  *temporary = false;
  if (name.rfind("shard-", 0) != 0) return -1;
  size_t i = 6;
  int64_t k = 0;
  while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i])) && i < 24) k = k * 10 + (name[i++] - '0');
  if (i == 6) return -1;
  std::string rest = name.substr(i);
  const size_t tmp = rest.find(".tmp.");
  if (tmp != std::string::npos) {
    const std::string pid = rest.substr(tmp + 5);
    if (pid.empty() || pid.find_first_not_of("0123456789") != std::string::npos) return -1;
    rest.resize(tmp);
    *temporary = true;
  }
  return rest == ".tokens" || rest == ".docs" || rest == ".json" ? k : -1;
}

// Whether directory `dir`, whose entries are `names` (list_directory's), holds what a prepare
// writes: its lock file, or a shard record beside its tokens.
bool holds_prepare_output(const std::string& dir, const std::vector<std::string>& names) {
  if (file_exists(path_join(dir, kPrepareLockName))) return true;
  for (const std::string& name : names) {
    bool temporary = false;
    if (ends_with(name, ".json") && shard_number(name, &temporary) >= 0 && !temporary &&
        std::binary_search(names.begin(), names.end(), name.substr(0, name.size() - 5) + ".tokens"))
      return true;
  }
  return false;
}

bool is_prepare_directory(const std::string& dir) {
  try {
    return holds_prepare_output(dir, list_directory(dir));
  } catch (const Error&) {  // unreadable: not taken for one (reading it fails where it is read)
    return false;
  }
}

int64_t prepare_running_in(const std::string& dir) {
  const int fd = ::open(path_join(dir, kPrepareLockName).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  int64_t pid = 0;
  if (::flock(fd, LOCK_SH | LOCK_NB) != 0) {
    char text[32] = {};
    const ssize_t n = ::pread(fd, text, sizeof text - 1, 0);
    pid = n > 0 ? std::atoll(text) : 0;
    if (pid <= 0) pid = -1;  // held, by a pid not written yet
  } else {
    ::flock(fd, LOCK_UN);
  }
  ::close(fd);
  return pid;
}

}  // namespace dsrun
