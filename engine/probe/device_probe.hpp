// What `dsrun probe` measures with libtorch, in dsrun-rank processes: the recipe's own decoder
// layers forward and backward, attention, copies between host and GPU, collectives across a node.
#pragma once

#include <string>

namespace dsrun {

// `dsrun-rank --probe CONFIG.toml OUT.json [--quick]`: every rank (RANK, WORLD_SIZE, LOCAL_RANK,
// MASTER_ADDR, MASTER_PORT as for training) times the collectives together, then compute and
// copies all at once as in training; rank 0 writes OUT.json: {"figures": [{"key", "value", "how"}, ...]}.
// Returns the process's exit code; errors are printed and give 1.
int probe_rank_main(const std::string& config_path, const std::string& out_path, bool quick);

}  // namespace dsrun
