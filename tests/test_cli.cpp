// The dsrun binary end to end: real processes, a real SQLite file in a temporary directory.
#include "test_util.hpp"

#include "engine/common/files.hpp"
#include "engine/common/host.hpp"
#include "engine/common/text.hpp"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>

namespace {

using Output = dsrun::test::CommandOutput;
using dsrun::test::contains;

// Runs dsrun from the source tree with the store in `dir`.
Output dsrun_cli(const std::string& args, const dsrun::test::TempDir& dir) {
  return dsrun::test::run_command("cd '" + dsrun::test::source_dir() + "' && DSRUN_DB='" + dir.file("runs.db") + "' '" DSRUN_BINARY "' " + args);
}

}  // namespace

TEST_CASE("dsrun plan prints the plan of the quickstart", "[cli]") {
  dsrun::test::TempDir dir;
  Output out = dsrun_cli("plan recipes/quickstart.toml", dir);
  INFO(out.text);
  CHECK(out.code == 0);
  CHECK(contains(out.text, "verdict: FITS"));
  CHECK(contains(out.text, "global 16 = micro 8 x accumulation 1 x data parallel 2"));
  CHECK(contains(out.text, "ZeRO stage 2"));
}

TEST_CASE("dsrun plan --json is machine-readable", "[cli]") {
  dsrun::test::TempDir dir;
  Output out = dsrun_cli("plan recipes/deepseek7b_zero2.toml --json", dir);
  INFO(out.text);
  REQUIRE(out.code == 0);
  std::string json = out.text.substr(out.text.find('{'));  // after the data.path warning
  nlohmann::json j = nlohmann::json::parse(json);
  CHECK(j["parallel"]["zero_stage"] == 2);
  CHECK(j["fits"] == true);
  CHECK(j["hardware_present"] == false);
}

TEST_CASE("dsrun RECIPE records a run that history and show find", "[cli][store]") {
  dsrun::test::TempDir dir;
  Output run = dsrun_cli("recipes/quickstart.toml --set run.name=cli-test --set run.steps=3 --set schedule.warmup_steps=1", dir);
  INFO(run.text);
  REQUIRE(run.code == 0);
  size_t at = run.text.find("run ");
  at = run.text.find("\nrun ", 0);
  REQUIRE(at != std::string::npos);
  std::string id = run.text.substr(at + 5, 8);

  Output history = dsrun_cli("history", dir);
  INFO(history.text);
  CHECK(history.code == 0);
  CHECK(contains(history.text, id));
  CHECK(contains(history.text, "cli-test"));
  CHECK(contains(history.text, "finished"));

  Output show = dsrun_cli("show " + id.substr(0, 5), dir);
  INFO(show.text);
  CHECK(show.code == 0);
  CHECK(contains(show.text, "recipe as written"));
  CHECK(contains(show.text, "name = \"cli-test\""));   // resolved config includes the --set
  CHECK(contains(show.text, "verdict: FITS"));          // and the plan

  Output json = dsrun_cli("history --json", dir);
  CHECK(nlohmann::json::parse(json.text)[0]["id"] == id);
  CHECK(dsrun_cli("history --status bogus", dir).code == 1);
}

TEST_CASE("a bad recipe exits 1 naming file, line and key, and records nothing", "[cli][errors]") {
  dsrun::test::TempDir dir;
  dir.write("bad.toml", "base = [\"hardware/cpu\", \"models/deepseek-tiny\"]\n[model]\nheads = 3\n[batch]\nglobal = 7\n");
  Output out = dsrun_cli("'" + dir.file("bad.toml") + "'", dir);
  INFO(out.text);
  CHECK(out.code == 1);
  CHECK(contains(out.text, dir.file("bad.toml") + ":3:9: error: model.heads"));
  CHECK(contains(out.text, "batch.global"));
  CHECK_FALSE(dsrun::file_exists(dir.file("runs.db")));
}

TEST_CASE("missing hardware: the plan is printed and the run is refused plainly", "[cli]") {
  dsrun::test::TempDir dir;
  Output out = dsrun_cli("recipes/deepseek7b_zero2.toml", dir);
  INFO(out.text);
  CHECK(out.code == 3);
  CHECK(contains(out.text, "not running: this machine has "));  // fewer GPUs than the recipe's 8
  CHECK(contains(out.text, "(hardware.devices_per_node)"));     // the key, and a fix
  CHECK(contains(out.text, "fix: --set hardware.devices_per_node="));
  CHECK(contains(out.text, "--smoke"));
}

