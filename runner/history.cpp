#include "runner/history.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/host.hpp"
#include "engine/common/text.hpp"
#include "engine/recipe/schema.hpp"
#include "runner/launcher.hpp"
#include "runner/slurm.hpp"
#include "runner/terminal.hpp"
#include "storage/store.hpp"

#include <dirent.h>
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <set>

namespace dsrun {

namespace {

Store open_store(const std::string& db_path) {
  if (!store_exists(db_path)) throw Error("no run store here", ErrorContext{db_path, 0, 0, "", -1, "run a recipe first, or pass --db"});
  return Store(db_path);
}

// Bytes under a path (files and directories, not following links).
int64_t tree_bytes(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return 0;
  if (!S_ISDIR(st.st_mode)) return static_cast<int64_t>(st.st_size);
  int64_t total = 0;
  for (const auto& name : list_directory(path)) total += tree_bytes(path_join(path, name));
  return total;
}

// `path` with its folders resolved to an absolute canonical form, or "" when it does not exist.
// The last component stays as it is: a symbolic link is removed, never what it points to.
std::string canonical_path(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return "";
  char folder[PATH_MAX];
  if (!::realpath(parent_directory(path).c_str(), folder)) return "";
  const std::string name = path.substr(path.find_last_of('/') == std::string::npos ? 0 : path.find_last_of('/') + 1);
  return path_join(folder, name);
}

// The paths to size and remove, each once: checkpoints usually lie inside the run directory, and
// counting both would report their bytes twice. Paths that do not exist are left out.
std::vector<std::string> outermost_paths(const std::vector<std::string>& paths) {
  std::vector<std::string> real;
  for (const auto& p : paths) {
    const std::string c = canonical_path(p);
    if (!c.empty()) real.push_back(c);
  }
  // Shortest first: a folder comes before everything under it.
  std::stable_sort(real.begin(), real.end(), [](const std::string& a, const std::string& b) { return a.size() < b.size(); });
  std::vector<std::string> out;
  for (const auto& p : real) {
    bool counted = false;
    for (const auto& kept : out) counted |= p == kept || p.rfind(kept == "/" ? kept : kept + "/", 0) == 0;
    if (!counted) out.push_back(p);
  }
  return out;
}

// A JSON document flattened to "a.b" -> scalar text (arrays kept whole).
void flat_json(const nlohmann::json& j, const std::string& prefix, std::map<std::string, std::string>& out) {
  if (j.is_object()) {
    for (auto& [k, v] : j.items()) flat_json(v, prefix.empty() ? k : prefix + "." + k, out);
    return;
  }
  if (j.is_number_float()) out[prefix] = format_double(j.get<double>(), 6);
  else if (j.is_string()) out[prefix] = j.get<std::string>();
  else out[prefix] = j.dump();
}

// Which way a metric improves. Settings and diagnostics (the learning rate, the fp16 loss scale,
// the gradient norm) have no better direction, so compare shows no best for them.
enum class Better { Lower, Higher, Neither };
Better better_direction(const std::string& key) {
  if (key == "lr" || key == "loss_scale" || key == "grad_norm") return Better::Neither;
  if (key.find("accuracy") != std::string::npos || key.find("tokens_per_second") != std::string::npos || key.find("mfu") != std::string::npos ||
      key.find("MBps") != std::string::npos)
    return Better::Higher;
  return Better::Lower;
}

// Plan numbers that are sizes in bytes (shown as KiB, MiB, GiB rather than 3.47158e+06).
bool is_byte_quantity(const std::string& plan_key) {
  return plan_key.rfind("memory_per_rank.", 0) == 0 || plan_key.rfind("host_memory_per_node.", 0) == 0 || plan_key.rfind("host_memory_per_rank.", 0) == 0 ||
         plan_key.find("bytes") != std::string::npos || plan_key == "checkpoint_disk.free" || plan_key == "checkpoint_disk.needed" ||
         plan_key == "checkpoint_disk.staging_per_rank";
}

double mean_after_first(const std::vector<MetricValue>& h) {
  if (h.empty()) return NAN;
  double sum = 0;
  size_t n = 0;
  for (size_t i = h.size() > 1 ? 1 : 0; i < h.size(); ++i, ++n) sum += h[i].value;  // step 1 includes warm-up
  return sum / static_cast<double>(n);
}

// (measured - predicted) / predicted in percent; NaN when either is missing.
double error_percent(double measured, double predicted) {
  if (!std::isfinite(measured) || !std::isfinite(predicted) || predicted == 0) return NAN;
  return (measured - predicted) / predicted * 100;
}

std::string percent_text(double e) {
  if (!std::isfinite(e)) return "-";
  return (e >= 0 ? "+" : "") + format_double(e, 3) + "%";
}

nlohmann::json number_or_null(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); }

}  // namespace

