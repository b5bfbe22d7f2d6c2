#include "runner/ui.hpp"

#include <algorithm>
#include <cctype>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>

extern char** environ;

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "engine/common/clock.hpp"
#include "runner/history.hpp"
#include "runner/launcher.hpp"
#include "runner/report.hpp"
#include "runner/sweep.hpp"
#include "runner/terminal.hpp"
#include "storage/run_query.hpp"
#include "storage/store.hpp"

#ifdef DSRUN_WITH_HTTPLIB
#include "runner/gated_http_server.hpp"
#endif
#include <nlohmann/json.hpp>

#include <cmath>
#include <csignal>
#include <iostream>
#include <mutex>
#include <sstream>

namespace dsrun {

namespace {

// A Prometheus label value: backslash, double quote and newline escaped.
std::string label(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

}  // namespace

#ifdef DSRUN_WITH_HTTPLIB
namespace {

httplib::Server* serving = nullptr;
void on_stop(int) {
  if (serving) serving->stop();
}

bool loopback(const std::string& host) { return host == "127.0.0.1" || host == "::1" || host == "localhost"; }




// The runs a request asks for: ?where= (the history language, bound values only) and ?limit=.
std::vector<RunRecord> runs_of(const Store& store, const httplib::Request& req) {
  RunQuery q;
  q.limit = req.has_param("limit") ? std::max(1, std::min(10000, std::atoi(req.get_param_value("limit").c_str()))) : 200;
  q.where = req.has_param("where") ? req.get_param_value("where") : "";
  q.names = query_names();  // (the store sets its dialect)
  return store.query_runs(q);
}

nlohmann::json run_json(const Store& store, const RunRecord& r) {
  nlohmann::json j = {{"id", r.id}, {"name", r.name}, {"status", to_string(r.status)}, {"model", r.model}, {"hardware", r.hardware},
                      {"world_size", r.world_size}, {"created_at", r.created_at}, {"ended_at", r.ended_at}, {"error", r.error}};
  for (const auto& [key, m] : store.latest_metrics(r.id))
    if (key.find('/') == std::string::npos) j["metrics"][key] = {{"step", m.step}, {"value", m.value}};
  return j;
}

// A run's page: what it is, its plan, its events, and charts drawn here (SVG, no library fetched)
// that poll /api/runs/ID/metrics while the run trains.
const char* const kRunScript = R"JS(
const run = document.body.dataset.run, token = new URLSearchParams(location.search).get('token');
const q = token ? '&token=' + encodeURIComponent(token) : '';
const series = {};
async function poll(key) {
  const s = series[key] || (series[key] = {points: [], after: 0});
  const r = await fetch('/api/runs/' + run + '/metrics?key=' + key + '&after=' + s.after + q);
  if (!r.ok) return;
  for (const [step, value] of await r.json()) { s.points.push([step, value]); s.after = step; }
  draw(key, s.points);
}
function draw(key, pts) {
  const svg = document.getElementById('chart-' + key);
  if (!svg || pts.length == 0) return;
  const W = 560, H = 180, xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1), y0 = Math.min(...ys), y1 = Math.max(...ys, y0 + 1e-9);
  const px = p => 40 + (p[0] - x0) / (x1 - x0) * (W - 50), py = p => H - 20 - (p[1] - y0) / (y1 - y0) * (H - 30);
  svg.innerHTML = '<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="' + pts.map(p => px(p) + ',' + py(p)).join(' ') + '"/>' +
    '<text x="2" y="12" font-size="11">' + y1.toPrecision(4) + '</text><text x="2" y="' + (H - 22) + '" font-size="11">' + y0.toPrecision(4) + '</text>' +
    '<text x="40" y="' + (H - 4) + '" font-size="11">step ' + x0 + '</text><text x="' + (W - 80) + '" y="' + (H - 4) + '" font-size="11">step ' + x1 + '</text>';
  document.getElementById('points-' + key).textContent = pts.length + ' points, latest ' + pts[pts.length - 1][1].toPrecision(5);
}
async function tick() {
  for (const key of ['loss', 'val_loss', 'tokens_per_second']) await poll(key);
  if (document.body.dataset.status == 'running') setTimeout(tick, 2000);
}
tick();
)JS";

// Compare: each run's loss and val_loss overlaid, one colour a run (the legend's), polling while
// any of them trains.
const char* const kCompareScript = R"JS(
const runs = document.body.dataset.runs.split(','), token = new URLSearchParams(location.search).get('token');
const q = token ? '&token=' + encodeURIComponent(token) : '';
const colours = document.body.dataset.colours.split(',');  // (the table's headings are in the same colours)
async function chart(key) {
  const all = [];
  for (const run of runs) {
    const r = await fetch('/api/runs/' + run + '/metrics?key=' + key + q);
    all.push(r.ok ? await r.json() : []);
  }
  const svg = document.getElementById('chart-' + key), pts = all.flat();
  if (!svg || pts.length == 0) return;
  const W = 560, H = 200, xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1), y0 = Math.min(...ys), y1 = Math.max(...ys, y0 + 1e-9);
  const px = p => 40 + (p[0] - x0) / (x1 - x0) * (W - 50), py = p => H - 20 - (p[1] - y0) / (y1 - y0) * (H - 30);
  svg.innerHTML = all.map((s, i) => s.length ? '<polyline class="run-' + runs[i] + '" fill="none" stroke="' + colours[i % colours.length] +
      '" stroke-width="1.5" points="' + s.map(p => px(p) + ',' + py(p)).join(' ') + '"/>' : '').join('') +
    '<text x="2" y="12" font-size="11">' + y1.toPrecision(4) + '</text><text x="2" y="' + (H - 22) + '" font-size="11">' + y0.toPrecision(4) + '</text>' +
    '<text x="40" y="' + (H - 4) + '" font-size="11">step ' + x0 + '</text><text x="' + (W - 80) + '" y="' + (H - 4) + '" font-size="11">step ' + x1 + '</text>';
}
async function tick() {
  for (const key of ['loss', 'val_loss']) await chart(key);
  if (document.body.dataset.running == '1') setTimeout(tick, 2000);
}
tick();
)JS";

