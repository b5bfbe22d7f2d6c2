#include "runner/probe.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/host_cores.hpp"
#include "engine/common/host.hpp"
#include "engine/common/text.hpp"
#include "engine/plan/plan.hpp"
#include "engine/probe/host_probe.hpp"
#include "runner/launcher.hpp"
#include "storage/store.hpp"

#include <nlohmann/json.hpp>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstring>
#include <ctime>
#include <iostream>
#include <map>
#include <set>
#include <sstream>

namespace dsrun {
namespace {

// "8x H100 80GB SXM" -> "8x-h100-80gb-sxm"
std::string slug(const std::string& name) {
  std::string out;
  for (char ch : name) {
    if (std::isalnum(static_cast<unsigned char>(ch))) out += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    else if (!out.empty() && out.back() != '-') out += '-';
  }
  while (!out.empty() && out.back() == '-') out.pop_back();
  return out.empty() ? "machine" : out;
}

// A directory made for this probe and removed with everything in it when the probe ends.
class ScratchDirectory {
 public:
  ScratchDirectory() {
    char pattern[] = "/tmp/dsrun-probe-XXXXXX";
    if (!::mkdtemp(pattern)) fail_at(__FILE__, __LINE__, std::string("cannot create a directory under /tmp: ") + std::strerror(errno));
    path_ = pattern;
  }
  ~ScratchDirectory() {
    if (!std::getenv("DSRUN_PROBE_KEEP")) remove_tree(path_);  // kept for a look at the ranks' logs
  }
  ScratchDirectory(const ScratchDirectory&) = delete;
  ScratchDirectory& operator=(const ScratchDirectory&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The template must be writable before minutes are spent measuring.
void check_writable_output(const std::string& path) {
  const std::string dir = parent_directory(path).empty() ? "." : parent_directory(path);
  if (!is_directory(dir) || ::access(dir.c_str(), W_OK) != 0) {
    ErrorContext c;
    c.file = path;
    c.system_errno = is_directory(dir) ? EACCES : ENOENT;
    c.hint = "pass -o with a file in a directory you can write, or --print for standard output";
    throw Error("dsrun probe: cannot write the template " + path + ": " + (is_directory(dir) ? "the directory " + dir + " is not writable" : "no directory " + dir), c);
  }
}

// The directory whose disk is measured: --disk, else checkpoint.dir, else the run store's.
std::string disk_directory(const ProbeArgs& args, const Recipe& r) {
  if (!args.disk.empty()) return args.disk;
  if (!r.checkpoint.dir.empty()) return r.checkpoint.dir;
  const std::string runs = runs_directory(default_store_path());
  make_directories(runs);
  return runs;
}

// dsrun-rank --probe on `world` local ranks; rank 0's figures. A rank that fails is an error
// carrying the tail of its log.
std::vector<ProbeFigure> probe_devices(const LoadedRecipe& loaded, const Plan& plan, int world, bool quick, const ScratchDirectory& scratch) {
  const std::string config = path_join(scratch.path(), "config.toml"), out = path_join(scratch.path(), "figures.json");
  write_file_atomic(config, rank_config_toml(loaded, plan));
  const std::string rank_binary = path_join(executable_directory(), "dsrun-rank");
  const int port = free_port();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    const std::string log = path_join(scratch.path(), "rank-" + std::to_string(rank) + ".log");
    const pid_t pid = ::fork();
    if (pid < 0) fail_at(__FILE__, __LINE__, std::string("fork failed: ") + std::strerror(errno));
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
      set_rank_environment(RankPlace{rank, world, rank, world, "127.0.0.1", port});
      if (quick) execl(rank_binary.c_str(), rank_binary.c_str(), "--probe", config.c_str(), out.c_str(), "--quick", static_cast<char*>(nullptr));
      else execl(rank_binary.c_str(), rank_binary.c_str(), "--probe", config.c_str(), out.c_str(), static_cast<char*>(nullptr));
      std::fprintf(stderr, "cannot start %s: %s\n", rank_binary.c_str(), std::strerror(errno));
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  // The ranks meet in collectives and barriers: once one fails the others would wait there until
  // NCCL's timeout, so they are stopped, and the failure reported is the ranks' own.
  std::string failures;
  std::vector<bool> running(static_cast<size_t>(world), true);
  for (int left = world; left > 0;) {
    bool reaped = false;
    for (int rank = 0; rank < world; ++rank) {
      if (!running[static_cast<size_t>(rank)]) continue;
      int status = 0;
      const pid_t done = ::waitpid(pids[static_cast<size_t>(rank)], &status, WNOHANG);
      if (done == 0 || (done < 0 && errno == EINTR)) continue;
      if (done < 0) fail_at(__FILE__, __LINE__, std::string("waitpid: ") + std::strerror(errno));
      running[static_cast<size_t>(rank)] = false;
      --left;
      reaped = true;
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) continue;
      if (!failures.empty() && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) continue;  // stopped below
      failures += "\nrank " + std::to_string(rank) + " " + (WIFEXITED(status) ? "exited with " + std::to_string(WEXITSTATUS(status)) : "died of signal " + std::to_string(WTERMSIG(status))) +
                  ":\n" + tail_of_file(path_join(scratch.path(), "rank-" + std::to_string(rank) + ".log"), 15);
      for (int other = 0; other < world; ++other)
        if (running[static_cast<size_t>(other)]) ::kill(pids[static_cast<size_t>(other)], SIGKILL);
    }
    if (!reaped && left > 0) ::usleep(50 * 1000);
  }
  if (!failures.empty()) throw Error("dsrun probe: the device probe failed" + failures);
  std::vector<ProbeFigure> figures;
  const nlohmann::json measured = nlohmann::json::parse(read_file(out));  // named: a range over a temporary's member dangles
  for (const auto& f : measured.at("figures"))
    figures.push_back({f.at("key").get<std::string>(), f.at("value").get<double>(), f.at("how").get<std::string>(), f.value("ranks", 0)});
  return figures;
}

std::string three_figures(double v) {
  std::ostringstream s;
  s.precision(v >= 100 ? 0 : v >= 10 ? 1 : v >= 1 ? 2 : 3);
  s << std::fixed << v;
  return s.str();
}

std::string today() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&t));
  return buf;
}

