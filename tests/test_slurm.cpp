// dsrun on a real one-node Slurm cluster (slurmctld, slurmd, munge; tests/servers/slurm_cluster.sh)
// started by the test process: `dsrun run --slurm` to the end, `dsrun cancel`, a requeued job
// resuming under the same run, Slurm's rejections and a job that vanished. Skipped, saying so,
// where Slurm is not installed (./setup.sh --with-test-tools installs it).
#include "storage/store.hpp"
#include "store_backends.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include <functional>
#include <set>

using dsrun::test::CommandOutput;
using dsrun::test::contains;
using dsrun::test::run_command;
using dsrun::test::source_dir;
using dsrun::test::TempDir;

namespace {

// The one-node Slurm cluster of this test process (tests/servers/slurm_cluster.sh).
class SlurmCluster {
 public:
  static SlurmCluster& get() {
    static SlurmCluster cluster;
    return cluster;
  }
  bool available() const { return server_.running(); }
  const std::string& skip_reason() const { return server_.skip_reason(); }
  // A shell prefix that points Slurm's commands (and the jobs, which inherit it) at this cluster.
  std::string env() const { return "SLURM_CONF='" + server_.dir() + "/slurm.conf' PATH=\"$PATH:/usr/sbin\" "; }
  std::string dir() const { return server_.dir(); }

 private:
  // Jobs of other tests' clusters may share the 2 cores: 4 CPUs lets a 2-task job start at once.
  SlurmCluster() : server_("slurm_cluster.sh", "SLURM_CLUSTER_CPUS=4 ") {}
  dsrun::test::ScriptServer server_;
};

bool skip_without_slurm() {
  if (SlurmCluster::get().available()) return false;
  WARN(SlurmCluster::get().skip_reason());
  return true;
}

// Run directories go beside a SQLite store; with a server store, under this process's own folder.
std::string runs_dir_for(const std::string& db) {
  static TempDir server_runs;
  return dsrun::is_postgres_location(db) ? server_runs.path() : dsrun::parent_directory(db);
}

CommandOutput dsrun_cli(const std::string& db, const std::string& args) {
  return run_command("cd '" + source_dir() + "' && DSRUN_RUNS_DIR='" + runs_dir_for(db) + "' " + SlurmCluster::get().env() + "timeout 300 '" DSRUN_BINARY "' " +
                     args + " --db '" + db + "'");
}

// The run id from `dsrun run --slurm`'s "run ID submitted to Slurm as job J".
std::string submitted_run(const CommandOutput& out) {
  const size_t at = out.text.find("\nrun ");
  REQUIRE(at != std::string::npos);
  return out.text.substr(at + 5, 8);
}

// What a failed wait reports: the run as dsrun shows it, the job as Slurm knows it, the tails
// of the ranks' logs and of the daemons' logs.
std::string job_story(const std::string& db, const std::string& id) {
  const std::string logs = dsrun::path_join(runs_dir_for(db), id + "/logs");
  const std::string daemons = SlurmCluster::get().dir();
  return dsrun_cli(db, "show " + id).text + "\n" +
         run_command(SlurmCluster::get().env() + "squeue -t all -o '%A %j %T %r %M'; " + SlurmCluster::get().env() + "scontrol show job 2>&1 | head -n 60; " +
                     "for f in '" + logs + "'/* '" + daemons + "/slurmctld.log' '" + daemons + "/slurmd.log'; do echo \"---- $f\"; tail -n 25 \"$f\"; done")
             .text;
}

// Polls the store (as `dsrun show` does, which also asks Slurm) until `done` or `seconds` pass.
bool wait_for(const std::string& db, const std::string& id, double seconds, const std::function<bool(dsrun::Store&, const dsrun::RunRecord&)>& done) {
  for (double waited = 0; waited < seconds; waited += 0.5) {
    dsrun_cli(db, "show " + id);  // brings the job's state from Slurm into the store
    dsrun::Store store(db);
    if (done(store, store.get_run(id))) return true;
    ::usleep(500000);
  }
  UNSCOPED_INFO("waited " << seconds << " s in vain:\n" << job_story(db, id));  // reported with the failed check
  return false;
}

int64_t last_step(dsrun::Store& store, const std::string& id) {
  const auto latest = store.latest_metrics(id);
  return latest.count("loss") ? latest.at("loss").step : 0;
}

// The store the jobs report into: the team's PostgreSQL when the test machine has it.
std::string shared_store(const TempDir& dir) {
  dsrun::test::PostgresServer& pg = dsrun::test::PostgresServer::get();
  return pg.available() ? pg.new_database() : dir.file("runs/dsrun.db");
}

const std::string kQuick = " recipes/quickstart.toml --set run.steps=30 --set checkpoint.every=10 --set eval.every=0 --set logging.tensorboard=false";
const std::string kLong = " recipes/quickstart.toml --set run.steps=100000 --set checkpoint.every=10 --set checkpoint.keep_last=2 --set eval.every=0"
                          " --set logging.tensorboard=false --set schedule.name=\\\"constant\\\"";

}  // namespace

