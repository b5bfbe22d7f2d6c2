// The recipe language: parsing, every validation error class, composition and precedence.
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "engine/plan/plan.hpp"
#include "engine/recipe/load.hpp"
#include "engine/recipe/schema.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>
#include <unistd.h>

#include <algorithm>
#include <cmath>

using namespace dsrun;
using dsrun::test::errors_of;
using dsrun::test::load_text;
using dsrun::test::only_error;

namespace {

bool contains(const std::string& haystack, const std::string& needle) { return haystack.find(needle) != std::string::npos; }

}  // namespace

TEST_CASE("an empty recipe is valid and every key has its default", "[recipe]") {
  LoadedRecipe r = load_text("");
  REQUIRE(r.ok());
  CHECK(r.config.size() == recipe_schema().size());
  CHECK(r.recipe.run.steps == 100);
  CHECK(r.recipe.hardware.devices_per_node == 2);  // "auto" on the 2-core test host
  CHECK(r.recipe.optimizer.beta2 == Approx(0.95));
  CHECK_FALSE(r.recipe.parallel.zero_stage.has_value());  // auto
}

TEST_CASE("values land in the typed recipe", "[recipe]") {
  LoadedRecipe r = load_text(R"(
[run]
steps = 50
[parallel]
zero_stage = 3
offload = "optimizer+params"
[optimizer]
name = "sgd"
lr = 1      # an integer for a float key is fine
momentum = 0.8
[schedule]
name = "multistep"
warmup_steps = 5
)");
  INFO(r.report());
  REQUIRE(r.ok());
  CHECK(r.recipe.run.steps == 50);
  CHECK(*r.recipe.parallel.zero_stage == 3);
  CHECK(r.recipe.parallel.offload == Offload::OptimizerAndParams);
  CHECK(r.recipe.optimizer.kind == OptimizerKind::Sgd);
  CHECK(r.recipe.optimizer.lr == 1.0);
  CHECK(r.config.at("optimizer.lr").value.kind == Value::Kind::Float);
  CHECK(r.recipe.schedule.kind == ScheduleKind::MultiStep);
}

TEST_CASE("unknown keys name file, line, column and the nearest valid key", "[recipe][errors]") {
  LoadedRecipe r = load_text("[batch]\nglobal = 8\nmicro_bach = 4\n");
  const Diagnostic& d = only_error(r);
  CHECK(d.key == "batch.micro_bach");
  CHECK(d.source.file == "test.toml");
  CHECK(d.source.line == 3);
  CHECK(d.source.column == 14);
  CHECK(contains(d.fix, "batch.micro"));
  CHECK(contains(d.format(), "test.toml:3:14: error: batch.micro_bach: unknown key"));

  const Diagnostic& section_typo = only_error(load_text("[optimzer]\nlr = 0.1\n"));
  CHECK(contains(section_typo.fix, "optimizer.lr"));
}

TEST_CASE("a key in the wrong section is found by its last component", "[recipe][errors]") {
  const Diagnostic& d = only_error(load_text("[batch]\nlr = 0.1\n"));
  CHECK(contains(d.fix, "optimizer.lr"));
}

TEST_CASE("derived keys explain how they are derived", "[recipe][errors]") {
  const Diagnostic& d = only_error(load_text("[batch]\naccumulation = 4\n"));
  CHECK(contains(d.fix, "derived"));
}

TEST_CASE("a section written as a value is explained", "[recipe][errors]") {
  const Diagnostic& d = only_error(load_text("model = \"deepseek-llm-7b\"\n"));
  CHECK(contains(d.message, "section"));
}

TEST_CASE("wrong types are errors with what was expected", "[recipe][errors]") {
  CHECK(contains(only_error(load_text("[run]\nsteps = \"100\"\n")).message, "expected integer"));
  CHECK(contains(only_error(load_text("[run]\nsteps = 1.5\n")).fix, "whole number"));
  CHECK(contains(only_error(load_text("[logging]\nprogress = \"yes\"\n")).message, "expected boolean"));
  CHECK(contains(only_error(load_text("[optimizer]\nbetas = 0.9\n")).message, "array of numbers"));
  CHECK(contains(only_error(load_text("[run]\ntags = [1, 2]\n")).message, "array of strings"));
  CHECK(contains(only_error(load_text("[run]\nname = 1979-05-27\n")).message, "date"));
}

TEST_CASE("out-of-range and absurd numbers are errors, never clamped", "[recipe][errors]") {
  const Diagnostic& stage = only_error(load_text("[parallel]\nzero_stage = 4\n"));
  CHECK(contains(stage.message, "out of range 0 .. 3"));
  CHECK(contains(only_error(load_text("[optimizer]\nlr = -1e-3\n")).message, "out of range"));
  CHECK(contains(only_error(load_text("[model]\nlayers = 99999999999\n")).message, "out of range"));
  CHECK(contains(only_error(load_text("[run]\nseed = -1\n")).message, "out of range"));
  CHECK(contains(only_error(load_text("[optimizer]\nlr = nan\n")).message, "not a finite number"));
  CHECK(contains(only_error(load_text("[optimizer]\nlr = inf\n")).message, "not a finite number"));
  CHECK(contains(only_error(load_text("[schedule]\nmilestones = [0.5, 1.5]\n")).message, "out of range"));
}

TEST_CASE("choices suggest the nearest valid value", "[recipe][errors]") {
  const Diagnostic& d = only_error(load_text("[precision]\ndtype = \"bf61\"\n"));
  CHECK(contains(d.fix, "bf16"));
  CHECK(contains(only_error(load_text("[parallel]\nactivation_checkpointing = true\n")).message, "expected one of"));
}

TEST_CASE("every error is collected at once, in one report", "[recipe][errors]") {
  LoadedRecipe r = load_text("[run]\nsteps = 0\n[optimizer]\nlr = \"fast\"\n[bogus]\nx = 1\n");
  CHECK(errors_of(r).size() == 3);
  CHECK(contains(r.report(), "3 errors"));
}

TEST_CASE("cross-field rules: attention shapes", "[recipe][rules]") {
  const Diagnostic& heads = only_error(load_text("[model]\nhidden = 4096\nheads = 30\n"));
  CHECK(heads.key == "model.heads");
  CHECK(contains(heads.message, "not divisible"));
  CHECK(contains(heads.fix, "32"));  // the divisor of 4096 closest to 30
  const Diagnostic& kv = only_error(load_text("[model]\nheads = 4\nkv_heads = 3\n"));
  CHECK(kv.key == "model.kv_heads");
  CHECK(contains(only_error(load_text("[model]\nhidden = 12\nheads = 4\n")).message, "odd"));
}

