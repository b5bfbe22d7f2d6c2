// The layout value and its rules: what the plan accepts, the ranks accept (random recipes pinned
// back), tensor groups stay in a node, every group is priced by where its members sit.
#include "engine/plan/plan.hpp"
#include "engine/recipe/schema.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <random>
#include <sstream>

using namespace dsrun;
using dsrun::test::contains;
using dsrun::test::load_text;

namespace {

// A random recipe whose layout keys are "auto" or random values, on CPU or GPU hardware of 1 or 2
// nodes, dense or MoE: the kind of recipe a user writes once and lets the plan finish.
std::string random_recipe(std::mt19937& rng) {
  auto pick = [&](std::vector<std::string> options) { return options[std::uniform_int_distribution<size_t>(0, options.size() - 1)(rng)]; };
  const std::string model = pick({"deepseek-tiny", "deepseek-tiny-gqa", "deepseek-moe-tiny"});
  const bool gpu = pick({"cpu", "gpu"}) == "gpu";
  std::string text = "base = [\"" + std::string(gpu ? "hardware/h100-80gb-x8" : "hardware/cpu") + "\", \"models/" + model + "\"]\n";
  text += "[hardware]\nnodes = " + pick({"1", "1", "2"}) + "\ndevices_per_node = " + pick({"2", "4", "8"}) + "\ninter_node_bandwidth_gbs = " + pick({"1", "25", "100"}) + "\n";
  if (!gpu) text += "memory_gib = 64\nhost_memory_gib = 64\n";
  text += "[parallel]\n";
  text += "tensor = " + pick({"\"auto\"", "1", "2", "4"}) + "\n";
  text += "pipeline = " + pick({"\"auto\"", "1", "2", "3"}) + "\n";
  text += "data_parallel = " + pick({"\"auto\"", "\"auto\"", "1", "2"}) + "\n";
  text += "sequence_parallel = " + pick({"\"auto\"", "true", "false"}) + "\n";
  text += "pipeline_schedule = " + pick({"\"auto\"", "\"1f1b\"", "\"gpipe\"", "\"interleaved\""}) + "\n";
  text += "virtual_stages = " + pick({"\"auto\"", "1", "2"}) + "\n";
  text += "zero_stage = " + pick({"\"auto\"", "0", "1", "2", "3"}) + "\n";
  text += "activation_checkpointing = " + pick({"\"none\"", "\"auto\"", "\"full\""}) + "\n";
  text += "offload = " + pick({"\"none\"", "\"none\"", "\"optimizer\""}) + "\n";
  if (model == "deepseek-moe-tiny") text += "expert = " + pick({"\"auto\"", "1", "2", "4"}) + "\n";
  text += "[batch]\nglobal = " + pick({"8", "12", "16", "24", "32"}) + "\nmicro = " + pick({"\"auto\"", "\"auto\"", "1", "2", "4"}) + "\nseq_len = " + pick({"32", "64", "128"}) + "\n";
  text += "[data]\nkind = \"synthetic\"\n";
  return text;
}

// What the launcher pins for the ranks: the layout's keys and the execution modes' (launcher.cpp).
std::vector<std::string> pins(const Layout& l, const ExecutionModes* modes = nullptr) {
  std::vector<std::string> sets;
  for (const auto& [key, value] : l.to_config_keys()) sets.push_back(key + "=" + value.toml());
  if (modes)
    for (const auto& [key, value] : modes->to_config_keys()) sets.push_back(key + "=" + value.toml());
  return sets;
}

}  // namespace

TEST_CASE("300 random recipes: every layout the plan chooses, pinned back, is accepted and plans the same", "[layout][plan]") {
  std::mt19937 rng(20261125);
  int planned = 0, refused = 0, searched = 0;
  for (int i = 0; i < 300; ++i) {
    const std::string text = random_recipe(rng);
    LoadedRecipe loaded = load_text(text);
    if (!loaded.ok()) {  // the recipe's own rules: fine, as long as they are errors with a key
      ++refused;
      continue;
    }
    Plan plan;
    try {
      plan = make_plan(loaded.recipe, dsrun::test::small_host());
    } catch (const Error& e) {  // "no layout of this hardware can run the model": said, not run
      ++refused;
      continue;
    }
    ++planned;
    searched += plan.layouts.empty() ? 0 : 1;
    INFO("recipe " << i << ":\n" << text << "chosen: " << plan.layout.describe());
    // What the launcher writes for the ranks: the recipe with the layout's and the modes' keys pinned.
    LoadedRecipe pinned = load_text(text, pins(plan.layout, &plan.modes));
    INFO(pinned.report());
    REQUIRE(pinned.ok());
    const Plan again = make_plan(pinned.recipe, dsrun::test::small_host());
    CHECK(again.layout == plan.layout);
    CHECK(again.modes == plan.modes);
    CHECK(again.fits == plan.fits);
    CHECK(again.step_seconds == Approx(plan.step_seconds).epsilon(1e-9));
    CHECK(again.layouts.empty());  // nothing left to search
    CHECK(layout_problems(pinned.recipe, plan.layout).empty());
  }
  INFO("planned " << planned << ", refused " << refused << ", searched " << searched);
  CHECK(planned >= 80);  // the sample exercises the search, not only the refusals (99 of 300 with this seed)
  CHECK(searched >= 50);
}