// The same PostgreSQL store with a password in its URL (the test server trusts its users, so any
// password connects); a SQLite store as it is.
std::string with_password(const std::string& db) {
  if (!dsrun::is_postgres_location(db)) return db;
  const size_t at = db.find('@');
  return at != std::string::npos ? db.substr(0, at) + ":s3cret" + db.substr(at) : db + "?password=s3cret";
}

mode_t mode_of(const std::string& path) {
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  return st.st_mode & 0777;
}

TEST_CASE("dsrun run --slurm: the quickstart's 2 tasks finish as one run with its metrics, checkpoints and job id, and its script holds no password and quotes a name with spaces", "[slurm]") {
  if (skip_without_slurm()) return;
  TempDir dir;
  const std::string db = shared_store(dir);
  CommandOutput out = dsrun_cli(with_password(db), "run --slurm" + kQuick + " --set 'run.name=\"has space\"'");
  INFO(out.text);
  REQUIRE(out.code == 0);
  CHECK(contains(out.text, "submitted to Slurm as job "));
  const std::string id = submitted_run(out);
  CHECK(wait_for(db, id, 180, [](dsrun::Store&, const dsrun::RunRecord& r) { return r.status != dsrun::RunStatus::Planned && r.status != dsrun::RunStatus::Running; }));
  dsrun::Store store(db);
  const dsrun::RunRecord r = store.get_run(id);
  INFO(dsrun_cli(db, "show " + id).text);
  CHECK(r.status == dsrun::RunStatus::Finished);
  CHECK(store.count_runs() == 1);  // the ranks reported into the run dsrun run recorded
  CHECK_FALSE(r.job_id.empty());
  CHECK(store.metric_history(id, "loss").size() == 30);
  CHECK(store.checkpoints(id).size() >= 3);
  const auto nodes = store.nodes(id);
  REQUIRE(nodes.size() == 1);
  CHECK(nodes[0].status == "finished");
  CHECK(wait_for(db, id, 60, [](dsrun::Store&, const dsrun::RunRecord& run) { return run.job_state == "COMPLETED"; }));
  CHECK(contains(dsrun_cli(db, "show " + id).text, "job         " + r.job_id + " COMPLETED"));
  // The job script holds the plan's shape.
  const std::string script = dsrun::read_file(dsrun::path_join(runs_dir_for(db), id + "/job.sh"));
  CHECK(contains(script, "#SBATCH --ntasks-per-node=2"));
  CHECK(contains(script, "#SBATCH --requeue"));
  CHECK(contains(script, "#SBATCH --job-name=\"dsrun-has space\""));
  // The password never enters the script (Slurm keeps a copy) nor a file others can read.
  const std::string run_dir = dsrun::path_join(runs_dir_for(db), id);
  CHECK_FALSE(contains(script, "s3cret"));
  CHECK(mode_of(dsrun::path_join(run_dir, "job.sh")) == 0700);
  if (dsrun::is_postgres_location(db)) {
    CHECK(contains(script, "DSRUN_DB_FILE="));
    CHECK(mode_of(dsrun::path_join(run_dir, "store_location")) == 0600);
    CHECK(mode_of(run_dir) == 0700);
    CHECK(contains(dsrun::read_file(dsrun::path_join(run_dir, "store_location")), "s3cret"));
  }
}