// A TOML document flattened to "a.b" -> value text.
std::map<std::string, std::string> flat_toml(const std::string& text) {
  std::map<std::string, std::string> out;
  toml::table t;
  try {
    t = toml::parse(text);
  } catch (const toml::parse_error&) {
    return out;
  }
  std::function<void(const toml::table&, const std::string&)> walk = [&](const toml::table& table, const std::string& prefix) {
    for (auto&& [k, node] : table) {
      const std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
      if (auto sub = node.as_table()) {
        walk(*sub, key);
        continue;
      }
      std::ostringstream os;
      if (auto s = node.as_string()) os << s->get();
      else if (auto i = node.as_integer()) os << i->get();
      else if (auto f = node.as_floating_point()) os << format_double(f->get(), 6);
      else if (auto b = node.as_boolean()) os << (b->get() ? "true" : "false");
      else os << toml::toml_formatter(node);
      out[key] = os.str();
    }
  };
  walk(t, "");
  return out;
}

// Keys where the runs differ (or all), as rows: key, value per run.
std::vector<std::vector<std::string>> differences(const std::vector<std::map<std::string, std::string>>& maps, bool all) {
  std::set<std::string> keys;
  for (const auto& m : maps)
    for (const auto& [k, v] : m) keys.insert(k);
  std::vector<std::vector<std::string>> rows;
  for (const auto& k : keys) {
    std::vector<std::string> row{k};
    bool differ = false;
    for (const auto& m : maps) {
      row.push_back(m.count(k) ? m.at(k) : "-");
      differ |= row.back() != row[1];
    }
    if (differ || all) rows.push_back(row);
  }
  return rows;
}

std::vector<PlanBesideMeasured> plan_beside_measured(const Store& store, const RunRecord& r) {
  std::vector<PlanBesideMeasured> rows;
  const nlohmann::json plan = nlohmann::json::parse(r.plan_json.empty() ? "{}" : r.plan_json, nullptr, false);
  // memory/rankN/KEY -> rank -> KEY -> value
  std::map<int, std::map<std::string, double>> by_rank;
  for (const auto& [k, m] : store.latest_metrics(r.id)) {
    if (k.rfind("memory/rank", 0) != 0) continue;
    const size_t slash = k.find('/', 11);
    if (slash == std::string::npos || slash == 11 || k.find_first_not_of("0123456789", 11) != slash) continue;
    by_rank[std::stoi(k.substr(11, slash - 11))][k.substr(slash + 1)] = m.value;
  }
  auto largest = [&](const std::string& key) {  // over ranks
    double v = NAN;
    for (const auto& [rank, values] : by_rank)
      if (values.count(key)) v = std::isnan(v) ? values.at(key) : std::max(v, values.at(key));
    return v;
  };
  auto text = [](double v, bool bytes) { return !std::isfinite(v) ? std::string("-") : bytes ? format_bytes(v) : format_double(v, 4); };
  auto add = [&](const std::string& quantity, double measured, double predicted, bool bytes, int rank, const std::string& kind, bool host) {
    rows.push_back({quantity, predicted, measured, error_percent(measured, predicted), text(predicted, bytes), text(measured, bytes), rank, kind, host});
  };
  add("model states per rank", largest("model_state_bytes"), largest("predicted_model_state_bytes"), true, -1, "", false);
  for (const auto& [rank, values] : by_rank) {
    // GPU ranks report the CUDA allocator's peak; CPU ranks only the process's peak RSS.
    const bool gpu = values.count("peak_allocated_bytes") > 0;
    if (!gpu && !values.count("peak_rss_bytes")) continue;
    const std::string kind = gpu ? "GPU allocated" : "CPU RSS";
    add("peak memory rank " + std::to_string(rank) + " (" + kind + ")", values.at(gpu ? "peak_allocated_bytes" : "peak_rss_bytes"),
        values.count("predicted_total_bytes") ? values.at("predicted_total_bytes") : NAN, true, rank, kind, false);
  }
  for (const auto& [rank, values] : by_rank)  // a GPU rank's host memory, against the plan's host figure
    if (values.count("peak_allocated_bytes") && values.count("peak_rss_bytes") && values.count("predicted_host_bytes"))
      add("host peak RSS rank " + std::to_string(rank), values.at("peak_rss_bytes"), values.at("predicted_host_bytes"), true, rank, "host RSS", true);
  const double step_predicted = plan.is_object() ? plan.value("/speed/step_seconds"_json_pointer, NAN) : NAN;
  const double tps_predicted = plan.is_object() ? plan.value("/speed/tokens_per_second"_json_pointer, NAN) : NAN;
  add("step seconds", mean_after_first(store.metric_history(r.id, "step_seconds")), step_predicted, false, -1, "", false);
  add("tokens/s", mean_after_first(store.metric_history(r.id, "tokens_per_second")), tps_predicted, false, -1, "", false);
  return rows;
}


