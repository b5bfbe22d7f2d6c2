// Checkpoints end to end, with real ranks and a real store: resume bitwise, restarts after kill -9,
// a crash during a save, resharding to other world sizes and ZeRO stages, corrupted shards,
// rollback lineage and export.
#include "engine/checkpoint/checkpoint.hpp"
#include "engine/checkpoint/export.hpp"
#include "engine/common/files.hpp"
#include "engine/common/host.hpp"
#include "engine/common/text.hpp"
#include "engine/recipe/load.hpp"
#include "storage/store.hpp"
#include "test_util.hpp"
#include "train_util.hpp"

#include <catch2/catch.hpp>

#include <cstring>
#include <fstream>

using dsrun::test::check_same_trajectory;
using dsrun::test::contains;
using dsrun::test::dsrun_command;
using dsrun::test::layout;
using dsrun::test::recorded_losses;
using dsrun::test::Run;
using dsrun::test::TempDir;
using dsrun::test::train;

namespace {

// Six steps with a checkpoint every two.
const std::string kSixSteps = " --set run.steps=6 --set checkpoint.every=2";

// The uninterrupted run every interrupted one is compared with: 2 ranks, ZeRO-1.
const std::vector<double>& uninterrupted() {
  static TempDir dir;
  static Run run = train(dir, layout(1, 2) + kSixSteps);
  INFO(run.text);
  REQUIRE(run.code == 0);
  REQUIRE(run.losses.size() == 6);
  return run.losses;
}

std::string checkpoint_dir(const TempDir& dir, const std::string& run_id, int64_t step) {
  return dir.file(run_id + "/checkpoints/" + dsrun::checkpoint_dir_name(step));
}

int count_events(const TempDir& dir, const std::string& run_id, const std::string& kind) {
  dsrun::Store store(dir.file("runs.db"));
  int n = 0;
  for (const auto& e : store.events(run_id)) n += e.kind == kind;
  return n;
}

// Rewrites one byte near the end of a file (inside the tensor data).
void flip_byte(const std::string& path) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-3, std::ios::end);
  char c = 0;
  f.read(&c, 1);
  f.seekp(-3, std::ios::end);
  c = static_cast<char>(c ^ 0x55);
  f.write(&c, 1);
}

// A run of `sets` that rank 1 crashes at step 5, resumed (from step 4's checkpoint): its id.
std::string crash_at_five_and_resume(const TempDir& dir, const std::string& sets) {
  Run crashed = train(dir, sets, "DSRUN_TEST_CRASH_AT=1:5");
  INFO(crashed.text);
  REQUIRE(crashed.code == 1);
  auto out = dsrun_command(dir, "resume " + crashed.id);
  INFO(out.text);
  REQUIRE(out.code == 0);
  CHECK(contains(out.text, "resume from step 4"));
  return crashed.id;
}

}  // namespace

TEST_CASE("resume after a crash continues the uninterrupted trajectory bitwise, no metric row lost or repeated", "[resume]") {
  TempDir dir;
  const std::string id = crash_at_five_and_resume(dir, layout(1, 2) + kSixSteps);
  CHECK(recorded_losses(dir, id) == uninterrupted());  // bitwise, and exactly 6 rows
  dsrun::Store store(dir.file("runs.db"));
  CHECK(store.get_run(id).status == dsrun::RunStatus::Finished);
  CHECK(count_events(dir, id, "resume") == 1);
  CHECK(store.metric_history(id, "lr").size() == 6);
}

// optimizer.state_dtype = "bf16": the states are rounded as stored, so a checkpoint's fp32 copy of
// them holds them exactly and the resumed run is the uninterrupted one, bit for bit.
TEST_CASE("bf16 optimizer states: training stays near fp32 states', and a crash resumes bitwise", "[resume][optimizer]") {
  const std::string bf16 = layout(1, 2) + kSixSteps + " --set optimizer.state_dtype=bf16";
  TempDir whole_dir;
  Run whole = train(whole_dir, bf16);
  check_same_trajectory(uninterrupted(), whole, 0.01);
  CHECK(whole.losses != uninterrupted());  // the states' rounding shows in the losses
  TempDir dir;
  CHECK(recorded_losses(dir, crash_at_five_and_resume(dir, bf16)) == whole.losses);
}

TEST_CASE("a rank killed with SIGKILL restarts all ranks from the latest checkpoint (run.max_restarts)", "[resume][restart]") {
  TempDir dir;
  Run run = train(dir, layout(1, 2) + kSixSteps + " --set run.max_restarts=2", "DSRUN_TEST_CRASH_AT=1:5");
  INFO(run.text);
  REQUIRE(run.code == 0);
  CHECK(run.losses == uninterrupted());
  CHECK(count_events(dir, run.id, "restart") == 1);
  CHECK(contains(run.text, "restart 1 of 2 after: rank 1 was killed by signal 9; from the checkpoint at step 4"));
  CHECK_FALSE(contains(run.text, "out of memory"));  // a SIGKILL the kernel's out-of-memory killer did not send
}

TEST_CASE("when restarts are used up the run says so, with the last attempt's cause", "[resume][restart]") {
  TempDir dir;
  Run run = train(dir, layout(1, 2) + kSixSteps + " --set run.max_restarts=1", "DSRUN_TEST_CRASH_AT=1:5:always");
  INFO(run.text);
  CHECK(run.code == 1);
  CHECK(count_events(dir, run.id, "restart") == 1);
  CHECK(contains(run.text, "run.max_restarts (1) used up; the last attempt: rank 1 was killed by signal 9"));
  CHECK_FALSE(contains(run.text, "out of memory"));
}

TEST_CASE("a crash in the middle of a save leaves the previous checkpoint usable", "[resume]") {
  TempDir dir;
  Run run = train(dir, layout(1, 2) + kSixSteps, "DSRUN_TEST_CRASH_IN_SAVE=0:4");
  INFO(run.text);
  REQUIRE(run.code == 1);
  CHECK(dsrun::is_directory(checkpoint_dir(dir, run.id, 4)));  // half written...
  CHECK_FALSE(dsrun::file_exists(checkpoint_dir(dir, run.id, 4) + "/COMPLETE"));  // ...so it does not exist
  auto out = dsrun_command(dir, "resume " + run.id);
  INFO(out.text);
  REQUIRE(out.code == 0);
  CHECK(contains(out.text, "resume from step 2"));
  CHECK(recorded_losses(dir, run.id) == uninterrupted());
}

TEST_CASE("resharding: 2 ranks at ZeRO-1 resume on 1 rank at ZeRO-0, 1 rank resumes on 3 at ZeRO-3", "[resume][reshard]") {
  TempDir dir;
  Run two = train(dir, layout(1, 2) + kSixSteps, "DSRUN_TEST_CRASH_AT=1:5");
  REQUIRE(two.code == 1);
  auto out = dsrun_command(dir, "resume " + two.id + " --set parallel.data_parallel=1 --set parallel.zero_stage=0");
  INFO(out.text);
  REQUIRE(out.code == 0);
  check_same_trajectory(uninterrupted(), Run{0, out.text, two.id, recorded_losses(dir, two.id), 0}, 1e-5);
  CHECK(dsrun::Store(dir.file("runs.db")).get_run(two.id).world_size == 1);

  Run one = train(dir, layout(0, 1) + kSixSteps, "DSRUN_TEST_CRASH_AT=0:5");
  REQUIRE(one.code == 1);
  out = dsrun_command(dir, "resume " + one.id + " --set parallel.data_parallel=3 --set parallel.zero_stage=3");
  INFO(out.text);
  REQUIRE(out.code == 0);
  CHECK(contains(out.text, "3 rank(s), ZeRO stage 3"));
  check_same_trajectory(uninterrupted(), Run{0, out.text, one.id, recorded_losses(dir, one.id), 0}, 1e-5);
}