TEST_CASE("a plan that does not fit exits 2 and is recorded as infeasible", "[cli]") {
  dsrun::test::TempDir dir;
  Output plan = dsrun_cli("plan recipes/deepseek67b_a100.toml --set parallel.offload=none --set parallel.zero_stage=0", dir);
  INFO(plan.text);
  CHECK(plan.code == 2);
  CHECK(contains(plan.text, "DOES NOT FIT"));
  CHECK(contains(plan.text, "suggestion: "));

  // On CPU ranks (hardware present) the run is recorded as infeasible, with the reason.
  Output run = dsrun_cli("recipes/quickstart.toml --set hardware.memory_gib=0.5 --set hardware.runtime_memory_gib=0.25", dir);
  INFO(run.text);
  CHECK(run.code == 2);
  CHECK(contains(run.text, "recorded as infeasible"));
  Output history = dsrun_cli("history --status infeasible", dir);
  CHECK(contains(history.text, "infeasible"));
  CHECK(contains(history.text, "quickstart"));
}

TEST_CASE("init writes a recipe from a template and templates lists them", "[cli]") {
  dsrun::test::TempDir dir;
  Output list = dsrun_cli("templates", dir);
  INFO(list.text);
  CHECK(contains(list.text, "hardware/rtx4090-x3-pcie"));
  CHECK(contains(list.text, "models/deepseek-moe-16b"));
  Output init = dsrun_cli("init '" + dir.file("mine") + "' --template quickstart", dir);
  INFO(init.text);
  REQUIRE(init.code == 0);
  std::string text = dsrun::read_file(dir.file("mine.toml"));
  CHECK(contains(text, "name = \"mine\""));
  CHECK(dsrun_cli("plan '" + dir.file("mine.toml") + "'", dir).code == 0);
  CHECK(dsrun_cli("init '" + dir.file("mine") + "' --template quickstart", dir).code == 1);  // no silent overwrite
  CHECK(contains(dsrun_cli("init x --template quickstrat", dir).text, "did you mean quickstart"));
}

TEST_CASE("dsrun plan opens token data as the ranks will: bad data is refused before a run is recorded", "[cli][data]") {
  dsrun::test::TempDir dir;
  const auto tokens = [](const std::vector<int>& lengths) {  // nanoGPT u16 documents, 50256 closing each
    std::string out;
    for (int n : lengths)
      for (int k = 0; k < n; ++k) {
        const uint16_t t = k + 1 == n ? 50256 : static_cast<uint16_t>(1 + k % 250);
        out.append(reinterpret_cast<const char*>(&t), 2);
      }
    return out;
  };
  const std::string sets = " --set data.kind=tokens --set data.format=nanogpt --set data.token_width=2 --set model.vocab=50304 --set data.path=";
  dir.write("short.bin", tokens({20}));
  Output plan = dsrun_cli("plan tests/recipes/tiny_train.toml" + sets + dir.file("short.bin"), dir);
  INFO(plan.text);
  CHECK(plan.code != 0);
  CHECK(contains(plan.text, dir.file("short.bin") + ": data.path: has 19 training tokens: not one sequence of 33"));
  Output run = dsrun_cli("run tests/recipes/tiny_train.toml" + sets + dir.file("short.bin"), dir);
  CHECK(run.code != 0);
  CHECK(!contains(run.text, "\nrun "));  // nothing recorded

  // Documents of 40 and 6000 tokens: a 5% validation tail cut at the last document end is 99%.
  dir.write("skewed.bin", tokens({40, 6000}));
  plan = dsrun_cli("plan tests/recipes/tiny_train.toml" + sets + dir.file("skewed.bin"), dir);
  INFO(plan.text);
  CHECK(plan.code == 0);
  CHECK(contains(plan.text, "dsrun: warning: data: "));  // the terminal wraps the rest
  CHECK(contains(plan.text, "validation is 99.3%"));
}