TEST_CASE("the rules: one table of problems, each on a key with a fix", "[layout][rules]") {
  LoadedRecipe r = load_text("base = [\"hardware/h100-80gb-x8\", \"models/deepseek-moe-tiny\"]\n[hardware]\nnodes = 2\ndevices_per_node = 4\ninter_node_bandwidth_gbs = 25\n");
  REQUIRE(r.ok());
  Layout l;
  l.tensor = 8;  // across the two nodes of 4
  l.data = 1;
  l.pipeline = 3;
  l.schedule = PipelineScheduleKind::Interleaved;
  l.virtual_stages = 1;
  l.zero_stage = 3;
  l.expert = 3;
  std::vector<std::string> keys;
  for (const LayoutProblem& p : layout_problems(r.recipe, l)) {
    CHECK_FALSE(p.fix.empty());
    keys.push_back(p.key);
  }
  auto has = [&](const std::string& key) { return std::find(keys.begin(), keys.end(), key) != keys.end(); };
  CHECK(has("parallel.pipeline"));  // 24 ranks on 8 devices
  // With degrees the hardware has, the remaining rules speak.
  l.pipeline = 1;
  keys.clear();
  for (const LayoutProblem& p : layout_problems(r.recipe, l)) keys.push_back(p.key);
  CHECK(has("parallel.tensor"));          // spans nodes
  CHECK(has("parallel.virtual_stages"));  // interleaved with one chunk
  CHECK(has("parallel.expert"));          // 3 does not divide the experts
  // A fixed layout with no problems.
  Layout ok;
  ok.tensor = 4, ok.data = 2, ok.expert = 2, ok.zero_stage = 2, ok.micro = 2;
  CHECK(layout_problems(r.recipe, ok).empty());
  CHECK(ok.mesh_shape().size() == 8);
}

TEST_CASE("a tensor group across nodes is refused with a fix, unless the recipe means it", "[layout][network]") {
  const std::string text = "base = [\"hardware/h100-80gb-x8\", \"models/deepseek-llm-7b\"]\n[hardware]\nnodes = 2\ndevices_per_node = 4\ninter_node_bandwidth_gbs = 25\n"
                           "[parallel]\ntensor = 8\n[precision]\ndtype = \"bf16\"\n[batch]\nglobal = 32\nseq_len = 4096\n";
  LoadedRecipe refused = load_text(text);
  REQUIRE_FALSE(refused.ok());
  CHECK(contains(refused.report(), "parallel.tensor: a tensor group of 8 ranks would span nodes of 4 ranks"));
  CHECK(contains(refused.report(), "use parallel.tensor = 4"));
  CHECK(contains(refused.report(), "parallel.tensor_across_nodes = true"));
  LoadedRecipe meant = load_text(text, {"parallel.tensor_across_nodes=true"});
  INFO(meant.report());
  REQUIRE(meant.ok());
  const Plan p = make_plan(meant.recipe, dsrun::test::small_host());
  bool across = false;
  for (const CommTerm& c : p.comm) across |= contains(c.collective, "(tensor") && contains(c.collective, "across 2 nodes");
  CHECK(across);
}