TEST_CASE("a corrupted or truncated shard is named with its step, and --fallback resumes from the previous checkpoint", "[resume]") {
  TempDir dir;
  Run run = train(dir, layout(1, 2) + kSixSteps, "DSRUN_TEST_CRASH_AT=1:6");
  REQUIRE(run.code == 1);
  const std::string step4 = checkpoint_dir(dir, run.id, 4);
  flip_byte(step4 + "/rank00001.safetensors");
  auto out = dsrun_command(dir, "resume " + run.id);
  INFO(out.text);
  CHECK(out.code == 1);
  CHECK(contains(out.text, "rank00001.safetensors"));
  CHECK(contains(out.text, "checkpoint at step 4"));
  CHECK(contains(out.text, "checksum"));
  CHECK(contains(out.text, "--fallback"));

  ::truncate((step4 + "/rank00000.safetensors").c_str(), 100);
  out = dsrun_command(dir, "resume " + run.id);
  CHECK(out.code == 1);
  CHECK(contains(out.text, "rank00000.safetensors"));
  CHECK(contains(out.text, "truncated"));

  out = dsrun_command(dir, "resume " + run.id + " --fallback");
  INFO(out.text);
  REQUIRE(out.code == 0);
  CHECK(contains(out.text, "skipped"));
  CHECK(contains(out.text, "resume from step 2"));
  CHECK(recorded_losses(dir, run.id) == uninterrupted());
}

TEST_CASE("rollback starts a child run from an earlier checkpoint with overrides, leaving the original untouched", "[resume][rollback]") {
  TempDir dir;
  Run parent = train(dir, layout(1, 2) + kSixSteps);
  REQUIRE(parent.code == 0);
  auto out = dsrun_command(dir, "rollback " + parent.id + " --to-step 3 --set optimizer.lr=1e-3");
  INFO(out.text);
  REQUIRE(out.code == 0);
  CHECK(contains(out.text, "at step 2 (the newest checkpoint at or before 3)"));
  const std::string child_id = out.text.substr(out.text.find("\nrun ") + 5, 8);
  dsrun::Store store(dir.file("runs.db"));
  dsrun::RunRecord child = store.get_run(child_id);
  CHECK(child.parent_run == parent.id);
  CHECK(child.parent_step == 2);
  CHECK(child.status == dsrun::RunStatus::Finished);
  CHECK(contains(child.config_toml, "lr = 0.001"));
  auto child_losses = store.metric_history(child_id, "loss");
  REQUIRE(child_losses.size() == 4);  // steps 3-6
  CHECK(child_losses.front().step == 3);
  CHECK(child_losses[0].value == uninterrupted()[2]);  // step 3's forward runs on the checkpoint's weights, bitwise
  CHECK(child_losses[1].value != Approx(uninterrupted()[3]).epsilon(1e-9));  // then the new learning rate shows
  CHECK(recorded_losses(dir, parent.id) == uninterrupted());
  CHECK(store.get_run(parent.id).status == dsrun::RunStatus::Finished);
  CHECK(contains(dsrun_command(dir, "show " + child_id).text, "parent      " + parent.id + " at step 2"));
  CHECK(contains(dsrun_command(dir, "show " + parent.id).text, child_id + " from step 2"));
}

TEST_CASE("export writes safetensors with Hugging Face names holding exactly the checkpoint's weights", "[resume][export]") {
  TempDir dir;
  Run run = train(dir, layout(3, 2) + kSixSteps + " --set precision.dtype=\"bf16\"");
  REQUIRE(run.code == 0);
  auto out = dsrun_command(dir, "export " + run.id + " --to '" + dir.file("export") + "'");
  INFO(out.text);
  REQUIRE(out.code == 0);
  CHECK(contains(out.text, "step 6"));
  dsrun::SafetensorsFile exported(dir.file("export/model.safetensors"));
  const std::string ckpt = checkpoint_dir(dir, run.id, 6);
  dsrun::CheckpointManifest manifest = dsrun::read_checkpoint(ckpt, true);
  dsrun::CheckpointReader reader(ckpt, manifest);
  dsrun::LoadOptions options;
  options.host = dsrun::test::small_host();
  dsrun::ModelSpec spec = dsrun::load_recipe_text(manifest.config_toml, "manifest", options).recipe.model;
  size_t tensors = 0;
  for (const auto& p : manifest.params) {
    std::vector<float> full = reader.read_whole(p);
    const int64_t row = p.shape.size() > 1 ? static_cast<int64_t>(full.size()) / p.shape[0] : 1;
    for (const auto& piece : dsrun::hf_pieces(p.name, p.shape, spec)) {
      const dsrun::SafetensorsEntry& e = exported.at(piece.name);
      CHECK(e.dtype == "F32");
      std::vector<float> got = exported.read_f32(e, 0, e.numel());
      std::vector<float> want(full.begin() + piece.row_begin * row, full.begin() + (piece.row_begin + piece.rows) * row);
      CHECK(got == want);
      ++tensors;
    }
  }
  CHECK(tensors == exported.entries().size());
  CHECK(contains(dsrun::read_file(dir.file("export/config.json")), "\"LlamaForCausalLM\""));

  out = dsrun_command(dir, "export " + run.id + " --step 5 --dtype bf16 --to '" + dir.file("export16") + "'");
  INFO(out.text);
  REQUIRE(out.code == 0);
  CHECK(contains(out.text, "step 4"));
  CHECK(dsrun::SafetensorsFile(dir.file("export16/model.safetensors")).at("model.embed_tokens.weight").dtype == "BF16");
}

TEST_CASE("a run initialised from exported weights starts where the exported run ended", "[resume][export]") {
  TempDir dir;
  Run first = train(dir, layout(0, 1) + kSixSteps);
  REQUIRE(first.code == 0);
  REQUIRE(dsrun_command(dir, "export " + first.id + " --to '" + dir.file("export") + "'").code == 0);
  // dsrun init --from-hf reads the export back as a recipe of the same model, starting from its weights.
  auto init = dsrun_command(dir, "init '" + dir.file("again") + "' --template quickstart --from-hf '" + dir.file("export") + "'");
  INFO(init.text);
  REQUIRE(init.code == 0);
  const std::string again = dsrun::read_file(dir.file("again.toml"));
  CHECK(contains(again, "init_from = \"" + dir.file("export") + "\""));
  CHECK_FALSE(contains(again, "models/"));  // the template's own model is gone
  const dsrun::LoadedRecipe imported = dsrun::test::load_recipe_at(dir.file("again.toml"));
  const dsrun::LoadedRecipe trained = dsrun::test::load_file("tests/recipes/tiny_train.toml");
  REQUIRE(imported.ok());
  CHECK(imported.recipe.model.hidden == trained.recipe.model.hidden);
  CHECK(imported.recipe.model.layers == trained.recipe.model.layers);
  CHECK(imported.recipe.model.kv_heads == trained.recipe.model.kv_heads);
  CHECK(imported.recipe.model.vocab == trained.recipe.model.vocab);
  CHECK(dsrun_command(dir, "plan '" + dir.file("again.toml") + "'").code == 0);
  Run second = train(dir, layout(0, 1) + " --set run.steps=3 --set model.init_from=\"" + dir.file("export") + "\"");
  INFO(second.text);
  REQUIRE(second.code == 0);
  // The first step's loss is measured on the imported weights: well below a fresh model's.
  CHECK(second.losses.front() < first.losses.front() - 0.2);
  Run mismatch = train(dir, layout(0, 1) + " --set run.steps=3 --set model.layers=3 --set model.init_from=\"" + dir.file("export") + "\"");
  CHECK(mismatch.code == 1);
  CHECK(contains(mismatch.text, "mismatch(es) between the weights and the model"));
  CHECK(contains(mismatch.text, "unexpected model.layers.3.self_attn.q_proj.weight"));
}