TEST_CASE("cross-field rules: batch = micro x accumulation x data parallel", "[recipe][rules]") {
  // 2 ranks (auto on the 2-core host)
  const Diagnostic& odd = only_error(load_text("[batch]\nglobal = 7\n"));
  CHECK(odd.key == "batch.global");
  CHECK(contains(odd.fix, "6 or 8"));
  const Diagnostic& micro = only_error(load_text("[batch]\nglobal = 12\nmicro = 4\n"));
  CHECK(micro.key == "batch.micro");
  CHECK(contains(micro.fix, "divides 6"));
  CHECK(contains(only_error(load_text("[batch]\nglobal = 8\nmicro = 8\n")).message, "exceeds"));
  CHECK(load_text("[batch]\nglobal = 12\nmicro = 3\n").ok());
  CHECK(contains(only_error(load_text("[parallel]\ndata_parallel = 3\n")).message, "2 devices"));
  CHECK(contains(only_error(load_text("[batch]\nseq_len = 8192\n")).key, "batch.seq_len"));
}

TEST_CASE("cross-field rules: context parallelism cuts each sequence into 2 x context chunks over ranks the hardware has, and names what it cannot split yet", "[recipe][rules][context]") {
  const std::string four = "[hardware]\ndevices_per_node = 4\n";
  CHECK(load_text("[parallel]\ncontext = 2\n[batch]\nseq_len = 64\n").ok());  // auto data: 2 devices / context 2 = 1 replica
  const Diagnostic& odd = only_error(load_text("[parallel]\ncontext = 2\n[batch]\nseq_len = 66\n"));
  CHECK(odd.key == "batch.seq_len");
  CHECK(contains(odd.message, "2 × context = 4"));
  CHECK(contains(odd.fix, "64 or 68"));
  const Diagnostic& world = only_error(load_text("[parallel]\ncontext = 4\ndata_parallel = 1\n[batch]\nseq_len = 64\n"));
  CHECK(world.key == "parallel.context");
  CHECK(contains(world.message, "context 4 = 4 ranks per replica but the hardware has 2 devices"));
  // What needs whole sequences on a rank is named, with its own key beside parallel.context.
  auto refused = [&](const std::vector<std::string>& sets, const std::string& what) {
    const Diagnostic& d = only_error(load_text(four + "[parallel]\ncontext = 2\ndata_parallel = 1\n[batch]\nseq_len = 64\n", sets));
    INFO(d.message);
    CHECK(d.key == "parallel.context");
    CHECK(contains(d.message, what));
    CHECK(contains(d.fix, "parallel.context = 1"));
  };
  refused({"model.mtp.depth=1"}, "multi-token prediction");
  refused({"model.moe.routed_experts=4", "model.moe.top_k=2", "model.moe.intermediate=64", "model.moe.capacity_factor=1.25"}, "expert capacity");
  CHECK(load_text(four + "[parallel]\ncontext = 2\ndata_parallel = 1\n[batch]\nseq_len = 64\n", {"model.moe.routed_experts=4", "model.moe.top_k=2", "model.moe.intermediate=64"}).ok());
  refused({"data.kind=\"tokens\"", "data.path=\"corpus.tokens\"", "data.separate_documents=true"}, "packed documents");
  refused({"parallel.pipeline=2"}, "pipeline parallelism");
}

TEST_CASE("cross-field rules: precision the hardware supports", "[recipe][rules]") {
  const Diagnostic& d = only_error(load_text("base = [\"hardware/h100-80gb-x1\"]\n[hardware]\npeak_tflops_fp16 = 0\n[precision]\ndtype = \"fp16\"\n"));
  CHECK(d.key == "precision.dtype");
  CHECK(contains(d.message, "does not support fp16"));
  // CPU ranks: refused by the device, whatever peak the recipe claims (libtorch's CPU kernels lack Half).
  const Diagnostic& cpu = only_error(load_text("[hardware]\npeak_tflops_fp16 = 10\n[precision]\ndtype = \"fp16\"\n"));
  CHECK(cpu.key == "precision.dtype");
  CHECK(contains(cpu.message, "CPU ranks cannot train in fp16"));
  CHECK(load_text("[hardware]\npeak_tflops_bf16 = 1\n[precision]\ndtype = \"bf16\"\n").ok());
}

TEST_CASE("cross-field rules: precision.fp8 needs FP8 tensor cores, bf16, a decoder and sizes in multiples of 16 (blockwise 128)", "[recipe][rules][fp8]") {
  const Diagnostic& cpu = only_error(load_text("[precision]\nfp8 = \"rowwise\"\n"));
  CHECK(cpu.key == "precision.fp8");
  CHECK(contains(cpu.message, "no FP8 tensor cores (CPU ranks)"));
  // (the tiny decoder's MLP, 344 wide, made 352: a multiple of 16)
  const std::string h100 = "base = [\"hardware/h100-80gb-x1\", \"models/deepseek-tiny\"]\n[model]\nintermediate = 352\n[precision]\ndtype = \"bf16\"\n";
  CHECK(load_text(h100 + "fp8 = \"tensorwise\"\n").ok());
  CHECK(load_text(h100 + "fp8 = \"rowwise\"\n").ok());
  const Diagnostic& none = only_error(load_text(h100 + "fp8 = \"rowwise\"\n", {"hardware.peak_tflops_fp8=0"}));
  CHECK(contains(none.message, "hardware.peak_tflops_fp8 = 0"));
  const Diagnostic& fp16 = only_error(load_text(h100 + "fp8 = \"rowwise\"\n", {"precision.dtype=\"fp16\""}));
  CHECK(fp16.key == "precision.fp8");
  CHECK(contains(fp16.fix, "precision.dtype = \"bf16\""));
  // Blockwise: whole blocks of 128 (the tiny decoder's 352-wide MLP is not; a 512-wide one is).
  const Diagnostic& blocks = only_error(load_text(h100 + "fp8 = \"blockwise\"\n"));
  CHECK(contains(blocks.message, "model.intermediate gives a linear layer a size of 352, not a multiple of 128 as blockwise FP8's blocks need"));
  CHECK(contains(blocks.fix, "precision.fp8 = \"rowwise\""));
  CHECK(load_text(h100 + "fp8 = \"blockwise\"\n", {"model.intermediate=512"}).ok());
  const Diagnostic& odd = only_error(load_text(h100 + "fp8 = \"tensorwise\"\n", {"model.intermediate=344"}));
  CHECK(contains(odd.message, "model.intermediate gives a linear layer a size of 344"));
}

TEST_CASE("cross-field rules: ZeRO stage and offload combinations", "[recipe][rules]") {
  CHECK(contains(only_error(load_text("[parallel]\nzero_stage = 2\noffload = \"optimizer+params\"\n")).message, "stage 3"));
  CHECK(contains(only_error(load_text("[parallel]\nzero_stage = 0\noffload = \"optimizer\"\n")).message, "stage 1, 2 or 3"));
  CHECK(load_text("[parallel]\nzero_stage = 1\noffload = \"optimizer\"\n").ok());
  CHECK(load_text("[parallel]\nzero_stage = 3\noffload = \"optimizer+params\"\n").ok());
}