QueryNames query_names() {
  QueryNames n;
  n.is_config_key = [](const std::string& k) { return find_key_spec(k) != nullptr || is_open_table_key(k); };
  for (const auto& s : recipe_schema()) n.known_names.push_back(s.key);
  for (const char* m : {"metrics.loss", "metrics.val_loss", "metrics.tokens_per_second", "metrics.step_seconds", "metrics.grad_norm", "metrics.lr"})
    n.known_names.push_back(m);
  return n;
}

int command_history(const HistoryArgs& a, const std::string& db_path) {
  if (!a.status.empty()) run_status_from_string(a.status);  // a typo is an error, not an empty list
  if (!store_exists(db_path)) {
    std::cout << "no runs yet (no store at " << db_path << ")\n";
    return 0;
  }
  Store store(db_path);
  refresh_slurm_runs(store);
  replay_stranded_journals(store, db_path);  // (before marking lost: a journal may say how the run ended)
  mark_lost_runs(store);
  RunQuery q;
  q.limit = a.limit;
  q.status = a.status;
  q.sweep = a.sweep.empty() ? "" : store.get_sweep(a.sweep).id;
  q.model = a.model;
  q.hardware = a.hardware;
  q.recipe = a.recipe;
  q.since_seconds = a.since.empty() ? 0 : parse_duration(a.since);
  q.where = a.where;
  q.sort = a.sort;
  q.names = query_names();
  q.ascending = a.ascending;
  q.deleted = a.deleted;
  std::vector<RunRecord> runs = store.query_runs(q);
  if (a.csv) {
    std::cout << render_history_csv(store, runs);
    return 0;
  }
  if (!a.json) {
    const bool filtered = !a.status.empty() || !a.sweep.empty() || !a.model.empty() || !a.hardware.empty() || !a.recipe.empty() ||
                          !a.since.empty() || !a.where.empty() || a.deleted;
    std::cout << render_history(store, runs, filtered);
    return 0;
  }
  nlohmann::json out = nlohmann::json::array();
  for (const auto& r : runs) {
    nlohmann::json metrics = nlohmann::json::object();
    for (const auto& [k, m] : store.latest_metrics(r.id)) metrics[k] = {{"step", m.step}, {"value", m.value}};
    out.push_back({{"id", r.id}, {"name", r.name}, {"status", to_string(r.status)}, {"model", r.model}, {"hardware", r.hardware},
                   {"zero_stage", r.zero_stage}, {"world_size", r.world_size}, {"created_at", r.created_at},
                   {"started_at", r.started_at}, {"ended_at", r.ended_at}, {"latest_metrics", metrics}, {"sweep_id", r.sweep_id},
                   {"trial_index", r.trial_index}, {"trial_params", nlohmann::json::parse(r.trial_params.empty() ? "null" : r.trial_params, nullptr, false)},
                   {"error", r.error}, {"parent_run", r.parent_run}, {"job_id", r.job_id}, {"job_state", r.job_state}});
  }
  std::cout << out.dump(2) << "\n";
  return 0;
}