std::string cpu_model() {
  for (const auto& line : split(file_exists("/proc/cpuinfo") ? read_file("/proc/cpuinfo") : "", '\n'))
    if (starts_with(line, "model name")) return trim(line.substr(line.find(':') + 1));
  return "unknown CPU";
}

// The template: the recipe's hardware table with the measured keys replaced, each saying how it
// was measured, and what was measured without a key as comments below.
std::string template_text(const LoadedRecipe& loaded, const std::string& name, const ProbeArgs& args, const HostFacts& host, const std::vector<ProbeFigure>& figures) {
  std::map<std::string, const ProbeFigure*> keyed;
  // List keys (hardware.*_gbs): one entry per group size, in the order of hardware.collective_ranks.
  std::map<std::string, std::map<int, const ProbeFigure*>> listed;
  std::set<int> group_sizes;
  for (const auto& f : figures) {
    if (f.key.empty()) continue;
    if (f.ranks > 0) {
      listed[f.key][f.ranks] = &f;
      group_sizes.insert(f.ranks);
    } else {
      keyed[f.key] = &f;
    }
  }
  auto toml_list = [](const std::vector<std::string>& items) { return "[" + join(items, ", ") + "]"; };
  std::string t = "# Probed by `dsrun probe " + args.recipe.path + (args.quick ? " --quick" : "") + "` on " + host.hostname + " (" + cpu_model() + ", " +
                  std::to_string(host.cpu_cores) + " cores, " + format_bytes(host.memory_bytes) + ") on " + today() + ".\n";
  t += "# Keys marked \"probed\" were measured there; the others are the recipe's hardware table as resolved.\n";
  t += "[hardware]\n";
  for (const auto& [key, setting] : loaded.config) {
    if (!starts_with(key, "hardware.")) continue;
    const std::string short_key = key.substr(9);
    if (key == "hardware.name") {
      t += "name = " + Value::of_string(name).toml() + "\n";
    } else if (key == "hardware.collective_ranks" && !group_sizes.empty()) {
      std::vector<std::string> items;
      for (int g : group_sizes) items.push_back(std::to_string(g));
      t += short_key + " = " + toml_list(items) + "  # probed: the group sizes of the lists below (every divisor of the node's ranks)\n";
    } else if (listed.count(key)) {
      std::vector<std::string> items;
      const ProbeFigure* any = nullptr;
      for (int g : group_sizes) {
        const auto at = listed[key].find(g);
        if (at == listed[key].end()) throw Error("dsrun probe: " + key + " was not measured over " + std::to_string(g) + " ranks");
        items.push_back(three_figures(at->second->value));
        any = at->second;
      }
      t += short_key + " = " + toml_list(items) + "  # probed: bus bandwidth, e.g. " + any->how + "\n";
    } else if (keyed.count(key)) {
      const ProbeFigure& f = *keyed[key];
      const bool count = key == "hardware.devices_per_node";
      const bool read = starts_with(f.how, "read: ");  // a fact read from the system rather than measured
      t += short_key + " = " + (count ? std::to_string(static_cast<int>(f.value)) : three_figures(f.value)) + "  # " +
           (read ? f.how : "probed: " + f.how) + "\n";
    } else {
      t += short_key + " = " + setting.value.toml() + "\n";
    }
  }
  t += "\n# Measured too, recorded here only:\n";
  for (const auto& f : figures)
    if (f.key.empty()) t += "#   " + three_figures(f.value) + " " + f.how + "\n";
  return t;
}

}  // namespace

