// Which host cores an offloaded rank's host step runs on: the cores near its GPU (the GPU's NUMA
// node, read from sysfs), shared out among the node's ranks near that node, as Linux cpu lists.
#pragma once

#include <string>
#include <vector>

namespace dsrun {

// "0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}; throws dsrun::Error naming the text when it is not a list.
std::vector<int> parse_cpu_list(const std::string& text);
// {0, 1, 2, 5} -> "0-2,5"
std::string format_cpu_list(const std::vector<int>& cpus);
// The cores this process may run on (sched_getaffinity), ascending.
std::vector<int> usable_cpus();
// The cores near a PCI device ("0000:1b:00.0"): /sys/bus/pci/devices/ID/local_cpulist; {} when unknown.
std::vector<int> pci_local_cpus(const std::string& pci_bus_id);

struct RankCores {
  std::vector<int> cores;  // this rank's share, ascending
  std::string why;         // for the rank's event: where they come from
};

// The usable cores near the rank's GPU (all usable ones when `near_gpu` says nothing), split evenly
// among the ranks that share them: local_world × near / usable of them, this rank taking slice
// local_rank mod that (GPUs are numbered socket by socket on the machines we know).
RankCores rank_host_cores(const std::vector<int>& usable, const std::vector<int>& near_gpu, int local_rank, int local_world);

struct HostStepThreads {
  int threads = 1;         // the host step's threads, the calling one included
  std::vector<int> cores;  // where its workers run; empty: anywhere
  std::string why;
};
// An offloaded GPU rank's host step, from the rank's share of the cores: all but the first,
// which stays with the thread launching the GPU's work. DSRUN_HOST_STEP_THREADS=N takes N (the
// share's last N cores) instead. The trainer and `dsrun probe` both count threads by this rule.
HostStepThreads host_step_threads(const RankCores& share);

}  // namespace dsrun