int command_delete(const std::vector<std::string>& runs, bool force, const std::string& db_path) {
  Store store = open_store(db_path);
  const std::string this_host = read_host_facts().hostname;
  for (const auto& q : runs) {
    const std::string id = store.resolve_run(q);
    const RunRecord r = store.get_run(id);
    if (r.status == RunStatus::Running) {
      // --force is only for runs whose launcher is gone; a live run must be stopped by its launcher.
      const std::string gone = launcher_gone(r, this_host, unix_now());
      if (gone.empty()) throw Error("run " + id + " is running", ErrorContext{db_path, 0, 0, q, -1, "stop it first (Ctrl-C its dsrun run)"});
      if (!force)
        throw Error("run " + id + " is marked running, but " + gone, ErrorContext{db_path, 0, 0, q, -1, "pass --force to delete it (it is recorded as killed)"});
      store.set_status(id, RunStatus::Killed, "launcher gone (" + gone + "); deleted with --force");
    }
    store.set_deleted(id, true);
    store.add_event(id, "deleted", -1, "soft-deleted; `dsrun restore " + id + "` brings it back, `dsrun gc` frees its files");
    std::cout << "deleted run " << id << " (restore with: dsrun restore " << id << ")\n";
  }
  return 0;
}

int command_restore(const std::vector<std::string>& runs, const std::string& db_path) {
  Store store = open_store(db_path);
  for (const auto& q : runs) {
    const std::string id = store.resolve_run(q, /*include_deleted=*/true);
    store.set_deleted(id, false);
    store.add_event(id, "restored", -1, "restored from the deleted runs");
    std::cout << "restored run " << id << "\n";
  }
  return 0;
}

int command_store_copy(const std::string& from, const std::string& to) {
  Store source = open_store(from);
  if (!is_postgres_location(to)) make_directories(parent_directory(to));
  Store target(to);
  const int64_t before = target.count_runs();
  const StoreCopy added = copy_store(source, target);
  std::cout << "copied " << added.runs << " new run(s) of " << source.count_runs() << " from " << source.path() << " to " << target.path() << " ("
            << before << " there before, " << target.count_runs() << " now); rows added: " << added.metrics << " metric(s), " << added.events << " event(s), "
            << added.checkpoints << " checkpoint(s), " << added.nodes << " node report(s), " << added.sweeps << " sweep(s)\n";
  return 0;
}

int command_gc(bool dry_run, const std::string& db_path) {
  Store store = open_store(db_path);
  RunQuery q;
  q.deleted = true;
  q.limit = 1 << 30;
  int64_t freed = 0, runs = 0;
  for (const auto& r : store.query_runs(q)) {
    std::vector<std::string> listed{path_join(runs_directory(db_path), r.id)};
    for (const auto& c : store.checkpoints(r.id)) listed.push_back(c.path);
    const std::vector<std::string> paths = outermost_paths(listed);
    int64_t bytes = 0;
    for (const auto& p : paths) bytes += tree_bytes(p);
    if (bytes == 0) continue;
    ++runs;
    freed += bytes;
    std::cout << (dry_run ? "would free " : "freed ") << format_bytes(static_cast<double>(bytes)) << " of run " << r.id << " (" << terminal_safe(r.name) << ")\n";
    if (dry_run) continue;
    for (const auto& p : paths) remove_tree(p);
    for (const auto& c : store.checkpoints(r.id)) {
      // A custom checkpoint.dir holds the run's checkpoints in a folder of its own (DIR/RUN_ID):
      // once they are gone, so is that folder if nothing else is in it.
      const std::string folder = parent_directory(c.path);
      if (folder.size() > r.id.size() && folder.compare(folder.size() - r.id.size() - 1, std::string::npos, "/" + r.id) == 0 &&
          is_directory(folder) && list_directory(folder).empty())
        remove_tree(folder);
      store.remove_checkpoint(r.id, c.path);
    }
    store.add_event(r.id, "gc", -1, "files removed: " + format_bytes(static_cast<double>(bytes)));
  }
  std::cout << (dry_run ? "gc would free " : "gc freed ") << format_bytes(static_cast<double>(freed)) << " (" << freed << " bytes) from " << runs << " deleted run(s)\n";
  return 0;
}

