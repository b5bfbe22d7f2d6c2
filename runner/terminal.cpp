#include "runner/terminal.hpp"

#include "engine/common/text.hpp"

#include <ctime>

namespace dsrun {

std::string format_time(double t) {
  if (t <= 0) return "-";
  std::time_t secs = static_cast<std::time_t>(t);
  std::tm tm{};
  localtime_r(&secs, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M", &tm);
  return buf;
}

static std::string duration_of(const RunRecord& r) {
  if (r.started_at <= 0) return "-";
  double end = r.ended_at > 0 ? r.ended_at : unix_now();
  return format_seconds(end - r.started_at);
}

// The metric a person looks at first: validation loss if there is one, else training loss.
static std::string key_metric(const Store& store, const std::string& run_id) {
  auto latest = store.latest_metrics(run_id);
  for (const char* key : {"val_loss", "loss", "accuracy"}) {
    auto it = latest.find(key);
    if (it != latest.end()) return std::string(key) + " " + format_double(it->second.value, 4) + " @" + std::to_string(it->second.step);
  }
  return "-";
}

std::string render_history(const Store& store, const std::vector<RunRecord>& runs, bool filtered) {
  if (runs.empty() && filtered) return "no runs match in " + store.path() + " (dsrun history without filters lists every run)\n";
  if (runs.empty()) return "no runs yet in " + store.path() + "\n";
  TextTable t({"id", "name", "status", "model", "hardware", "zero", "ranks", "key metric", "created", "duration"});
  for (const auto& r : runs) {
    // A batch job still in Slurm's hands shows its state: planned (PENDING), running (RUNNING).
    const bool job_open = !r.job_id.empty() && !r.job_state.empty() && (r.status == RunStatus::Planned || r.status == RunStatus::Running);
    t.add({r.id, r.name, std::string(to_string(r.status)) + (job_open ? " (" + r.job_state + ")" : ""), r.model, r.hardware, std::to_string(r.zero_stage), std::to_string(r.world_size),
           key_metric(store, r.id), format_time(r.created_at), duration_of(r)});
  }
  return t.render();
}

std::string render_history_csv(const Store& store, const std::vector<RunRecord>& runs) {
  auto field = [](const std::string& s) { return csv_field(s); };
  std::string out = "id,name,status,model,hardware,zero_stage,world_size,sweep_id,trial_index,trial_params,created_at,started_at,ended_at,loss,val_loss,error\n";
  for (const auto& r : runs) {
    auto latest = store.latest_metrics(r.id);
    auto metric = [&](const char* k) { return latest.count(k) ? format_double(latest[k].value, 17) : std::string(); };
    out += join({field(r.id), field(r.name), to_string(r.status), field(r.model), field(r.hardware), std::to_string(r.zero_stage), std::to_string(r.world_size),
                 field(r.sweep_id), r.trial_index >= 0 ? std::to_string(r.trial_index) : "", field(r.trial_params), format_double(r.created_at, 15),
                 r.started_at > 0 ? format_double(r.started_at, 15) : "", r.ended_at > 0 ? format_double(r.ended_at, 15) : "", metric("loss"), metric("val_loss"),
                 field(r.error)},
                ",") + "\n";
  }
  return out;
}

std::string render_run(const Store& store, const RunRecord& r) {
  std::string out;
  auto field = [&](const std::string& name, const std::string& value) {
    if (!value.empty()) out += "  " + name + std::string(name.size() < 12 ? 12 - name.size() : 1, ' ') + terminal_safe(value) + "\n";
  };
  // Everything below comes from the store, which others may write: printed terminal-safe.
  out += "run " + terminal_safe(r.id) + " (" + terminal_safe(r.name) + ")\n";
  field("status", std::string(to_string(r.status)) + (r.error.empty() ? "" : ": " + r.error));
  field("created", format_time(r.created_at));
  field("started", r.started_at > 0 ? format_time(r.started_at) : "");
  field("ended", r.ended_at > 0 ? format_time(r.ended_at) : "");
  field("duration", r.started_at > 0 ? duration_of(r) : "");
  field("recipe", r.recipe_path);
  field("model", r.model);
  field("hardware", r.hardware);
  field("ranks", std::to_string(r.world_size) + ", ZeRO stage " + std::to_string(r.zero_stage));
  field("host", r.host);
  field("git", r.git_revision);
  // Lineage: the run this one was rolled back from, and the runs rolled back from this one.
  if (!r.parent_run.empty()) {
    std::string chain = r.parent_run + " at step " + std::to_string(r.parent_step);
    RunRecord up = store.get_run(r.parent_run);
    for (int depth = 0; !up.parent_run.empty() && depth < 50; ++depth) {
      chain += " <- " + up.parent_run + " at step " + std::to_string(up.parent_step);
      up = store.get_run(up.parent_run);
    }
    field("parent", chain);
  }
  std::vector<std::string> children;
  for (const auto& c : store.children(r.id)) children.push_back(c.id + " from step " + std::to_string(c.parent_step) + " (" + to_string(c.status) + ")");
  field("children", join(children, ", "));
  field("sweep", r.sweep_id.empty() ? "" : r.sweep_id + " trial " + std::to_string(r.trial_index) + ": " + r.trial_params);
  field("job", r.job_id.empty() ? "" : r.job_id + (r.job_state.empty() ? "" : " " + r.job_state) + (r.job_nodes.empty() ? "" : " on " + r.job_nodes) +
                                           (r.job_reason.empty() ? "" : " (" + r.job_reason + ")"));

  const auto nodes = store.nodes(r.id);
  if (!nodes.empty()) {
    out += "\nnodes\n";
    TextTable t({"node", "host", "status", "restarts", "last heard", "error"});
    for (const auto& n : nodes)
      t.add({std::to_string(n.node_rank), n.host + (n.pid > 0 ? " (pid " + std::to_string(n.pid) + ")" : ""), n.status, std::to_string(n.restarts),
             n.heartbeat_at > 0 ? format_time(n.heartbeat_at) : "-", n.error});
    out += t.render("  ");
  }

  auto latest = store.latest_metrics(r.id);
  if (!latest.empty()) {
    out += "\nlatest metrics\n";
    TextTable t({"metric", "value", "step"});
    for (const auto& [key, m] : latest) t.add({key, format_double(m.value, 6), std::to_string(m.step)});
    out += t.render("  ");
  }
  auto checkpoints = store.checkpoints(r.id);
  if (!checkpoints.empty()) {
    out += "\ncheckpoints\n";
    TextTable t({"step", "bytes", "checksum", "path"});
    for (const auto& c : checkpoints) t.add({std::to_string(c.step), format_bytes(static_cast<double>(c.bytes)), c.checksum, c.path});
    out += t.render("  ");
  }
  auto events = store.events(r.id);
  if (!events.empty()) {
    out += "\nevents\n";
    for (const auto& e : events)
      out += "  " + format_time(e.time) + "  " + terminal_safe(e.kind) + (e.rank >= 0 ? " [rank " + std::to_string(e.rank) + "]" : "") + "  " + terminal_safe(e.message, true) + "\n";
  }
  out += "\nrecipe as written (" + terminal_safe(r.recipe_path) + ")\n" + terminal_safe(r.recipe_text, true);
  if (!r.recipe_text.empty() && r.recipe_text.back() != '\n') out += "\n";
  out += "\nresolved config\n" + terminal_safe(r.config_toml, true);
  out += "\n" + terminal_safe(r.plan_text, true);
  return out;
}

}  // namespace dsrun
