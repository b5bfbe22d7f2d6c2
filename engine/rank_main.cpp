// The dsrun-rank binary: one training process, or one process of `dsrun probe` (--probe). Kept
// apart from `dsrun` so that planning, history and the launcher never load libtorch.
#include "engine/probe/device_probe.hpp"
#include "engine/train/trainer.hpp"

#include <string>

int main(int argc, char** argv) {
  if (argc >= 4 && std::string(argv[1]) == "--probe") return dsrun::probe_rank_main(argv[2], argv[3], argc >= 5 && std::string(argv[4]) == "--quick");
  return dsrun::rank_main(argc, argv);
}