TEST_CASE("a launcher killed with SIGKILL takes its ranks with it, and the run resumes with --force", "[resume][restart]") {
  // Synchronous saves, then asynchronous ones: the kill then lands while a writer thread writes.
  for (const std::string async : {"false", "true"}) {
    INFO("checkpoint.async = " << async);
    TempDir dir;
    // Train "forever" with a checkpoint every 2 steps; kill -9 the launcher once one exists.
    const std::string run_cmd = "'" DSRUN_BINARY "' run tests/recipes/tiny_train.toml --db '" + dir.file("runs.db") + "' " + layout(1, 2) +
                                " --set run.steps=100000 --set checkpoint.every=2 --set schedule.name=\\\"constant\\\" --set checkpoint.async=" + async;
    auto out = dsrun::test::run_command("cd '" + dsrun::test::source_dir() + "' && (" + run_cmd + " > '" + dir.file("out.txt") + "' 2>&1 & echo $! > '" +
                                        dir.file("pid") + "'); for i in $(seq 300); do ls '" + dir.path() + "'/*/checkpoints/step_*/COMPLETE >/dev/null 2>&1 && break; sleep 0.1; done; "
                                        "kill -9 $(cat '" + dir.file("pid") + "'); sleep 1");
    INFO(out.text << dsrun::read_file(dir.file("out.txt")));
    dsrun::Store store(dir.file("runs.db"));
    auto runs = store.list_runs({});
    REQUIRE(runs.size() == 1);
    const std::string id = runs[0].id;
    CHECK(runs[0].status == dsrun::RunStatus::Running);  // nobody was left to record the end
    // No rank outlived its launcher (their command lines name the run's config; "[k]" keeps pgrep
    // from matching the shell that runs it).
    CHECK(dsrun::test::run_command("pgrep -f 'dsrun-ran[k] " + dir.file(id + "/config.toml") + "'").code != 0);

    auto refused = dsrun_command(dir, "resume " + id);
    CHECK(refused.code == 1);
    CHECK(contains(refused.text, "--force"));
    auto newest = dsrun::find_checkpoint(dir.file(id + "/checkpoints"), -1, false);
    REQUIRE(newest.has_value());
    auto resumed = dsrun_command(dir, "resume " + id + " --force --set run.steps=" + std::to_string(newest->step + 2));
    INFO(resumed.text);
    CHECK(resumed.code == 0);
    CHECK(contains(resumed.text, "resume from step " + std::to_string(newest->step)));
    CHECK(store.get_run(id).status == dsrun::RunStatus::Finished);
  }
}

TEST_CASE("resume on a weighted mixture of mapped token files (nanoGPT and llm.c, separate documents) continues bitwise", "[resume][data]") {
  TempDir dir;
  // Two sources the ranks map: a headerless u16 (nanoGPT) stream where 50256 closes a document
  // every 37 tokens, and an llm.c GPT-2 file where 50256 opens one every 23.
  std::string nano, llmc(1024, '\0');
  for (int k = 0; k < 6000; ++k) {
    const uint16_t t = k % 37 == 36 ? 50256 : static_cast<uint16_t>(1 + (k * 7) % 250);
    nano.append(reinterpret_cast<const char*>(&t), 2);
  }
  const int32_t header[3] = {20240520, 1, 4000};
  std::memcpy(&llmc[0], header, sizeof header);
  for (int k = 0; k < 4000; ++k) {
    const uint16_t t = k % 23 == 0 ? 50256 : static_cast<uint16_t>(1 + (k * 11) % 250);
    llmc.append(reinterpret_cast<const char*>(&t), 2);
  }
  dir.write("nano.bin", nano);
  dir.write("llmc.bin", llmc);
  const std::string data = " --set data.kind=tokens --set 'data.blend=[\"" + dir.file("nano.bin") + "\", \"" + dir.file("llmc.bin") +
                           "\"]' --set 'data.blend_weights=[3.0, 1.0]' --set data.format=nanogpt --set data.token_width=2" +
                           " --set data.separate_documents=true --set model.vocab=50304";
  Run reference = train(dir, layout(1, 2) + kSixSteps + data);
  INFO(reference.text);
  REQUIRE(reference.code == 0);
  REQUIRE(reference.losses.size() == 6);
  CHECK(contains(dsrun_command(dir, "show " + reference.id).text, "weight 3072/4096"));  // the data line names the mixture
  Run crashed = train(dir, layout(1, 2) + kSixSteps + data, "DSRUN_TEST_CRASH_AT=1:5");
  REQUIRE(crashed.code == 1);
  auto out = dsrun_command(dir, "resume " + crashed.id);
  INFO(out.text);
  REQUIRE(out.code == 0);
  CHECK(recorded_losses(dir, crashed.id) == reference.losses);  // bitwise
  // The same files moved to another directory are the same data: the resume names the new place.
  Run moved = train(dir, layout(1, 2) + kSixSteps + data, "DSRUN_TEST_CRASH_AT=1:5");
  REQUIRE(moved.code == 1);
  dsrun::test::run_command("mkdir -p '" + dir.file("elsewhere") + "' && mv '" + dir.file("nano.bin") + "' '" + dir.file("llmc.bin") + "' '" + dir.file("elsewhere") + "'");
  auto refused = dsrun_command(dir, "resume " + moved.id);
  CHECK(refused.code == 1);  // at the old place the files are gone
  auto elsewhere = dsrun_command(dir, "resume " + moved.id + " --set 'data.blend=[\"" + dir.file("elsewhere/nano.bin") + "\", \"" + dir.file("elsewhere/llmc.bin") + "\"]'");
  INFO(elsewhere.text);
  CHECK(elsewhere.code == 0);
  CHECK(recorded_losses(dir, moved.id) == reference.losses);
}

TEST_CASE("logical checkpoints: tensor 2 x pipeline 2 resumes on data 4, pipeline 2 on tensor 2", "[resume][reshard][pipeline][tensor]") {
  TempDir dir;
  const std::string four = kSixSteps + " --set hardware.devices_per_node=4";
  Run mp = train(dir, layout(1, 1) + four + " --set parallel.tensor=2 --set parallel.pipeline=2", "DSRUN_TEST_CRASH_AT=3:5");
  INFO(mp.text);
  REQUIRE(mp.code == 1);
  auto out = dsrun_command(dir, "resume " + mp.id + " --set parallel.tensor=1 --set parallel.pipeline=1 --set parallel.data_parallel=4 --set batch.micro=1");
  INFO(out.text);
  REQUIRE(out.code == 0);
  CHECK(contains(out.text, "resume from step 4"));
  check_same_trajectory(uninterrupted(), Run{0, out.text, mp.id, recorded_losses(dir, mp.id), 0}, 1e-5);

  Run pp = train(dir, layout(2, 1) + four + " --set parallel.pipeline=2", "DSRUN_TEST_CRASH_AT=1:5");
  REQUIRE(pp.code == 1);
  out = dsrun_command(dir, "resume " + pp.id + " --set parallel.pipeline=1 --set parallel.tensor=2 --set parallel.zero_stage=1");
  INFO(out.text);
  REQUIRE(out.code == 0);
  check_same_trajectory(uninterrupted(), Run{0, out.text, pp.id, recorded_losses(dir, pp.id), 0}, 1e-5);
}

