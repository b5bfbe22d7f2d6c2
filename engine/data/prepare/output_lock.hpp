// One prepare at a time per output directory (flock on its lock file), and the stale files of an
// earlier, larger prepare removed under that lock.
// Part of engine/data/prepare.cpp, which alone includes it.
#pragma once

#include "engine/data/prepare/input.hpp"

namespace dsrun::prepare_detail {

// The lock of an output directory, held (flock) from before the old manifest is deleted until the
// new one is written; the kernel drops it when the process ends, however it ends. The file stays
// (removing it would let a second prepare lock a file the first no longer sees); it holds the pid.
class OutputLock {
 public:
  explicit OutputLock(const std::string& dir) {
    const std::string path = path_join(dir, kPrepareLockName);
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) throw input_error(path, 0, std::string("cannot create the lock file: ") + std::strerror(errno), "check that the output directory is writable");
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      char text[32] = {};
      const ssize_t n = ::pread(fd_, text, sizeof text - 1, 0);
      const long long pid = n > 0 ? std::atoll(text) : 0;
      ::close(fd_);
      if (err == EWOULDBLOCK) {
        ErrorContext c;
        c.file = dir;
        c.hint = "wait for it to finish (or stop it), or write to another directory with -o";
        throw Error("another dsrun prepare" + (pid > 0 ? " (pid " + std::to_string(pid) + ")" : std::string()) + " is writing to this directory", c);
      }
      throw input_error(path, 0, std::string("cannot lock: ") + std::strerror(err), "put the output directory on a file system that supports flock");
    }
    const std::string pid = std::to_string(::getpid()) + "\n";
    if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
      // The lock holds without the pid; a second prepare is refused all the same, without it.
    }
  }
  ~OutputLock() { ::close(fd_); }
  OutputLock(const OutputLock&) = delete;
  OutputLock& operator=(const OutputLock&) = delete;

 private:
  int fd_ = -1;
};

// Files an earlier prepare left that this one's manifest does not list: shards numbered `shards`
// and above (the earlier corpus was larger), and temporary files of a killed prepare. Under the
// lock, so no other prepare is writing them.
inline int remove_stale_files(const std::string& dir, size_t shards) {
  int removed = 0;
  for (const std::string& name : list_directory(dir)) {
    bool temporary = false;
    const int64_t k = shard_number(name, &temporary);
    const bool manifest_tmp = name.rfind("manifest.json.tmp.", 0) == 0;
    if (!manifest_tmp && (k < 0 || (!temporary && static_cast<size_t>(k) < shards))) continue;
    const std::string path = path_join(dir, name);
    if (::unlink(path.c_str()) != 0 && errno != ENOENT)
      throw input_error(path, 0, std::string("cannot remove a stale file of an earlier prepare: ") + std::strerror(errno), "remove it by hand, or write to a new directory");
    ++removed;
  }
  return removed;
}

}  // namespace dsrun::prepare_detail