// A sweep's trials as parallel coordinates: an axis for each parameter the sweep varies (log-spaced
// where its values are positive and span more than 100x; strings and booleans as categories),
// the objective last (missing for trials without one); pruned trials dashed grey, failed ones
// red, the best thick; each line links to its run.
const char* const kSweepScript = R"JS(
const data = JSON.parse(document.getElementById('sweep-data').textContent);
// Keys and values come from a sweep's recipe, which a shared store's other users wrote: escaped.
const esc = v => String(v).replace(/[&<>"']/g, c => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;'})[c]);
const token = new URLSearchParams(location.search).get('token'), tq = token ? '?token=' + encodeURIComponent(token) : '';
const axes = data.parameters.map(k => ({key: k, get: t => t.params[k]})).concat([{key: data.metric + ' (' + data.goal + ')', get: t => t.objective}]);
const W = Math.max(400, 160 * axes.length), H = 320, axis_top = 30, axis_bottom = H - 40;  // (not `top`: a browser's window.top)
for (const a of axes) {
  const vals = data.trials.map(a.get).filter(v => v !== null && v !== undefined);
  a.categorical = vals.some(v => typeof v !== 'number');
  if (a.categorical) { a.cats = [...new Set(vals.map(String))]; a.pos = v => a.cats.length < 2 ? 0.5 : a.cats.indexOf(String(v)) / (a.cats.length - 1); continue; }
  const lo = Math.min(...vals), hi = Math.max(...vals);
  a.log = lo > 0 && hi / lo > 100;
  const f = a.log ? Math.log : (v => v);
  a.lo = lo; a.hi = hi;
  a.pos = v => hi == lo ? 0.5 : (f(v) - f(lo)) / (f(hi) - f(lo));
}
const x = i => 60 + i * (W - 120) / Math.max(1, axes.length - 1), y = p => axis_bottom - p * (axis_bottom - axis_top);
let svg = '';
axes.forEach((a, i) => {
  svg += '<line x1="' + x(i) + '" y1="' + axis_top + '" x2="' + x(i) + '" y2="' + axis_bottom + '" stroke="#999"/>' +
    '<text x="' + (x(i) - 50) + '" y="' + (H - 22) + '" font-size="11">' + esc(a.key) + (a.log ? ' (log)' : '') + '</text>';
  const ends = a.categorical ? [a.cats[0], a.cats[a.cats.length - 1]] : [a.lo, a.hi].map(v => v === undefined ? '' : Number(v).toPrecision(3));
  svg += '<text x="' + (x(i) + 4) + '" y="' + (axis_bottom + 12) + '" font-size="10">' + esc(ends[0]) + '</text><text x="' + (x(i) + 4) + '" y="' + (axis_top - 4) + '" font-size="10">' + esc(ends[1]) + '</text>';
});
for (const t of data.trials) {
  const pts = [];
  axes.forEach((a, i) => { const v = a.get(t); if (v !== null && v !== undefined) pts.push(x(i) + ',' + y(a.pos(v))); });
  const best = t.run == data.best_run, cls = 'trial ' + t.status + (best ? ' best' : '');
  const stroke = best ? '#ff7f0e' : t.status == 'pruned' ? '#aaa' : t.status == 'finished' ? '#1f77b4' : '#d62728';
  svg += '<a href="/run/' + esc(t.run) + tq + '"><polyline class="' + esc(cls) + '" data-run="' + esc(t.run) + '" fill="none" stroke="' + stroke + '" stroke-width="' + (best ? 3 : 1.5) + '"' +
    (t.status == 'pruned' ? ' stroke-dasharray="4 3"' : '') + ' points="' + pts.join(' ') + '"><title>trial ' + esc(t.trial) + ' (' + esc(t.status) + ')</title></polyline></a>';
}
const el = document.getElementById('coordinates');
el.setAttribute('width', W); el.setAttribute('height', H); el.innerHTML = svg;
)JS";

// A token given in the address travels with the page's links and forms (escaped for attributes).
std::string token_query(const httplib::Request& req) { return req.has_param("token") ? "?token=" + html_escape(req.get_param_value("token")) : ""; }
std::string token_field(const httplib::Request& req) {
  return req.has_param("token") ? "<input type=\"hidden\" name=\"token\" value=\"" + html_escape(req.get_param_value("token")) + "\">" : "";
}

// `body_attributes`: what the page's script reads (data-run=..., already escaped).
std::string page(const std::string& title, const std::string& body, const std::string& body_attributes = "") {
  return "<!doctype html><html><head><meta charset=\"utf-8\"><title>" + html_escape(title) +
         "</title><style>body{font:14px sans-serif;margin:2em}table{border-collapse:collapse}td,th{padding:3px 10px;border-bottom:1px solid #ddd;text-align:left}"
         ".failed,.lost{color:#b00}.running{color:#06c}input[name=where]{width:40em}</style></head><body" +
         body_attributes + ">" +
         body + "</body></html>";
}

}  // namespace
#endif