TEST_CASE("cross-field rules: schedules, MoE, data and model agree", "[recipe][rules]") {
  CHECK(only_error(load_text("[run]\nsteps = 10\n[schedule]\nwarmup_steps = 10\n")).key == "schedule.warmup_steps");
  CHECK(only_error(load_text("[schedule]\nname = \"multistep\"\nmilestones = [0.9, 0.8]\nfactors = [0.3, 0.1]\n")).key == "schedule.milestones");
  CHECK(only_error(load_text("[schedule]\nname = \"multistep\"\nmilestones = [0.8]\nfactors = [0.3, 0.1]\n")).key == "schedule.factors");
  CHECK(only_error(load_text("[model.moe]\nrouted_experts = 4\ntop_k = 5\nintermediate = 8\n")).key == "model.moe.top_k");
  CHECK(only_error(load_text("[data]\nkind = \"cifar10\"\npath = \"/tmp\"\n")).key == "data.kind");
  CHECK(only_error(load_text("[data]\nkind = \"text\"\n")).key == "data.path");
  CHECK(only_error(load_text("[model]\narch = \"resnet\"\n[model.resnet]\ndepth = 20\n")).key == "model.resnet.depth");
  CHECK(only_error(load_text("[eval]\nevery = 10\n[data]\nval_fraction = 0\n")).key == "eval.every");
  CHECK(only_error(load_text("[hardware]\nnodes = 2\n")).key == "hardware.inter_node_bandwidth_gbs");
  CHECK(only_error(load_text("[hardware]\ndevice = \"cuda\"\nmemory_gib = 80\n")).key == "hardware.devices_per_node");
}

TEST_CASE("keys that do not apply are warnings, not silence", "[recipe][warnings]") {
  LoadedRecipe r = load_text("[optimizer]\nname = \"adamw\"\nmomentum = 0.5\n[precision.loss_scale]\nwindow = 10\n");
  REQUIRE(r.ok());
  int warnings = 0;
  for (const auto& d : r.diagnostics)
    if (d.severity == Diagnostic::Severity::Warning) {
      ++warnings;
      CHECK(contains(d.message, "has no effect"));
    }
  CHECK(warnings == 2);
}

TEST_CASE("malformed TOML and odd encodings are errors with a position", "[recipe][errors]") {
  const Diagnostic& d = only_error(load_text("[run]\nsteps = = 3\n"));
  CHECK(contains(d.message, "malformed TOML"));
  CHECK(d.source.line == 2);
  CHECK(contains(only_error(load_text(std::string("\xFF\xFE[\0r\0", 6))).fix, "UTF-8"));
  const Diagnostic& nul = only_error(load_text(std::string("[run]\nname = \"a\0b\"\n", 18)));
  CHECK(contains(nul.message, "NUL"));
  CHECK(nul.source.line == 2);  // located: line 2, column 10 (name = "a^@b")
  CHECK(nul.source.column == 10);
  CHECK(only_error(load_text(std::string("\0", 1))).source.column == 1);
  CHECK_FALSE(load_text("[run]\nname = \"\xC3\x28\"\n").ok());  // invalid UTF-8
  CHECK_FALSE(load_text("[run]\nsteps = 1\n[run]\nseed = 2\n").ok());  // duplicate table
}

TEST_CASE("precedence: command line > recipe > bases (later over earlier) > defaults", "[recipe][compose]") {
  dsrun::test::TempDir dir;
  dir.write("first.toml", "[run]\nsteps = 10\nseed = 1\ndescription = \"first\"\n");
  dir.write("second.toml", "[run]\nseed = 2\ndescription = \"second\"\n");
  std::string recipe = dir.write("r.toml", "base = [\"first.toml\", \"second.toml\"]\n[run]\ndescription = \"recipe\"\nname = \"x\"\n");
  LoadOptions o;
  o.host = dsrun::test::small_host();
  o.overrides = {"run.name=from-cli"};
  LoadedRecipe r = load_recipe_file(recipe, o);
  INFO(r.report());
  REQUIRE(r.ok());
  CHECK(r.recipe.run.steps == 10);                 // only in the first base
  CHECK(r.recipe.run.seed == 2);                   // the later base wins
  CHECK(r.recipe.run.description == "recipe");     // the recipe beats its bases
  CHECK(r.recipe.run.name == "from-cli");          // --set beats the recipe (bare word taken as a string)
  CHECK(r.recipe.run.max_restarts == 0);           // default
  CHECK(r.config.at("run.seed").source.file == dir.file("second.toml"));
  CHECK(r.config.at("run.name").source.layer == Layer::CommandLine);
  CHECK(r.files.size() == 3);
}

TEST_CASE("command-line overrides (--set) are typed like TOML and validated like the recipe", "[recipe][compose]") {
  LoadedRecipe r = load_text("", {"optimizer.lr=1e-3", "parallel.zero_stage=2", "optimizer.betas=[0.8, 0.9]", "optimizer.name=sgd"});
  INFO(r.report());
  REQUIRE(r.ok());
  CHECK(r.recipe.optimizer.lr == Approx(1e-3));
  CHECK(*r.recipe.parallel.zero_stage == 2);
  CHECK(r.recipe.optimizer.beta1 == Approx(0.8));
  CHECK(r.recipe.optimizer.kind == OptimizerKind::Sgd);
  const Diagnostic& bad = only_error(load_text("", {"optimizer.lr=fast"}));
  CHECK(contains(bad.format(), "--set optimizer.lr=fast"));
  CHECK(contains(only_error(load_text("", {"optimizer.lr"})).message, "section.key=value"));
  CHECK(contains(only_error(load_text("", {"optimizer.learning_rate=1"})).fix, "optimizer.lr"));
}

TEST_CASE("bases: templates by name, cycles and unknown names", "[recipe][compose]") {
  LoadedRecipe r = load_text("base = [\"hardware/a100-40gb-x8\", \"models/deepseek-llm-7b\"]\n[precision]\ndtype = \"bf16\"\n[batch]\nglobal = 64\nseq_len = 4096\n");
  INFO(r.report());
  REQUIRE(r.ok());
  CHECK(r.recipe.model.hidden == 4096);
  CHECK(r.recipe.hardware.devices_per_node == 8);

  const Diagnostic& unknown = only_error(load_text("base = \"models/deepseek-llm-7\"\n"));
  CHECK(contains(unknown.fix, "models/deepseek-llm-7b"));

  dsrun::test::TempDir dir;
  dir.write("a.toml", "base = \"b.toml\"\n");
  dir.write("b.toml", "base = \"a.toml\"\n");
  LoadOptions o;
  o.host = dsrun::test::small_host();
  LoadedRecipe cyc = load_recipe_file(dir.file("a.toml"), o);
  CHECK(contains(only_error(cyc).message, "cycle"));
}

TEST_CASE("the resolved config reads back as the same recipe", "[recipe][compose]") {
  LoadedRecipe first = load_text("base = [\"hardware/cpu\", \"models/deepseek-moe-tiny\"]\n[hooks.options]\npatience = 3\nmode = \"min\"\n",
                                 {"optimizer.lr=0.01", "run.tags=[\"a\", \"b\"]"});
  REQUIRE(first.ok());
  std::string text = config_to_toml(first.config);
  LoadedRecipe second = load_text(text);
  INFO(text << second.report());
  REQUIRE(second.ok());
  CHECK(config_to_toml(second.config) == text);
  CHECK(second.recipe.model.moe.routed_experts == 8);
  CHECK(second.recipe.hooks.options.at("patience") == "3");
}