TEST_CASE("logical checkpoints across expert-parallel degrees: ep2 resumes as ep1, ep1 as ep2", "[resume][reshard][expert]") {
  TempDir dir;
  const std::string moe = kSixSteps + " --set model.moe.routed_experts=4 --set model.moe.top_k=2 --set model.moe.intermediate=64 --set model.moe.shared_experts=1";
  Run whole = train(dir, layout(1, 2) + moe);
  INFO(whole.text);
  REQUIRE(whole.code == 0);
  for (const auto& [from, to] : {std::pair<int, int>{2, 1}, std::pair<int, int>{1, 2}}) {
    INFO("expert " << from << " -> " << to);
    Run crashed = train(dir, layout(1, 2) + moe + " --set parallel.expert=" + std::to_string(from), "DSRUN_TEST_CRASH_AT=1:5");
    INFO(crashed.text);
    REQUIRE(crashed.code == 1);
    auto out = dsrun_command(dir, "resume " + crashed.id + " --set parallel.expert=" + std::to_string(to));
    INFO(out.text);
    REQUIRE(out.code == 0);
    CHECK(contains(out.text, "resume from step 4"));
    check_same_trajectory(whole.losses, Run{0, out.text, crashed.id, recorded_losses(dir, crashed.id), 0}, 1e-5);
  }
}

TEST_CASE("DeepSeek-V3's parts (latent attention, the grouped sigmoid router with its bias, MTP) resume across layouts", "[resume][reshard][latent]") {
  TempDir dir;
  const std::string v3 = kSixSteps + " --set hardware.devices_per_node=2 --set model.attention=\\\"mla\\\" --set model.mla.q_lora_rank=32"
                         " --set model.mla.kv_lora_rank=16 --set model.mla.qk_nope_head_dim=16 --set model.mla.qk_rope_head_dim=8 --set model.mla.v_head_dim=16"
                         " --set model.moe.routed_experts=4 --set model.moe.top_k=2 --set model.moe.intermediate=32 --set model.moe.shared_experts=1"
                         " --set model.moe.scoring_func=\\\"sigmoid\\\" --set model.moe.n_group=2 --set model.moe.topk_group=1 --set model.moe.balance=\\\"bias\\\""
                         " --set model.moe.norm_topk_prob=true --set model.mtp.depth=1";
  Run whole = train(dir, layout(1, 2) + v3);
  INFO(whole.text);
  REQUIRE(whole.code == 0);
  REQUIRE(whole.losses.size() == 6);
  // Each crashes at step 5 in one layout and resumes from step 4 in another.
  const std::pair<std::string, std::string> moves[] = {
      {layout(1, 1) + " --set parallel.tensor=2", layout(3, 2)},
      {layout(1, 1) + " --set parallel.pipeline=2", layout(1, 2) + " --set parallel.expert=2"},
  };
  for (const auto& [from, to] : moves) {
    INFO(from << " -> " << to);
    Run crashed = train(dir, from + v3, "DSRUN_TEST_CRASH_AT=1:5");
    INFO(crashed.text);
    REQUIRE(crashed.code == 1);
    auto out = dsrun_command(dir, "resume " + crashed.id + " " + to + " --set parallel.tensor=1 --set parallel.pipeline=1");
    INFO(out.text);
    REQUIRE(out.code == 0);
    CHECK(contains(out.text, "resume from step 4"));
    check_same_trajectory(whole.losses, Run{0, out.text, crashed.id, recorded_losses(dir, crashed.id), 0}, 1e-5);
    // MTP's own metric, from every layout (the pipeline's last stage too): with the bias balancing
    // and no sequence-wise loss, aux_loss is exactly loss_weight (0.3) times it.
    const std::vector<double> mtp = dsrun::test::recorded_metric(dir, crashed.id, "mtp_loss"), aux = dsrun::test::recorded_metric(dir, crashed.id, "aux_loss");
    REQUIRE(mtp.size() == 6);
    REQUIRE(aux.size() == 6);
    for (size_t i = 0; i < mtp.size(); ++i) {
      INFO("step " << i + 1);
      CHECK(mtp[i] > 1.0);  // a cross-entropy over 256 tokens, not yet learnt
      CHECK(aux[i] == Approx(0.3 * mtp[i]).epsilon(1e-6));
    }
  }
}

TEST_CASE("export from a tensor 2 x pipeline 2 run with tied embeddings gives the one-process weights", "[resume][export][pipeline][tensor]") {
  TempDir dir;
  const std::string common = " --set run.steps=3 --set hardware.devices_per_node=4 --set model.tie_embeddings=true";
  Run whole = train(dir, layout(0, 1) + common);
  Run split = train(dir, layout(1, 1) + common + " --set parallel.tensor=2 --set parallel.pipeline=2");
  INFO(split.text);
  REQUIRE(whole.code == 0);
  REQUIRE(split.code == 0);
  for (const Run* r : {&whole, &split}) {
    auto out = dsrun_command(dir, "export " + r->id + " --to '" + dir.file("export-" + r->id) + "'");
    INFO(out.text);
    REQUIRE(out.code == 0);
  }
  dsrun::SafetensorsFile a(dir.file("export-" + whole.id + "/model.safetensors")), b(dir.file("export-" + split.id + "/model.safetensors"));
  REQUIRE(a.entries().size() == b.entries().size());
  for (const auto& e : a.entries()) {
    INFO(e.name);
    const dsrun::SafetensorsEntry& f = b.at(e.name);
    REQUIRE(f.shape == e.shape);
    std::vector<float> x = a.read_f32(e, 0, e.numel()), y = b.read_f32(f, 0, f.numel());
    // Adam divides by the gradient's running RMS, so where a gradient is near zero the last-bit
    // differences of another layout's reductions move a weight by a fraction of lr (3e-3): well
    // under 1e-4 after 3 steps, while a misplaced slice would be off by the weights' own size (~0.02).
    double worst = 0;
    for (size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::fabs(double(x[i]) - y[i]));
    CHECK(worst < 1e-4);
  }
}