TEST_CASE("dsrun probe --quick writes a template of positive measured figures, and a recipe based on it plans with them", "[cli][probe]") {
  dsrun::test::TempDir dir;
  const std::string out_path = dir.file("cpu-probed.toml");
  Output out = dsrun_cli("probe recipes/quickstart.toml --quick -o '" + out_path + "' --disk '" + dir.path() + "'", dir);
  INFO(out.text);
  REQUIRE(out.code == 0);
  CHECK(contains(out.text, "wrote " + out_path));
  CHECK(contains(out.text, "probe ["));  // progress, phase by phase
  const std::string text = dsrun::read_file(out_path);
  INFO(text);
  // Every key the probe measures on CPU ranks, each with how it was measured, each positive.
  std::map<std::string, double> probed;
  for (const std::string& line : dsrun::split(text, '\n')) {
    const size_t mark = line.find("  # probed: ");
    if (mark == std::string::npos) continue;
    const std::string key = dsrun::trim(line.substr(0, line.find('=')));
    const std::string value = dsrun::trim(line.substr(line.find('=') + 1, mark - line.find('=') - 1));
    if (value.front() == '[') continue;  // the collective tables, checked below
    probed[key] = std::stod(value);
    CHECK(line.size() > mark + 30);  // the how, not an empty note
  }
  for (const char* key : {"matmul_efficiency", "comm_efficiency", "host_optimizer_gbs", "host_memory_bandwidth_gbs", "disk_write_gbs", "disk_read_gbs"}) {
    INFO(key);
    REQUIRE(probed.count(key));
    CHECK(probed[key] > 0);
  }
  CHECK(probed["matmul_efficiency"] <= 1);
  CHECK(probed["comm_efficiency"] <= 1);
  CHECK(contains(text, "bus bandwidth: all-reduce of"));  // per collective and size, recorded
  // The quick probe's two CPU ranks: one group size, a figure for every collective, and pairs.
  CHECK(contains(text, "collective_ranks = [2]  # probed"));
  for (const char* key : {"all_reduce_gbs = [", "all_gather_gbs = [", "reduce_scatter_gbs = [", "all_to_all_gbs = ["}) CHECK(contains(text, key));
  REQUIRE(probed.count("p2p_gbs"));
  CHECK(probed["p2p_gbs"] > 0);
  CHECK(contains(text, "while the cut decoder's forward and backward run on the CPU"));  // the host step beside compute, recorded on CPU ranks
  CHECK(contains(text, "name = \"cpu-probed\""));
  // The round trip: a recipe whose base names the template plans with its figures.
  const std::string recipe = dir.write("probed.toml", "base = [\"" + dsrun::test::source_dir() + "/recipes/quickstart.toml\", \"" + out_path + "\"]\n");
  const dsrun::LoadedRecipe loaded = dsrun::test::load_file("recipes/quickstart.toml", {});
  dsrun::LoadOptions o;
  o.host = dsrun::test::small_host();
  const dsrun::LoadedRecipe based = dsrun::load_recipe_file(recipe, o);
  INFO(based.report());
  REQUIRE(based.ok());
  const dsrun::HardwareSpec& hw = based.recipe.hardware;
  CHECK(hw.name == "cpu-probed");
  CHECK(hw.matmul_efficiency == Approx(probed["matmul_efficiency"]));
  CHECK(hw.host_optimizer_bandwidth == Approx(probed["host_optimizer_gbs"] * 1e9));
  CHECK(hw.disk_read_bandwidth == Approx(probed["disk_read_gbs"] * 1e9));
  REQUIRE(hw.collectives.ranks == std::vector<int>{2});
  for (const auto& [op, name] : dsrun::kCollectives) {
    INFO(name);
    CHECK(hw.collectives.of(op, 2) > 0);
  }
  CHECK(hw.collectives.point_to_point == Approx(probed["p2p_gbs"] * 1e9));
  CHECK(hw.peak_flops_fp32 == Approx(loaded.recipe.hardware.peak_flops_fp32));  // unmeasured keys as the recipe had them
  // The machine's memory is read, not the recipe's kept (a GPU recipe's template said 1 TiB on a 126 GiB host).
  CHECK(contains(text, "host_memory_gib = "));
  CHECK(contains(text, "# read: this machine's memory"));
  CHECK(hw.host_memory_bytes == Approx(static_cast<double>(dsrun::read_host_facts().memory_bytes)).epsilon(0.01));
  Output plan = dsrun_cli("plan '" + recipe + "'", dir);
  INFO(plan.text);
  CHECK(plan.code == 0);
  CHECK(contains(plan.text, "hardware.disk_read_gbs"));
}