int command_compare(const CompareArgs& a, const std::string& db_path) {
  Store store = open_store(db_path);
  if (a.runs.size() < 2) throw Error("compare needs at least two runs", ErrorContext{"", 0, 0, "compare", -1, "dsrun compare RUN RUN [RUN...]"});
  std::vector<RunRecord> runs;
  for (const auto& q : a.runs) runs.push_back(store.get_run(store.resolve_run(q)));
  std::vector<std::string> header{"key"};
  for (const auto& r : runs) header.push_back(r.id);

  std::vector<std::map<std::string, std::string>> configs, plans;
  for (const auto& r : runs) {
    configs.push_back(flat_toml(r.config_toml));
    std::map<std::string, std::string> p;
    nlohmann::json j = nlohmann::json::parse(r.plan_json.empty() ? "{}" : r.plan_json, nullptr, false);
    if (!j.is_discarded()) flat_json(j, "", p);
    p.erase("recipe");
    for (auto it = p.begin(); it != p.end();)  // long lists (notes, auto choices) are read in `show`
      it = (it->first.rfind("notes", 0) == 0 || it->first.rfind("auto_choices", 0) == 0 || it->first.rfind("suggestions", 0) == 0 || it->first.rfind("verdict", 0) == 0) ? p.erase(it) : std::next(it);
    plans.push_back(p);
  }
  auto config_rows = differences(configs, a.all);
  auto plan_rows = differences(plans, false);
  auto plan_text_rows = plan_rows;  // JSON keeps the numbers as recorded
  for (auto& row : plan_text_rows)
    if (is_byte_quantity(row[0]))
      for (size_t i = 1; i < row.size(); ++i) {
        char* end = nullptr;
        const double v = std::strtod(row[i].c_str(), &end);
        if (end != row[i].c_str() && *end == 0) row[i] = format_bytes(v);
      }

  // Metrics: final, best, and at a step.
  std::set<std::string> keys;
  for (const auto& r : runs)
    for (const auto& [k, m] : store.latest_metrics(r.id))
      if (k.rfind("memory/", 0) != 0 && k != "startup_seconds" && k != "launch_to_ready_seconds") keys.insert(k);
  std::vector<std::vector<std::string>> metric_rows;
  nlohmann::json metrics_json = nlohmann::json::object();
  for (const auto& k : keys) {
    std::vector<std::string> final_row{k + " final"}, best_row{k + " best"}, at_row{k + " at step " + std::to_string(a.at_step)};
    for (const auto& r : runs) {
      auto h = store.metric_history(r.id, k);
      if (h.empty()) {
        final_row.push_back("-");
        best_row.push_back("-");
        at_row.push_back("-");
        continue;
      }
      const Better better = better_direction(k);
      double best = h[0].value;
      int64_t best_step = h[0].step;
      for (const auto& m : h)
        if (better == Better::Higher ? m.value > best : m.value < best) {
          best = m.value;
          best_step = m.step;
        }
      std::string at = "-";
      for (const auto& m : h)
        if (m.step == a.at_step) at = format_double(m.value, 5);
      final_row.push_back(format_double(h.back().value, 5) + " @" + std::to_string(h.back().step));
      best_row.push_back(better == Better::Neither ? "-" : format_double(best, 5) + " @" + std::to_string(best_step));
      at_row.push_back(at);
      metrics_json[r.id][k] = {{"final", h.back().value}, {"final_step", h.back().step}, {"best", nullptr}, {"best_step", nullptr}};
      if (better != Better::Neither) {
        metrics_json[r.id][k]["best"] = best;
        metrics_json[r.id][k]["best_step"] = best_step;
      }
    }
    metric_rows.push_back(final_row);
    metric_rows.push_back(best_row);
    if (a.at_step >= 0) metric_rows.push_back(at_row);
  }

  // The plan's predictions beside what was measured (plan_beside_measured).
  std::vector<std::vector<std::string>> predicted;
  nlohmann::json predicted_json = nlohmann::json::object();
  for (const auto& r : runs) {
    predicted_json[r.id] = nlohmann::json::object();
    predicted_json[r.id]["peak memory per rank"] = nlohmann::json::array();
    for (const PlanBesideMeasured& row : plan_beside_measured(store, r)) {
      predicted.push_back({r.id, row.quantity, row.predicted_text, row.measured_text, percent_text(row.error_percent)});
      nlohmann::json e = {{"predicted", number_or_null(row.predicted)}, {"measured", number_or_null(row.measured)}, {"error_pct", number_or_null(row.error_percent)}};
      if (row.rank < 0) {
        predicted_json[r.id][row.quantity] = e;
        continue;
      }
      if (row.host) continue;  // (the JSON keeps its earlier shape: device peaks per rank)
      e["rank"] = row.rank;
      e["kind"] = row.kind;
      predicted_json[r.id]["peak memory per rank"].push_back(e);
    }
  }

  if (a.json) {
    nlohmann::json out = {{"runs", nlohmann::json::array()}, {"config", nlohmann::json::array()}, {"plan", nlohmann::json::array()},
                          {"metrics", metrics_json}, {"predicted_vs_measured", predicted_json}};
    for (const auto& r : runs) out["runs"].push_back({{"id", r.id}, {"name", r.name}, {"status", to_string(r.status)}});
    for (const auto& row : config_rows) out["config"].push_back(row);
    for (const auto& row : plan_rows) out["plan"].push_back(row);
    std::cout << out.dump(2) << "\n";
    return 0;
  }
  for (const auto& r : runs) std::cout << "run " << r.id << "  " << terminal_safe(r.name) << "  " << to_string(r.status) << "\n";
  auto print = [&](const std::string& title, const std::vector<std::string>& head, const std::vector<std::vector<std::string>>& rows, const std::string& empty) {
    std::cout << "\n" << title << "\n";
    if (rows.empty()) {
      std::cout << "  " << empty << "\n";
      return;
    }
    TextTable t(head);
    for (const auto& row : rows) t.add(row);
    std::cout << t.render("  ");
  };
  print(a.all ? "config (all keys)" : "config differences", header, config_rows, "none: the resolved configs are identical");
  print("plan differences", header, plan_text_rows, "none");
  print("metrics", header, metric_rows, "no metrics recorded");
  print("predicted vs measured", {"run", "quantity", "predicted", "measured", "error"}, predicted, "nothing to compare");
  return 0;
}

