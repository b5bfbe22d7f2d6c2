#include "runner/report.hpp"

#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "runner/terminal.hpp"
#include "storage/store.hpp"

#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <tuple>

namespace dsrun {

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

namespace {

std::string escape(const std::string& s) { return html_escape(s); }

const char* const kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"};

// 4-6 round tick values covering [lo, hi].
std::vector<double> ticks(double lo, double hi) {
  const double span = hi - lo;
  const double raw = span / 5;
  const double mag = std::pow(10, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0})
    if (raw <= m * mag) {
      step = m * mag;
      break;
    }
  std::vector<double> out;
  for (double v = std::ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push_back(std::fabs(v) < step * 1e-9 ? 0 : v);
  return out;
}

struct Series {
  std::string label;
  std::string color;
  std::vector<MetricValue> points;
};

// A line chart in SVG: axes with ticks, one polyline per series, a legend.
std::string svg_chart(const std::string& title, const std::vector<Series>& series) {
  const double W = 600, H = 260, left = 70, right = 20, top = 30, bottom = 40;
  double x0 = 1e300, x1 = -1e300, y0 = 1e300, y1 = -1e300;
  for (const auto& s : series)
    for (const auto& p : s.points) {
      if (!std::isfinite(p.value)) continue;
      x0 = std::min(x0, static_cast<double>(p.step));
      x1 = std::max(x1, static_cast<double>(p.step));
      y0 = std::min(y0, p.value);
      y1 = std::max(y1, p.value);
    }
  if (x0 > x1) return "";
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) {
    y0 -= std::fabs(y0) * 0.05 + 1e-12;
    y1 += std::fabs(y1) * 0.05 + 1e-12;
  }
  const double pad = (y1 - y0) * 0.05;
  y0 -= pad;
  y1 += pad;
  auto X = [&](double x) { return left + (x - x0) / (x1 - x0) * (W - left - right); };
  auto Y = [&](double y) { return top + (1 - (y - y0) / (y1 - y0)) * (H - top - bottom); };
  std::string s = "<svg class=\"chart\" data-metric=\"" + escape(title) + "\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" + format_double(W, 6) + "\" height=\"" +
                  format_double(H, 6) + "\" viewBox=\"0 0 " + format_double(W, 6) + " " + format_double(H, 6) + "\" role=\"img\" aria-label=\"" + escape(title) + "\">\n";
  s += "<text x=\"" + format_double(left, 6) + "\" y=\"18\" class=\"title\">" + escape(title) + "</text>\n";
  s += "<rect x=\"" + format_double(left, 6) + "\" y=\"" + format_double(top, 6) + "\" width=\"" + format_double(W - left - right, 6) + "\" height=\"" +
       format_double(H - top - bottom, 6) + "\" class=\"frame\"/>\n";
  for (double t : ticks(y0, y1)) {
    s += "<line x1=\"" + format_double(left, 6) + "\" x2=\"" + format_double(W - right, 6) + "\" y1=\"" + format_double(Y(t), 6) + "\" y2=\"" + format_double(Y(t), 6) +
         "\" class=\"grid\"/><text x=\"" + format_double(left - 6, 6) + "\" y=\"" + format_double(Y(t) + 4, 6) + "\" class=\"ylabel\">" + format_double(t, 4) + "</text>\n";
  }
  for (double t : ticks(x0, x1))
    s += "<text x=\"" + format_double(X(t), 6) + "\" y=\"" + format_double(H - bottom + 16, 6) + "\" class=\"xlabel\">" + format_double(t, 6) + "</text>\n";
  s += "<text x=\"" + format_double(W - right, 6) + "\" y=\"" + format_double(H - 6, 6) + "\" class=\"xlabel end\">step</text>\n";
  double legend_y = top + 14;
  for (const auto& ser : series) {
    std::string pts;
    for (const auto& p : ser.points)
      if (std::isfinite(p.value)) pts += format_double(X(static_cast<double>(p.step)), 6) + "," + format_double(Y(p.value), 6) + " ";
    if (ser.points.size() == 1) {
      s += "<circle cx=\"" + format_double(X(static_cast<double>(ser.points[0].step)), 6) + "\" cy=\"" + format_double(Y(ser.points[0].value), 6) + "\" r=\"3\" fill=\"" + ser.color + "\"/>\n";
    }
    s += "<polyline class=\"series\" data-run=\"" + escape(ser.label) + "\" fill=\"none\" stroke=\"" + ser.color + "\" stroke-width=\"1.6\" points=\"" + pts + "\"/>\n";
    s += "<text x=\"" + format_double(W - right - 6, 6) + "\" y=\"" + format_double(legend_y, 6) + "\" class=\"legend\" fill=\"" + ser.color + "\">" + escape(ser.label) + "</text>\n";
    legend_y += 14;
  }
  s += "</svg>\n";
  return s;
}

// Bars: for each label, a measured and a predicted value (memory per rank against the plan).
std::string svg_bars(const std::string& title, const std::vector<std::tuple<std::string, double, double>>& bars) {
  if (bars.empty()) return "";
  auto value_label = [](double measured, double predicted) { return format_bytes(measured) + " / " + format_bytes(predicted); };
  size_t longest = 0;
  for (const auto& [label, measured, predicted] : bars) longest = std::max(longest, value_label(measured, predicted).size());
  // The longest bar's value label must fit to its right: about 7 px a character at 11 px.
  const double W = 600, row = 26, top = 30, left = 170, right = 12 + 7 * static_cast<double>(longest);
  const double H = top + row * static_cast<double>(bars.size()) + 24;
  double most = 0;
  for (const auto& [label, measured, predicted] : bars) most = std::max({most, measured, predicted});
  if (most <= 0) return "";
  auto len = [&](double v) { return (W - left - right) * v / most; };
  std::string s = "<svg class=\"chart\" data-metric=\"" + escape(title) + "\" xmlns=\"http://www.w3.org/2000/svg\" width=\"" + format_double(W, 6) + "\" height=\"" +
                  format_double(H, 6) + "\" role=\"img\" aria-label=\"" + escape(title) + "\">\n<text x=\"8\" y=\"18\" class=\"title\">" + escape(title) +
                  " (dark: measured, light: plan)</text>\n";
  double y = top;
  for (const auto& [label, measured, predicted] : bars) {
    s += "<text x=\"" + format_double(left - 6, 6) + "\" y=\"" + format_double(y + 15, 6) + "\" class=\"ylabel\">" + escape(label) + "</text>\n";
    s += "<rect class=\"bar predicted\" x=\"" + format_double(left, 6) + "\" y=\"" + format_double(y + 2, 6) + "\" width=\"" + format_double(len(predicted), 6) +
         "\" height=\"9\" fill=\"#9ecae1\"/>\n";
    s += "<rect class=\"bar measured\" x=\"" + format_double(left, 6) + "\" y=\"" + format_double(y + 12, 6) + "\" width=\"" + format_double(len(measured), 6) +
         "\" height=\"9\" fill=\"#08519c\"/>\n";
    s += "<text x=\"" + format_double(left + len(std::max(measured, predicted)) + 4, 6) + "\" y=\"" + format_double(y + 15, 6) + "\" class=\"legend\" style=\"text-anchor:start\">" +
         escape(value_label(measured, predicted)) + "</text>\n";
    y += row;
  }
  s += "</svg>\n";
  return s;
}

}  // namespace