TEST_CASE("dsrun probe: a template path that cannot be written, a disk path that does not exist and a GPU recipe without GPUs are clear errors", "[cli][probe]") {
  dsrun::test::TempDir dir;
  Output nowhere = dsrun_cli("probe recipes/quickstart.toml --quick -o /nonexistent/dir/cpu.toml", dir);
  INFO(nowhere.text);
  CHECK(nowhere.code == 1);
  CHECK(contains(nowhere.text, "/nonexistent/dir/cpu.toml"));
  CHECK(contains(nowhere.text, "no directory /nonexistent/dir"));
  CHECK(contains(nowhere.text, "--print"));
  CHECK_FALSE(contains(nowhere.text, "probe ["));  // refused before any measuring
  Output no_disk = dsrun_cli("probe recipes/quickstart.toml --quick --print --disk '" + dir.file("missing") + "'", dir);
  INFO(no_disk.text);
  CHECK(no_disk.code == 1);
  CHECK(contains(no_disk.text, dir.file("missing")));
  CHECK(contains(no_disk.text, "checkpoint.dir"));
  CHECK(contains(no_disk.text, "No such file or directory"));
  // On a machine with GPUs (the device machine runs this suite too) the GPU recipe would probe.
  if (dsrun::read_host_facts().cuda_devices > 0) return;
  Output gpu = dsrun_cli("probe recipes/deepseek7b_zero2.toml --quick --print", dir);
  INFO(gpu.text);
  CHECK(gpu.code == 1);
  CHECK(contains(gpu.text, "hardware.device"));
  CHECK(contains(gpu.text, "has none"));
}

TEST_CASE("a validation split too small for one sequence is refused by dsrun plan and dsrun run, naming data.val_fraction, before a run is recorded", "[cli][data]") {
  dsrun::test::TempDir dir;
  Output plan = dsrun_cli("plan tests/recipes/tiny_train.toml --set data.val_fraction=1e-300 --set eval.every=5", dir);
  INFO(plan.text);
  CHECK(plan.code == 1);
  CHECK(contains(plan.text, "data.val_fraction"));
  CHECK(contains(plan.text, "not one validation sequence of 33"));
  Output run = dsrun_cli("run tests/recipes/tiny_train.toml --set data.val_fraction=1e-300 --set eval.every=5", dir);
  CHECK(run.code == 1);
  CHECK_FALSE(dsrun::file_exists(dir.file("runs.db")));
  // Without evaluation the split is not used: fine.
  CHECK(dsrun_cli("plan tests/recipes/tiny_train.toml --set data.val_fraction=1e-300 --set eval.every=0", dir).code == 0);
}

TEST_CASE("dsrun run refuses precision.fp8 before launch on a build without FP8 products, naming the key, and dsrun plan prices it", "[cli][fp8]") {
  dsrun::test::TempDir dir;
  // (a GPU recipe: the plan holds anywhere; a CPU build has no scaled FP8 products)
  if (!dsrun::this_build_kernels().fp8_products) {
    Output out = dsrun_cli("run recipes/gpu/small_gpu_check.toml --set precision.dtype=bf16 --set precision.fp8=tensorwise", dir);
    INFO(out.text);
    CHECK(out.code != 0);
    CHECK(contains(out.text, "precision.fp8"));
    CHECK(contains(out.text, "needs torch's scaled FP8 products; this build has none"));
  }
  Output plan = dsrun_cli("plan recipes/gpu/small_gpu_check.toml --set precision.dtype=bf16 --set precision.fp8=tensorwise", dir);
  CHECK(plan.code == 0);  // the plan is about the recipe's GPUs, wherever it is made
  CHECK(contains(plan.text, "FP8 products (tensorwise scaling)"));
}

TEST_CASE("run refuses data this machine lacks before a run is recorded (plan only warns)", "[cli][data]") {
  dsrun::test::TempDir dir;
  const std::string missing = " --set data.kind=\\\"text\\\" --set data.path=\\\"/nonexistent/corpus.txt\\\"";
  Output planned = dsrun_cli("plan tests/recipes/tiny_train.toml" + missing, dir);
  CHECK(planned.code == 0);
  CHECK(contains(planned.text, "does not exist on this machine; a run here would fail"));
  Output run = dsrun_cli("run tests/recipes/tiny_train.toml" + missing, dir);
  INFO(run.text);
  CHECK(run.code == 1);
  CHECK(contains(run.text, "data.path: \"/nonexistent/corpus.txt\" does not exist on this machine: nothing trained"));
  CHECK(contains(dsrun_cli("history", dir).text, "no runs yet"));  // before, a run was recorded and its ranks failed
  // A blend's missing sources alike (the loader's one phrase for what this machine lacks).
  Output blend = dsrun_cli("run tests/recipes/tiny_train.toml --set data.kind=\\\"tokens\\\" --set 'data.blend=[\"/nonexistent/a.bin\"]'", dir);
  INFO(blend.text);
  CHECK(blend.code == 1);
  CHECK(contains(blend.text, "data.blend: 1 of 1 sources do not exist on this machine: nothing trained"));
}