namespace {
// A sample's value as the exposition format writes it: exact (a program reads it back; six digits
// would round a loss and a byte count), with the format's own spellings of NaN and infinities.
std::string sample_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return format_double_exact(v);
}
}  // namespace

std::string prometheus_metrics(const Store& store) {
  struct Series {
    const char* name;
    const char* help;
    std::vector<std::string> keys;  // the metric keys it reads, the first present wins
  };
  static const Series kSeries[] = {{"dsrun_run_step", "The latest step of each running run.", {"loss"}},
                                   {"dsrun_run_loss", "The latest training loss of each running run.", {"loss"}},
                                   {"dsrun_run_val_loss", "The latest validation loss of each running run.", {"val_loss"}},
                                   {"dsrun_run_tokens_per_second", "Tokens (images for ResNet) per second at the latest step.", {"tokens_per_second"}},
                                   {"dsrun_run_mfu", "Model FLOPs utilisation at the latest step (0-1).", {"mfu"}},
                                   {"dsrun_run_step_seconds", "Seconds the latest step took.", {"step_seconds"}}};
  RunListOptions running;
  running.limit = 100000;
  running.status = "running";
  const std::vector<RunRecord> runs = store.list_runs(running);
  std::ostringstream out;
  auto labels = [](const RunRecord& r) { return "{run_id=\"" + label(r.id) + "\",name=\"" + label(r.name) + "\",node=\"" + label(r.host) + "\"}"; };
  std::vector<std::map<std::string, MetricValue>> latest;
  for (const RunRecord& r : runs) latest.push_back(store.latest_metrics(r.id));
  for (const Series& s : kSeries) {
    out << "# HELP " << s.name << " " << s.help << "\n# TYPE " << s.name << " gauge\n";
    for (size_t i = 0; i < runs.size(); ++i)
      for (const std::string& key : s.keys)
        if (auto it = latest[i].find(key); it != latest[i].end()) {
          const double v = std::string(s.name) == "dsrun_run_step" ? static_cast<double>(it->second.step) : it->second.value;
          out << s.name << labels(runs[i]) << " " << sample_value(v) << "\n";
          break;
        }
  }
  out << "# HELP dsrun_run_device_peak_bytes The largest device peak over a running run's ranks.\n# TYPE dsrun_run_device_peak_bytes gauge\n";
  for (size_t i = 0; i < runs.size(); ++i) {
    double peak = -1;
    for (const auto& [key, m] : latest[i])
      if (key.rfind("memory/rank", 0) == 0 && key.size() > 21 && key.compare(key.size() - 21, 21, "/peak_allocated_bytes") == 0) peak = std::max(peak, m.value);
    if (peak >= 0) out << "dsrun_run_device_peak_bytes" << labels(runs[i]) << " " << sample_value(peak) << "\n";
  }
  out << "# HELP dsrun_run_running 1 for each run the store has running.\n# TYPE dsrun_run_running gauge\n";
  for (const RunRecord& r : runs) out << "dsrun_run_running" << labels(r) << " 1\n";
  return out.str();
}

