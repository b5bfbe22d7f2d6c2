// What the CLI prints about stored runs: the history table and the full view of one run.
// Kept apart from the commands so the formats are easy to find and change.
#pragma once

#include "storage/store.hpp"

#include <string>
#include <vector>

namespace dsrun {

std::string format_time(double unix_seconds);  // "2026-11-21 23:40", local time
// `filtered`: the runs were selected by filters (--status, --where, --deleted, ...), so an empty
// list means nothing matched rather than an empty store.
std::string render_history(const Store& store, const std::vector<RunRecord>& runs, bool filtered = false);
std::string render_history_csv(const Store& store, const std::vector<RunRecord>& runs);  // one row per run, RFC 4180
std::string render_run(const Store& store, const RunRecord& run);

}  // namespace dsrun
