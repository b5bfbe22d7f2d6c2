// One rank's training run: rendezvous, model, ZeRO, optimizer, schedule, data, the loop, eval.
// Entry point of the dsrun-rank binary, which the launcher (or torchrun, Slurm) starts per rank.
#pragma once

namespace dsrun {

// argv: dsrun-rank CONFIG.toml; rank and world from the torchrun variables. Returns the exit code.
int rank_main(int argc, char** argv);

}  // namespace dsrun