TEST_CASE("a resume into a changed model is refused, naming what the checkpoint has and the model lacks, in every layout", "[resume][model]") {
  TempDir dir;
  // Tensor 2 × pipeline 2: each rank holds one stage's units, so the check spans the ranks.
  const std::string model_parallel = " --set hardware.devices_per_node=4 --set parallel.tensor=2 --set parallel.pipeline=2 --set parallel.data_parallel=1";
  Run crashed = train(dir, layout(0, 1) + model_parallel + kSixSteps, "DSRUN_TEST_CRASH_AT=1:5");
  INFO(crashed.text);
  REQUIRE(crashed.code == 1);
  auto fewer = dsrun_command(dir, "resume " + crashed.id + " --set model.layers=2");  // tiny_train has 4 layers
  INFO(fewer.text);
  CHECK(fewer.code == 1);
  CHECK(contains(fewer.text, "checkpoint does not fit this model"));
  CHECK(contains(fewer.text, "unexpected block3."));
  CHECK(contains(fewer.text, "(in the checkpoint, not in this model)"));
  auto tied = dsrun_command(dir, "resume " + crashed.id + " --set model.tie_embeddings=true");
  INFO(tied.text);
  CHECK(tied.code == 1);
  CHECK(contains(tied.text, "unexpected"));
  // Its rank's log (appended to by every attempt) is quoted from this attempt's start: the first
  // resume's refusal of the missing block3 is not shown again.
  CHECK_FALSE(contains(tied.text, "unexpected block3."));
  // A data-parallel checkpoint resumed into tensor parallelism with fewer layers: the same refusal.
  Run plain = train(dir, layout(1, 2) + kSixSteps, "DSRUN_TEST_CRASH_AT=1:5");
  REQUIRE(plain.code == 1);
  auto changed = dsrun_command(dir, "resume " + plain.id + " --set model.layers=2 --set parallel.tensor=2 --set parallel.data_parallel=1 --set parallel.zero_stage=0");
  INFO(changed.text);
  CHECK(changed.code == 1);
  CHECK(contains(changed.text, "unexpected block3."));
}

TEST_CASE("a resume that changes the batch, the seed or the steps says what changes, records it, or refuses", "[resume][model]") {
  TempDir dir;
  Run crashed = train(dir, layout(1, 2) + kSixSteps, "DSRUN_TEST_CRASH_AT=1:5");  // the newest checkpoint is step 4
  REQUIRE(crashed.code == 1);
  auto nothing = dsrun_command(dir, "resume " + crashed.id + " --set run.steps=4");
  INFO(nothing.text);
  CHECK(nothing.code == 1);
  CHECK(contains(nothing.text, "the checkpoint is at step 4 and run.steps = 4: nothing would be trained"));
  auto reseeded = dsrun_command(dir, "resume " + crashed.id + " --set run.seed=99 --set batch.global=24");
  INFO(reseeded.text);
  CHECK(reseeded.code == 0);
  CHECK(contains(reseeded.text, "warning: resume of " + crashed.id + ": run.seed 7 -> 99"));
  CHECK(contains(reseeded.text, "batch.global 12 -> 24: the data position is step x global batch, so the resumed run reads from sample 96, not from where the run stopped (sample 48)"));
  CHECK(count_events(dir, crashed.id, "resume_change") == 2);
  // Another optimizer or rotary base trains on silently no more.
  Run again = train(dir, layout(1, 2) + kSixSteps, "DSRUN_TEST_CRASH_AT=1:5");
  REQUIRE(again.code == 1);
  auto other = dsrun_command(dir, "resume " + again.id + " --set optimizer.name=\\\"adam\\\" --set model.rope_theta=500000.0");
  INFO(other.text);
  CHECK(other.code == 0);
  CHECK(contains(other.text, "warning: resume of " + again.id + ": optimizer.name \"adamw\" -> \"adam\": from the checkpoint on, training differs"));
  CHECK(contains(other.text, "model.rope_theta 10000.0 -> 5e+05"));
  CHECK(count_events(dir, again.id, "resume_change") == 2);
}

TEST_CASE("a resume whose data changed is refused naming the file, and --force trains on and records it", "[resume][data]") {
  TempDir dir;
  std::string nano;
  for (int k = 0; k < 6000; ++k) {
    const uint16_t t = k % 37 == 36 ? 50256 : static_cast<uint16_t>(1 + (k * 7) % 250);
    nano.append(reinterpret_cast<const char*>(&t), 2);
  }
  dir.write("nano.bin", nano);
  const std::string data = " --set data.kind=tokens --set data.path=" + dir.file("nano.bin") + " --set data.format=nanogpt --set data.token_width=2 --set model.vocab=50304";
  Run crashed = train(dir, layout(0, 1) + kSixSteps + data, "DSRUN_TEST_CRASH_AT=0:5");
  INFO(crashed.text);
  REQUIRE(crashed.code == 1);

  // Same size, one token rewritten: refused before any rank starts.
  std::string edited = nano;
  edited[7000] ^= 1;
  dir.write("nano.bin", edited);
  auto out = dsrun_command(dir, "resume " + crashed.id);
  INFO(out.text);
  CHECK(out.code != 0);
  CHECK(contains(out.text, "the data differs from what the checkpoint at step 4 trained on: " + dir.file("nano.bin") + ": same size, different content"));
  CHECK(contains(out.text, "--force"));

  // A rank resumed by another launcher (torchrun, a restart) checks the files it maps itself.
  const std::string rank_binary = dsrun::parent_directory(DSRUN_BINARY) + "/dsrun-rank";
  const std::string checkpoint = dir.file(crashed.id + "/checkpoints/step_00000004");
  auto rank = dsrun::test::run_command("cd '" + dir.path() + "' && RANK=0 WORLD_SIZE=1 MASTER_PORT=$((20000 + RANDOM % 12000))" +
                                       " DSRUN_RESUME_FROM='" + checkpoint + "' '" + rank_binary + "' '" + dir.file(crashed.id + "/config.toml") + "'");
  INFO(rank.text);
  CHECK(rank.code == 1);
  CHECK(contains(rank.text, "the data differs from what the checkpoint at step 4 trained on"));

  // --force: trained on, said and recorded.
  dir.write("nano.bin", nano.substr(0, 4096));
  out = dsrun_command(dir, "resume " + crashed.id + " --force");
  INFO(out.text);
  REQUIRE(out.code == 0);
  CHECK(contains(out.text, "12000 bytes -> 4096 bytes"));
  const std::string shown = dsrun_command(dir, "show " + crashed.id).text;
  CHECK(contains(shown, "resume_change  data file changed since the checkpoint (--force): " + dir.file("nano.bin") + ": 12000 bytes -> 4096 bytes"));
  CHECK(contains(shown, "resumed on changed data (--force)"));
}

namespace {

// A layout written out whole, so that a rollback into it replaces every setting of the last one.
std::string full_layout(int stage, int data, int tensor, int pipeline, int expert, const std::string& offload, int micro) {
  return layout(stage, data) + " --set parallel.tensor=" + std::to_string(tensor) + " --set parallel.pipeline=" + std::to_string(pipeline) +
         " --set parallel.expert=" + std::to_string(expert) + " --set parallel.offload=\\\"" + offload + "\\\" --set batch.micro=" + std::to_string(micro);
}

std::string run_id_in(const std::string& text) {
  const size_t at = text.find("\nrun ");
  return at == std::string::npos ? "" : text.substr(at + 5, 8);
}

}  // namespace