TEST_CASE("every shipped recipe and template loads without errors", "[recipe][shipped]") {
  std::string root = dsrun::test::source_dir();
  std::vector<std::string> files;
  for (const auto& f : list_directory(root + "/recipes"))
    if (ends_with(f, ".toml")) files.push_back(root + "/recipes/" + f);
  for (const auto& f : list_directory(root + "/templates/recipes")) files.push_back(root + "/templates/recipes/" + f);
  REQUIRE(files.size() >= 8);
  LoadOptions o;
  o.host = dsrun::test::small_host();
  for (const auto& f : files) {
    LoadedRecipe r = load_recipe_file(f, o);
    INFO(f << "\n" << r.report());
    CHECK(r.ok());
  }
}

TEST_CASE("docs/recipe.md is the generated reference", "[recipe][docs]") {
  std::string on_disk = read_file(dsrun::test::source_dir() + "/docs/recipe.md");
  INFO("regenerate with: ./build/dsrun docs recipe > docs/recipe.md");
  CHECK(on_disk == recipe_reference_markdown());
}

TEST_CASE("did-you-mean distance", "[recipe][text]") {
  CHECK(edit_distance("kitten", "sitting") == 3);
  CHECK(nearest("optimzer.lr", {"optimizer.lr", "run.steps"}) == "optimizer.lr");
  CHECK(nearest("zzzzzz", {"optimizer.lr", "run.steps"}).empty());
}

TEST_CASE("settings_differences names each key two configs set differently, and only those", "[recipe][text]") {
  const std::string here = "[batch]\nglobal = 12\nmicro = 2\n\n[optimizer]\nlr = 0.001\n[build]\ncuda = false\n";
  const std::string there = "[batch]\nglobal = 12\nmicro = 4\n\n[optimizer]\nlr = 0.001\nbeta1 = 0.9\n[build]\ncuda = true\n";
  CHECK(settings_differences(here, here).empty());
  const std::vector<std::string> d = settings_differences(here, there);
  REQUIRE(d.size() == 3);
  CHECK(d[0] == "batch.micro = 2 here, 4 there");
  CHECK(d[1] == "build.cuda = false here, true there");
  CHECK(d[2] == "optimizer.beta1 unset here, 0.9 there");
  const std::vector<std::string> cut = settings_differences(here, there, 1);
  REQUIRE(cut.size() == 2);
  CHECK(cut[1] == "... and 2 more");
}

TEST_CASE("a rule that spans keys is located at the key the user set, the later one when both are", "[recipe][rules]") {
  // hidden set, heads default: the error is about heads, at hidden's line.
  const Diagnostic& odd = only_error(load_text("[run]\nsteps = 5\n[model]\nhidden = 12\n"));
  CHECK(odd.key == "model.heads");
  CHECK(odd.source.layer == Layer::Recipe);
  CHECK(odd.source.line == 4);
  // Both set: the later line.
  const Diagnostic& both = only_error(load_text("[model]\nheads = 5\nhidden = 15\nkv_heads = 5\n"));
  CHECK(both.source.line == 3);
  const Diagnostic& both_reversed = only_error(load_text("[model]\nhidden = 15\nheads = 5\nkv_heads = 5\n"));
  CHECK(both_reversed.source.line == 3);
  // The command line wins over the file; the batch rule points at what the user changed.
  const Diagnostic& warmup = only_error(load_text("[schedule]\nwarmup_steps = 10\n", {"run.steps=5"}));
  CHECK(warmup.key == "schedule.warmup_steps");
  CHECK(warmup.source.layer == Layer::CommandLine);
  const Diagnostic& global = only_error(load_text("[parallel]\ndata_parallel = 2\n[batch]\nglobal = 7\nmicro = 1\n"));
  CHECK(global.key == "batch.global");
  CHECK(global.source.line == 4);
  const Diagnostic& split = only_error(load_text("[batch]\nglobal = 8\nmicro = 1\n[parallel]\ndata_parallel = 3\nzero_stage = 1\n[hardware]\ndevices_per_node = 3\n"));
  CHECK(split.key == "batch.global");
  CHECK(split.source.line == 5);  // data_parallel, after global
}

TEST_CASE("tensor parallelism: every size it splits must divide, all reported at once with a fix", "[recipe][rules][tensor]") {
  // 4 heads, 2 KV heads, MLP 344, vocabulary 256 over 3 tensor ranks: none divides.
  LoadedRecipe r = load_text("base = [\"models/deepseek-tiny\"]\n[hardware]\ndevices_per_node = 6\n[model]\nkv_heads = 2\n[parallel]\ntensor = 3\n");
  auto errors = errors_of(r);
  INFO(r.report());
  REQUIRE(errors.size() == 4);
  for (const auto& e : errors) {
    CHECK(e.key == "parallel.tensor");
    CHECK(e.source.line == 7);  // where tensor = 3 is
    CHECK(contains(e.fix, "parallel.tensor = 2"));
  }
  CHECK(contains(r.report(), "model.kv_heads = 2"));
  CHECK(contains(r.report(), "whole KV heads"));
  // A ResNet has no heads to split.
  CHECK(contains(only_error(load_text("base = [\"models/resnet50-cifar10\"]\n[hardware]\ndevices_per_node = 2\n[parallel]\ntensor = 2\n")).message, "ResNet"));
  CHECK(only_error(load_text("[hardware]\ndevices_per_node = 2\n[parallel]\ntensor = 4\n")).key == "parallel.tensor");
  // Sequence parallelism splits the sequence evenly, and is not yet combined with MoE.
  const Diagnostic& seq = only_error(load_text("[hardware]\ndevices_per_node = 2\n[parallel]\ntensor = 2\nsequence_parallel = true\n[batch]\nseq_len = 1023\n"));
  CHECK(seq.key == "batch.seq_len");
  CHECK(contains(seq.fix, "multiple of 2"));
  CHECK(only_error(load_text("base = [\"models/deepseek-moe-tiny\"]\n[hardware]\ndevices_per_node = 2\n[parallel]\ntensor = 2\nsequence_parallel = true\n")).key ==
        "parallel.sequence_parallel");
}

TEST_CASE("tensor parallelism: the world is data × tensor, and data_parallel auto takes the devices left", "[recipe][plan][tensor]") {
  LoadedRecipe r = load_text("base = [\"models/deepseek-tiny\"]\n[hardware]\ndevices_per_node = 4\n[parallel]\ntensor = 2\n[batch]\nglobal = 8\n");
  INFO(r.report());
  REQUIRE(errors_of(r).empty());
  CHECK(r.recipe.parallel.data_parallel_or_auto(r.recipe.hardware) == 2);
  Plan p = make_plan(r.recipe, dsrun::test::small_host());
  CHECK(p.world_size == 4);
  CHECK(p.layout.data == 2);
  CHECK(p.layout.tensor == 2);
  CHECK(p.accumulation * p.layout.micro * 2 == 8);
  // Each rank holds half of every split weight; norms whole (hidden 128, 4 layers: 9 norm vectors).
  const double replicated = 128.0 * 9;
  CHECK(p.memory.states.params == Approx(((p.cost.params - replicated) / 2 + replicated) * 4));
}