#ifndef DSRUN_WITH_HTTPLIB
int command_ui(const UiOptions&) {
  throw Error("this dsrun was built without cpp-httplib: no dsrun ui", ErrorContext{"", 0, 0, "", -1, "install libcpp-httplib-dev (setup.sh does) and rebuild"});
}
#else
int command_ui(const UiOptions& o) {
  std::string token = o.token;
  if (!o.token_file.empty()) token = trim(read_file(o.token_file));
  if (!loopback(o.host) && token.empty()) {
    ErrorContext c;
    c.key = "--host";
    c.hint = "give --token TOKEN (or --token-file FILE), which every request must then carry, or keep the default 127.0.0.1";
    throw Error("--host " + o.host + " would serve every run's recipe, config and metrics to the network without a token", c);
  }
  if (!store_exists(o.db_path)) throw Error("no run store here", ErrorContext{o.db_path, 0, 0, "", -1, "run a recipe first, or pass --db"});
  Store store(o.db_path);
  std::mutex store_mutex;  // one connection: requests take turns
  // Browsers keep idle connections open, each holding a worker: more workers, a short keep-alive,
  // so that a few open tabs never leave a scraper or a poll waiting; a header deadline and a few
  // connections per address, so that slow or greedy clients cannot hold them all.
  GatedHttpServer server(ConnectionLimits{});
  server.new_task_queue = [] { return new httplib::ThreadPool(32); };
  // Read-only: GET alone, every request with the token when there is one.
  server.set_pre_routing_handler([&](const httplib::Request& req, httplib::Response& res) {
    if (req.method != "GET" && req.method != "HEAD") {
      res.status = 405;
      res.set_content("dsrun ui is read-only\n", "text/plain");
      return httplib::Server::HandlerResponse::Handled;
    }
    if (token.empty()) return httplib::Server::HandlerResponse::Unhandled;
    // The scheme is case-insensitive (RFC 7235): "Bearer", "bearer", "BEARER" alike.
    const std::string authorization = trim(req.get_header_value("Authorization"));
    const size_t blank = authorization.find(' ');
    std::string scheme = authorization.substr(0, blank);
    std::transform(scheme.begin(), scheme.end(), scheme.begin(), [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
    const bool bearer = scheme == "bearer" && blank != std::string::npos && trim(authorization.substr(blank + 1)) == token;
    if (bearer || (req.has_param("token") && req.get_param_value("token") == token)) return httplib::Server::HandlerResponse::Unhandled;
    res.status = 401;
    res.set_content("a token is required (Authorization: Bearer TOKEN, or ?token=TOKEN)\n", "text/plain");
    return httplib::Server::HandlerResponse::Handled;
  });
  // Runs whose launcher died are marked lost (and their failed alerts sent) as `dsrun history`
  // does: by a `dsrun history` of its own, at most every 10 s, since marking one forks its alert
  // delivery and this server has threads (fork is safe only from the single-threaded commands).
  double last_lost_check = 0;
  auto mark_lost = [&] {
    if (steady_seconds() - last_lost_check < 10) return;
    last_lost_check = steady_seconds();
    const std::string self = path_join(executable_directory(), "dsrun");
    std::vector<std::string> argv{self, "history", "--limit", "1", "--db", o.db_path};
    std::vector<char*> args;
    for (std::string& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
    pid_t pid = -1;
    if (posix_spawn(&pid, self.c_str(), &actions, nullptr, args.data(), environ) == 0) {
      int status = 0;
      ::waitpid(pid, &status, 0);
    }
    posix_spawn_file_actions_destroy(&actions);
  };
  auto guarded = [&](auto&& handler) {
    return [&, handler](const httplib::Request& req, httplib::Response& res) {
      std::lock_guard<std::mutex> lock(store_mutex);
      mark_lost();
      res.set_header("Cache-Control", "no-store");  // live figures: a browser never shows a stale one
      try {
        handler(req, res);
      } catch (const Error& e) {  // a bad --where, above all: the page says what, as the CLI does
        // ... but not where the store is: its file, user, host and database stay off the page.
        res.status = 400;
        res.set_content(std::string(e.what()) + (e.context().key.empty() ? "" : " (" + e.context().key + ")") +
                            (e.context().hint.empty() ? "" : "\n  fix: " + e.context().hint) + "\n",
                        "text/plain");
      }
    };
  };
  server.Get("/metrics", guarded([&](const httplib::Request&, httplib::Response& res) {
    res.set_content(prometheus_metrics(store), "text/plain; version=0.0.4");
  }));
  server.Get("/api/runs", guarded([&](const httplib::Request& req, httplib::Response& res) {
    nlohmann::json runs = nlohmann::json::array();
    for (const RunRecord& r : runs_of(store, req)) runs.push_back(run_json(store, r));
    res.set_content(runs.dump(), "application/json");
  }));
  server.Get(R"(/api/runs/([0-9a-zA-Z_.-]+)/metrics)", guarded([&](const httplib::Request& req, httplib::Response& res) {
    const std::string id = store.resolve_run(req.matches[1]);
    const std::string key = req.has_param("key") ? req.get_param_value("key") : "loss";
    const int64_t after = req.has_param("after") ? std::atoll(req.get_param_value("after").c_str()) : -1;
    nlohmann::json points = nlohmann::json::array();
    for (const MetricValue& m : store.metric_history(id, key))
      if (m.step > after) points.push_back({m.step, m.value});
    res.set_content(points.dump(), "application/json");
  }));
  server.Get(R"(/api/runs/([0-9a-zA-Z_.-]+))", guarded([&](const httplib::Request& req, httplib::Response& res) {
    const RunRecord r = store.get_run(store.resolve_run(req.matches[1]));
    nlohmann::json j = run_json(store, r);
    j["config_toml"] = r.config_toml;
    j["plan_text"] = r.plan_text;
    for (const EventRecord& e : store.events(r.id)) j["events"].push_back({{"time", e.time}, {"kind", e.kind}, {"rank", e.rank}, {"message", e.message}});
    for (const NodeRecord& n : store.nodes(r.id)) j["nodes"].push_back({{"node", n.node_rank}, {"host", n.host}, {"status", n.status}, {"restarts", n.restarts}});
    res.set_content(j.dump(), "application/json");
  }));
  server.Get(R"(/run/([0-9a-zA-Z_.-]+))", guarded([&](const httplib::Request& req, httplib::Response& res) {
    const RunRecord r = store.get_run(store.resolve_run(req.matches[1]));
    std::string events;
    for (const EventRecord& e : store.events(r.id))
      events += "<tr><td>" + format_time(e.time) + "</td><td>" + html_escape(e.kind) + "</td><td>" + html_escape(e.message) + "</td></tr>";
    std::string charts;
    for (const char* key : {"loss", "val_loss", "tokens_per_second"})
      charts += std::string("<h3>") + key + " <small id=\"points-" + key + "\"></small></h3><svg id=\"chart-" + key + "\" width=\"560\" height=\"180\"></svg>";
    std::string beside = "<table id=\"plan-beside-measured\"><tr><th>quantity</th><th>plan</th><th>measured</th><th>error</th></tr>";
    for (const PlanBesideMeasured& row : plan_beside_measured(store, r))
      beside += "<tr><td>" + html_escape(row.quantity) + "</td><td>" + html_escape(row.predicted_text) + "</td><td>" + html_escape(row.measured_text) + "</td><td>" +
                (std::isfinite(row.error_percent) ? html_escape(format_double(row.error_percent, 3)) + "%" : "-") + "</td></tr>";
    beside += "</table>";
    std::string checkpoints;
    for (const CheckpointRecord& c : store.checkpoints(r.id))
      checkpoints += "<tr><td>" + std::to_string(c.step) + "</td><td>" + html_escape(c.path) + "</td><td>" + format_bytes(static_cast<double>(c.bytes)) + "</td><td>" +
                     format_time(c.created_at) + "</td></tr>";
    std::string nodes;
    for (const NodeRecord& n : store.nodes(r.id))
      nodes += "<tr><td>" + std::to_string(n.node_rank) + "</td><td>" + html_escape(n.host) + "</td><td class=\"" + html_escape(n.status) + "\">" + html_escape(n.status) +
               "</td><td>" + std::to_string(n.restarts) + "</td><td>" + html_escape(n.error) + "</td></tr>";
    const std::string body = "<p><a href=\"/\">runs</a></p><h1>" + html_escape(r.id) + " " + html_escape(r.name) + " <span class=\"" + to_string(r.status) + "\">" +
                             to_string(r.status) + "</span></h1>" + (r.error.empty() ? "" : "<pre class=\"failed\">" + html_escape(r.error) + "</pre>") + charts +
                             "<h2>The plan beside what was measured</h2>" + beside +
                             "<h2>Nodes <small>(a row for each node of a run over several)</small></h2><table id=\"nodes\"><tr><th>node</th><th>host</th><th>status</th><th>restarts</th><th>error</th></tr>" + nodes + "</table>" +
                             "<h2>Checkpoints</h2><table id=\"checkpoints\"><tr><th>step</th><th>path</th><th>size</th><th>saved</th></tr>" + checkpoints + "</table>" +
                             "<h2>Plan</h2><pre>" + html_escape(r.plan_text) + "</pre><h2>Events</h2><table>" + events + "</table><h2>Config</h2><pre>" +
                             html_escape(r.config_toml) + "</pre><script>" + kRunScript + "</script>";
    res.set_content(page("dsrun " + r.id, body, " data-run=\"" + html_escape(r.id) + "\" data-status=\"" + to_string(r.status) + "\""), "text/html; charset=utf-8");
  }));
  // Two or more runs: their curves overlaid and the config keys where they differ.
  server.Get("/compare", guarded([&](const httplib::Request& req, httplib::Response& res) {
    std::vector<RunRecord> runs;
    for (size_t i = 0; i < req.get_param_value_count("run"); ++i) runs.push_back(store.get_run(store.resolve_run(req.get_param_value("run", i))));
    if (runs.size() < 2) throw Error("compare needs at least two runs", ErrorContext{"", 0, 0, "run", -1, "/compare?run=ID&run=ID, or tick two runs on the runs page"});
    std::vector<std::map<std::string, std::string>> configs;
    std::string ids, head = "<tr><th>key</th>", finals, running = "0", colours;
    static const char* const kColours[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"};
    std::vector<std::map<std::string, MetricValue>> latest;  // each run's, read once
    for (size_t i = 0; i < runs.size(); ++i) {
      const RunRecord& r = runs[i];
      configs.push_back(flat_toml(r.config_toml));
      latest.push_back(store.latest_metrics(r.id));
      ids += (i ? "," : "") + r.id;
      colours += (i ? "," : "") + std::string(kColours[i % 8]);
      head += "<th style=\"color:" + std::string(kColours[i % 8]) + "\">" + html_escape(r.id) + " " + html_escape(r.name) + "</th>";
      finals += "<td class=\"" + std::string(to_string(r.status)) + "\">" + to_string(r.status) + "</td>";
      if (r.status == RunStatus::Running) running = "1";
    }
    std::string diff;
    for (const auto& row : differences(configs, false)) {
      diff += "<tr class=\"differs\"><td>" + html_escape(row[0]) + "</td>";
      for (size_t i = 1; i < row.size(); ++i) diff += "<td>" + html_escape(row[i]) + "</td>";
      diff += "</tr>";
    }
    std::string metrics;
    for (const char* key : {"loss", "val_loss", "tokens_per_second", "step_seconds"}) {
      metrics += std::string("<tr><td>") + key + " (latest)</td>";
      for (const auto& run_latest : latest) {
        const auto it = run_latest.find(key);
        metrics += "<td>" + (it == run_latest.end() ? std::string("-") : html_escape(format_double(it->second.value, 5)) + " @" + std::to_string(it->second.step)) + "</td>";
      }
      metrics += "</tr>";
    }
    std::string charts;
    for (const char* key : {"loss", "val_loss"}) charts += std::string("<h3>") + key + "</h3><svg id=\"chart-" + key + "\" width=\"560\" height=\"200\"></svg>";
    const std::string body = "<p><a href=\"/\">runs</a></p><h1>Compare</h1><table>" + head + "</tr><tr><td>status</td>" + finals + "</tr>" + metrics + "</table>" + charts +
                             "<h2>Config: the keys that differ</h2><table id=\"config-diff\">" + head + "</tr>" +
                             (diff.empty() ? "<tr><td>(the configs are the same)</td></tr>" : diff) + "</table><script>" + kCompareScript + "</script>";
    res.set_content(page("dsrun compare", body, " data-runs=\"" + html_escape(ids) + "\" data-running=\"" + running + "\" data-colours=\"" + colours + "\""),
                    "text/html; charset=utf-8");
  }));
  server.Get(R"(/api/sweeps/([0-9a-zA-Z_.-]+))", guarded([&](const httplib::Request& req, httplib::Response& res) {
    res.set_content(sweep_leaderboard(store, req.matches[1]).dump(), "application/json");
  }));
  server.Get(R"(/sweep/([0-9a-zA-Z_.-]+))", guarded([&](const httplib::Request& req, httplib::Response& res) {
    const nlohmann::json board = sweep_leaderboard(store, req.matches[1]);
    const std::string token_query = dsrun::token_query(req);
    std::string rows;
    for (const auto& t : board["trials"]) {
      const std::string run = t["run"].get<std::string>();
      rows += "<tr><td>" + std::to_string(t["trial"].get<int64_t>()) + "</td><td><a href=\"/run/" + html_escape(run) + token_query + "\">" + html_escape(run) + "</a></td><td class=\"" +
              html_escape(t["status"].get<std::string>()) + "\">" + html_escape(t["status"].get<std::string>()) + "</td><td>" +
              (t["objective"].is_null() ? "-" : html_escape(format_double(t["objective"].get<double>(), 5))) + "</td><td>" + html_escape(t["params"].dump()) + "</td></tr>";
    }
    std::string data = board.dump();
    for (size_t at = data.find("</"); at != std::string::npos; at = data.find("</", at + 3)) data.replace(at, 2, "<\\/");  // (inside a script element)
    const std::string best = board["best_run"].get<std::string>();
    const std::string body = "<p><a href=\"/\">runs</a></p><h1>Sweep " + html_escape(board["sweep"].get<std::string>()) + " " + html_escape(board["name"].get<std::string>()) +
                             " <span class=\"" + html_escape(board["status"].get<std::string>()) + "\">" + html_escape(board["status"].get<std::string>()) + "</span></h1>" +
                             (best.empty() ? "" : "<p>best run: <a id=\"best\" href=\"/run/" + html_escape(best) + token_query + "\">" + html_escape(best) + "</a></p>") +
                             "<svg id=\"coordinates\"></svg><p><small>pruned trials dashed grey, failed red, the best thick orange</small></p>"
                             "<table><tr><th>trial</th><th>run</th><th>status</th><th>" + html_escape(board["metric"].get<std::string>()) + "</th><th>values</th></tr>" + rows +
                             "</table><script type=\"application/json\" id=\"sweep-data\">" + data + "</script><script>" + kSweepScript + "</script>";
    res.set_content(page("dsrun sweep " + board["sweep"].get<std::string>(), body), "text/html; charset=utf-8");
  }));
  server.Get("/", guarded([&](const httplib::Request& req, httplib::Response& res) {
    const std::string where = req.has_param("where") ? req.get_param_value("where") : "";
    const std::string token_query = dsrun::token_query(req);
    std::string rows;
    for (const RunRecord& r : runs_of(store, req)) {
      const auto latest = store.latest_metrics(r.id);
      const auto loss = latest.find("loss");
      const std::string sweep = r.sweep_id.empty() ? "" : "<a href=\"/sweep/" + html_escape(r.sweep_id) + token_query + "\">" + html_escape(r.sweep_id) + "</a>";
      rows += "<tr><td><input type=\"checkbox\" name=\"run\" value=\"" + html_escape(r.id) + "\"></td><td><a href=\"/run/" + html_escape(r.id) + token_query + "\">" + html_escape(r.id) +
              "</a></td><td>" + html_escape(r.name) + "</td><td class=\"" + to_string(r.status) + "\">" + to_string(r.status) +
              "</td><td>" + html_escape(r.model) + "</td><td>" + html_escape(r.hardware) + "</td><td>" + sweep + "</td><td>" + (loss != latest.end() ? std::to_string(loss->second.step) : "") +
              "</td><td>" + (loss != latest.end() ? html_escape(std::to_string(loss->second.value)) : "") + "</td><td>" + format_time(r.created_at) + "</td></tr>";
    }
    const std::string token_field = dsrun::token_field(req);
    res.set_content(page("dsrun runs", "<h1>Runs</h1><form><input name=\"where\" value=\"" + html_escape(where) +
                                           "\" placeholder=\"optimizer.lr > 1e-4 and metrics.val_loss < 2.5\"> <button>filter</button>" + token_field +
                                           "</form><form action=\"/compare\">" + token_field + "<table><tr><th></th><th>id</th><th>name</th>"
                                           "<th>status</th><th>model</th><th>hardware</th><th>sweep</th><th>step</th><th>loss</th><th>created</th></tr>" +
                                           rows + "</table><button>compare the ticked runs</button></form><p><a href=\"/metrics\">/metrics</a> · <a href=\"/api/runs\">/api/runs</a></p>"),
                    "text/html; charset=utf-8");
  }));
  const int port = server.bind(o.host, o.port);
  if (port < 0) throw Error("cannot listen on " + o.host + ":" + std::to_string(o.port), ErrorContext{"", 0, 0, "--port", -1, "choose another --port, or stop what holds it"});
  serving = &server;
  std::signal(SIGINT, on_stop);
  std::signal(SIGTERM, on_stop);
  std::cout << "dsrun ui: http://" << o.host << ":" << port << "/ (runs), /metrics (Prometheus), /api/runs; read-only; Ctrl-C stops" << std::endl;
  server.listen_after_bind();
  serving = nullptr;
  return 0;
}

#endif

}  // namespace dsrun
