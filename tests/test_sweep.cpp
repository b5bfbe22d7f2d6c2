// Sweeps: the [sweep] section and its errors, grid and seeded random trials, distributions, paired
// values, TPE against random search, pruning decisions on synthetic curves, the store under 8
// concurrent writers, and real sweeps on CPU ranks (grid, infeasible trials, pruning, target,
// resume after the sweep process is killed, history --sweep, leaderboard exports).
#include "engine/sweep/sweep.hpp"
#include "storage/store.hpp"
#include "store_backends.hpp"
#include "test_util.hpp"
#include "train_util.hpp"

#include <catch2/catch.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <set>

using dsrun::test::contains;
using dsrun::test::dsrun_command;
using dsrun::test::error_of;
using dsrun::test::TempDir;

namespace {

std::string sweep_file(const TempDir& dir, const std::string& sweep, const std::string& recipe_extra = "") {
  return dir.write("sweep.toml", "base = \"" + dsrun::test::source_dir() + "/tests/recipes/tiny_train.toml\"\n" + recipe_extra + "\n" + sweep);
}

// The sweep id a `dsrun sweep` printed ("sweep sXXXXXXX ...").
std::string sweep_id_of(const std::string& text) {
  size_t at = text.find("sweep s");
  return at == std::string::npos ? "" : text.substr(at + 6, 8);
}

const char* kTinyTrials = "[run]\nsteps = 4\n[checkpoint]\nat_end = false\n[parallel]\ndata_parallel = 1\n";

}  // namespace