TEST_CASE("pipeline parallelism: impossible layouts are refused at once, naming the key and a fix", "[recipe][rules][pipeline]") {
  // deepseek-tiny has 4 layers: 8 stages cannot each get one; ZeRO-3 is not combined with a pipeline.
  LoadedRecipe r = load_text("base = [\"models/deepseek-tiny\"]\n[hardware]\ndevices_per_node = 8\n[parallel]\npipeline = 8\nzero_stage = 3\n");
  auto errors = errors_of(r);
  INFO(r.report());
  REQUIRE(errors.size() == 2);
  CHECK(errors[0].key == "parallel.pipeline");
  CHECK(errors[0].source.line == 5);
  CHECK(contains(errors[0].message, "the model has 4"));
  CHECK(contains(errors[0].fix, "parallel.pipeline = 4"));
  CHECK(errors[1].key == "parallel.zero_stage");
  CHECK(contains(errors[1].fix, "zero_stage = 2"));
  // Degrees whose product does not divide the devices.
  const Diagnostic& product = only_error(load_text("base = [\"models/deepseek-tiny\"]\n[hardware]\ndevices_per_node = 8\n[parallel]\npipeline = 3\n"));
  CHECK(product.key == "parallel.pipeline");
  CHECK(contains(product.message, "does not divide the 8 devices"));
  const Diagnostic& too_many = only_error(load_text("base = [\"models/deepseek-tiny\"]\n[hardware]\ndevices_per_node = 8\n[parallel]\npipeline = 2\ntensor = 2\ndata_parallel = 4\n"));
  CHECK(too_many.key == "parallel.data_parallel");
  CHECK(contains(too_many.message, "4 × tensor 2 × pipeline 2 = 16 ranks"));
  // The interleaved schedule: virtual stages, and micro-batches in multiples of the stages.
  const Diagnostic& micro = only_error(load_text("base = [\"models/deepseek-tiny\"]\n[hardware]\ndevices_per_node = 2\n[parallel]\npipeline = 2\n"
                                                 "pipeline_schedule = \"interleaved\"\nvirtual_stages = 2\n[batch]\nglobal = 6\nmicro = 2\n"));
  CHECK(micro.key == "batch.micro");
  CHECK(contains(micro.message, "(3 = global / data_parallel / micro)"));
  CHECK(only_error(load_text("base = [\"models/deepseek-tiny\"]\n[hardware]\ndevices_per_node = 2\n[parallel]\npipeline = 2\nvirtual_stages = 2\n")).key == "parallel.virtual_stages");
  CHECK(only_error(load_text("base = [\"models/resnet50-cifar10\"]\n[hardware]\ndevices_per_node = 2\n[parallel]\npipeline = 2\n")).key == "parallel.pipeline");
}

TEST_CASE("a GPU rank's host memory counts NCCL for each communicator it uses: two in a data-parallel job, more under expert or tensor groups", "[recipe][plan][memory]") {
  auto process_of = [](const std::string& model, const std::string& parallel) {
    LoadedRecipe r = load_text("base = [\"hardware/h100-80gb-x8\", \"models/" + model + "\"]\n[hardware]\ndevices_per_node = 4\n[parallel]\n" + parallel +
                               "\n[precision]\ndtype = \"bf16\"\n[batch]\nglobal = 16\nmicro = 4\n");
    INFO(r.report());
    REQUIRE(errors_of(r).empty());
    const Plan p = make_plan(r.recipe, dsrun::test::small_host());
    return std::make_pair(p.host.process, r.recipe.hardware.host_nccl_memory_bytes);
  };
  const auto [dense, nccl] = process_of("deepseek-tiny", "data_parallel = 4");
  const auto [tensor, _t] = process_of("deepseek-tiny", "data_parallel = 2\ntensor = 2");
  const auto [moe_ep1, _1] = process_of("deepseek-moe-tiny", "data_parallel = 4\nexpert = 1");
  const auto [moe_ep2, _2] = process_of("deepseek-moe-tiny", "data_parallel = 4\nexpert = 2");
  const auto [moe_ep4, _4] = process_of("deepseek-moe-tiny", "data_parallel = 4\nexpert = 4");
  REQUIRE(nccl > 0);
  CHECK(tensor - dense == Approx(nccl / 4));    // + the tensor group
  CHECK(moe_ep1 - dense == Approx(nccl / 4));   // + the expert replicas' reduction
  CHECK(moe_ep2 - dense == Approx(nccl / 2));   // + the shards' all-to-all and the replicas
  CHECK(moe_ep4 - dense == Approx(nccl / 4));   // + the shards (each shard held once: no replicas)
}

TEST_CASE("a pipeline with fewer micro-batches a step than stages is planned, on GPUs with a note of its NCCL history", "[recipe][plan][pipeline]") {
  auto plan_of = [](const std::string& hardware, int micro) {
    LoadedRecipe r = load_text("base = [\"" + hardware + "\", \"models/deepseek-tiny\"]\n[hardware]\ndevices_per_node = 4\n[parallel]\npipeline = 2\ndata_parallel = 2\n"
                               "[precision]\ndtype = \"bf16\"\n[batch]\nglobal = 16\nmicro = " + std::to_string(micro) + "\n");
    INFO(r.report());
    REQUIRE(errors_of(r).empty());
    return make_plan(r.recipe, dsrun::test::small_host());
  };
  auto note = [](const Plan& p) {
    for (const std::string& n : p.notes)
      if (contains(n, "fewer micro-batches a step (1) than pipeline stages (2)")) return n;
    return std::string();
  };
  const Plan one = plan_of("hardware/h100-80gb-x8", 8), two = plan_of("hardware/h100-80gb-x8", 4), cpu = plan_of("hardware/cpu", 8);
  CHECK(one.accumulation == 1);
  CHECK(one.fits);
  CHECK(one.pipeline_problem.empty());
  CHECK(contains(note(one), "each stage idles 50% of the step"));
  CHECK(contains(note(one), "the layouts that failed (pipeline 2 x data 2, pipeline 4) not yet"));
  CHECK(note(two).empty());
  CHECK(two.pipeline_problem.empty());
  CHECK(cpu.pipeline_problem.empty());
  CHECK(contains(note(cpu), "each stage idles 50%"));
  CHECK_FALSE(contains(note(cpu), "NCCL"));
}

