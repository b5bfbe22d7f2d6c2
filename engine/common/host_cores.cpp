#include "engine/common/host_cores.hpp"

#include "engine/common/environment.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"

#include <sched.h>

#include <algorithm>
#include <cctype>
#include <cmath>

namespace dsrun {

std::vector<int> parse_cpu_list(const std::string& text) {
  std::vector<int> cpus;
  auto bad = [&]() {
    ErrorContext c;
    c.hint = "a Linux cpu list looks like 0-3,8,10-11";
    return Error("not a cpu list: \"" + text + "\"", c);
  };
  auto number = [&](const std::string& s) {
    if (s.empty() || s.size() > 6 || !std::all_of(s.begin(), s.end(), [](char ch) { return std::isdigit(static_cast<unsigned char>(ch)); })) throw bad();
    return std::stoi(s);
  };
  const std::string t = trim(text);
  if (t.empty()) return cpus;
  for (const std::string& part : split(t, ',')) {
    const size_t dash = part.find('-');
    const int first = number(trim(part.substr(0, dash)));
    const int last = dash == std::string::npos ? first : number(trim(part.substr(dash + 1)));
    if (last < first) throw bad();
    for (int c = first; c <= last; ++c) cpus.push_back(c);
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

std::string format_cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(cpus[i]) + (j > i ? "-" + std::to_string(cpus[j]) : "");
    i = j + 1;
  }
  return out;
}

std::vector<int> usable_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) fail_at(__FILE__, __LINE__, "sched_getaffinity failed");
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

std::vector<int> pci_local_cpus(const std::string& pci_bus_id) {
  if (pci_bus_id.empty()) return {};
  std::string id;
  for (char ch : pci_bus_id) id += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  const std::string path = "/sys/bus/pci/devices/" + id + "/local_cpulist";
  if (!file_exists(path)) return {};
  return parse_cpu_list(read_file(path));
}

RankCores rank_host_cores(const std::vector<int>& usable, const std::vector<int>& near_gpu, int local_rank, int local_world) {
  RankCores r;
  std::vector<int> candidates;
  for (int c : usable)
    if (std::binary_search(near_gpu.begin(), near_gpu.end(), c)) candidates.push_back(c);
  if (candidates.empty()) {
    candidates = usable;
    r.why = near_gpu.empty() ? "no NUMA placement known for the GPU: the usable cores" : "none of the GPU's local cores are usable: the usable cores";
  } else {
    r.why = "the usable cores near the GPU (" + format_cpu_list(candidates) + ")";
  }
  const int world = std::max(1, local_world);
  const int sharing = std::max(1, std::min(world, static_cast<int>(std::lround(static_cast<double>(world) * candidates.size() / std::max<size_t>(1, usable.size())))));
  const size_t share = candidates.size() / static_cast<size_t>(sharing);
  if (share == 0) {
    r.cores = candidates;
    r.why += ", shared by all " + std::to_string(sharing) + " ranks near it";
    return r;
  }
  const size_t slice = static_cast<size_t>(local_rank % sharing);
  r.cores.assign(candidates.begin() + static_cast<long>(slice * share), candidates.begin() + static_cast<long>((slice + 1) * share));
  r.why += ", slice " + std::to_string(slice + 1) + " of " + std::to_string(sharing);
  return r;
}

HostStepThreads host_step_threads(const RankCores& share) {
  HostStepThreads t;
  const int cores = static_cast<int>(share.cores.size());
  const int asked = env_int("DSRUN_HOST_STEP_THREADS", 0);
  const int kept = asked > 0 ? std::max(0, cores - asked) : std::min(1, cores - 1);
  t.threads = std::max(1, asked > 0 ? asked : cores - kept);
  if (cores > 1 || asked > 0) t.cores.assign(share.cores.begin() + std::min(kept, cores), share.cores.end());
  t.why = asked > 0 ? "DSRUN_HOST_STEP_THREADS=" + std::to_string(asked) : "the share less " + std::to_string(kept) + " core(s) for the thread launching the GPU's work";
  return t;
}

}  // namespace dsrun
