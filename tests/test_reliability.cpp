// What an adversarial user tries against whole runs: data paths that are not what they claim (a
// device, a FIFO, links, empty files), launcher failures (the run must end `failed`, never stay
// `running`), sweeps whose trials cannot run on their share of the machine, and non-finite metrics
// from hooks. Each run here fails within seconds; none may hang or die by a signal.
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "storage/store.hpp"
#include "test_util.hpp"
#include "train_util.hpp"

#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <csignal>
#include <unistd.h>

using dsrun::test::contains;
using dsrun::test::Run;
using dsrun::test::TempDir;
using dsrun::test::train;

namespace {

dsrun::RunStatus status_of(const TempDir& dir, const std::string& id) {
  dsrun::Store store(dir.file("runs.db"));
  return store.get_run(id).status;
}

// A decoder run on byte-level text at `path`, one step.
Run train_on_text(const TempDir& dir, const std::string& path) {
  return train(dir, "--set run.steps=1 --set schedule.warmup_steps=0 --set data.kind=\\\"text\\\" --set data.path=\\\"" + path + "\\\"");
}

}  // namespace

TEST_CASE("data paths must be regular files: devices, FIFOs, links and empty files are errors naming the file", "[reliability][data]") {
  TempDir dir;
  const std::string fifo = dir.file("fifo");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  REQUIRE(::symlink("/dev/zero", dir.file("zero-link").c_str()) == 0);
  dir.write("text.txt", "some text that is long enough to be a training set, repeated. " + std::string(4000, 'x'));
  REQUIRE(::symlink(dir.file("text.txt").c_str(), dir.file("link1").c_str()) == 0);
  REQUIRE(::symlink(dir.file("link1").c_str(), dir.file("link2").c_str()) == 0);
  REQUIRE(::symlink(dir.file("missing").c_str(), dir.file("dangling").c_str()) == 0);
  dir.write("empty.txt", "");

  const std::vector<std::pair<std::string, std::string>> cases = {
      {"/dev/zero", "is a character device, not a regular file"},
      {dir.file("zero-link"), "is a symbolic link to /dev/zero, which is a character device"},
      {fifo, "is a FIFO (named pipe), not a regular file"},
      {dir.file("link2"), "is a symbolic link to " + dir.file("link1") + ", which is a symbolic link"},
      {dir.file("empty.txt"), "has 0 tokens"},
  };
  // A path that leads nowhere is refused before a run is recorded (the ranks found it missing before).
  Run dangling = train_on_text(dir, dir.file("dangling"));
  INFO(dangling.text);
  CHECK(dangling.code == 1);
  CHECK(contains(dangling.text, "data.path: \"" + dir.file("dangling") + "\" does not exist on this machine: nothing trained"));
  CHECK(dangling.id.empty());
  for (const auto& [path, expected] : cases) {
    Run run = train_on_text(dir, path);
    INFO(path << "\n" << run.text);
    CHECK(run.code == 1);  // an error, not a signal
    CHECK(contains(run.text, expected));
    CHECK(contains(run.text, "data.path"));
    CHECK(run.seconds < 60);
    REQUIRE(run.id.size() == 8);
    CHECK(status_of(dir, run.id) == dsrun::RunStatus::Failed);
  }
  // One link to a regular file is followed.
  Run linked = train_on_text(dir, dir.file("link1"));
  INFO(linked.text);
  CHECK(linked.code == 0);
}