TEST_CASE("pipeline parallelism in the plan: stages split by FLOPs, each rank's states, live micro-batches and the bubble", "[recipe][plan][pipeline]") {
  auto plan_of = [](const std::string& schedule) {
    LoadedRecipe r = load_text("base = [\"models/deepseek-tiny\"]\n[hardware]\ndevices_per_node = 4\n[parallel]\npipeline = 2\npipeline_schedule = \"" + schedule +
                               "\"\n[batch]\nglobal = 16\nmicro = 2\n");
    INFO(r.report());
    REQUIRE(errors_of(r).empty());
    return make_plan(r.recipe, dsrun::test::small_host());
  };
  const Plan p = plan_of("1f1b");
  CHECK(p.world_size == 4);
  CHECK(p.layout.data == 2);
  CHECK(p.layout.pipeline == 2);
  CHECK(p.accumulation == 4);
  // 6 units (embedding, 4 blocks, head) in two contiguous pieces covering all of them.
  REQUIRE(p.pipeline_pieces.size() == 2);
  CHECK(p.pipeline_pieces[0].first == 0);
  CHECK(p.pipeline_pieces[0].second == p.pipeline_pieces[1].first);
  CHECK(p.pipeline_pieces[1].second == 6);
  CHECK(p.bubble_fraction == Approx(1.0 / 5));  // (p-1)/(m+p-1)
  CHECK(p.pipeline_problem.empty());
  // The stages' parameters add up to the model's (fp32 ZeRO-0: 16 bytes each with AdamW).
  REQUIRE(p.stage_memory.size() == 2);
  CHECK(p.stage_memory[0].model_state_bytes + p.stage_memory[1].model_state_bytes == Approx(p.cost.params * 16));
  // GPipe keeps every micro-batch's activations, 1F1B at most two on the first stage.
  const Plan gpipe = plan_of("gpipe");
  CHECK(p.live_micro_batches == 2);
  CHECK(gpipe.live_micro_batches == 4);
  CHECK(gpipe.memory.activations > p.memory.activations);
  CHECK(contains(render_plan(p), "bubble 20%"));
}

TEST_CASE("layout search: \"auto\" keys take the fastest layout that fits, every candidate ranked with a reason", "[recipe][plan][search]") {
  LoadOptions o;
  o.host = dsrun::test::small_host();
  LoadedRecipe r = load_recipe_file(dsrun::test::source_dir() + "/recipes/deepseek67b_2x8a100_auto.toml", o);
  INFO(r.report());
  REQUIRE(r.ok());
  CHECK(r.recipe.parallel.search.tensor);
  CHECK(r.recipe.parallel.search.sequence_parallel);
  const Plan p = make_plan(r.recipe, o.host);
  REQUIRE(p.layouts.size() > 5);
  const LayoutRow& best = p.layouts.front();
  CHECK(best.fits);
  CHECK(contains(best.verdict, "the fastest that fits"));
  CHECK(p.fits);
  CHECK(p.layout == best.layout);
  CHECK(p.world_size == 16);
  // Ranked: those that fit by step time, then those that do not, then the impossible, each with why.
  int order = 0;
  for (size_t i = 0; i < p.layouts.size(); ++i) {
    const LayoutRow& row = p.layouts[i];
    const int rank = !row.problem.empty() ? 2 : row.fits ? 0 : 1;
    CHECK(rank >= order);
    order = rank;
    if (i > 0 && rank == 0) CHECK(row.step_seconds >= p.layouts[i - 1].step_seconds);
    CHECK_FALSE(row.verdict.empty());
  }
  // The same layout written out by hand plans the same step.
  const Plan fixed = make_plan(with_layout(r.recipe, best.layout), o.host);
  CHECK(fixed.step_seconds == Approx(p.step_seconds));
  CHECK(fixed.layouts.empty());
  // A ResNet cannot be split: only tensor 1 × pipeline 1 can run.
  LoadedRecipe resnet = load_text("base = [\"models/resnet50-cifar10\"]\n[hardware]\ndevices_per_node = 2\n[parallel]\ntensor = \"auto\"\n[batch]\nglobal = 8\n");
  REQUIRE(errors_of(resnet).empty());
  const LayoutSearch search = search_layouts(resnet.recipe, o.host, true);
  const std::vector<LayoutRow>& rows = search.rows;
  REQUIRE(!rows.empty());
  CHECK(rows.front().layout.ranks_per_replica() == 1);
  CHECK(contains(rows.back().verdict, "cannot run: "));
  CHECK(contains(rows.back().verdict, "a ResNet"));
  CHECK(contains(render_layouts(search, resnet.recipe), "tensor 1 × pipeline 1 × data 2"));
}

TEST_CASE("expert parallelism: degrees the experts or the data ranks do not divide, and top_k above the experts, are refused with a fix", "[recipe][rules][expert]") {
  // 8 routed experts over 3 expert ranks; over 4 of 2 data ranks; on a dense model.
  const Diagnostic& experts = only_error(load_text("base = [\"models/deepseek-moe-tiny\"]\n[hardware]\ndevices_per_node = 6\n[parallel]\nexpert = 3\n[batch]\nglobal = 12\n"));
  CHECK(experts.key == "parallel.expert");
  CHECK(experts.source.line == 5);
  CHECK(contains(experts.message, "does not divide model.moe.routed_experts = 8"));
  CHECK(contains(experts.fix, "parallel.expert = 2"));
  const Diagnostic& data = only_error(load_text("base = [\"models/deepseek-moe-tiny\"]\n[hardware]\ndevices_per_node = 2\n[parallel]\nexpert = 4\n"));
  CHECK(data.key == "parallel.expert");
  CHECK(contains(data.message, "does not divide the 2 data-parallel ranks"));
  CHECK(contains(data.fix, "parallel.expert = 2"));
  CHECK(contains(only_error(load_text("[hardware]\ndevices_per_node = 2\n[parallel]\nexpert = 2\n")).message, "this model has none"));
  const Diagnostic& top_k = only_error(load_text("base = [\"models/deepseek-moe-tiny\"]\n[model.moe]\ntop_k = 9\n"));
  CHECK(top_k.key == "model.moe.top_k");
  CHECK(top_k.source.line == 3);
  CHECK(contains(top_k.message, "between 1 and routed_experts (8)"));
  CHECK(only_error(load_text("base = [\"models/deepseek-moe-tiny\"]\n[model.moe]\nroute_bias = [1, 2]\n")).key == "model.moe.route_bias");
}

TEST_CASE("MoE balancing: an unknown balance and a negative bias_update_rate are refused with the line and a fix", "[recipe][expert][balance]") {
  const Diagnostic& balance = only_error(load_text("base = [\"models/deepseek-moe-tiny\"]\n[model.moe]\nbalance = \"biased\"\n"));
  CHECK(balance.key == "model.moe.balance");
  CHECK(balance.source.line == 3);
  CHECK(contains(balance.message, "aux_loss, bias"));
  CHECK(contains(balance.fix, "\"bias\""));
  const Diagnostic& rate = only_error(load_text("base = [\"models/deepseek-moe-tiny\"]\n[model.moe]\nbalance = \"bias\"\nbias_update_rate = -0.001\n"));
  CHECK(rate.key == "model.moe.bias_update_rate");
  CHECK(rate.source.line == 4);
  CHECK_FALSE(rate.fix.empty());
  LoadedRecipe ok = load_text("base = [\"models/deepseek-moe-tiny\"]\n[model.moe]\nbalance = \"bias\"\nbias_update_rate = 0.01\n");
  REQUIRE(errors_of(ok).empty());
  CHECK(ok.recipe.model.moe.learns_bias());
  CHECK(ok.recipe.model.moe.bias_update_rate == 0.01);
  // A key older versions wrote into every config (checkpoint manifests): a warning, not an error.
  LoadedRecipe old = load_text("base = [\"models/deepseek-moe-tiny\"]\n[hardware]\nexpert_call_ms = 0.8\n");
  CHECK(errors_of(old).empty());
  CHECK(contains(old.report(), "no longer used"));
}

