// Where an offloaded rank's host step runs: Linux cpu lists, the share of the cores near a GPU
// each rank takes, and a thread pool whose workers stay on the cores it is given.
#include "engine/common/files.hpp"
#include "engine/common/host_cores.hpp"
#include "engine/train/host_optimizer.hpp"

#include <catch2/catch.hpp>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <set>
#include <thread>

using dsrun::format_cpu_list;
using dsrun::parse_cpu_list;
using dsrun::rank_host_cores;

TEST_CASE("cpu lists parse and print as Linux writes them, and bad ones are errors naming the text", "[host][cores]") {
  CHECK(parse_cpu_list("0-3,8,10-11\n") == std::vector<int>{0, 1, 2, 3, 8, 10, 11});
  CHECK(parse_cpu_list("5") == std::vector<int>{5});
  CHECK(parse_cpu_list("").empty());
  CHECK(format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8");
  CHECK(format_cpu_list(parse_cpu_list("0-55,112-167")) == "0-55,112-167");
  for (const char* bad : {"a-b", "3-1", "1,,2", "-4"}) {
    INFO(bad);
    CHECK_THROWS_WITH(parse_cpu_list(bad), Catch::Contains(bad) && Catch::Contains("not a cpu list"));
  }
}

TEST_CASE("a PCI device's near cores come from sysfs, whose files report a page whatever they hold", "[host][cores]") {
  // Every PCI device of this machine with a local_cpulist: sysfs says 4096 bytes and holds a few
  // (a GPU machine's offloaded ranks failed on exactly this read).
  int read = 0;
  for (const std::string& name : dsrun::list_directory("/sys/bus/pci/devices")) {
    if (!dsrun::file_exists("/sys/bus/pci/devices/" + name + "/local_cpulist")) continue;
    std::vector<int> cpus = dsrun::pci_local_cpus(name);
    INFO(name);
    CHECK_FALSE(cpus.empty());
    CHECK(std::is_sorted(cpus.begin(), cpus.end()));
    ++read;
  }
  if (read == 0) WARN("no PCI device with local_cpulist on this machine: nothing to read");
  CHECK(dsrun::pci_local_cpus("").empty());
  CHECK(dsrun::pci_local_cpus("0000:ff:ff.7-none").empty());
}

TEST_CASE("each GPU rank's host step takes its slice of the usable cores near its GPU", "[host][cores]") {
  // Two sockets of 8 cores, 8 GPUs: GPUs 0-3 near socket 0, 4-7 near socket 1.
  const std::vector<int> usable = parse_cpu_list("0-15");
  const auto socket0 = parse_cpu_list("0-7"), socket1 = parse_cpu_list("8-15");
  CHECK(rank_host_cores(usable, socket0, 0, 8).cores == std::vector<int>{0, 1});
  CHECK(rank_host_cores(usable, socket0, 3, 8).cores == std::vector<int>{6, 7});
  CHECK(rank_host_cores(usable, socket1, 4, 8).cores == std::vector<int>{8, 9});
  CHECK(rank_host_cores(usable, socket1, 7, 8).cores == std::vector<int>{14, 15});
  CHECK(rank_host_cores(usable, socket1, 7, 8).why.find("near the GPU (8-15)") != std::string::npos);
  // One GPU: every usable core near it.
  CHECK(rank_host_cores(usable, socket1, 0, 1).cores == socket1);
  // Nothing known of the GPU's placement: the usable cores, split by rank (the old rule).
  const dsrun::RankCores unknown = rank_host_cores(usable, {}, 1, 2);
  CHECK(unknown.cores == parse_cpu_list("8-15"));
  CHECK(unknown.why.find("no NUMA placement") != std::string::npos);
  // A process confined to cores outside the GPU's node: those it has.
  CHECK(rank_host_cores(parse_cpu_list("8-9"), socket0, 0, 1).cores == std::vector<int>{8, 9});
  // More ranks than cores near them: they share.
  CHECK(rank_host_cores(parse_cpu_list("0-1"), parse_cpu_list("0-1"), 3, 4).cores == std::vector<int>{0, 1});
}

TEST_CASE("the host step's workers run only on the cores given, and anywhere without them", "[host][cores]") {
  const std::vector<int> usable = dsrun::usable_cpus();
  REQUIRE(!usable.empty());
  auto worker_affinities = [](dsrun::HostThreadPool& pool) {
    std::mutex m;
    std::set<std::vector<int>> seen;
    const auto caller = std::this_thread::get_id();
    // The caller dawdles over the tasks it takes, so that the workers take some however busy the machine.
    pool.run(64, [&](int64_t) {
      if (std::this_thread::get_id() == caller) {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        return;
      }
      cpu_set_t set;
      CPU_ZERO(&set);
      pthread_getaffinity_np(pthread_self(), sizeof set, &set);
      std::vector<int> cpus;
      for (int c = 0; c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &set)) cpus.push_back(c);
      std::lock_guard<std::mutex> lock(m);
      seen.insert(cpus);
    });
    return seen;
  };
  dsrun::HostThreadPool pinned(3, {usable.front()});
  const auto pinned_seen = worker_affinities(pinned);
  REQUIRE(!pinned_seen.empty());
  CHECK(pinned_seen == std::set<std::vector<int>>{{usable.front()}});
  dsrun::HostThreadPool anywhere(3);
  for (const auto& cpus : worker_affinities(anywhere)) CHECK(cpus == usable);
}

TEST_CASE("an offloaded rank's host step keeps its share's first core for the GPU's launches, unless DSRUN_HOST_STEP_THREADS says", "[host][cores]") {
  ::unsetenv("DSRUN_HOST_STEP_THREADS");
  dsrun::RankCores share;
  share.cores = {4, 5, 6, 7, 8, 9, 10, 11};
  dsrun::HostStepThreads t = dsrun::host_step_threads(share);
  CHECK(t.threads == 7);
  CHECK(t.cores == std::vector<int>{5, 6, 7, 8, 9, 10, 11});
  share.cores = {3};  // one core: the step shares it
  t = dsrun::host_step_threads(share);
  CHECK(t.threads == 1);
  CHECK(t.cores.empty());
  share.cores = {4, 5, 6, 7, 8, 9, 10, 11};
  ::setenv("DSRUN_HOST_STEP_THREADS", "5", 1);
  t = dsrun::host_step_threads(share);
  ::unsetenv("DSRUN_HOST_STEP_THREADS");
  CHECK(t.threads == 5);
  CHECK(t.cores == std::vector<int>{7, 8, 9, 10, 11});
  CHECK(t.why.find("DSRUN_HOST_STEP_THREADS=5") != std::string::npos);
}

