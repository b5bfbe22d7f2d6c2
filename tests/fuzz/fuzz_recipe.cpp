// libFuzzer target for the recipe loader: any bytes in, diagnostics or a recipe out, never a crash.
// Build with clang: cmake -B build-fuzz -DDSRUN_FUZZ=ON -DCMAKE_CXX_COMPILER=clang++ (docs/testing.md).
#include "engine/plan/plan.hpp"
#include "engine/recipe/load.hpp"

#include <cstddef>
#include <cstdint>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  dsrun::LoadOptions options;
  options.host.cpu_cores = 2;
  options.host.memory_bytes = 8e9;
  // A line starting with "--set " becomes an override, so the fuzzer reaches that parser too.
  if (text.rfind("--set ", 0) == 0) {
    size_t end = text.find('\n');
    options.overrides.push_back(text.substr(6, end == std::string::npos ? std::string::npos : end - 6));
    text = end == std::string::npos ? "" : text.substr(end + 1);
  }
  dsrun::LoadedRecipe loaded = dsrun::load_recipe_text(text, "fuzz.toml", options);
  (void)loaded.report();
  (void)dsrun::config_to_toml(loaded.config);
  if (loaded.ok()) {
    dsrun::Plan plan = dsrun::make_plan(loaded.recipe, options.host);
    (void)dsrun::render_plan(plan);
    (void)dsrun::plan_to_json(plan);
  }
  return 0;
}