TEST_CASE("expert parallelism in the plan: each rank's experts, their ZeRO replicas, the all-to-all and the imbalance headroom", "[recipe][plan][expert]") {
  auto plan_of = [](const std::string& parallel) {
    LoadedRecipe r = load_text("base = [\"models/deepseek-moe-tiny\"]\n[hardware]\ndevices_per_node = 4\n[parallel]\nzero_stage = 1\n" + parallel +
                               "\n[precision]\ndtype = \"fp32\"\n[batch]\nglobal = 8\nmicro = 2\nseq_len = 64\n");
    INFO(r.report());
    REQUIRE(errors_of(r).empty());
    return make_plan(r.recipe, dsrun::test::small_host());
  };
  const Plan one = plan_of("expert = 1"), two = plan_of("expert = 2");
  CHECK(two.world_size == 4);  // folded into the data ranks: no extra factor
  CHECK(two.layout.data == 4);
  CHECK(two.layout.expert == 2);
  // deepseek-moe-tiny: 3 MoE layers of 8 experts of 3 · 128 · 64 weights; fp32 ZeRO-1 AdamW:
  // 8 bytes replicated (weights, gradients) + 8 sharded (Adam) per parameter.
  const double routed = 3 * 8 * 3 * 128.0 * 64;
  CHECK(one.memory.routed_expert_states == 0);
  CHECK(two.memory.routed_expert_states == Approx(routed / 2 * 8 + std::ceil(routed / 2 / 2) * 8));  // half the experts, states over the 2 replicas
  CHECK(one.memory.states.device_total() - two.memory.states.device_total() == Approx(routed * 8 + routed / 4 * 8 - two.memory.routed_expert_states).epsilon(1e-6));
  // All-to-all: micro · s · k rows of h fp32 each way, forward and backward, 3 layers, one
  // micro-batch per step, half of them leaving the rank, for the busiest rank (1.25 × the mean).
  auto all_to_all = [](const Plan& p) {
    for (const CommTerm& c : p.comm)
      if (contains(c.collective, "all-to-all")) return c.bytes;
    return 0.0;
  };
  CHECK(two.accumulation == 1);
  const Plan every_pair = plan_of("expert = 2\n[execution]\ntokens_once_per_rank = false");
  CHECK_FALSE(every_pair.modes.tokens_once_per_rank);
  CHECK(all_to_all(every_pair) == Approx(3 * 4 * (2.0 * 64 * 2) * 128 * 4 * 0.5 * 1.25));
  // Tokens once per rank (on by default): the dispatch and its gradient carry each token once to
  // each rank its 2 choices of 8 experts are on, 2 · (1 - 4/8 · 3/7) ranks on average, and 8
  // bytes per pair forward say which token each reads; the combine both ways still per pair.
  CHECK(two.modes.tokens_once_per_rank);
  const double tokens = 2.0 * 64, distinct = 2 * (1 - 4.0 / 8 * 3.0 / 7);
  CHECK(all_to_all(two) == Approx(3 * (2 * (2 * tokens + tokens * distinct) * 128 * 4 + 2 * tokens * 8) * 0.5 * 1.25));
  CHECK(all_to_all(two) < 0.9 * all_to_all(every_pair));
  CHECK(contains(render_plan(two), "each token once to each rank its choices are on"));
  CHECK(contains(render_plan(two), "expert parallel 2 within the data ranks: each keeps 4 of 8 routed experts"));
  // A larger headroom costs activations and time.
  const Plan lopsided = plan_of("expert = 2\nexpert_imbalance = 3");
  CHECK(lopsided.memory.activations > two.memory.activations);
  CHECK(lopsided.step_seconds > two.step_seconds);
  // "auto" searches the degrees the data ranks and experts divide by, and says why it chose one.
  const Plan searched = plan_of("expert = \"auto\"");
  std::vector<int> degrees;
  for (const LayoutRow& row : searched.layouts) degrees.push_back(row.layout.expert);
  std::sort(degrees.begin(), degrees.end());
  CHECK(degrees == std::vector<int>{1, 2, 4});
  CHECK(searched.layout.expert == searched.layouts.front().layout.expert);
  bool explained = false;
  for (const AutoChoice& c : searched.choices) explained |= c.key == "parallel.expert" && contains(c.reason, "the fastest that fits");
  CHECK(explained);
}

TEST_CASE("a hook script that is a directory, and a batch that does not split over the default data ranks, are errors at a file and line", "[recipe][rules]") {
  auto errors = errors_of(load_text("[hooks]\nscript = \"/\"\n"));
  REQUIRE(errors.size() == 1);
  CHECK(errors[0].key == "hooks.script");
  CHECK(errors[0].source.line == 2);
  CHECK(contains(errors[0].message, "is a directory"));
  // Neither batch.global nor data_parallel written: the error points at the hardware base's
  // devices_per_node, which makes the data ranks, not at "(default)".
  errors = errors_of(load_text("base = [\"hardware/cpu\", \"models/deepseek-tiny\"]\n[hardware]\ndevices_per_node = 3\n"));
  REQUIRE(errors.size() == 1);
  CHECK(errors[0].key == "batch.global");
  CHECK(errors[0].source.layer != Layer::Default);
  CHECK(errors[0].source.line == 3);
}

TEST_CASE("data mixtures the ranks would refuse are refused by the recipe, at their line", "[recipe][rules][data]") {
  dsrun::test::TempDir dir;
  dir.write("a.bin", std::string(4096, 'a'));
  const std::string a = "\"" + dir.file("a.bin") + "\"";
  std::string many = "[data]\nkind = \"tokens\"\nblend = [";
  for (int k = 0; k < 5000; ++k) many += (k ? ", " : "") + a;
  many += "]\n";
  const Diagnostic too_many = only_error(load_text(many));
  CHECK(too_many.key == "data.blend");
  CHECK(contains(too_many.message, "5000 sources: a mixture takes at most 4096"));
  const Diagnostic zero = only_error(load_text("[data]\nkind = \"tokens\"\nblend = [" + a + ", " + a + "]\nblend_weights = [0.0, 0.0]\n"));
  CHECK(zero.key == "data.blend_weights");
  CHECK(zero.source.line == 4);
  CHECK(contains(zero.message, "sum to zero"));
  CHECK(only_error(load_text("[data]\nkind = \"tokens\"\nblend = [" + a + ", " + a + "]\nblend_weights = [1.0, -1.0]\n")).key == "data.blend_weights");
  // A Megatron-LM prefix (PREFIX.bin beside PREFIX.idx) is data that exists: no warning.
  dir.write("corpus_text_document.bin", "x");
  dir.write("corpus_text_document.idx", "x");
  const LoadedRecipe prefix = load_text("[data]\nkind = \"tokens\"\npath = \"" + dir.file("corpus_text_document") + "\"\n");
  REQUIRE(prefix.ok());
  CHECK(prefix.diagnostics.empty());
  const LoadedRecipe missing = load_text("[data]\nkind = \"tokens\"\nblend = [" + a + ", \"/nonexistent/x.bin\"]\n");
  REQUIRE(missing.ok());
  REQUIRE(missing.diagnostics.size() == 1);
  CHECK(contains(missing.diagnostics[0].message, "1 of 2 sources do not exist on this machine"));
}

