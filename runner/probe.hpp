// `dsrun probe`: measures this machine for a recipe and writes a hardware template whose
// measured keys say how they were measured; a recipe's base then names it (hardware/NAME).
#pragma once

#include "runner/commands.hpp"

#include <string>

namespace dsrun {

struct ProbeArgs {
  RecipeArgs recipe;       // the model's shapes, the dtype and the hardware table to start from
  std::string name;        // the template's hardware.name and file name; "" = the recipe's, "-probed"
  std::string output;      // where the template goes; "" = templates/hardware/NAME.toml
  bool print = false;      // write it to standard output instead
  bool quick = false;      // seconds, small sizes (CI): figures are rough
  std::string disk;        // where the disk is measured; "" = checkpoint.dir, else the run store's directory
};

int command_probe(const ProbeArgs& args);

}  // namespace dsrun
