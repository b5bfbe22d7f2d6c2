// `dsrun report RUN [RUN...] -o report.html`: one self-contained HTML page (inline CSS and SVG,
// no scripts, no network) with metric charts overlaid for the runs, memory, recipes, plans, events.
#pragma once

#include <string>
#include <vector>

namespace dsrun {

class Store;

// The page as text (tests render it in headless Chromium).
std::string render_report_html(const Store& store, const std::vector<std::string>& run_ids);
int command_report(const std::vector<std::string>& runs, const std::string& output, const std::string& db_path);

// Text made safe inside HTML (elements and quoted attributes): & < > " escaped.
std::string html_escape(const std::string& s);

}  // namespace dsrun