TEST_CASE("one checkpoint format: every layout saves it and three other layouts resume from it", "[resume][reshard][format]") {
  TempDir dir;
  // A mixture-of-experts decoder, so that expert parallelism has experts to place.
  const std::string moe = " --set model.moe.routed_experts=4 --set model.moe.top_k=2 --set model.moe.intermediate=64 --set model.moe.shared_experts=1 --set hardware.devices_per_node=4 --set schedule.warmup_steps=1";
  // Micro-batches of one sample everywhere: the balancing loss is per micro-batch, so its size is
  // part of the trajectory (ep2 x dp2 needs 1 for the global batch of 12 on 4 ranks).
  const std::vector<std::pair<std::string, std::string>> layouts = {
      {"dp2 ZeRO-0", full_layout(0, 2, 1, 1, 1, "none", 1)},
      {"dp2 ZeRO-1", full_layout(1, 2, 1, 1, 1, "none", 1)},
      {"dp2 ZeRO-2", full_layout(2, 2, 1, 1, 1, "none", 1)},
      {"dp2 ZeRO-3", full_layout(3, 2, 1, 1, 1, "none", 1)},
      {"tp2 x pp2", full_layout(1, 1, 2, 2, 1, "none", 1)},
      {"ep2 x dp2", full_layout(1, 4, 1, 1, 2, "none", 1)},
      {"ZeRO-3 offload", full_layout(3, 2, 1, 1, 1, "optimizer+params", 1)},
  };
  Run whole = train(dir, layouts[1].second + moe + " --set run.steps=3 --set checkpoint.at_end=false");
  INFO(whole.text);
  REQUIRE(whole.code == 0);
  REQUIRE(whole.losses.size() == 3);
  std::vector<std::string> writers;
  for (const auto& [name, sets] : layouts) {
    INFO("writer " << name);
    Run w = train(dir, sets + moe + " --set run.steps=2");  // saves at the end, step 2
    INFO(w.text);
    REQUIRE(w.code == 0);
    const dsrun::CheckpointManifest m = dsrun::read_checkpoint(checkpoint_dir(dir, w.id, 2), true);
    CHECK(m.format_version == 3);
    size_t sliced = 0;  // tensor parallelism's regions, ZeRO's ranges: parameters stored in parts
    for (const auto& p : m.params) sliced += p.slices.size() > 1;
    if (name != "dp2 ZeRO-0") CHECK(sliced > 0);
    writers.push_back(w.id);
  }
  // Each writer is read by the layouts 1, 2 and 4 places on (of 7, cyclically), so every layout
  // also reads three writers: 21 of the 42 pairs, for CI's time.
  for (size_t from = 0; from < layouts.size(); ++from)
    for (size_t offset : {1, 2, 4}) {
      const size_t to = (from + offset) % layouts.size();
      INFO(layouts[from].first << " -> " << layouts[to].first);
      auto out = dsrun_command(dir, "rollback " + writers[from] + " --to-step 2 --set run.steps=3 --set checkpoint.at_end=false " + layouts[to].second);
      INFO(out.text);
      REQUIRE(out.code == 0);
      const std::vector<double> losses = recorded_losses(dir, run_id_in(out.text));
      REQUIRE(losses.size() == 1);  // step 3, on the restored weights and optimizer states
      CHECK(std::fabs(losses[0] - whole.losses[2]) <= 1e-5 * std::fabs(whole.losses[2]));
    }
}

TEST_CASE("checkpoints in the two older formats (ZeRO shards, whole parameters) still resume and export", "[resume][format]") {
  // tests/checkpoints/ holds step 2 of these runs as dsrun wrote them before format 3: flat ZeRO
  // units from 2 data-parallel ranks (version 1), whole parameters from tensor parallelism (version 2).
  TempDir dir;
  // Whole logits (batch.loss_chunk_tokens = 0): the loss as those runs computed it, so that their
  // step 2 is this run's bit for bit.
  const std::string small = " --set model.hidden=16 --set model.layers=2 --set model.heads=2 --set model.kv_heads=2 --set model.intermediate=32 --set model.vocab=64 --set run.steps=4 --set checkpoint.every=2 --set batch.loss_chunk_tokens=0";
  Run reference = train(dir, layout(1, 2) + small);
  INFO(reference.text);
  REQUIRE(reference.code == 0);
  REQUIRE(reference.losses.size() == 4);
  auto out = dsrun_command(dir, "export " + reference.id + " --step 2 --to '" + dir.file("reference") + "'");
  REQUIRE(out.code == 0);
  dsrun::SafetensorsFile expected(dir.file("reference/model.safetensors"));
  struct Old {
    std::string fixture, sets;
    int version;
    double tolerance;  // the tensor-parallel run's sums are ordered otherwise
  };
  // v1 was bit for bit on the CPU that wrote the fixtures; OpenBLAS's kernels for another CPU model
  // round the last bits otherwise (2e-8 relative in the losses on an AMD EPYC), where a misread
  // shard would differ by the weights' size.
  for (const Old& old : {Old{"v1_zero1_dp2", layout(1, 2), 1, 1e-6}, Old{"v2_tensor2", layout(1, 1) + " --set parallel.tensor=2", 2, 1e-5}}) {
    INFO(old.fixture);
    Run crashed = train(dir, old.sets + small, "DSRUN_TEST_CRASH_AT=0:3");
    REQUIRE(crashed.code == 1);
    // Its step 2 becomes the one the older dsrun wrote for the same recipe.
    const std::string step2 = checkpoint_dir(dir, crashed.id, 2);
    dsrun::remove_tree(step2);
    dsrun::make_directories(step2);
    const std::string fixture = dsrun::test::source_dir() + "/tests/checkpoints/" + old.fixture;
    for (const std::string& name : dsrun::list_directory(fixture)) dsrun::write_file_atomic(step2 + "/" + name, dsrun::read_file(fixture + "/" + name));
    REQUIRE(dsrun::read_checkpoint(step2, true).format_version == old.version);
    out = dsrun_command(dir, "resume " + crashed.id);
    INFO(out.text);
    REQUIRE(out.code == 0);
    CHECK(contains(out.text, "resume from step 2"));
    check_same_trajectory(reference.losses, Run{0, out.text, crashed.id, recorded_losses(dir, crashed.id), 0}, old.tolerance);
    out = dsrun_command(dir, "export " + crashed.id + " --step 2 --to '" + dir.file(old.fixture) + "'");
    INFO(out.text);
    REQUIRE(out.code == 0);
    dsrun::SafetensorsFile exported(dir.file(old.fixture + "/model.safetensors"));
    REQUIRE(exported.entries().size() == expected.entries().size());
    for (const auto& e : expected.entries()) {
      INFO(e.name);
      const std::vector<float> want = expected.read_f32(e, 0, e.numel()), got = exported.read_f32(exported.at(e.name), 0, e.numel());
      for (size_t i = 0; i < want.size(); ++i) CHECK(std::fabs(got[i] - want[i]) <= old.tolerance * (1 + std::fabs(want[i])));
    }
  }
}

namespace {

// A tmpfs of `size` mounted on `path` while it lives (root only); mounted() says whether it is.
class SmallDisk {
 public:
  SmallDisk(const std::string& path, const std::string& size) : path_(path) {
    dsrun::make_directories(path);
    mounted_ = dsrun::test::run_command("mount -t tmpfs -o size=" + size + " tmpfs '" + path + "' 2>&1").code == 0;
  }
  ~SmallDisk() {
    if (mounted_) dsrun::test::run_command("umount '" + path_ + "' 2>&1");
  }
  bool mounted() const { return mounted_; }
  bool grow(const std::string& size) { return dsrun::test::run_command("mount -o remount,size=" + size + " '" + path_ + "' 2>&1").code == 0; }

 private:
  std::string path_;
  bool mounted_ = false;
};

std::vector<int64_t> complete_steps(const std::string& root) {
  std::vector<int64_t> steps;
  for (const auto& c : dsrun::list_checkpoints(root)) {
    CHECK(c.complete);  // nothing half-written left behind
    steps.push_back(c.step);
  }
  return steps;
}

}  // namespace