int command_probe(const ProbeArgs& args) {
  const double start = steady_seconds();
  auto progress = [&](const std::string& line) { std::cerr << "probe [" << format_seconds(steady_seconds() - start) << "] " << line << std::endl; };
  HostFacts host = read_host_facts();
  LoadedRecipe loaded = load_or_report(args.recipe, host);
  const Recipe& r = loaded.recipe;
  const std::string name = args.name.empty() ? slug(r.hardware.name) + "-probed" : args.name;
  const std::string output = args.output.empty() ? path_join(templates_directory(), "hardware/" + slug(name) + ".toml") : args.output;
  if (!args.print) check_writable_output(output);
  const std::string disk = disk_directory(args, r);
  require_probe_directory(disk);
  Plan plan = make_plan(r, host);
  const bool gpu = r.hardware.device == Device::Cuda;
  if (gpu && host.cuda_devices == 0) {
    ErrorContext c;
    c.file = args.recipe.path;
    c.key = "hardware.device";
    c.hint = "probe a GPU machine with a GPU recipe, or this machine with a recipe whose hardware.device is \"cpu\"";
    throw Error("dsrun probe: the recipe is for GPUs but this machine has none", c);
  }
  // The node's devices: its GPUs (as many as the recipe puts on a node and the machine has), or
  // its CPU ranks (two at most in quick mode).
  const int world = gpu ? std::min(r.hardware.devices_per_node, host.cuda_devices) : (args.quick ? std::min(2, r.hardware.devices_per_node) : r.hardware.devices_per_node);

  HostProbeOptions o;
  o.threads = host.cpu_cores;
  // An offloaded GPU rank's host step, by the trainer's rule (host_step_threads; which cores are
  // near which GPU takes the GPU's PCI id, which dsrun has not).
  const HostStepThreads step = host_step_threads(rank_host_cores(usable_cpus(), {}, 0, world));
  o.rank_threads = gpu ? step.threads : std::max(1, host.cpu_cores / std::max(1, world));
  o.rank_threads_why = gpu ? "as an offloaded rank runs it: " + step.why : "the cores per CPU rank";
  o.offloading_ranks = gpu ? world : 0;
  // A working set like a model's (the 1B's host step moves 26 GB): a small one ran 15-20% faster.
  if (gpu && host.memory_bytes >= 64.0 * (1 << 30)) o.optimizer_elements = int64_t{256} << 20;
  o.dtype = r.precision.dtype;
  o.disk_directory = disk;
  if (args.quick) {
    o.optimizer_elements = int64_t{4} << 20;
    o.memory_bytes = int64_t{64} << 20;
    o.disk_bytes = int64_t{64} << 20;
    o.repeats = 1;
  }
  std::vector<ProbeFigure> figures = probe_host(o, progress);
  // What the machine is, read rather than measured: a template for it must not keep the recipe's.
  figures.push_back({"hardware.host_memory_gib", static_cast<double>(host.memory_bytes) / double(1 << 30), "read: this machine's memory (/proc/meminfo)"});
  if (gpu) figures.push_back({"hardware.devices_per_node", static_cast<double>(host.cuda_devices), "read: the GPUs this machine shows (/proc/driver/nvidia/gpus)"});
  ScratchDirectory scratch;
  progress(std::string(gpu ? "GPU" : "CPU") + " ranks: " + (world > 1 ? "collectives over " + std::to_string(world) + " ranks, then " : std::string()) +
           "the decoder's layers, attention" + (gpu ? ", host-GPU copies" : "") + " on every rank at once");
  for (auto& f : probe_devices(loaded, plan, world, args.quick, scratch)) figures.push_back(f);
  for (auto& f : figures) {
    if (!(f.value > 0) || !std::isfinite(f.value)) throw Error("dsrun probe: a measurement came out as " + std::to_string(f.value) + ": " + f.how);
    // An efficiency above 1 means the recipe's peak is below what the device does: keep the
    // template valid (the keys range to 1) and say so.
    if (ends_with(f.key, "_efficiency") && f.value > 1) {
      f.how += "; measured " + three_figures(f.value) + " of the recipe's peak, above 1: check hardware.peak_tflops_*";
      f.value = 1;
    }
  }

  const std::string text = template_text(loaded, name, args, host, figures);
  if (args.print) {
    std::cout << text;
  } else {
    write_file_atomic(output, text);
    std::cout << "wrote " << output << " (" << figures.size() << " figures in " << format_seconds(steady_seconds() - start) << ")\n";
    if (starts_with(output, templates_directory() + "/hardware/")) std::cout << "use it: base = [\"hardware/" << file_stem(output) << "\", ...] in a recipe\n";
  }
  return 0;
}

}  // namespace dsrun