TEST_CASE("dsrun cancel of a Slurm run mid-run records it killed, and a requeued job resumes from its checkpoint under the same run", "[slurm]") {
  if (skip_without_slurm()) return;
  TempDir dir;
  const std::string db = dir.file("runs/dsrun.db");
  CommandOutput out = dsrun_cli(db, "run --slurm" + kLong);
  INFO(out.text);
  REQUIRE(out.code == 0);
  const std::string id = submitted_run(out);
  // A checkpoint first, then Slurm requeues the job (as preemption or a node failure would).
  REQUIRE(wait_for(db, id, 180, [](dsrun::Store& s, const dsrun::RunRecord& r) { return !s.checkpoints(r.id).empty() && r.status == dsrun::RunStatus::Running; }));
  const std::string job = dsrun::Store(db).get_run(id).job_id;
  int64_t saved = 0;
  {
    dsrun::Store store(db);
    saved = store.checkpoints(id).back().step;
  }
  CommandOutput requeue = run_command(SlurmCluster::get().env() + "scontrol requeue " + job + " && sleep 2 && " + SlurmCluster::get().env() +
                                      "scontrol update JobId=" + job + " StartTime=now");
  INFO(requeue.text);
  REQUIRE(requeue.code == 0);
  REQUIRE(wait_for(db, id, 180, [&](dsrun::Store& s, const dsrun::RunRecord& r) {
    bool resumed = false;
    for (const auto& e : s.events(r.id)) resumed |= e.kind == "requeued";
    return resumed && r.status == dsrun::RunStatus::Running && last_step(s, r.id) > saved;
  }));
  {
    dsrun::Store store(db);
    CHECK(store.count_runs() == 1);  // the same run, not a new one
    bool from_checkpoint = false;
    for (const auto& e : store.events(id)) from_checkpoint |= e.kind == "launch" && contains(e.message, "resuming from");
    CHECK(from_checkpoint);
  }
  // dsrun cancel: scancel; the ranks stop and the run is killed.
  CommandOutput cancel = dsrun_cli(db, "cancel " + id);
  INFO(cancel.text);
  CHECK(cancel.code == 0);
  CHECK(contains(cancel.text, "cancelled Slurm job " + job));
  CHECK(wait_for(db, id, 120, [](dsrun::Store&, const dsrun::RunRecord& r) { return r.status == dsrun::RunStatus::Killed; }));
  CHECK(wait_for(db, id, 60, [](dsrun::Store&, const dsrun::RunRecord& r) { return r.job_state == "CANCELLED"; }));
}

TEST_CASE("Slurm faults: a rejected job says Slurm's reason, a job Slurm forgot is marked lost at its last step, no sbatch is a clear error", "[slurm]") {
  TempDir dir;
  const std::string db = dir.file("runs/dsrun.db");
  // Without Slurm's commands on PATH (no cluster needed).
  CommandOutput none = run_command("cd '" + source_dir() + "' && PATH=/nonexistent '" DSRUN_BINARY "' run --slurm" + kQuick + " --db '" + db + "'");
  INFO(none.text);
  CHECK(none.code == 1);
  CHECK(contains(none.text, "no sbatch on PATH"));
  CHECK(contains(none.text, "without --slurm"));
  if (skip_without_slurm()) return;
  CommandOutput rejected = dsrun_cli(db, "run --slurm" + kQuick + " --set slurm.partition=\\\"nosuch\\\"");
  INFO(rejected.text);
  CHECK(rejected.code == 1);
  CHECK(contains(rejected.text, "Invalid partition name specified"));
  CHECK(contains(rejected.text, "[slurm]"));
  {
    dsrun::Store store(db);
    const auto runs = store.list_runs({});
    REQUIRE(runs.size() >= 1);
    CHECK(runs[0].status == dsrun::RunStatus::Failed);
    CHECK(contains(runs[0].error, "not submitted"));
  }
  // A running run whose job Slurm no longer knows (it aged out, or the cluster was rebuilt).
  std::string id;
  {
    dsrun::Store store(db);
    dsrun::NewRun run;
    run.name = "vanished";
    run.recipe_text = run.config_toml = "x";
    id = store.create_run(run);
    store.set_status(id, dsrun::RunStatus::Running);
    store.add_metrics(id, 17, {{"loss", 2.5}});
    store.set_job(id, "987654", "RUNNING", "vm", "");
  }
  CommandOutput history = dsrun_cli(db, "history");
  INFO(history.text);
  dsrun::Store store(db);
  const dsrun::RunRecord lost = store.get_run(id);
  CHECK(lost.status == dsrun::RunStatus::Lost);
  CHECK(contains(lost.error, "gone from Slurm's queue"));
  CHECK(contains(lost.error, "at step 17"));
  CHECK(lost.job_state == "UNKNOWN");
}

