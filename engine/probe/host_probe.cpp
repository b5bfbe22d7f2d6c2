#include "engine/probe/host_probe.hpp"

#include "engine/common/clock.hpp"
#include "engine/common/error.hpp"
#include "engine/common/file_descriptor.hpp"
#include "engine/common/files.hpp"
#include "engine/train/host_optimizer.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <sstream>

namespace dsrun {
namespace {

// The host step's bytes per element, as the plan counts them (plan_time.cpp, predict_time): fp32
// weights and Adam's two states read and written, the gradient read, the working copy written.
int host_step_bytes(DType dtype) {
  const int e = bytes_per_element(dtype);
  return 8 + 16 + e + (dtype == DType::Fp32 ? 0 : e);
}

// STREAM's triad, a = b + s·c, over `n` floats per array on the pool: 12 bytes per element moved.
double time_triad(int64_t n, HostThreadPool& pool, int repeats) {
  std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n), 1.f), c(static_cast<size_t>(n), 2.f);
  const int64_t block = int64_t{1} << 18;
  const int64_t tasks = (n + block - 1) / block;
  double best = 1e30;
  for (int r = 0; r < repeats + 1; ++r) {
    const double start = steady_seconds();
    pool.run(tasks, [&](int64_t t) {
      const int64_t begin = t * block, end = std::min(n, begin + block);
      float* pa = a.data();
      const float *pb = b.data(), *pc = c.data();
      for (int64_t i = begin; i < end; ++i) pa[i] = pb[i] + 3.f * pc[i];
    });
    if (r > 0) best = std::min(best, steady_seconds() - start);
  }
  return best;
}

// A failed system call on the probe's disk file: the directory, checkpoint.dir and errno.
[[noreturn]] void disk_failure(const std::string& what, const std::string& path, int err) {
  ErrorContext c;
  c.file = path;
  c.key = "checkpoint.dir";
  c.system_errno = err;
  c.hint = "give `dsrun probe --disk DIR` a directory this user can write, on the disk that will hold checkpoints";
  throw Error("probe: " + what + " " + path + ": " + std::strerror(err), c);
}

#define DSRUN_PROBE_SYSCALL(call, what, path) \
  do {                                        \
    if ((call) < 0) disk_failure(what, path, errno); \
  } while (0)

}  // namespace

HostStepBench::HostStepBench(int64_t elements, DType dtype, int threads)
    : n_(elements), bytes_(static_cast<double>(elements) * host_step_bytes(dtype)), pool_(threads) {
  const bool mixed = dtype != DType::Fp32;
  master_.assign(static_cast<size_t>(n_), 0.5f);
  m_.assign(static_cast<size_t>(n_), 0.f);
  v_.assign(static_cast<size_t>(n_), 0.f);
  if (mixed) {
    grad16_.assign(static_cast<size_t>(n_), dtype == DType::Bf16 ? host_to_bf16(1e-3f) : host_to_f16(1e-3f));
    param16_.assign(static_cast<size_t>(n_), 0);
  } else {
    grad32_.assign(static_cast<size_t>(n_), 1e-3f);
  }
  const int64_t chunk = int64_t{1} << 16;
  for (int64_t at = 0; at < n_; at += chunk) {
    HostChunk c;
    c.n = std::min(chunk, n_ - at);
    c.master = master_.data() + at;
    c.m = m_.data() + at;
    c.v = v_.data() + at;
    c.decay = true;
    if (mixed) {
      c.grad = grad16_.data() + at;
      c.grad_dtype = c.param_dtype = dtype == DType::Bf16 ? HostDType::BF16 : HostDType::F16;
      c.param_out = param16_.data() + at;
    } else {
      c.grad = grad32_.data() + at;
    }
    chunks_.push_back(c);
  }
  step_.lr = 1e-4;
  step_.weight_decay = 0.1;
  run_once();  // faults the pages in: never timed
}

void HostStepBench::run_once() {
  step_.t += 1;
  pool_.run(static_cast<int64_t>(chunks_.size()), [&](int64_t i) { host_optimizer_step(chunks_[static_cast<size_t>(i)], step_); });
}

double HostStepBench::median_seconds(int repeats) {
  std::vector<double> seconds;
  for (int r = 0; r < std::max(1, repeats); ++r) {
    const double start = steady_seconds();
    run_once();
    seconds.push_back(steady_seconds() - start);
  }
  return probe_median(std::move(seconds));
}

void require_probe_directory(const std::string& directory) {
  struct stat st {};
  if (::stat(directory.c_str(), &st) != 0) disk_failure("no directory", directory, errno);
  if (!S_ISDIR(st.st_mode)) disk_failure("not a directory:", directory, ENOTDIR);
}

double probe_median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

std::string probe_number(double v, int digits) {
  std::ostringstream s;
  s.precision(digits);
  s << std::fixed << v;
  return s.str();
}

