// The dsrun-rank binary: one training process. Kept apart from `dsrun` so that planning,
// history and the launcher never load libtorch.
#include "engine/train/trainer.hpp"

int main(int argc, char** argv) { return dsrun::rank_main(argc, argv); }