TEST_CASE("dsrun sweep --slurm: a 6-trial job array, 2 at a time, into the shared store runs every trial once and prunes with ASHA", "[slurm][sweep]") {
  if (skip_without_slurm()) return;
  TempDir dir;
  const std::string db = shared_store(dir);
  const std::string recipe = dir.write("lr.toml", "base = \"" + source_dir() + "/tests/recipes/tiny_train.toml\"\n"
                                                  "[run]\nsteps = 60\n[checkpoint]\nat_end = false\n[parallel]\ndata_parallel = 1\n"
                                                  "[hardware]\ndevices_per_node = 1\n[schedule]\nname = \"constant\"\n"
                                                  "[sweep]\nmethod = \"grid\"\nconcurrency = 2\n[sweep.objective]\nmetric = \"loss\"\n"
                                                  "[sweep.pruning]\nmethod = \"asha\"\ngrace_steps = 2\nreduction_factor = 2\n"
                                                  "[sweep.parameters]\n\"optimizer.lr\" = [3e-3, 1e-7, 2e-3, 1e-7, 1e-3, 1e-7]\n");
  CommandOutput out = dsrun_cli(db, "sweep '" + recipe + "' --slurm");
  INFO(out.text);
  REQUIRE(out.code == 0);
  const size_t at = out.text.find("sweep s");
  REQUIRE(at != std::string::npos);
  const std::string sweep_id = out.text.substr(at + 6, 8);
  CHECK(contains(out.text, "job array"));
  bool done = false;
  for (int i = 0; i < 360 && !done; ++i) {
    dsrun::Store store(db);
    done = store.get_sweep(sweep_id).status == "finished";
    if (!done) ::usleep(500000);
  }
  INFO(dsrun_cli(db, "sweep --show " + sweep_id).text);
  REQUIRE(done);
  dsrun::Store store(db);
  const auto trials = store.sweep_trials(sweep_id);
  REQUIRE(trials.size() == 6);  // each trial once: no index run twice, none skipped
  std::set<int64_t> indices;
  for (const auto& t : trials) {
    indices.insert(t.trial_index);
    CHECK((t.status == dsrun::RunStatus::Finished || t.status == dsrun::RunStatus::Pruned));
    CHECK(contains(t.job_id, "_"));  // the array task that ran it
    if (contains(t.trial_params, "1e-07")) CHECK(t.status == dsrun::RunStatus::Pruned);  // hopeless learning rates stop early
  }
  CHECK(indices.size() == 6);
  CHECK(trials[0].status == dsrun::RunStatus::Finished);  // lr 3e-3 leads from the start: never pruned
  CHECK(store.get_sweep(sweep_id).best_run == trials[0].id);
}

TEST_CASE("a job Slurm stops at its time limit is never left running: TIMEOUT and Slurm's reason are recorded", "[slurm]") {
  if (skip_without_slurm()) return;
  TempDir dir;
  const std::string db = dir.file("runs/dsrun.db");
  CommandOutput out = dsrun_cli(db, "run --slurm" + kLong + " --set run.time_limit=\\\"10\\\"");
  INFO(out.text);
  REQUIRE(out.code == 0);
  const std::string id = submitted_run(out);
  CHECK(contains(dsrun::read_file(dsrun::path_join(runs_dir_for(db), id + "/job.sh")), "#SBATCH --time=0:10:00"));
  REQUIRE(wait_for(db, id, 180, [](dsrun::Store& s, const dsrun::RunRecord& r) { return r.status == dsrun::RunStatus::Running && last_step(s, r.id) > 0; }));
  const std::string job = dsrun::Store(db).get_run(id).job_id;
  // The limit lowered to nothing: Slurm's next check (every 30 s at most) times the job out.
  REQUIRE(run_command(SlurmCluster::get().env() + "scontrol update JobId=" + job + " TimeLimit=0").code == 0);
  CHECK(wait_for(db, id, 120, [](dsrun::Store&, const dsrun::RunRecord& r) {
    return r.status != dsrun::RunStatus::Running && r.status != dsrun::RunStatus::Planned && r.job_state == "TIMEOUT";
  }));
  dsrun::Store store(db);
  const dsrun::RunRecord r = store.get_run(id);
  CHECK((r.status == dsrun::RunStatus::Killed || r.status == dsrun::RunStatus::Failed));
  std::string said = r.error;
  for (const auto& e : store.events(id)) said += "\n" + e.message;
  INFO(said);
  CHECK(contains(said, "TIMEOUT (TimeLimit)"));
  CHECK(contains(dsrun_cli(db, "show " + id).text, job + " TIMEOUT"));
}