TEST_CASE("a save that meets a full disk fails cleanly, keep_last leaves the newest two, and resume goes on", "[resume][disk]") {
  TempDir dir;
  Run reference = train(dir, layout(1, 2) + " --set run.steps=8 --set checkpoint.at_end=false");
  REQUIRE(reference.code == 0);
  // Room for two checkpoints of the tiny decoder (9.8 MiB each), not for a third beside them.
  const std::string disk = dir.file("small_disk");
  SmallDisk small(disk, "26m");
  // Where no filesystem can be mounted, a file size limit makes the step-6 save fail the same way.
  const std::string env = small.mounted() ? "" : "DSRUN_TEST_FILE_SIZE_LIMIT=6:1000000";
  if (!small.mounted()) WARN("tmpfs cannot be mounted here: RLIMIT_FSIZE stands in for the full disk");
  const std::string sets = layout(1, 2) + " --set run.steps=8 --set checkpoint.every=2 --set checkpoint.keep_last=2 --set checkpoint.dir='\"" + disk + "\"'";
  Run full = train(dir, sets, env);
  // The recorded error first: a long output is cut in the middle by CI's log.
  const std::string recorded = full.id.empty() ? "" : dsrun::Store(dir.file("runs.db")).get_run(full.id).error;
  INFO("recorded error: " << recorded);
  INFO(full.text);
  REQUIRE(full.code == 1);
  CHECK(contains(full.text, "checkpoint at step 6 did not fit"));
  CHECK(contains(full.text, "checkpoint.dir"));
  CHECK(contains(full.text, "It needs 9.8"));  // the checkpoint's bytes, all ranks
  CHECK(contains(full.text, "the newest complete checkpoint is step 4"));
  const std::string root = disk + "/" + full.id;  // checkpoint.dir holds a directory per run
  CHECK(complete_steps(root) == std::vector<int64_t>{2, 4});  // step 6's partial files removed, retention untouched
  CHECK(dsrun::Store(dir.file("runs.db")).get_run(full.id).status == dsrun::RunStatus::Failed);
  // The run's error is the cause, not its peer's "Connection reset by peer" that follows it.
  CHECK(contains(recorded, "did not fit"));
  CHECK_FALSE(contains(recorded, "Connection reset"));

  if (small.mounted()) REQUIRE(small.grow("64m"));
  auto out = dsrun_command(dir, "resume " + full.id);
  INFO(out.text);
  REQUIRE(out.code == 0);
  CHECK(contains(out.text, "resume from step 4"));
  CHECK(complete_steps(root) == std::vector<int64_t>{6, 8});  // keep_last = 2: exactly the newest two
  CHECK(recorded_losses(dir, full.id) == reference.losses);
}

TEST_CASE("asynchronous saves: the trajectory is the synchronous one bitwise, each save records its pause, a crash mid-write leaves the previous checkpoint latest", "[resume][async]") {
  TempDir dir;
  Run async = train(dir, layout(1, 2) + kSixSteps + " --set checkpoint.async=true");
  INFO(async.text);
  REQUIRE(async.code == 0);
  CHECK(async.losses == uninterrupted());
  CHECK(complete_steps(dir.file(async.id + "/checkpoints")) == std::vector<int64_t>{2, 4, 6});
  const std::vector<double> pauses = dsrun::test::recorded_metric(dir, async.id, "checkpoint_pause_s");
  const std::vector<double> bandwidth = dsrun::test::recorded_metric(dir, async.id, "checkpoint_write_MBps");
  CHECK(pauses.size() == 3);
  CHECK(bandwidth.size() == 3);
  for (double b : bandwidth) CHECK(b > 0);
  int async_events = 0;
  for (const auto& e : dsrun::Store(dir.file("runs.db")).events(async.id)) async_events += e.kind == "checkpoint" && contains(e.message, "(async)");
  CHECK(async_events == 3);

  // Rank 1 dies in its writer thread, its file of step 4 written, before the commit.
  Run crashed = train(dir, layout(1, 2) + kSixSteps + " --set checkpoint.async=true", "DSRUN_TEST_CRASH_IN_SAVE=1:4");
  INFO(crashed.text);
  REQUIRE(crashed.code == 1);
  CHECK_FALSE(dsrun::file_exists(checkpoint_dir(dir, crashed.id, 4) + "/COMPLETE"));
  auto newest = dsrun::find_checkpoint(dir.file(crashed.id + "/checkpoints"), -1, false);
  REQUIRE(newest.has_value());
  CHECK(newest->step == 2);
  auto out = dsrun_command(dir, "resume " + crashed.id);
  INFO(out.text);
  REQUIRE(out.code == 0);
  CHECK(contains(out.text, "resume from step 2"));
  CHECK(recorded_losses(dir, crashed.id) == uninterrupted());
  // A resume reads its checkpoint and records how fast.
  CHECK(dsrun::test::recorded_metric(dir, crashed.id, "checkpoint_read_MBps").size() == 1);
}

TEST_CASE("balance by bias: a router forced onto one expert evens out, every rank holds the same bias, resume continues it bitwise, export carries it", "[resume][expert][balance]") {
  // Top-1 of 4 experts with expert 0 favoured by a fixed +1 on its score: every token goes there
  // (busiest / mean = 4) until the learned bias (0.01 a step) has pulled expert 0 down by about 1.
  // Two ranks keeping two experts each, so that the loads are summed over the expert exchange.
  const std::string sets = layout(1, 2) + " --set parallel.expert=2 --set run.steps=120 --set checkpoint.every=60" +
                           " --set model.moe.routed_experts=4 --set model.moe.top_k=1 --set model.moe.intermediate=64 --set model.moe.shared_experts=1" +
                           " --set model.moe.route_bias=[1,0,0,0] --set model.moe.balance=\"bias\" --set model.moe.bias_update_rate=0.01";
  TempDir dir;
  Run whole = train(dir, sets);
  INFO(whole.text);
  REQUIRE(whole.code == 0);
  const std::vector<double> load = dsrun::test::recorded_metric(dir, whole.id, "expert_load_max");
  REQUIRE(load.size() == 120);
  CHECK(load.front() == 4.0);
  double late = 0;
  for (size_t i = 100; i < 120; ++i) late += load[i] / 20;
  CHECK(late < 1.6);

  // The bias is in every rank's file, the same on each, and expert 0's went down.
  auto bias_of = [&](const std::string& run_id, int rank) {
    dsrun::SafetensorsFile f(dsrun::path_join(checkpoint_dir(dir, run_id, 120), dsrun::rank_file_name(rank)));
    const dsrun::SafetensorsEntry& e = f.at("buffer.block1.moe.expert_bias");
    return f.read_f32(e, 0, e.numel());
  };
  const std::vector<float> bias = bias_of(whole.id, 0);
  REQUIRE(bias.size() == 4);
  CHECK(bias_of(whole.id, 1) == bias);
  CHECK(bias[0] < -0.5f);

  // A crash after the checkpoint at step 60: the resumed run ends with the same bias and losses.
  Run crashed = train(dir, sets, "DSRUN_TEST_CRASH_AT=1:90");
  REQUIRE(crashed.code == 1);
  auto out = dsrun_command(dir, "resume " + crashed.id);
  INFO(out.text);
  REQUIRE(out.code == 0);
  CHECK(recorded_losses(dir, crashed.id) == whole.losses);
  CHECK(bias_of(crashed.id, 0) == bias);

  // Exported under DeepSeek-V3's name, and read back by a run initialised from the export.
  out = dsrun_command(dir, "export " + whole.id + " --to '" + dir.file("export") + "'");
  INFO(out.text);
  REQUIRE(out.code == 0);
  dsrun::SafetensorsFile exported(dir.file("export/model.safetensors"));
  const dsrun::SafetensorsEntry& e = exported.at("model.layers.1.mlp.gate.e_score_correction_bias");
  CHECK(exported.read_f32(e, 0, e.numel()) == bias);
  Run from_export = train(dir, sets + " --set run.steps=3 --set model.init_from=\"" + dir.file("export") + "\"");
  INFO(from_export.text);
  REQUIRE(from_export.code == 0);
  // With the bias the routing starts even, not at 4.
  CHECK(dsrun::test::recorded_metric(dir, from_export.id, "expert_load_max").front() < 2.0);
}

