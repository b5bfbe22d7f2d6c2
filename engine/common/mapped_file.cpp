#include "engine/common/mapped_file.hpp"

#include "engine/common/error.hpp"

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <fcntl.h>
#include <mutex>
#include <sys/mman.h>
#include <unistd.h>

namespace dsrun {
namespace {

// The maps a fault may hit, as a list the handler walks without locks: nodes are pushed at the
// head and never freed (a process maps its data once), a node's `live` goes false when unmapped.
struct MapNode {
  const unsigned char* begin = nullptr;
  size_t size = 0;
  std::string message;   // for stderr
  std::string line;      // for the report pipe ("" until a reporter is installed)
  std::atomic<bool> live{true};
  MapNode* next = nullptr;
};

std::atomic<MapNode*> g_maps{nullptr};
std::mutex g_registry_mutex;  // registration and installation, never the handler
std::function<std::string(const std::string&)> g_report_line;
int g_report_fd = -1;

void write_all(int fd, const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // nothing else can be done from a signal handler
    done += static_cast<size_t>(n);
  }
}

void on_sigbus(int sig, siginfo_t* info, void*) {
  const auto* at = static_cast<const unsigned char*>(info->si_addr);
  for (MapNode* n = g_maps.load(std::memory_order_acquire); n; n = n->next) {
    if (!n->live.load(std::memory_order_acquire) || at < n->begin || at >= n->begin + n->size) continue;
    write_all(2, n->message + "\n");
    if (g_report_fd >= 0 && !n->line.empty()) write_all(g_report_fd, n->line);
    break;
  }
  // Die of the signal as before, so the launcher still sees signal 7.
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

MapNode* register_map(const unsigned char* begin, size_t size, const std::string& path) {
  auto* n = new MapNode;  // never freed: see MapNode
  n->begin = begin;
  n->size = size;
  n->message = "SIGBUS reading the mapped file " + path + " (" + std::to_string(size) +
               " bytes when mapped): it was truncated or replaced, or its storage failed, while this process read it; "
               "put the file back as it was, or dsrun resume --force to train on it as it is now";
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  if (g_report_line) n->line = g_report_line(n->message);
  n->next = g_maps.load(std::memory_order_relaxed);
  g_maps.store(n, std::memory_order_release);
  return n;
}

void unregister_map(const unsigned char* begin) {
  for (MapNode* n = g_maps.load(std::memory_order_acquire); n; n = n->next)
    if (n->begin == begin && n->live.load()) {
      n->live.store(false, std::memory_order_release);
      return;
    }
}

Error map_error(const std::string& path, const std::string& key, const std::string& what) {
  ErrorContext c;
  c.file = path;
  c.key = key;
  c.hint = "check " + key;
  return Error(what + ": " + std::strerror(errno), c);
}

}  // namespace

MappedFile::MappedFile(const std::string& path, const std::string& key) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw map_error(path, key, "cannot open");
  const off_t size = ::lseek(fd, 0, SEEK_END);
  if (size < 0) {
    const Error e = map_error(path, key, "cannot size");
    ::close(fd);
    throw e;
  }
  size_ = static_cast<size_t>(size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const Error e = map_error(path, key, "cannot map");
      ::close(fd);
      throw e;
    }
    data_ = static_cast<const unsigned char*>(p);
    // Advice only: a kernel that ignores it reads the same bytes.
    (void)::madvise(p, size_, MADV_RANDOM);  // windows are read in shuffled order
    register_map(data_, size_, path_);
  }
  if (::close(fd) != 0) fail_at(__FILE__, __LINE__, "close " + path + ": " + std::strerror(errno));
}

MappedFile::~MappedFile() {
  if (!data_) return;
  unregister_map(data_);
  ::munmap(const_cast<unsigned char*>(data_), size_);
}

void report_mapped_file_faults(int report_fd, std::function<std::string(const std::string&)> report_line) {
  {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    g_report_fd = report_fd;
    g_report_line = std::move(report_line);
    for (MapNode* n = g_maps.load(); n; n = n->next)
      if (g_report_line) n->line = g_report_line(n->message);
  }
  struct sigaction sa {};
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  if (::sigaction(SIGBUS, &sa, nullptr) != 0) fail_at(__FILE__, __LINE__, std::string("sigaction(SIGBUS): ") + std::strerror(errno));
}

}  // namespace dsrun
