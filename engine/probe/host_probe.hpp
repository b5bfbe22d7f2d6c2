// What `dsrun probe` measures on the host without libtorch: the offloaded optimizer step's own
// throughput (the fused host step ranks run), host memory bandwidth, and the disk under checkpoint.dir.
#pragma once

#include "engine/common/clock.hpp"

#include "engine/recipe/recipe.hpp"
#include "engine/train/host_optimizer.hpp"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dsrun {

// One measured fact: the hardware.* key it sets (empty: recorded in the template's comments
// only), its value in that key's unit, and one line on how it was measured.
struct ProbeFigure {
  std::string key;
  double value = 0;
  std::string how;
  int ranks = 0;  // a list key's entry (hardware.*_gbs): the group size it was measured for; 0: a scalar key
};

struct HostProbeOptions {
  int threads = 1;                // every usable core
  int rank_threads = 1;           // the host step's threads in one rank (the trainer's rule)
  int offloading_ranks = 0;       // GPU ranks per node whose host steps run at once; 0: CPU ranks (the key is every core's figure)
  std::string rank_threads_why;   // how a rank comes to that many, for the figure's note
  DType dtype = DType::Fp32;      // gradients and working parameters of the host step
  int64_t optimizer_elements = int64_t{48} << 20;  // per timed step
  int64_t memory_bytes = int64_t{1} << 30;         // per array of the triad
  std::string disk_directory;     // empty: no disk figures
  int64_t disk_bytes = int64_t{1} << 30;
  int repeats = 3;                // the median of these is kept
};

using ProbeProgress = std::function<void(const std::string& line)>;

// Both halves of the probe time with steady_seconds (engine/common/clock.hpp) and print numbers with fixed digits.
// The median of measured call times: what training sustains (the fastest flatters, a mean takes in bursts of load).
double probe_median(std::vector<double> seconds);
std::string probe_number(double v, int digits);

// hardware.host_optimizer_gbs (GPU ranks: one rank's threads times the ranks, at most every
// core's figure; CPU ranks: every core's), the other figure recorded beside it,
// hardware.host_memory_bandwidth_gbs, hardware.disk_write_gbs and disk_read_gbs.
std::vector<ProbeFigure> probe_host(const HostProbeOptions& options, const ProbeProgress& progress);

// One fused host AdamW step (the offloaded ranks' own code, engine/train/host_optimizer.hpp)
// over `elements` parameters with `dtype` gradients, on a pool of `threads`: its buffers made and
// faulted in once, then timed call by call. The median, not the best: the best of three flattered
// a GPU rank's step by 15-25%.
class HostStepBench {
 public:
  HostStepBench(int64_t elements, DType dtype, int threads);
  double median_seconds(int repeats);
  // Bytes the step reads and writes, as the plan counts them (plan_time.cpp: 24 + 2e per parameter with e-byte gradients).
  double bytes() const { return bytes_; }

 private:
  void run_once();
  int64_t n_;
  double bytes_;
  HostThreadPool pool_;
  std::vector<float> master_, m_, v_, grad32_;
  std::vector<uint16_t> grad16_, param16_;
  std::vector<HostChunk> chunks_;
  HostStep step_;
};

// Throws the probe's error (naming the directory and checkpoint.dir) unless `directory` exists.
void require_probe_directory(const std::string& directory);

// The disk alone: writes `bytes` under `directory` in 8 MiB blocks with one fsync, drops the
// file's pages from the cache, reads it back. Errors name the directory and checkpoint.dir.
std::vector<ProbeFigure> probe_disk(const std::string& directory, int64_t bytes);

}  // namespace dsrun