TEST_CASE("a grid enumerates every combination once, ranges gridded linearly or log-spaced", "[sweep]") {
  TempDir dir;
  dsrun::SweepSpec s = dsrun::load_sweep_spec(sweep_file(dir, R"(
[sweep]
method = "grid"
[sweep.parameters."optimizer.lr"]
min = 1e-4
max = 1e-2
distribution = "log_uniform"
grid_points = 3
[sweep.parameters."schedule.name"]
values = ["cosine", "linear"]
)"));
  REQUIRE(dsrun::grid_size(s) == 6);
  std::set<std::string> seen;
  for (int64_t i = 0; i < 6; ++i) seen.insert(dsrun::describe_params(dsrun::grid_trial(s, i)));
  CHECK(seen.size() == 6);
  CHECK(dsrun::grid_trial(s, 0)["schedule.name"] == "cosine");
  CHECK(dsrun::grid_trial(s, 1)["schedule.name"] == "linear");  // the last parameter varies fastest
  CHECK(dsrun::grid_trial(s, 2)["optimizer.lr"].get<double>() == Approx(1e-3));  // log-spaced middle point
  CHECK(dsrun::grid_trial(s, 5)["optimizer.lr"].get<double>() == Approx(1e-2));
  CHECK(dsrun::trial_budget(s) == 6);
  CHECK(dsrun::trial_overrides(dsrun::grid_trial(s, 1)) == std::vector<std::string>{"optimizer.lr=0.0001", "schedule.name=\"linear\""});
}

TEST_CASE("random trials are reproducible from the seed and follow their distributions", "[sweep]") {
  TempDir dir;
  std::string path = sweep_file(dir, R"(
[sweep]
method = "random"
seed = 7
trials = 2000
[sweep.parameters."optimizer.lr"]
min = 1e-4
max = 1e-2
distribution = "log_uniform"
[sweep.parameters."batch.micro"]
min = 1
max = 4
distribution = "int_uniform"
[sweep.parameters."optimizer.weight_decay"]
min = 0.0
max = 0.2
[[sweep.paired]]
keys = ["model.heads", "model.kv_heads"]
values = [[4, 4], [4, 2], [4, 1]]
)");
  dsrun::SweepSpec s = dsrun::load_sweep_spec(path);
  CHECK(dsrun::random_trial(s, 3) == dsrun::random_trial(s, 3));
  dsrun::SweepSpec other = s;
  other.seed = 8;
  CHECK(dsrun::random_trial(other, 3) != dsrun::random_trial(s, 3));
  std::vector<double> lrs;
  std::set<int64_t> micros;
  double wd_sum = 0;
  std::set<std::pair<int64_t, int64_t>> pairs;
  for (int64_t i = 0; i < 2000; ++i) {
    dsrun::TrialParams t = dsrun::random_trial(s, i);
    const double lr = t["optimizer.lr"].get<double>();
    REQUIRE((lr >= 1e-4 && lr <= 1e-2));
    lrs.push_back(lr);
    micros.insert(t["batch.micro"].get<int64_t>());
    wd_sum += t["optimizer.weight_decay"].get<double>();
    pairs.insert({t["model.heads"].get<int64_t>(), t["model.kv_heads"].get<int64_t>()});
  }
  std::sort(lrs.begin(), lrs.end());
  CHECK(lrs[1000] == Approx(1e-3).epsilon(0.1));  // log-uniform: the median is the geometric mean
  CHECK(micros == std::set<int64_t>{1, 2, 3, 4});
  CHECK(wd_sum / 2000 == Approx(0.1).epsilon(0.05));
  CHECK(pairs == std::set<std::pair<int64_t, int64_t>>{{4, 4}, {4, 2}, {4, 1}});  // paired values vary together
}

TEST_CASE("sweep sections with mistakes are errors naming file, line and key", "[sweep]") {
  TempDir dir;
  auto err = [&](const std::string& sweep) { return error_of([&] { dsrun::load_sweep_spec(sweep_file(dir, sweep)); }); };
  std::string e = err("[sweep]\nmethod = \"grid\"\n[sweep.parameters]\n\"optimizer.lrr\" = [1, 2]\n");
  CHECK(contains(e, "sweep.toml:6:"));
  CHECK(contains(e, "is not a recipe key"));
  CHECK(contains(e, "did you mean optimizer.lr?"));
  CHECK(contains(err("[sweep]\nmethd = \"grid\"\n"), "did you mean sweep.method?"));
  CHECK(contains(err("[sweep]\nmethod = \"grid\"\n[sweep.parameters.\"optimizer.lr\"]\nmin = 0.1\nmax = 1.0\n"), "a grid over a range needs grid_points"));
  CHECK(contains(err("[sweep]\nmethod = \"random\"\n[sweep.parameters]\n\"optimizer.lr\" = [1e-3]\n"), "need a number of trials"));
  CHECK(contains(err("[sweep]\nmethod = \"random\"\ntrials = 3\n[sweep.parameters.\"optimizer.lr\"]\nmin = 0\nmax = 1\ndistribution = \"log_uniform\"\n"), "log_uniform needs min > 0"));
  CHECK(contains(err("[sweep]\n[sweep.objective]\ngoal = \"minimise\"\n[sweep.parameters]\n\"optimizer.lr\" = [1e-3]\n"), "did you mean \"minimize\"?"));
  CHECK(contains(err("[run]\nsteps = 3\n"), "no [sweep] section"));
}

TEST_CASE("TPE finds better parameters than random search on a synthetic objective", "[sweep][tpe]") {
  // f = (log10 lr + 2.5)² + 4 (wd - 0.3)² + 0.5 unless cosine: 30 trials, 20 seeds, same budget.
  int tpe_wins = 0;
  double tpe_mean = 0, random_mean = 0;
  for (uint64_t seed = 0; seed < 20; ++seed) {
    dsrun::SweepSpec s;
    s.method = dsrun::SweepMethod::Tpe;
    s.seed = seed;
    s.max_trials = 30;
    dsrun::SweepParameter lr{{"optimizer.lr"}, dsrun::Distribution::LogUniform, {}, 1e-5, 1, 0};
    dsrun::SweepParameter wd{{"optimizer.weight_decay"}, dsrun::Distribution::Uniform, {}, 0, 1, 0};
    dsrun::SweepParameter schedule{{"schedule.name"}, dsrun::Distribution::Values, {"cosine", "linear", "constant"}, 0, 0, 0};
    s.parameters = {lr, wd, schedule};
    auto f = [](const dsrun::TrialParams& p) {
      const double x = std::log10(p.at("optimizer.lr").get<double>()) + 2.5, y = p.at("optimizer.weight_decay").get<double>() - 0.3;
      return x * x + 4 * y * y + (p.at("schedule.name") == "cosine" ? 0.0 : 0.5);
    };
    std::vector<dsrun::TrialOutcome> history;
    double best_tpe = 1e9, best_random = 1e9;
    for (int64_t i = 0; i < 30; ++i) {
      dsrun::TrialParams t = dsrun::tpe_trial(s, i, history);
      history.push_back({t, f(t)});
      best_tpe = std::min(best_tpe, f(t));
      best_random = std::min(best_random, f(dsrun::random_trial(s, i)));
    }
    tpe_wins += best_tpe < best_random;
    tpe_mean += best_tpe / 20;
    random_mean += best_random / 20;
  }
  INFO("TPE won on " << tpe_wins << " of 20 seeds; mean best " << tpe_mean << " vs random " << random_mean);
  CHECK(tpe_wins >= 13);  // measured: 14 of 20, mean 0.169 vs 0.229
  CHECK(tpe_mean < random_mean * 0.85);
}

TEST_CASE("median stopping and ASHA prune poor curves and spare good ones", "[sweep][pruning]") {
  auto curve = [](double start, double slope, int steps) {
    dsrun::Curve c;
    for (int s = 1; s <= steps; ++s) c.push_back({s, start - slope * s});
    return c;
  };
  std::vector<dsrun::Curve> others = {curve(5, 0.1, 10), curve(5, 0.12, 10), curve(5, 0.08, 10)};
  dsrun::PruningSpec median{dsrun::PruneMethod::Median, 3, 3, 3};
  auto bad = dsrun::prune_reason(median, false, curve(5, 0.01, 4), others);
  REQUIRE(bad.has_value());
  CHECK(contains(*bad, "median stopping"));
  CHECK_FALSE(dsrun::prune_reason(median, false, curve(5, 0.2, 4), others).has_value());  // better than the median
  CHECK_FALSE(dsrun::prune_reason(median, false, curve(5, 0.01, 2), others).has_value());  // inside the grace period
  median.min_trials = 4;
  CHECK_FALSE(dsrun::prune_reason(median, false, curve(5, 0.01, 4), others).has_value());  // too few trials to compare
  CHECK(dsrun::prune_reason(median, true, curve(5, -0.3, 4), others) == std::nullopt);  // maximize: rising is good

  dsrun::PruningSpec asha{dsrun::PruneMethod::Asha, 2, 2, 1};
  auto rung = dsrun::prune_reason(asha, false, curve(5, 0.05, 4), others);
  REQUIRE(rung.has_value());
  CHECK(contains(*rung, "ASHA: at rung step 2"));
  CHECK_FALSE(dsrun::prune_reason(asha, false, curve(5, 0.3, 4), others).has_value());  // best at every rung
  CHECK_FALSE(dsrun::prune_reason(asha, false, curve(5, 0.05, 4), {}).has_value());     // alone at its rung: nothing to rank
}

TEST_CASE("8 processes writing the store at once and a reader: no failures, no lost or duplicated rows, on both backends", "[sweep][store]") {
  TempDir dir;
  for (const auto& backend : dsrun::test::store_backends(dir)) {
  INFO(backend.name);
  const std::string db = backend.location;
  { dsrun::Store init(db); }
  std::vector<pid_t> children;
  for (int w = 0; w < 9; ++w) {
    pid_t pid = ::fork();
    if (pid == 0) {
      int code = 0;
      try {
        dsrun::Store store(db);
        if (w == 8) {  // the reader, as `dsrun history` would
          for (int i = 0; i < 200; ++i)
            for (const auto& r : store.list_runs({})) store.latest_metrics(r.id);
        } else {
          dsrun::NewRun run;
          run.name = "writer" + std::to_string(w);
          run.recipe_text = run.config_toml = "x";
          run.sweep_id = "s0000000";
          run.trial_index = w;
          const std::string id = store.create_run(run);
          store.set_status(id, dsrun::RunStatus::Running);
          for (int step = 1; step <= 100; ++step) {
            store.add_metrics(id, step, {{"loss", 1.0 / step}, {"lr", 0.1}});
            if (step % 25 == 0) store.add_event(id, "note", 0, "step " + std::to_string(step));
          }
          store.set_status(id, dsrun::RunStatus::Finished);
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "writer %d: %s\n", w, e.what());
        code = 1;
      }
      _exit(code);
    }
    children.push_back(pid);
  }
  int failures = 0;
  for (pid_t pid : children) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    failures += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  CHECK(failures == 0);
  dsrun::Store store(db);
  auto runs = store.list_runs({});
  REQUIRE(runs.size() == 8);
  std::set<int64_t> trials;
  for (const auto& r : runs) {
    CHECK(r.status == dsrun::RunStatus::Finished);
    CHECK(store.metric_history(r.id, "loss").size() == 100);
    CHECK(store.events(r.id).size() == 4);
    trials.insert(r.trial_index);
  }
  CHECK(trials.size() == 8);
  // Counted by the database itself: every row written once.
  CHECK(store.database().query("SELECT count(*) FROM metrics", {}).at(0).integer(0) == 8 * 200);
  CHECK(store.database().query("SELECT count(*) FROM metrics_latest", {}).at(0).integer(0) == 8 * 2);
  CHECK(store.database().query("SELECT count(*) FROM events", {}).at(0).integer(0) == 8 * 4);
  }
}

TEST_CASE("a real grid sweep over the learning rate: trials, leaderboard, history --sweep, exports", "[sweep][run]") {
  TempDir dir;
  std::string path = sweep_file(dir, "[sweep]\nmethod = \"grid\"\nconcurrency = 2\n[sweep.objective]\nmetric = \"loss\"\n"
                                     "[sweep.parameters]\n\"optimizer.lr\" = [1e-3, 3e-3, 1e-2]\n", kTinyTrials);
  auto out = dsrun_command(dir, "sweep '" + path + "'");
  INFO(out.text);
  REQUIRE(out.code == 0);
  const std::string id = sweep_id_of(out.text);
  CHECK(contains(out.text, "3 trial(s), grid, minimize loss"));
  CHECK(contains(out.text, "best run: "));
  dsrun::Store store(dir.file("runs.db"));
  auto trials = store.sweep_trials(id);
  REQUIRE(trials.size() == 3);
  for (const auto& t : trials) CHECK(t.status == dsrun::RunStatus::Finished);
  CHECK(nlohmann::json::parse(trials[2].trial_params) == nlohmann::json::parse(R"({"optimizer.lr": 0.01})"));
  CHECK(contains(trials[1].config_toml, "lr = 0.003"));
  CHECK(store.get_sweep(id).best_run == nlohmann::json::parse(dsrun_command(dir, "sweep --show " + id + " --json").text)["trials"][0]["run"]);

  auto history = dsrun_command(dir, "history --sweep " + id + " --csv");
  INFO(history.text);
  CHECK(history.code == 0);
  CHECK(std::count(history.text.begin(), history.text.end(), '\n') == 4);  // header + 3 trials
  CHECK(contains(history.text, "\"{\"\"optimizer.lr\"\":0.01}\""));       // JSON inside CSV, quoted
  auto csv = dsrun_command(dir, "sweep --show " + id + " --csv");
  CHECK(contains(csv.text, "rank,trial,run,status,loss,optimizer.lr,seconds,error"));
}

TEST_CASE("trials whose plan does not fit are recorded infeasible without launching, failures do not stop the sweep", "[sweep][run]") {
  TempDir dir;
  // hidden 16384: billions of parameters, far beyond this machine's memory.
  std::string path = sweep_file(dir, "[sweep]\nmethod = \"grid\"\n[sweep.parameters]\n\"model.hidden\" = [128, 16384]\n"
                                     "[[sweep.paired]]\nkeys = [\"data.kind\", \"data.path\"]\n"
                                     "values = [[\"synthetic\", \"\"], [\"text\", \"/nonexistent/corpus.txt\"]]\n", kTinyTrials);
  auto out = dsrun_command(dir, "sweep '" + path + "'");
  INFO(out.text);
  REQUIRE(out.code == 0);
  dsrun::Store store(dir.file("runs.db"));
  auto trials = store.sweep_trials(sweep_id_of(out.text));
  REQUIRE(trials.size() == 4);
  int infeasible = 0, failed = 0, finished = 0;
  for (const auto& t : trials) {
    infeasible += t.status == dsrun::RunStatus::Infeasible;
    failed += t.status == dsrun::RunStatus::Failed;
    finished += t.status == dsrun::RunStatus::Finished;
    if (t.status == dsrun::RunStatus::Infeasible) {
      CHECK(t.started_at == 0);  // never launched
      CHECK_FALSE(t.error.empty());
    }
  }
  CHECK(infeasible == 2);
  CHECK(finished == 1);
  CHECK(failed == 1);  // the missing data file fails that trial; the sweep goes on
}

TEST_CASE("pruning stops a poor trial early and a reached target ends the sweep", "[sweep][run][pruning]") {
  TempDir dir;
  std::string path = sweep_file(dir, "[sweep]\nmethod = \"grid\"\n[sweep.objective]\nmetric = \"loss\"\n"
                                     "[sweep.pruning]\nmethod = \"asha\"\ngrace_steps = 2\nreduction_factor = 2\n"
                                     "[sweep.parameters]\n\"optimizer.lr\" = [3e-3, 1e-7]\n",
                                "[run]\nsteps = 60\n[checkpoint]\nat_end = false\n[parallel]\ndata_parallel = 1\n[schedule]\nname = \"constant\"\n");
  auto out = dsrun_command(dir, "sweep '" + path + "'");
  INFO(out.text);
  REQUIRE(out.code == 0);
  dsrun::Store store(dir.file("runs.db"));
  auto trials = store.sweep_trials(sweep_id_of(out.text));
  REQUIRE(trials.size() == 2);
  CHECK(trials[0].status == dsrun::RunStatus::Finished);
  CHECK(trials[1].status == dsrun::RunStatus::Pruned);
  CHECK(store.metric_history(trials[1].id, "loss").size() < 60);
  bool reason = false;
  for (const auto& e : store.events(trials[1].id)) reason |= e.kind == "pruned" && contains(e.message, "ASHA");
  CHECK(reason);

  std::string target = dir.file("target.toml");
  dsrun::write_file_atomic(target, "base = \"" + dsrun::test::source_dir() + "/tests/recipes/tiny_train.toml\"\n" + kTinyTrials +
                                       "[sweep]\nmethod = \"grid\"\n[sweep.objective]\nmetric = \"loss\"\ntarget = 100.0\n"
                                       "[sweep.parameters]\n\"optimizer.lr\" = [1e-3, 2e-3, 3e-3, 4e-3]\n");
  out = dsrun_command(dir, "sweep '" + target + "'");
  INFO(out.text);
  REQUIRE(out.code == 0);
  CHECK(contains(out.text, "ended early: target reached"));
  CHECK(store.sweep_trials(sweep_id_of(out.text)).size() == 1);
}

TEST_CASE("a killed sweep resumes: abandoned trials are marked and only what is missing runs", "[sweep][run][resume]") {
  TempDir dir;
  std::string path = sweep_file(dir, "[sweep]\nmethod = \"grid\"\n[sweep.parameters]\n\"optimizer.lr\" = [1e-3, 2e-3, 3e-3]\n",
                                "[run]\nsteps = 20\n[checkpoint]\nat_end = false\n[parallel]\ndata_parallel = 1\n");
  // Start the sweep, wait until its first trial has finished and the second is running, kill -9 it.
  const std::string db = dir.file("runs.db");
  auto out = dsrun::test::run_command(
      "cd '" + dsrun::test::source_dir() + "' && ('" DSRUN_BINARY "' sweep '" + path + "' --db '" + db + "' > '" + dir.file("sweep.txt") + "' 2>&1 & echo $! > '" +
      dir.file("pid") + "'); for i in $(seq 600); do n=$(sqlite3 '" + db + "' \"SELECT count(*) FROM runs WHERE status = 'finished'\" 2>/dev/null); "
      "r=$(sqlite3 '" + db + "' \"SELECT count(*) FROM runs WHERE status = 'running'\" 2>/dev/null); "
      "[ \"$n\" = 1 ] && [ \"$r\" = 1 ] && break; sleep 0.1; done; kill -9 $(cat '" + dir.file("pid") + "'); sleep 1");
  const std::string printed = dsrun::read_file(dir.file("sweep.txt"));
  INFO(out.text << printed);
  const std::string id = sweep_id_of(printed);
  REQUIRE_FALSE(id.empty());
  {
    dsrun::Store store(db);
    CHECK(store.get_sweep(id).status == "running");  // nobody recorded its end
  }
  auto resumed = dsrun_command(dir, "sweep --resume " + id);
  INFO(resumed.text);
  REQUIRE(resumed.code == 0);
  CHECK(contains(resumed.text, "2 of 3 trial(s) to run"));
  dsrun::Store store(db);
  auto trials = store.sweep_trials(id);
  int finished = 0, abandoned = 0;
  for (const auto& t : trials) {
    finished += t.status == dsrun::RunStatus::Finished;
    abandoned += t.status == dsrun::RunStatus::Failed && contains(t.error, "abandoned");
  }
  CHECK(finished == 3);
  CHECK(abandoned == 1);
  CHECK(store.get_sweep(id).status == "finished");
}

TEST_CASE("the shipped sweep recipes load, and dsrun plan and run ignore their [sweep] section", "[sweep]") {
  dsrun::SweepSpec lr = dsrun::load_sweep_spec(dsrun::test::source_dir() + "/recipes/lr_sweep.toml");
  CHECK(lr.method == dsrun::SweepMethod::Random);
  CHECK(lr.pruning.method == dsrun::PruneMethod::Asha);
  dsrun::SweepSpec tune = dsrun::load_sweep_spec(dsrun::test::source_dir() + "/recipes/sweeps/autotune.toml");
  CHECK(dsrun::grid_size(tune) == 18);
  CHECK(tune.maximize);
  TempDir dir;
  CHECK(dsrun_command(dir, "plan recipes/lr_sweep.toml").code == 0);
}
