// Facts about the machine dsrun runs on (cores, memory, GPUs), read once and passed in explicitly,
// so that the plan stays a pure function of (recipe, host facts) and tests can pass made-up hosts.
#pragma once

#include "engine/common/build_kernels.hpp"

#include <cstdint>
#include <string>

namespace dsrun {

struct HostFacts {
  int cpu_cores = 1;            // usable cores (sched affinity), not sockets × threads
  double memory_bytes = 0;      // MemTotal
  double available_bytes = 0;   // MemAvailable when read: what a run can still take without swapping
  int cuda_devices = 0;         // NVIDIA GPUs visible to the driver (0 on a CPU machine)
  std::string cuda_visible;     // CUDA_VISIBLE_DEVICES where set (it narrows cuda_devices), for messages
  std::string hostname;
  // Free bytes where checkpoints will be written (checkpoint.dir, else the run store's directory),
  // filled in by the command that plans a run; -1: not known (the plan then says nothing of disk).
  double checkpoint_free_bytes = -1;
  // What this build's kernels can do (this_build_kernels()): the execution modes depend on it.
  BuildKernels kernels;
};

HostFacts read_host_facts();
// Free bytes (for an unprivileged writer) on the filesystem holding `path`, or the nearest
// existing directory above it; -1 when none can be read.
double free_disk_bytes(const std::string& path);

}  // namespace dsrun