TEST_CASE("7B on 2 nodes, tensor 8 × data 2: the gradient all-reduce crosses the network and is priced by it", "[layout][network]") {
  const std::string text = "base = [\"hardware/h100-80gb-x8\", \"models/deepseek-llm-7b\"]\n[hardware]\nnodes = 2\n"
                           "[parallel]\ntensor = 8\nzero_stage = 0\n[precision]\ndtype = \"bf16\"\n[batch]\nglobal = 32\nseq_len = 4096\n";
  auto gradient_term = [&](const std::string& gbs) {
    LoadedRecipe r = load_text(text, {"hardware.inter_node_bandwidth_gbs=" + gbs});
    INFO(r.report());
    REQUIRE(r.ok());
    const Plan p = make_plan(r.recipe, dsrun::test::small_host());
    CHECK(p.layout.data == 2);
    for (const CommTerm& c : p.comm)
      if (contains(c.collective, "all-reduce gradients")) {
        CHECK(contains(c.collective, "across 2 nodes"));
        return c;
      }
    FAIL("no gradient all-reduce");
    return CommTerm{};
  };
  const CommTerm slow = gradient_term("1"), fast = gradient_term("100");
  CHECK(slow.bytes == Approx(fast.bytes));
  // The node's network shared by its 8 ranks, at the network's own efficiency
  // (hardware.network_efficiency, 0.8 by default; not the template's NVLink comm_efficiency, 0.75):
  // 1 GB/s gives each rank 0.1 GB/s; 100 GB/s gives 10 GB/s, under NVLink's 450.
  CHECK(slow.seconds == Approx(slow.bytes / (1e9 / 8 * 0.8)).epsilon(1e-6));
  CHECK(fast.seconds == Approx(fast.bytes / (100e9 / 8 * 0.8)).epsilon(1e-6));
  CHECK(slow.seconds / fast.seconds == Approx(100));
}

TEST_CASE("the 67B at 1 GB/s keeps tensor inside a node and says what crosses", "[layout][network][search]") {
  LoadedRecipe r = dsrun::test::load_file("recipes/deepseek67b_2x8a100_auto.toml", {"hardware.inter_node_bandwidth_gbs=1"});
  REQUIRE(r.ok());
  const Plan p = make_plan(r.recipe, dsrun::test::small_host());
  CHECK(p.fits);
  CHECK(8 % p.layout.tensor == 0);  // a tensor group inside a node of 8
  for (const LayoutRow& row : p.layouts) CHECK(8 % row.layout.tensor == 0);
  bool says = false;
  for (const CommTerm& c : p.comm) says |= contains(c.collective, "stage boundaries across nodes") || contains(c.collective, "across 2 nodes");
  CHECK(says);
  // The network's price moves the choice's step: at 100 GB/s it is faster.
  LoadedRecipe fast = dsrun::test::load_file("recipes/deepseek67b_2x8a100_auto.toml", {"hardware.inter_node_bandwidth_gbs=100"});
  REQUIRE(fast.ok());
  CHECK(make_plan(fast.recipe, dsrun::test::small_host()).step_seconds < p.step_seconds);
}

TEST_CASE("offloading parameters with the stage left to the plan: the search skips layouts no stage can run, fixed degrees name both rules", "[layout][search][offload]") {
  // The search over the 67B's layouts met pipelines (no ZeRO-3) with offloaded parameters (only ZeRO-3).
  LoadedRecipe searched = dsrun::test::load_file("recipes/deepseek67b_2x8a100_auto.toml", {"parallel.offload=\"optimizer+params\""});
  REQUIRE(searched.ok());
  const Plan p = make_plan(searched.recipe, dsrun::test::small_host());
  CHECK(p.layout.zero_stage == 3);
  CHECK(p.layout.pipeline == 1);
  bool pipelines_refused = false;
  for (const LayoutRow& row : p.layouts)
    if (row.layout.pipeline > 1) pipelines_refused |= contains(row.verdict, "cannot run: ZeRO-3 with pipeline parallelism");
  CHECK(pipelines_refused);
  // Every degree fixed, the stage still the plan's: an error on the keys, with each stage's reason.
  LoadedRecipe fixed = dsrun::test::load_file("recipes/deepseek67b_2x8a100_auto.toml",
                                              {"parallel.offload=\"optimizer+params\"", "parallel.pipeline=2", "parallel.tensor=1", "parallel.pipeline_schedule=\"1f1b\"",
                                               "parallel.virtual_stages=1", "parallel.sequence_parallel=false", "parallel.data_parallel=8"});
  REQUIRE(fixed.ok());
  const std::string error = dsrun::test::error_of([&] { make_plan(fixed.recipe, dsrun::test::small_host()); });
  CHECK(contains(error, "parallel.zero_stage: no ZeRO stage can run this layout"));
  CHECK(contains(error, "ZeRO-3 with pipeline parallelism is not supported"));
  CHECK(contains(error, "offloading parameters needs ZeRO stage 3"));
  CHECK_FALSE(contains(error, "assertion"));
}

