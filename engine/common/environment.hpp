// Reading the process environment: launchers (dsrun, torchrun, Slurm) pass ranks their place
// through variables; one rule for all of them: unset or empty takes the fallback.
#pragma once

#include <string>

namespace dsrun {

int env_int(const char* name, int fallback);
std::string env_string(const char* name, const std::string& fallback);

}  // namespace dsrun
