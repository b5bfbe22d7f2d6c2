// `dsrun ui`: a read-only web server over the run store (the same store `history` reads): the runs
// table with `--where`, a JSON API, and /metrics in Prometheus' text format for a cluster's scraper.
#pragma once

#include <string>

namespace dsrun {

struct UiOptions {
  std::string db_path;
  std::string host = "127.0.0.1";  // loopback unless told; any other needs a token
  int port = 8321;
  std::string token, token_file;   // required for a host other than loopback
};

// Serves until SIGINT or SIGTERM; returns the exit code. A non-loopback host without a token is
// refused before anything listens; every request then carries the token (Authorization: Bearer
// TOKEN, or ?token=TOKEN), else 401.
int command_ui(const UiOptions& options);

// The running runs' latest figures in Prometheus' text exposition format (version 0.0.4): step,
// loss, tokens/s, MFU, the largest device peak over its ranks, and a status series, each labelled
// by run id, name and node (the host of its launcher). Finished runs drop out.
class Store;
std::string prometheus_metrics(const Store& store);

}  // namespace dsrun