TEST_CASE("when host memory binds, the verdict, every row and the suggestion name hardware.host_memory_gib with the numbers", "[layout][verdict]") {
  LoadedRecipe r = load_text("base = [\"hardware/h100-80gb-x8\", \"models/deepseek-llm-7b\"]\n[hardware]\nhost_memory_gib = 16\n"
                             "[parallel]\ntensor = \"auto\"\noffload = \"optimizer\"\n[precision]\ndtype = \"bf16\"\n[batch]\nglobal = 32\nseq_len = 4096\n");
  INFO(r.report());
  REQUIRE(r.ok());
  const Plan p = make_plan(r.recipe, dsrun::test::small_host());
  INFO(render_plan(p));
  CHECK_FALSE(p.fits);
  CHECK(p.binds == "host memory");
  REQUIRE_FALSE(p.verdict.empty());
  CHECK(contains(p.verdict[0], "does not fit: host memory (hardware.host_memory_gib) needs"));
  CHECK(contains(p.verdict[0], "16.00 GiB available"));
  for (const std::string& v : p.verdict) CHECK_FALSE(v.rfind("fits:", 0) == 0);  // never a bare "fits" after "does not fit"
  for (const LayoutRow& row : p.layouts)
    if (row.problem.empty() && !row.fits && row.binds == "host memory") CHECK(contains(row.verdict, "per node (hardware.host_memory_gib)"));
  bool named = false;
  for (const std::string& s : p.suggestions) named |= contains(s, "--set hardware.host_memory_gib=");
  CHECK(named);
}

TEST_CASE("smoke plans of every recipe keep each degree and choice of its plan, with this machine's memory", "[layout][smoke]") {
  std::vector<std::string> recipes;
  {
    std::istringstream names(dsrun::test::run_command("cd '" + dsrun::test::source_dir() + "' && ls recipes/*.toml recipes/gpu/*.toml recipes/hooks/*.toml recipes/sweeps/*.toml").text);
    for (std::string name; std::getline(names, name);)
      if (!name.empty()) recipes.push_back(name);
  }
  REQUIRE(recipes.size() >= 15);
  // The micro batch is shrunk with the batch; everything else is the plan's.
  const std::vector<std::string> kept{"parallel.pipeline", "parallel.data_parallel", "parallel.tensor", "parallel.expert", "parallel.pipeline_schedule", "parallel.virtual_stages",
                                      "parallel.sequence_parallel", "parallel.zero_stage", "parallel.activation_checkpointing", "parallel.offload", "parallel.delayed_update"};
  const double machine = static_cast<double>(read_host_facts().memory_bytes);
  for (const std::string& recipe : recipes) {
    INFO(recipe);
    auto plan_json = [&](const std::string& flags) {
      // run_command joins stderr (the recipes' data-path warnings); keep only stdout's JSON
      auto out = dsrun::test::run_command("cd '" + dsrun::test::source_dir() + "' && '" DSRUN_BINARY "' plan " + recipe + " --json " + flags + " 2>/dev/null; true");
      INFO(out.text);
      REQUIRE(!out.text.empty());
      return nlohmann::json::parse(out.text);
    };
    const nlohmann::json real = plan_json(""), smoke = plan_json("--smoke");
    for (const std::string& key : kept) {
      INFO(key);
      CHECK(smoke["layout"][key] == real["layout"][key]);
    }
    CHECK(smoke["topology"]["device"] == "cpu");
    // Memory from this machine, not a template's: the node is this one.
    CHECK(smoke["host_memory_per_node"]["capacity"].get<double>() <= machine * 1.001);
  }
}