TEST_CASE("empty or truncated CIFAR-10 batches are errors naming the file, never SIGFPE", "[reliability][data]") {
  TempDir dir;
  dsrun::make_directories(dir.file("cifar"));
  const char* names[] = {"data_batch_1.bin", "data_batch_2.bin", "data_batch_3.bin", "data_batch_4.bin", "data_batch_5.bin", "test_batch.bin"};
  for (const char* n : names) dir.write("cifar/" + std::string(n), "");
  const std::string recipe = dir.write("resnet.toml", "base = [\"hardware/cpu\", \"models/resnet50-cifar10\"]\n"
                                                       "[run]\nsteps = 1\n[model.resnet]\ndepth = 18\nwidth = 8\n"
                                                       "[batch]\nglobal = 2\nmicro = 2\n[parallel]\ndata_parallel = 1\n"
                                                       "[precision]\ndtype = \"fp32\"\n[schedule]\nwarmup_steps = 0\n"
                                                       "[data]\nkind = \"cifar10\"\npath = \"" + dir.file("cifar") + "\"\n[logging]\nprogress = false\n");
  Run empty = train(dir, "", "", recipe);
  INFO(empty.text);
  CHECK(empty.code == 1);
  CHECK(contains(empty.text, "data_batch_1.bin"));
  CHECK(contains(empty.text, "is empty"));
  dir.write("cifar/data_batch_1.bin", std::string(3073 + 5, '\1'));
  Run truncated = train(dir, "", "", recipe);
  INFO(truncated.text);
  CHECK(truncated.code == 1);
  CHECK(contains(truncated.text, "not a multiple of 3073"));
}

TEST_CASE("a run whose launcher fails before or after its ranks ends failed with the reason", "[reliability][launcher]") {
  TempDir dir;
  dir.write("not-a-directory", "x");
  // A checkpoint directory that cannot be created is refused with the recipe, before a run is
  // recorded (a launcher that fails before its ranks is the host-memory case below).
  Run no_dir = train(dir, "--set run.steps=3 --set checkpoint.dir=\\\"" + dir.file("not-a-directory/checkpoints") + "\\\"");
  INFO(no_dir.text);
  CHECK(no_dir.code == 1);
  CHECK(contains(no_dir.text, "checkpoint.dir"));
  CHECK(contains(no_dir.text, "is not a directory"));
  dsrun::Store store(dir.file("runs.db"));
  CHECK(store.list_runs({}).empty());
  // The ranks start and fail (bad data): failed, with the rank's reason.
  Run bad_data = train_on_text(dir, "/dev/zero");
  CHECK(status_of(dir, bad_data.id) == dsrun::RunStatus::Failed);
  CHECK(contains(store.get_run(bad_data.id).error, "/dev/zero"));
}

TEST_CASE("a sweep whose trials cannot run on their share fails before anything runs, with the fix", "[reliability][sweep]") {
  TempDir dir;
  const std::string recipe = dir.write("sweep.toml", "base = \"" + dsrun::test::source_dir() + "/tests/recipes/tiny_train.toml\"\n"
                                                     "[run]\nsteps = 3\n[hardware]\ndevices_per_node = \"auto\"\n[parallel]\ndata_parallel = 2\n"
                                                     "[sweep]\nmethod = \"grid\"\nconcurrency = 2\n[sweep.objective]\nmetric = \"loss\"\n"
                                                     "[sweep.parameters.\"optimizer.lr\"]\nvalues = [1e-3, 2e-3]\n");
  // Two cores for two trials: one core, so one rank, each.
  auto out = dsrun::test::run_command("cd '" + dsrun::test::source_dir() + "' && taskset -c 0,1 '" DSRUN_BINARY "' sweep '" + recipe + "' --db '" + dir.file("runs.db") + "'");
  INFO(out.text);
  CHECK(out.code == 1);
  CHECK(contains(out.text, "2 concurrent trials get 1 core(s) each (of 2)"));
  CHECK(contains(out.text, "sweep.concurrency = 1"));
  CHECK(contains(out.text, "parallel.data_parallel = \"auto\""));
  CHECK_FALSE(contains(out.text, "trial 1/"));  // nothing started
  if (dsrun::file_exists(dir.file("runs.db"))) CHECK(dsrun::Store(dir.file("runs.db")).list_runs({}).empty());
}