TEST_CASE("run.time_limit reads Slurm's --time forms, and bad time limits and sbatch lines are errors at their line", "[recipe][slurm]") {
  CHECK(parse_time_limit_minutes("90") == 90);
  CHECK(parse_time_limit_minutes("2:00:00") == 120);
  CHECK(parse_time_limit_minutes("1-12:00:00") == 36 * 60);
  CHECK(parse_time_limit_minutes("1-2") == 26 * 60);
  CHECK(parse_time_limit_minutes("0:30") == 1);  // 30 seconds: Slurm rounds up to a minute
  CHECK_FALSE(parse_time_limit_minutes("0"));
  CHECK_FALSE(parse_time_limit_minutes("two hours"));
  CHECK_FALSE(parse_time_limit_minutes("1:2:3:4"));
  CHECK_FALSE(parse_time_limit_minutes("-5"));
  LoadedRecipe ok = load_text("[run]\ntime_limit = \"4:00:00\"\n[slurm]\npartition = \"gpu\"\nsbatch = [\"--exclusive\"]\n");
  CHECK(ok.ok());
  CHECK(ok.recipe.run.time_limit_minutes == 240);
  CHECK(ok.recipe.slurm.partition == "gpu");
  const Diagnostic& bad = only_error(load_text("[run]\nsteps = 3\ntime_limit = \"soon\"\n"));
  CHECK(bad.key == "run.time_limit");
  CHECK(bad.source.line == 3);
  CHECK(contains(bad.fix, "H:MM:SS"));
  const Diagnostic& line = only_error(load_text("[slurm]\nsbatch = [\"exclusive\"]\n"));
  CHECK(line.key == "slurm.sbatch");
  CHECK(contains(line.fix, "starting with --"));
  CHECK(only_error(load_text("[slurm]\npartiton = \"gpu\"\n")).key == "slurm.partiton");  // a typo is caught like any key's
}

TEST_CASE("a control character in the run's name or a [slurm] value is refused at its key: it would end a job script's line and start shell", "[recipe][slurm]") {
  const std::string base = "base = [\"hardware/cpu\", \"models/deepseek-tiny\"]\n";
  auto errors = errors_of(load_text(base, {"run.name=\"a\\ntouch X\""}));
  REQUIRE(errors.size() == 1);
  CHECK(errors[0].key == "run.name");
  CHECK(contains(errors[0].message, "newline"));
  errors = errors_of(load_text(base + "[slurm]\npartition = \"gpu\\tx\"\nsbatch = [\"--exclusive\\n\"]\n"));
  REQUIRE(errors.size() == 2);
  CHECK(errors[0].key == "slurm.partition");
  CHECK(errors[1].key == "slurm.sbatch");
  CHECK(errors_of(load_text(base, {"run.name=\"has space\""})).empty());
}

TEST_CASE("checkpoint.dir must be a directory this user can write, or one that can be made: a regular file or a dangling link is refused at its key", "[recipe][checkpoint]") {
  dsrun::test::TempDir dir;
  const std::string base = "base = [\"hardware/cpu\", \"models/deepseek-tiny\"]\n";
  dsrun::write_file_atomic(dir.file("a_file"), "x");
  REQUIRE(::symlink(dir.file("nowhere").c_str(), dir.file("dangling").c_str()) == 0);
  auto errors = errors_of(load_text(base, {"checkpoint.dir=\"" + dir.file("a_file") + "\""}));
  REQUIRE(errors.size() == 1);
  CHECK(errors[0].key == "checkpoint.dir");
  CHECK(contains(errors[0].message, "is a regular file"));
  errors = errors_of(load_text(base, {"checkpoint.dir=\"" + dir.file("dangling") + "\""}));
  REQUIRE(errors.size() == 1);
  CHECK(contains(errors[0].message, "symbolic link to something that does not exist"));
  errors = errors_of(load_text(base, {"checkpoint.dir=\"" + dir.file("a_file/below") + "\""}));
  REQUIRE(errors.size() == 1);
  CHECK(contains(errors[0].message, "is not a directory"));
  CHECK(errors_of(load_text(base, {"checkpoint.dir=\"" + dir.file("new/deeper") + "\""})).empty());  // made when needed
  CHECK(errors_of(load_text(base, {"checkpoint.dir=\"" + dir.path() + "\""})).empty());
}


TEST_CASE("DeepSeek-V2/V3 keys: groups, head widths and YaRN refused by name with a fix, the templates plan", "[recipe][rules][latent]") {
  const std::string moe = "[model.moe]\nrouted_experts = 8\ntop_k = 2\nintermediate = 8\n";
  const Diagnostic& groups = only_error(load_text(moe + "n_group = 3\n"));
  CHECK(groups.key == "model.moe.n_group");
  CHECK(groups.message.find("do not divide into 3 equal groups") != std::string::npos);
  CHECK(only_error(load_text(moe + "n_group = 4\ntopk_group = 5\n")).key == "model.moe.topk_group");
  CHECK(only_error(load_text(moe + "n_group = 8\ntopk_group = 1\n")).key == "model.moe.top_k");  // 2 experts from 1 group of 1
  const std::string mla = "[model]\nattention = \"mla\"\n[model.mla]\nkv_lora_rank = 32\nqk_nope_head_dim = 32\n";
  CHECK(only_error(load_text(mla + "qk_rope_head_dim = 6\n")).key == "model.mla.qk_nope_head_dim");  // 32 + 6 is no multiple of 8
  CHECK(only_error(load_text(mla + "qk_rope_head_dim = 16\nv_head_dim = 12\n")).key == "model.mla.v_head_dim");
  CHECK(only_error(load_text("[model.rope_scaling]\ntype = \"yarn\"\n")).key == "model.rope_scaling.factor");
  const LoadedRecipe v3 = load_text("base = [\"hardware/h100-80gb-x1\", \"models/deepseek-v3-tiny\"]\n[batch]\nseq_len = 128\n");
  CHECK(errors_of(v3).empty());
  CHECK(v3.recipe.model.moe_layers() == 4);  // 3 MoE blocks and the MTP module's
  for (const char* name : {"models/deepseek-v2-lite", "models/deepseek-v3"})
    CHECK(errors_of(load_text(std::string("base = [\"hardware/h100-80gb-x8\", \"") + name + "\"]\n[batch]\nseq_len = 4096\n")).empty());
}