std::vector<ProbeFigure> probe_disk(const std::string& directory, int64_t bytes) {
  require_probe_directory(directory);
  std::string name = path_join(directory, ".dsrun-probe-XXXXXX");
  std::vector<char> path(name.begin(), name.end());
  path.push_back('\0');
  FileDescriptor fd(::mkstemp(path.data()));
  name = path.data();
  if (fd.get() < 0) disk_failure("cannot create a file in", directory, errno);
  // The file goes whatever happens; its name is gone at once, its blocks when it is closed.
  ::unlink(name.c_str());
  const int64_t block = int64_t{8} << 20;
  std::vector<char> buffer(static_cast<size_t>(block));
  for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = static_cast<char>(i * 2654435761u >> 13);  // not compressible to nothing
  const double write_start = steady_seconds();
  for (int64_t done = 0; done < bytes;) {
    const ssize_t n = ::write(fd.get(), buffer.data(), static_cast<size_t>(std::min(block, bytes - done)));
    if (n < 0) {
      if (errno == EINTR) continue;
      disk_failure("cannot write", directory, errno);
    }
    done += n;
  }
  DSRUN_PROBE_SYSCALL(::fsync(fd.get()), "cannot fsync a file in", directory);
  const double write_seconds = steady_seconds() - write_start;
  // Reads from the disk, not from the page cache the writes filled.
  ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED);
  DSRUN_PROBE_SYSCALL(::lseek(fd.get(), 0, SEEK_SET), "cannot seek in a file in", directory);
  const double read_start = steady_seconds();
  for (int64_t done = 0; done < bytes;) {
    const ssize_t n = ::read(fd.get(), buffer.data(), static_cast<size_t>(std::min(block, bytes - done)));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) disk_failure("cannot read back", directory, n < 0 ? errno : EIO);
    done += n;
  }
  const double read_seconds = steady_seconds() - read_start;
  const std::string size = probe_number(static_cast<double>(bytes) / (1 << 20), 0) + " MiB";
  return {
      {"hardware.disk_write_gbs", bytes / write_seconds / 1e9, size + " in 8 MiB writes and one fsync under " + directory},
      {"hardware.disk_read_gbs", bytes / read_seconds / 1e9, "the same " + size + " read back after dropping its cached pages (POSIX_FADV_DONTNEED)"},
  };
}

std::vector<ProbeFigure> probe_host(const HostProbeOptions& o, const ProbeProgress& progress) {
  std::vector<ProbeFigure> figures;
  const int per_element = host_step_bytes(o.dtype);
  const std::string dtype = to_string(o.dtype);
  const std::string elements = probe_number(static_cast<double>(o.optimizer_elements) / 1e6, 1) + " M";
  // Every core, then one offloaded rank's threads. GPU ranks each run their own host step on
  // their share of the cores: the node's figure is the ranks' sum, at most every core's.
  double all_cores = 0, one_rank = 0;
  {
    progress("host optimizer step: AdamW over " + elements + " parameters on " + std::to_string(o.threads) + " thread(s)");
    HostStepBench bench(o.optimizer_elements, o.dtype, o.threads);
    all_cores = bench.bytes() / bench.median_seconds(o.repeats);
  }
  if (o.offloading_ranks > 0) {
    progress("host optimizer step: the same on one rank's " + std::to_string(o.rank_threads) + " thread(s)");
    HostStepBench bench(o.optimizer_elements, o.dtype, o.rank_threads);
    one_rank = bench.bytes() / bench.median_seconds(o.repeats);
  }
  const std::string step = "the fused host AdamW step (" + dtype + " gradients, " + std::to_string(per_element) + " bytes per parameter) over " + elements +
                           " parameters, median of " + std::to_string(o.repeats);
  if (o.offloading_ranks > 0) {
    const double node = std::min(all_cores, one_rank * o.offloading_ranks);
    figures.push_back({"hardware.host_optimizer_gbs", node / 1e9,
                       step + " on one rank's " + std::to_string(o.rank_threads) + " thread(s) (" + o.rank_threads_why + "): " + probe_number(one_rank / 1e9, 1) +
                           " GB/s, times " + std::to_string(o.offloading_ranks) + " rank(s), at most every core's figure"});
    figures.push_back({"", all_cores / 1e9, "GB/s: the same step on every core (" + std::to_string(o.threads) + " threads)"});
  } else {
    figures.push_back({"hardware.host_optimizer_gbs", all_cores / 1e9, step + " on " + std::to_string(o.threads) + " thread(s)"});
  }
  {
    const int64_t n = o.memory_bytes / 4;
    progress("host memory: STREAM triad over 3 x " + probe_number(static_cast<double>(o.memory_bytes) / (1 << 20), 0) + " MiB");
    HostThreadPool pool(o.threads);
    const double seconds = time_triad(n, pool, o.repeats);
    figures.push_back({"hardware.host_memory_bandwidth_gbs", static_cast<double>(n) * 12 / seconds / 1e9,
                       "STREAM's triad (a = b + s*c, fp32, 12 bytes per element) over 3 x " + probe_number(static_cast<double>(o.memory_bytes) / (1 << 20), 0) +
                           " MiB on " + std::to_string(o.threads) + " thread(s), best of " + std::to_string(o.repeats)});
  }
  if (!o.disk_directory.empty()) {
    progress("disk: " + probe_number(static_cast<double>(o.disk_bytes) / (1 << 20), 0) + " MiB written and read under " + o.disk_directory);
    for (auto& f : probe_disk(o.disk_directory, o.disk_bytes)) figures.push_back(f);
  }
  return figures;
}

}  // namespace dsrun
