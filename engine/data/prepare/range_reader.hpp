// A plain file's byte range, read a block at a time and checked unchanged after it.
// Part of engine/data/prepare.cpp, which alone includes it.
#pragma once

#include "engine/data/prepare/shard_builder.hpp"

namespace dsrun::prepare_detail {

// A plain file's byte range, read a block at a time; checked unchanged after its last block.
class RangeReader {
 public:
  RangeReader(const InputFile& f, int64_t begin, int64_t end) : f_(f), begin_(begin), at_(begin), end_(end) {
    fd_ = ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw input_error(f.path, 0, std::string("cannot open: ") + std::strerror(errno), "check the file");
  }
  ~RangeReader() { ::close(fd_); }
  RangeReader(const RangeReader&) = delete;
  RangeReader& operator=(const RangeReader&) = delete;

  // The next block into `out` (replaced); false at the end of the range.
  bool read(std::string& out) {
    if (at_ >= end_) {
      if (at_ == begin_) check_unchanged(f_, fd_);  // an empty range is read too
      return false;
    }
    out.resize(static_cast<size_t>(std::min<int64_t>(end_ - at_, static_cast<int64_t>(kUnitBytes))));
    for (size_t done = 0; done < out.size();) {
      const ssize_t n = ::pread(fd_, out.data() + done, out.size() - done, at_ + static_cast<int64_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = errno;
        check_unchanged(f_, fd_);  // a file that shrank: say that it changed
        throw input_error(f_.path, 0, n < 0 ? std::string("cannot read: ") + std::strerror(err) : "the file shrank while being read", "check the file");
      }
      done += static_cast<size_t>(n);
    }
    at_ += static_cast<int64_t>(out.size());
    if (at_ >= end_) check_unchanged(f_, fd_);
    return true;
  }

 private:
  const InputFile& f_;
  const int64_t begin_;
  int64_t at_, end_;
  int fd_ = -1;
};

}  // namespace dsrun::prepare_detail