std::string render_report_html(const Store& store, const std::vector<std::string>& run_ids) {
  std::vector<RunRecord> runs;
  for (const auto& id : run_ids) runs.push_back(store.get_run(id));
  std::string title = runs.size() == 1 ? "dsrun report: run " + runs[0].id : "dsrun report: " + std::to_string(runs.size()) + " runs";
  std::string h = "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>" + escape(title) + "</title>\n<style>\n"
                  "body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1360px}h1{font-size:22px}h2{font-size:18px;margin-top:28px}"
                  "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
                  "pre{background:#f6f6f6;padding:8px;font-size:12px;overflow:auto;max-height:420px}"
                  ".charts{display:flex;flex-wrap:wrap;gap:12px}.chart{background:#fff;border:1px solid #ddd}"
                  ".chart .title{font-size:13px;font-weight:600}.chart .frame{fill:none;stroke:#999}.chart .grid{stroke:#eee}"
                  ".chart .ylabel{font-size:10px;text-anchor:end}.chart .xlabel{font-size:10px;text-anchor:middle}.chart .end{text-anchor:end}"
                  ".chart .legend{font-size:11px;text-anchor:end}.swatch{display:inline-block;width:12px;height:12px;margin-right:4px}\n"
                  "</style></head><body>\n<h1>" + escape(title) + "</h1>\n";
  h += "<table id=\"runs\"><tr><th></th><th>run</th><th>name</th><th>status</th><th>model</th><th>hardware</th><th>ranks</th><th>ZeRO</th><th>created</th><th>duration</th></tr>\n";
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto& r = runs[i];
    const std::string duration = r.started_at > 0 && r.ended_at > 0 ? format_seconds(r.ended_at - r.started_at) : "";
    h += "<tr><td><span class=\"swatch\" style=\"background:" + std::string(kColors[i % 8]) + "\"></span></td><td>" + escape(r.id) + "</td><td>" + escape(r.name) +
         "</td><td>" + to_string(r.status) + "</td><td>" + escape(r.model) + "</td><td>" + escape(r.hardware) + "</td><td>" + std::to_string(r.world_size) +
         "</td><td>" + std::to_string(r.zero_stage) + "</td><td>" + escape(format_time(r.created_at)) + "</td><td>" + escape(duration) + "</td></tr>\n";
  }
  h += "</table>\n<h2>Metrics</h2>\n<div class=\"charts\">\n";
  for (const char* metric : {"loss", "val_loss", "lr", "grad_norm", "tokens_per_second", "step_seconds", "accuracy", "val_accuracy", "aux_loss", "loss_scale",
                             "expert_load_max", "dropped_tokens"}) {
    std::vector<Series> series;
    for (size_t i = 0; i < runs.size(); ++i) {
      auto points = store.metric_history(runs[i].id, metric);
      if (!points.empty()) series.push_back({runs[i].id, kColors[i % 8], points});
    }
    if (!series.empty()) h += svg_chart(metric, series);
  }
  // MoE runs: each layer's expert load (busiest expert's tokens over the mean), one chart per run.
  for (const auto& r : runs) {
    std::vector<Series> layers;
    for (const auto& [name, latest] : store.latest_metrics(r.id))
      if (name.rfind("expert_load/", 0) == 0)
        layers.push_back({"layer " + name.substr(12), kColors[layers.size() % 8], store.metric_history(r.id, name)});
    if (!layers.empty()) h += svg_chart("expert load by layer (busiest/mean), " + r.id, layers);
  }
  h += "</div>\n<h2>Memory per rank</h2>\n";
  std::vector<std::tuple<std::string, double, double>> bars;  // model states: measured vs plan, per rank
  for (const auto& r : runs) {
    std::map<std::string, std::map<std::string, double>> by_rank;
    for (const auto& [k, m] : store.latest_metrics(r.id))
      if (k.rfind("memory/", 0) == 0 && k.find('/', 7) != std::string::npos) by_rank[k.substr(7, k.find('/', 7) - 7)][k.substr(k.find('/', 7) + 1)] = m.value;
    for (auto& [rank, v] : by_rank)
      if (v.count("model_state_bytes") && v.count("predicted_model_state_bytes"))
        bars.emplace_back(r.id + " " + rank, v["model_state_bytes"], v["predicted_model_state_bytes"]);
  }
  h += "<div class=\"charts\">" + svg_bars("model states per rank", bars) + "</div>\n<table id=\"memory\"><tr><th>run</th><th>rank</th><th>model states</th><th>predicted model states</th><th>peak</th><th>predicted total</th></tr>\n";
  for (const auto& r : runs) {
    std::map<std::string, std::map<std::string, double>> by_rank;
    for (const auto& [k, m] : store.latest_metrics(r.id))
      if (k.rfind("memory/", 0) == 0) {
        const size_t slash = k.find('/', 7);
        if (slash != std::string::npos) by_rank[k.substr(7, slash - 7)][k.substr(slash + 1)] = m.value;
      }
    for (auto& [rank, v] : by_rank) {
      auto bytes = [&](const char* key) { return v.count(key) ? format_bytes(v[key]) : std::string("-"); };
      const char* peak = v.count("peak_allocated_bytes") ? "peak_allocated_bytes" : "peak_rss_bytes";
      h += "<tr><td>" + escape(r.id) + "</td><td>" + escape(rank) + "</td><td>" + bytes("model_state_bytes") + "</td><td>" + bytes("predicted_model_state_bytes") + "</td><td>" +
           bytes(peak) + "</td><td>" + bytes("predicted_total_bytes") + "</td></tr>\n";
    }
  }
  h += "</table>\n";
  for (const auto& r : runs) {
    h += "<h2>Run " + escape(r.id) + " (" + escape(r.name) + ")</h2>\n";
    if (!r.error.empty()) h += "<p><b>error:</b> " + escape(r.error) + "</p>\n";
    h += "<h3>Recipe as written (" + escape(r.recipe_path) + ")</h3>\n<pre>" + escape(r.recipe_text) + "</pre>\n";
    h += "<h3>Plan</h3>\n<pre>" + escape(r.plan_text) + "</pre>\n";
    h += "<h3>Events</h3>\n<table class=\"events\"><tr><th>time</th><th>kind</th><th>rank</th><th>message</th></tr>\n";
    for (const auto& e : store.events(r.id))
      h += "<tr><td>" + escape(format_time(e.time)) + "</td><td>" + escape(e.kind) + "</td><td>" + (e.rank >= 0 ? std::to_string(e.rank) : "") + "</td><td>" + escape(e.message) +
           "</td></tr>\n";
    h += "</table>\n";
  }
  h += "<p style=\"color:#888;font-size:12px\">written by dsrun report</p>\n</body></html>\n";
  return h;
}

int command_report(const std::vector<std::string>& queries, const std::string& output, const std::string& db_path) {
  if (!store_exists(db_path)) throw Error("no run store here", ErrorContext{db_path, 0, 0, "", -1, "run a recipe first, or pass --db"});
  Store store(db_path);
  std::vector<std::string> ids;
  for (const auto& q : queries) {
    const std::string id = store.resolve_run(q);
    if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);  // named twice (id and name): drawn once
  }
  write_file_atomic(output, render_report_html(store, ids));
  std::cout << "wrote " << output << " (" << ids.size() << " run(s))\n";
  return 0;
}

}  // namespace dsrun
