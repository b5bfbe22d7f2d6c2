// The CLI's commands, one function each, called by main after CLI11 has parsed the arguments.
// Each returns the process exit code (docs/cli.md lists them); errors travel up as dsrun::Error.
#pragma once

#include <string>
#include <vector>

namespace dsrun {

enum ExitCode { kExitOk = 0, kExitError = 1, kExitDoesNotFit = 2, kExitHardwareMissing = 3 };

struct RecipeArgs {
  std::string path;
  std::vector<std::string> sets;  // --set section.key=value
};

std::string default_store_path();  // $DSRUN_DB, else runs/dsrun.db under the current directory

int command_plan(const RecipeArgs& args, bool json);
int command_run(const RecipeArgs& args, const std::string& db_path);
int command_history(const std::string& db_path, int limit, const std::string& status, bool json);
int command_show(const std::string& db_path, const std::string& run, bool json);
int command_init(const std::string& name, const std::string& template_name, bool force);
int command_templates();
int command_docs(const std::string& topic);

}  // namespace dsrun