TEST_CASE("execution.cuda_graphs: on for one bf16 decoder rank with one micro-batch a step, refused with a reason otherwise, an evaluation beside the graph counted", "[layout][execution][graphs]") {
  const std::string one_gpu =
      "base = [\"hardware/h100-80gb-x1\", \"models/deepseek-tiny\"]\n[parallel]\nzero_stage = 2\n[precision]\ndtype = \"bf16\"\n"
      "[batch]\nglobal = 4\nmicro = 4\nseq_len = 128\n";
  auto plan_with = [&](std::vector<std::string> sets) {
    LoadedRecipe r = load_text(one_gpu, std::move(sets));
    INFO(r.report());
    REQUIRE(r.ok());
    return make_plan(r.recipe, dsrun::test::small_host());
  };
  // "auto" takes it where the rule holds, as true does.
  CHECK(plan_with({}).modes.cuda_graphs);
  const Plan asked = plan_with({"execution.cuda_graphs=true"});
  CHECK(asked.modes.cuda_graphs);
  CHECK(contains(asked.modes.describe(), "forward and backward replayed as one CUDA graph"));
  CHECK_FALSE(plan_with({"execution.cuda_graphs=false"}).modes.cuda_graphs);
  // The graph's pool keeps the step's peak between steps: an evaluation's forward is counted on top,
  // and only where both hold.
  const Plan graphed = plan_with({"eval.every=5"}), eager = plan_with({"eval.every=5", "execution.cuda_graphs=false"});
  CHECK(graphed.memory.evaluation_beside_graph > 0);
  CHECK(eager.memory.evaluation_beside_graph == 0);
  CHECK(plan_with({}).memory.evaluation_beside_graph == 0);
  CHECK(graphed.memory.total() == Approx(eager.memory.total() + graphed.memory.evaluation_beside_graph).epsilon(1e-9));
  // Unchunked, the whole micro-batch's logits in bf16, their fp32 copy and its log-softmax: 10 bytes
  // a token and vocabulary entry against a chunk's 4.
  const Plan whole = plan_with({"eval.every=5", "batch.loss_chunk_tokens=0"});
  REQUIRE(whole.modes.cuda_graphs);
  REQUIRE(graphed.modes.loss_chunk_tokens > 0);
  const double chunk = std::min<double>(static_cast<double>(graphed.modes.loss_chunk_tokens), 4 * 128);
  CHECK(whole.memory.evaluation_beside_graph == Approx(graphed.memory.evaluation_beside_graph * (10.0 * 4 * 128) / (4.0 * chunk)));
  // Each rule, asked for by true: refused, and the plan says why.
  const std::vector<std::pair<std::vector<std::string>, std::string>> refusals = {
      {{"batch.micro=2"}, "more than one micro-batch a step"},
      {{"precision.dtype=\"fp16\""}, "only bf16"},
      {{"parallel.activation_checkpointing=\"full\""}, "recomputation"},
      {{"hardware.devices_per_node=2", "parallel.data_parallel=2", "batch.micro=2"}, "several ranks"},
      {{"execution.update_on_device=false"}, "gradients are not left to autograd"},
  };
  for (const auto& [sets, why] : refusals) {
    std::vector<std::string> asked = sets;
    asked.push_back("execution.cuda_graphs=true");
    const Plan p = plan_with(asked);
    INFO(why);
    CHECK_FALSE(p.modes.cuda_graphs);
    CHECK(std::any_of(p.notes.begin(), p.notes.end(), [&](const std::string& n) { return contains(n, "execution.cuda_graphs = true does not hold here: " + why); }));
  }
}