int command_watch(const std::string& query, double interval_s, const std::string& db_path) {
  Store store = open_store(db_path);
  const std::string id = store.resolve_run(query);
  const std::string this_host = read_host_facts().hostname;
  int64_t last_step = 0, last_event = 0;
  while (true) {
    if (!store.get_run(id).job_id.empty()) refresh_slurm_runs(store);
    RunRecord r = store.get_run(id);
    auto losses = store.metric_history(id, "loss");
    for (const auto& m : losses) {
      if (m.step <= last_step) continue;
      auto latest = store.latest_metrics(id);
      std::cout << "step " << m.step << "  loss " << format_double(m.value, 5);
      if (latest.count("val_loss")) std::cout << "  val_loss " << format_double(latest["val_loss"].value, 5) << " @" << latest["val_loss"].step;
      std::cout << "\n";
      last_step = m.step;
    }
    for (const auto& e : store.events(id)) {
      if (e.id <= last_event) continue;
      std::cout << format_time(e.time) << "  " << e.kind << (e.rank >= 0 ? " [rank " + std::to_string(e.rank) + "]" : "") << "  " << e.message << "\n";
      last_event = e.id;
    }
    std::cout << std::flush;
    if (r.status != RunStatus::Running && r.status != RunStatus::Planned) {
      std::cout << "run " << id << " " << to_string(r.status) << (r.error.empty() ? "" : ": " + r.error) << "\n";
      return r.status == RunStatus::Finished ? 0 : r.status == RunStatus::Killed ? 130 : 1;
    }
    // A launcher killed with -9 (or a rebooted machine) never records the end: waiting would be forever.
    const std::string gone = launcher_gone(r, this_host, unix_now());
    if (!gone.empty())
      throw Error("run " + id + " is marked running, but " + gone,
                  ErrorContext{db_path, 0, 0, "", -1, "continue it with `dsrun resume " + id + " --force`, or remove it with `dsrun delete " + id + " --force`"});
    ::usleep(static_cast<useconds_t>(interval_s * 1e6));
  }
}

}  // namespace dsrun
