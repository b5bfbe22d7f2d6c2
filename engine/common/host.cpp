#include "engine/common/host.hpp"

#include <dirent.h>
#include <sys/statvfs.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace dsrun {

static int count_nvidia_gpus() {
  // The driver lists one directory per GPU here; reading it needs no CUDA runtime.
  int n = 0;
  if (DIR* d = opendir("/proc/driver/nvidia/gpus")) {
    while (dirent* e = readdir(d))
      if (e->d_name[0] != '.') ++n;
    closedir(d);
  }
  // CUDA_VISIBLE_DEVICES narrows what a process may use.
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES")) {
    std::string v = visible;
    if (v.empty()) return 0;
    int listed = 1;
    for (char c : v) listed += c == ',';
    if (listed < n) n = listed;
  }
  return n;
}

HostFacts read_host_facts() {
  HostFacts h;
  h.kernels = this_build_kernels();
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) h.cpu_cores = CPU_COUNT(&set);
  if (h.cpu_cores <= 0) h.cpu_cores = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));

  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemTotal:") h.memory_bytes = kib * 1024.0;
    if (key == "MemAvailable:") h.available_bytes = kib * 1024.0;
  }
  h.cuda_devices = count_nvidia_gpus();
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES")) h.cuda_visible = visible;
  char name[256] = {0};
  if (gethostname(name, sizeof name - 1) == 0) h.hostname = name;
  return h;
}

double free_disk_bytes(const std::string& path) {
  // A checkpoint directory usually does not exist before the run: ask about the directory that will hold it.
  for (std::string at = path.empty() ? "." : path;;) {
    struct statvfs fs {};
    if (::statvfs(at.c_str(), &fs) == 0) return static_cast<double>(fs.f_bavail) * static_cast<double>(fs.f_frsize);
    if (at == "/" || at == ".") return -1;
    const size_t slash = at.find_last_of('/');
    at = slash == std::string::npos ? "." : slash == 0 ? "/" : at.substr(0, slash);
  }
}

}  // namespace dsrun