TEST_CASE("execution modes: one rule each, from the layout and the build's kernels, pinned for the ranks", "[layout][execution]") {
  const std::string one_gpu =
      "base = [\"hardware/h100-80gb-x1\", \"models/deepseek-tiny\"]\n[parallel]\nzero_stage = 2\n[precision]\ndtype = \"bf16\"\ngrad_dtype = \"bf16\"\n"
      "[batch]\nglobal = 4\nmicro = 2\nseq_len = 128\nloss_chunk_tokens = 64\n";
  LoadedRecipe r = load_text(one_gpu);
  REQUIRE(r.ok());
  // Two micro-batches a step: `auto` sums their gradients in fp32, which autograd cannot hold; the
  // recipe's bf16 keeps them where autograd puts them.
  const Plan widened = make_plan(load_text(one_gpu, {"precision.grad_dtype=\"auto\""}).recipe, dsrun::test::small_host());
  CHECK(widened.modes.gradient_dtype == DType::Fp32);
  CHECK_FALSE(widened.modes.gradients_left_to_autograd);
  CHECK(widened.memory.gradients_after_peak == 0);
  // Planned by this CPU build (the test host has no kernels): for dsrun's GPU build, and said so.
  const Plan gpu = make_plan(r.recipe, dsrun::test::small_host());
  CHECK(gpu.modes.loss_chunk_tokens == 64);
  CHECK(gpu.modes.loss_gradients_in_forward);
  CHECK(gpu.modes.step_applies_scales);
  CHECK(gpu.modes.update_on_device);
  CHECK(gpu.modes.gradients_left_to_autograd);
  CHECK_FALSE(gpu.modes.variable_length_attention);  // no separate documents
  CHECK(std::any_of(gpu.notes.begin(), gpu.notes.end(), [](const std::string& n) { return n.find("planned for dsrun's GPU build") != std::string::npos; }));
  CHECK(nlohmann::json::parse(plan_to_json(gpu))["execution"]["update_on_device"] == true);
  CHECK(gpu.memory.gradients_after_peak > 0);

  // A CUDA build without dsrun's Adam kernel or torch's fused AdamW: the step cannot apply the
  // scales, so nothing that depends on it holds either.
  HostFacts old_torch = dsrun::test::small_host();
  old_torch.kernels.cuda = true;
  const ExecutionModes m = decide_execution_modes(r.recipe, gpu.layout, 64, old_torch.kernels);
  CHECK_FALSE(m.step_applies_scales);
  CHECK_FALSE(m.update_on_device);
  CHECK_FALSE(m.gradients_left_to_autograd);
  CHECK(m.loss_gradients_in_forward);
  CHECK(make_plan(r.recipe, old_torch).memory.gradients_after_peak == 0);

  // false turns a mode off, and what depends on it; the plan prices the gradient buffer again.
  LoadedRecipe off = load_text(one_gpu, {"execution.update_on_device=false"});
  REQUIRE(off.ok());
  const Plan buffered = make_plan(off.recipe, dsrun::test::small_host());
  CHECK_FALSE(buffered.modes.update_on_device);
  CHECK_FALSE(buffered.modes.gradients_left_to_autograd);
  CHECK(buffered.modes.step_applies_scales);
  CHECK(buffered.memory.gradients_after_peak == 0);

  // true where a rule refuses it: the rule wins and the plan says why.
  LoadedRecipe fp16 = load_text(one_gpu, {"precision.dtype=\"fp16\"", "precision.grad_dtype=\"fp16\"", "execution.loss_gradients_in_forward=true"});
  REQUIRE(fp16.ok());
  const Plan scaled = make_plan(fp16.recipe, dsrun::test::small_host());
  CHECK_FALSE(scaled.modes.loss_gradients_in_forward);
  CHECK(std::any_of(scaled.notes.begin(), scaled.notes.end(),
                    [](const std::string& n) { return n.find("execution.loss_gradients_in_forward = true does not hold here: in fp16") != std::string::npos; }));

  // Two ranks: gradients are reduced, so a buffer holds them; the update stays on the device.
  LoadedRecipe two = load_text(one_gpu, {"hardware.devices_per_node=2", "parallel.data_parallel=2"});
  REQUIRE(two.ok());
  const Plan pair = make_plan(two.recipe, dsrun::test::small_host());
  CHECK(pair.modes.update_on_device);
  CHECK_FALSE(pair.modes.gradients_left_to_autograd);

  // Variable-length attention: separate documents in bf16 with a head_dim the kernel takes; fp32 or
  // CPU ranks use the mask, and the plan's document line follows the mode.
  Recipe docs = r.recipe;
  docs.data.separate_documents = true;
  BuildKernels gpu_build;
  gpu_build.cuda = gpu_build.device_adam = gpu_build.fused_adam = gpu_build.varlen_attention = true;
  CHECK(decide_execution_modes(docs, gpu.layout, 64, gpu_build).variable_length_attention);
  docs.precision.dtype = DType::Fp32;
  std::vector<RefusedMode> why;
  docs.execution.forced["variable_length_attention"] = true;
  CHECK_FALSE(decide_execution_modes(docs, gpu.layout, 64, gpu_build, &why).variable_length_attention);
  REQUIRE(why.size() == 1);
  CHECK(why[0].name == "variable_length_attention");
  CHECK(why[0].describe() == "execution.variable_length_attention = true does not hold here: the kernel runs in bf16/fp16 only");

  // Every mode has its [execution] key, and a rank's config pins each (the launcher's keys).
  for (const ExecutionModeRow& row : execution_mode_rows()) {
    INFO(row.name);
    CHECK(find_key_spec(std::string("execution.") + row.name) != nullptr);
  }
  CHECK(gpu.modes.to_config_keys().size() == execution_mode_rows().size() + 2);  // + batch.loss_chunk_tokens, precision.grad_dtype
}
