// A .gz or .zst input's text, block by block, so that a file larger than memory streams through.
// Part of engine/data/prepare.cpp, which alone includes it.
#pragma once

#include "engine/data/prepare/input.hpp"

namespace dsrun::prepare_detail {

// A compressed file's text, block by block, so that a file larger than memory can be read.
class Decompressor {
 public:
  explicit Decompressor(const InputFile& f) : f_(f) {
    fd_ = ::open(f.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw input_error(f.path, 0, std::string("cannot open: ") + std::strerror(errno), "check the file");
    if (f.compression == Compression::gzip) {
      // zlib reads what is not gzip as plain bytes: a .gz of random bytes would be tokenized as text.
      unsigned char magic[2] = {0, 0};
      const ssize_t got = ::pread(fd_, magic, 2, 0);
      if (got != 2 || magic[0] != 0x1f || magic[1] != 0x8b) {
        ::close(fd_);
        throw input_error(f.path, 0, got < 2 ? "is empty or shorter than a gzip header" : "is not gzip data (it does not start with gzip's 1f 8b)",
                          "download it again, or rename it without .gz if it is plain text");
      }
      gz_ = ::gzdopen(fd_, "rb");  // closes fd_ on gzclose
      if (!gz_) {
        ::close(fd_);
        throw input_error(f.path, 0, "cannot open gzip file", "check the file");
      }
      ::gzbuffer(gz_, 1 << 17);
    } else {
      file_ = ::fdopen(fd_, "rb");  // closes fd_ on fclose
      if (!file_) {
        ::close(fd_);
        throw input_error(f.path, 0, std::string("cannot open: ") + std::strerror(errno), "check the file");
      }
      zstd_ = ZSTD_createDCtx();
      in_.resize(ZSTD_DStreamInSize());
    }
  }
  ~Decompressor() {
    if (gz_) ::gzclose(gz_);
    if (file_) std::fclose(file_);
    if (zstd_) ZSTD_freeDCtx(zstd_);
  }
  Decompressor(const Decompressor&) = delete;
  Decompressor& operator=(const Decompressor&) = delete;

  // Appends up to about a megabyte of text to `out`; false once the file is done.
  bool read(std::string& out) {
    const size_t start = out.size();
    if (gz_) {
      out.resize(start + (1 << 20));
      const int n = ::gzread(gz_, out.data() + start, 1 << 20);
      if (n < 0) {
        int code = 0;
        throw input_error(f_.path, 0, std::string("corrupt gzip data: ") + ::gzerror(gz_, &code), "download the file again");
      }
      out.resize(start + static_cast<size_t>(n));
      int code = Z_OK;
      const char* why = ::gzerror(gz_, &code);
      if (n == 0 && code != Z_OK)  // zlib reports a cut-off stream here, not as n < 0
        throw input_error(f_.path, 0, std::string(code == Z_BUF_ERROR ? "truncated gzip data: " : "corrupt gzip data: ") + why, "download the file again");
      if (n == 0) check_unchanged(f_, fd_);
      return n > 0;
    }
    while (out.size() - start < (1 << 20)) {
      if (in_pos_ == in_size_ && !pending_) {
        in_size_ = std::fread(in_.data(), 1, in_.size(), file_);
        in_pos_ = 0;
        consumed_ += static_cast<int64_t>(in_size_);
        if (in_size_ == 0) {
          if (std::ferror(file_)) throw input_error(f_.path, 0, std::string("cannot read: ") + std::strerror(errno), "check the file");
          check_unchanged(f_, fd_);
          if (last_ != 0) throw input_error(f_.path, 0, "truncated zstd data", "download the file again");
          return out.size() > start;
        }
      }
      ZSTD_inBuffer in{in_.data(), in_size_, in_pos_};
      const size_t at = out.size();
      out.resize(at + ZSTD_DStreamOutSize());
      ZSTD_outBuffer o{out.data() + at, ZSTD_DStreamOutSize(), 0};
      last_ = ZSTD_decompressStream(zstd_, &o, &in);
      if (ZSTD_isError(last_)) throw input_error(f_.path, 0, std::string("corrupt zstd data: ") + ZSTD_getErrorName(last_), "download the file again");
      out.resize(at + o.pos);
      in_pos_ = in.pos;
      // A full output buffer: more may come without more input, unless the frame just ended
      // (last_ == 0: decoded and flushed). Asked again with no input after its end, zstd would
      // answer with the size of the next frame's header, which is not a cut-off frame: a text of
      // a multiple of 128 KiB ends exactly so.
      pending_ = o.pos == o.size && last_ != 0;
    }
    return true;
  }
  // Compressed bytes read so far (progress).
  int64_t consumed() const { return gz_ ? static_cast<int64_t>(::gzoffset(gz_)) : consumed_; }

 private:
  const InputFile& f_;
  gzFile gz_ = nullptr;
  std::FILE* file_ = nullptr;
  ZSTD_DCtx* zstd_ = nullptr;
  std::string in_;
  size_t in_pos_ = 0, in_size_ = 0, last_ = 0;
  bool pending_ = false;
  int64_t consumed_ = 0;
  int fd_ = -1;  // owned by gz_ or file_
};

}  // namespace dsrun::prepare_detail