TEST_CASE("resume --force refuses a run still training, a resume the ranks refuse keeps the run's config, and of two concurrent resumes one trains and the other changes nothing", "[resume][store]") {
  TempDir dir;
  const std::string run_cmd = "'" DSRUN_BINARY "' run tests/recipes/tiny_train.toml --db '" + dir.file("runs.db") + "' " + layout(1, 2) +
                              " --set run.steps=100000 --set checkpoint.every=2 --set schedule.name=\\\"constant\\\"";
  // Training in the background until a checkpoint exists.
  auto started = dsrun::test::run_command("cd '" + dsrun::test::source_dir() + "' && (" + run_cmd + " > '" + dir.file("out.txt") + "' 2>&1 & echo $! > '" +
                                          dir.file("pid") + "'); for i in $(seq 300); do ls '" + dir.path() + "'/*/checkpoints/step_*/COMPLETE >/dev/null 2>&1 && break; sleep 0.1; done");
  INFO(started.text);
  dsrun::Store store(dir.file("runs.db"));
  auto runs = store.list_runs({});
  REQUIRE(runs.size() == 1);
  const std::string id = runs[0].id;
  // 1. Its launcher is alive: --force is refused, naming it, and the run trains on.
  auto refused = dsrun_command(dir, "resume " + id + " --force");
  CHECK(refused.code == 1);
  CHECK(contains(refused.text, "still training"));
  CHECK(contains(refused.text, "process " + dsrun::trim(dsrun::read_file(dir.file("pid")))));
  CHECK(store.get_run(id).status == dsrun::RunStatus::Running);
  // Stopped as `kill` would (Ctrl-C alike): the run ends killed.
  dsrun::test::run_command("kill -TERM $(cat '" + dir.file("pid") + "'); while kill -0 $(cat '" + dir.file("pid") + "') 2>/dev/null; do sleep 0.1; done");
  REQUIRE(store.get_run(id).status == dsrun::RunStatus::Killed);
  const std::string config_before = dsrun::read_file(dir.file(id + "/config.toml"));
  const std::string recorded_before = store.get_run(id).config_toml;
  // 2. The ranks refuse the checkpoint (another model): the run fails, its config stays as it was.
  auto mismatch = dsrun_command(dir, "resume " + id + " --set model.layers=3");
  CHECK(mismatch.code == 1);
  CHECK(dsrun::read_file(dir.file(id + "/config.toml")) == config_before);
  CHECK(store.get_run(id).config_toml == recorded_before);
  // 3. Two resumes at once: one takes the run and finishes it, the other is refused.
  auto newest = dsrun::find_checkpoint(dir.file(id + "/checkpoints"), -1, false);
  REQUIRE(newest.has_value());
  const std::string resume = "'" DSRUN_BINARY "' resume " + id + " --db '" + dir.file("runs.db") + "' --set run.steps=" + std::to_string(newest->step + 2);
  auto both = dsrun::test::run_command("cd '" + dsrun::test::source_dir() + "' && (" + resume + " > '" + dir.file("a.txt") + "' 2>&1; echo $? > '" + dir.file("a.code") + "') & (" +
                                       resume + " > '" + dir.file("b.txt") + "' 2>&1; echo $? > '" + dir.file("b.code") + "') & wait");
  const std::string a = dsrun::read_file(dir.file("a.txt")), b = dsrun::read_file(dir.file("b.txt"));
  INFO(a << "\n----\n" << b);
  const int code_a = std::stoi(dsrun::read_file(dir.file("a.code"))), code_b = std::stoi(dsrun::read_file(dir.file("b.code")));
  CHECK(code_a + code_b == 1);  // one 0, one 1
  const std::string& loser = code_a == 0 ? b : a;
  CHECK((contains(loser, "took it first") || contains(loser, "still training")));
  CHECK_FALSE(contains(loser, "--force"));  // the winner's launcher is alive: a --force would not help
  CHECK(store.get_run(id).status == dsrun::RunStatus::Finished);
  // The changed model was never recorded; the winner's step count was, once it trained on it.
  CHECK(contains(store.get_run(id).config_toml, "\nsteps = " + std::to_string(newest->step + 2)));
  CHECK(store.get_run(id).config_toml.find("\nlayers = 3") == std::string::npos);
}

TEST_CASE("a step directory whose manifest is another step's is refused by resume and rollback alike, and --fallback takes the newest good one", "[resume][rollback]") {
  TempDir dir;
  Run parent = train(dir, layout(1, 2) + kSixSteps + " --set checkpoint.keep_last=10");
  REQUIRE(parent.code == 0);
  // A copy of step 2 under a later step's name.
  dsrun::test::run_command("cp -r '" + checkpoint_dir(dir, parent.id, 2) + "' '" + checkpoint_dir(dir, parent.id, 10) + "'");
  auto refused = dsrun_command(dir, "rollback " + parent.id + " --to-step 10");
  INFO(refused.text);
  CHECK(refused.code == 1);
  CHECK(contains(refused.text, "its manifest is step 2's, not its directory's"));
  auto fallback = dsrun_command(dir, "rollback " + parent.id + " --to-step 10 --fallback --set run.steps=7");
  INFO(fallback.text);
  CHECK(fallback.code == 0);
  CHECK(contains(fallback.text, "at step 6"));
  const std::string child_id = fallback.text.substr(fallback.text.find("\nrun ") + 5, 8);
  dsrun::Store store(dir.file("runs.db"));
  CHECK(store.get_run(child_id).parent_step == 6);
  // The child's record says which checkpoint --fallback passed over, and why.
  int skipped = 0;
  for (const auto& e : store.events(child_id)) skipped += e.kind == "checkpoint" && contains(e.message, "skipped a checkpoint of run " + parent.id) ? 1 : 0;
  CHECK(skipped == 1);
}

TEST_CASE("logical checkpoints across context parallelism: context 2 resumes as one rank, data 2 as context 2", "[resume][reshard][context]") {
  TempDir dir;
  Run whole = train(dir, layout(1, 1) + kSixSteps);
  INFO(whole.text);
  REQUIRE(whole.code == 0);
  const std::string context2 = " --set parallel.data_parallel=1 --set parallel.context=2";
  for (const auto& [from, to] : {std::pair<std::string, std::string>{layout(1, 1) + context2, " --set parallel.context=1"},
                                 std::pair<std::string, std::string>{layout(1, 2), context2}}) {
    INFO(from << " -> " << to);
    Run crashed = train(dir, from + kSixSteps, "DSRUN_TEST_CRASH_AT=1:5");
    INFO(crashed.text);
    REQUIRE(crashed.code == 1);
    auto out = dsrun_command(dir, "resume " + crashed.id + to);
    INFO(out.text);
    REQUIRE(out.code == 0);
    CHECK(contains(out.text, "resume from step 4"));
    check_same_trajectory(whole.losses, Run{0, out.text, crashed.id, recorded_losses(dir, crashed.id), 0}, 1e-5);
  }
}
