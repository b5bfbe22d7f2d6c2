// A read-only map of a whole file (RAII), and the SIGBUS report that names the file a fault hit:
// a mapped file that shrinks under a reader kills it with SIGBUS, which by itself names nothing.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

namespace dsrun {

// MAP_SHARED: its pages are the page cache's, shared by every process on the host, and not
// counted in a process's anonymous memory. Every map is listed for the fault report while it lives.
class MappedFile {
 public:
  // `key`: the recipe key the path came from, for the error when it cannot be opened or mapped.
  explicit MappedFile(const std::string& path, const std::string& key = "data.path");
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const unsigned char* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

// Installs a SIGBUS handler: a fault inside a mapped file writes a message naming the file (and
// its size when mapped) to stderr, and `report_line(message)` to `report_fd` (the launcher's pipe;
// -1: none), then dies of SIGBUS as before. The bytes are made when a file is mapped, so the
// handler only looks up and writes.
void report_mapped_file_faults(int report_fd, std::function<std::string(const std::string& message)> report_line);

}  // namespace dsrun
