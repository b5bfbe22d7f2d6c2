// An owned file descriptor: closed when it goes, whatever path the code leaves by. For code that
// reads and writes files through the system calls (checkpoint files, the probe's disk file).
#pragma once

#include <unistd.h>

namespace dsrun {

class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }
  // Closes it now (before a rename, say); returns what close(2) returned.
  int close() {
    const int result = fd_ >= 0 ? ::close(fd_) : 0;
    fd_ = -1;
    return result;
  }

 private:
  int fd_;
};

}  // namespace dsrun