TEST_CASE("non-finite metrics from a hook are recorded as events, not dropped", "[reliability][hooks]") {
  TempDir dir;
  const std::string script = dir.write("m.lua", "function metrics(ctx) return {nan_metric = 0/0, inf_metric = 1/0, fine = 1} end\n");
  Run run = train(dir, "--set run.steps=3 --set hooks.script=\\\"" + script + "\\\"");
  INFO(run.text);
  REQUIRE(run.code == 0);
  dsrun::Store store(dir.file("runs.db"));
  int nan_events = 0, inf_events = 0;
  for (const auto& e : store.events(run.id)) {
    nan_events += e.kind == "metric" && contains(e.message, "nan_metric is not a finite number");
    inf_events += e.kind == "metric" && contains(e.message, "inf_metric is not a finite number");
  }
  CHECK(nan_events == 3);
  CHECK(inf_events == 3);
  CHECK(store.metric_history(run.id, "fine").size() == 3);
}

TEST_CASE("a run needing more host memory than the node has free fails before its ranks start, naming the key and the bytes", "[reliability][launcher]") {
  TempDir dir;
  // A 19 B-parameter decoder on hardware declared large enough: the plan fits, this machine does not.
  // No checkpoints: their 233 GB would not fit this disk, which the plan refuses first.
  Run run = train(dir, "--set run.steps=3 --set checkpoint.at_end=false --set hardware.memory_gib=100000 --set hardware.host_memory_gib=100000 --set model.hidden=8192 "
                       "--set model.layers=24 --set model.heads=64 --set model.kv_heads=64 --set model.intermediate=22016");
  INFO(run.text);
  CHECK(run.code == 1);
  CHECK(contains(run.text, "hardware.host_memory_gib: the plan needs"));
  CHECK(contains(run.text, "is available now (MemAvailable)"));
  CHECK(run.seconds < 30);
  REQUIRE(run.id.size() == 8);
  CHECK(status_of(dir, run.id) == dsrun::RunStatus::Failed);
}

TEST_CASE("SIGUSR1 before the ranks are ready waits for them, then saves: no rank dies of it", "[reliability][launcher]") {
  TempDir dir;
  const std::string cmd = "cd '" + dsrun::test::source_dir() + "' && ('" DSRUN_BINARY "' run tests/recipes/tiny_train.toml --db '" + dir.file("runs.db") +
                          "' --set run.steps=400 --set checkpoint.at_end=false > '" + dir.file("out.txt") + "' 2>&1; echo $? > '" + dir.file("code") + "') > /dev/null 2>&1 &";
  dsrun::test::run_command(cmd);
  // The moment the ranks are started (the launch event), before they report ready: SIGUSR1 to
  // the launcher (the process the run records).
  int64_t launcher = 0;
  for (int i = 0; i < 600 && launcher == 0; ++i) {
    if (dsrun::file_exists(dir.file("runs.db"))) {
      dsrun::Store store(dir.file("runs.db"));
      for (const auto& r : store.list_runs({}))
        for (const auto& e : store.events(r.id))
          if (e.kind == "launch") launcher = store.get_run(r.id).pid;
    }
    if (launcher == 0) ::usleep(10000);
  }
  REQUIRE(launcher > 0);
  CHECK(::kill(static_cast<pid_t>(launcher), SIGUSR1) == 0);
  dsrun::test::run_command("while [ ! -f '" + dir.file("code") + "' ]; do sleep 0.1; done");
  INFO(dsrun::read_file(dir.file("out.txt")));
  CHECK(dsrun::trim(dsrun::read_file(dir.file("code"))) == "0");
  dsrun::Store store(dir.file("runs.db"));
  const auto runs = store.list_runs({});
  REQUIRE(runs.size() == 1);
  CHECK(runs[0].status == dsrun::RunStatus::Finished);
  int requested = 0;
  for (const auto& e : store.events(runs[0].id)) requested += contains(e.message, "checkpoint requested (SIGUSR1)");
  CHECK(requested == 1);
  CHECK(store.checkpoints(runs[0].id).size() == 1);
}

