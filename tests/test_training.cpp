// The engine end to end: real dsrun-rank processes, Gloo collectives, a real store.
// ZeRO 0-3 on 1-3 ranks against one process, reruns, measured memory, failures and hangs.
#include "engine/checkpoint/checkpoint.hpp"
#include "engine/common/text.hpp"
#include "storage/store.hpp"
#include "test_util.hpp"
#include "train_util.hpp"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>

using dsrun::test::check_same_trajectory;
using dsrun::test::contains;
using dsrun::test::layout;
using dsrun::test::Run;
using dsrun::test::train;

namespace {

// Model-state bytes each rank measured from its tensors against the plan's prediction.
void check_memory_matches_plan(const dsrun::test::TempDir& dir, const Run& run, int ranks) {
  dsrun::Store store(dir.file("runs.db"));
  auto latest = store.latest_metrics(run.id);
  for (int r = 0; r < ranks; ++r) {
    std::string prefix = "memory/rank" + std::to_string(r) + "/";
    REQUIRE(latest.count(prefix + "model_state_bytes"));
    double measured = latest[prefix + "model_state_bytes"].value, predicted = latest[prefix + "predicted_model_state_bytes"].value;
    INFO("rank " << r << ": measured " << measured << " predicted " << predicted);
    CHECK(measured == Approx(predicted).epsilon(0.01));
  }
}

const std::vector<double>& reference_losses() {
  static dsrun::test::TempDir dir;
  static Run reference = train(dir, layout(0, 1));
  INFO(reference.text);
  REQUIRE(reference.code == 0);
  REQUIRE(reference.losses.size() == 20);
  return reference.losses;
}

}  // namespace

TEST_CASE("one process trains: the loss falls", "[training]") {
  const std::vector<double>& ref = reference_losses();
  CHECK(ref.back() < ref.front() - 1.0);
}

// Every stage from `first_stage` to 3 on `ranks` ranks against the one-process reference:
// losses within 1e-5 relative over 20 steps, and each rank's model-state bytes as planned.
void check_stages_against_reference(int ranks, int first_stage) {
  const std::vector<double>& ref = reference_losses();
  dsrun::test::TempDir dir;
  for (int stage = first_stage; stage <= 3; ++stage) {
    Run run = train(dir, layout(stage, ranks));
    INFO("stage " << stage << " on " << ranks << " rank(s)");
    check_same_trajectory(ref, run, 1e-5);
    check_memory_matches_plan(dir, run, ranks);
  }
}

TEST_CASE("ZeRO 0-3 on 2 ranks follow the one-process trajectory, with the planned memory", "[training][zero]") {
  check_stages_against_reference(2, 0);
}

TEST_CASE("ZeRO 0-3 on 3 ranks (uneven shards) follow the one-process trajectory", "[training][zero]") {
  check_stages_against_reference(3, 0);
}

TEST_CASE("ZeRO 1-3 on 1 rank follow the one-process trajectory", "[training][zero]") {
  check_stages_against_reference(1, 1);
}

TEST_CASE("activation checkpointing recomputes exactly what it dropped", "[training][zero]") {
  const std::vector<double>& ref = reference_losses();
  dsrun::test::TempDir dir;
  check_same_trajectory(ref, train(dir, layout(3, 2) + " --set parallel.activation_checkpointing=full"), 1e-5);
}

// A model-parallel run (`parallel` sets tensor or pipeline degrees; `ranks` in all) follows one
// process for 10 steps: losses and gradient norms within 1e-5, each rank's model states as
// planned, and the parameters after the last step.
// norm_tolerance: MoE runs' norms drift further than dense ones', since a last-bit difference can
// flip a near-tie routing choice (6.3e-5 relative by step 9 of ep2 on PyTorch 2.x's CPU kernels).
void check_model_parallel(const std::string& model, const std::string& parallel, int stage, int data_parallel, int ranks, double norm_tolerance = 5e-5) {
  dsrun::test::TempDir dir;
  const std::string steps = " --set run.steps=10 --set hardware.devices_per_node=4" + model;
  Run one = train(dir, layout(0, 1) + steps);
  REQUIRE(one.code == 0);
  Run tp = train(dir, layout(stage, data_parallel) + steps + parallel);
  INFO("ZeRO " << stage << ", data " << data_parallel << parallel << model);
  check_same_trajectory(one.losses, tp, 1e-5);
  const std::vector<double> norms = dsrun::test::recorded_metric(dir, one.id, "grad_norm"), tp_norms = dsrun::test::recorded_metric(dir, tp.id, "grad_norm");
  REQUIRE(norms.size() == tp_norms.size());
  for (size_t i = 0; i < norms.size(); ++i) {
    INFO("gradient norm at step " << i + 1);
    // The norm drifts faster than the loss (it sums squares of gradients near zero): 2e-5 relative
    // after 8 steps on AMD EPYC's OpenBLAS kernels and on PyTorch 2.x, where the loss keeps 1e-5.
    CHECK(tp_norms[i] == Approx(norms[i]).epsilon(norm_tolerance));
  }
  check_memory_matches_plan(dir, tp, ranks);
  // The parameters after the last step, from each run's final (logical) checkpoint, by name.
  auto final_weights = [&](const Run& run) {
    const std::string ckpt = dir.file(run.id + "/checkpoints/" + dsrun::checkpoint_dir_name(10));
    dsrun::CheckpointManifest m = dsrun::read_checkpoint(ckpt, true);
    dsrun::CheckpointReader reader(ckpt, m);
    std::map<std::string, std::vector<float>> weights;
    for (const auto& p : m.params) weights[p.name] = reader.read_whole(p);
    return weights;
  };
  const auto a = final_weights(one), b = final_weights(tp);
  REQUIRE(a.size() == b.size());
  for (const auto& [name, values] : a) {
    INFO(name);
    REQUIRE(b.count(name));
    REQUIRE(b.at(name).size() == values.size());
    // Adam turns last-bit gradient differences into weight differences of a fraction of lr (3e-3)
    // where a gradient is near zero (up to 1.03e-4 seen with whole logits; 3.9e-4 in the embedding
    // with the fused projection and loss, whose one-rank and vocabulary-parallel forms sum in other
    // orders); a misplaced slice would differ by the weights' size (~0.02).
    double worst = 0;
    for (size_t i = 0; i < values.size(); ++i) worst = std::max(worst, std::fabs(double(values[i]) - b.at(name)[i]));
    CHECK(worst < 6e-4);
  }
}

void check_tensor_parallel(const std::string& model, int stage, int data_parallel) {
  check_model_parallel(model, " --set parallel.tensor=2", stage, data_parallel, 2 * data_parallel);
}

TEST_CASE("tensor parallelism on 2 ranks follows one process (GQA, tied embeddings)", "[training][tensor]") {
  check_tensor_parallel(" --set model.kv_heads=2 --set model.tie_embeddings=true", 0, 1);
}

TEST_CASE("sequence parallelism on data 2 x tensor 2 with ZeRO-2 follows one process", "[training][tensor][sequence]") {
  check_tensor_parallel(" --set parallel.sequence_parallel=true", 2, 2);
}

TEST_CASE("data 2 x tensor 2 with ZeRO-1 and ZeRO-3 follows one process", "[training][tensor][zero]") {
  check_tensor_parallel("", 1, 2);
  check_tensor_parallel("", 3, 2);
}

TEST_CASE("pipeline parallelism on 2 stages follows one process: 1F1B, and interleaved with tied embeddings", "[training][pipeline]") {
  check_model_parallel("", " --set parallel.pipeline=2", 0, 1, 2);
  check_model_parallel(" --set model.layers=4 --set model.tie_embeddings=true",
                       " --set parallel.pipeline=2 --set parallel.pipeline_schedule=\\\"interleaved\\\" --set parallel.virtual_stages=2", 1, 1, 2);
}

TEST_CASE("pipeline 2 x data 2 with ZeRO-2, and pipeline 2 x tensor 2, follow one process", "[training][pipeline][tensor]") {
  check_model_parallel("", " --set parallel.pipeline=2", 2, 2, 4);
  check_model_parallel(" --set model.kv_heads=2", " --set parallel.pipeline=2 --set parallel.tensor=2 --set parallel.pipeline_schedule=\\\"gpipe\\\"", 1, 1, 4);
}

TEST_CASE("context parallelism follows one process: context 2 (GQA), and data 2 x context 2 with ZeRO-2", "[training][context]") {
  check_model_parallel(" --set model.kv_heads=2", " --set parallel.context=2", 0, 1, 2);
  check_model_parallel("", " --set parallel.context=2", 2, 2, 4);
}

// Latent attention (DeepSeek-V2/V3's MLA, dense here: MoE waits) under context parallelism.
const std::string kDenseMla = " --set model.attention=\\\"mla\\\" --set model.mla.q_lora_rank=32 --set model.mla.kv_lora_rank=16 --set model.mla.qk_nope_head_dim=16"
                              " --set model.mla.qk_rope_head_dim=8 --set model.mla.v_head_dim=16";

TEST_CASE("context parallelism composed: latent attention on context 4, and tensor 2 x context 2 with ZeRO-3", "[training][context][tensor][latent]") {
  check_model_parallel(kDenseMla, " --set parallel.context=4", 1, 1, 4);
  check_model_parallel(" --set model.kv_heads=2", " --set parallel.context=2 --set parallel.tensor=2", 3, 1, 4);
}

// The tiny decoder's blocks after the first as DeepSeek-MoE layers: 4 routed experts (top-2) and a shared one.
const std::string kMoe = " --set model.moe.routed_experts=4 --set model.moe.top_k=2 --set model.moe.intermediate=64 --set model.moe.shared_experts=1";
constexpr double kMoeNorms = 2e-4;

TEST_CASE("expert parallelism follows one process: ep2, and ep2 within data 4 with ZeRO-2", "[training][expert]") {
  check_model_parallel(kMoe, " --set parallel.expert=2", 0, 2, 2, kMoeNorms);
  check_model_parallel(kMoe + " --set batch.global=8", " --set parallel.expert=2", 2, 4, 4, kMoeNorms);
}

TEST_CASE("expert parallelism composed: ep2 x pipeline 2, and ep2 x tensor 2 with ZeRO-3", "[training][expert][pipeline][tensor]") {
  check_model_parallel(kMoe, " --set parallel.expert=2 --set parallel.pipeline=2", 1, 2, 4, kMoeNorms);
  // (init_std 0.05: routing by clear margins. At the default 0.02 a near-tie choice flipped between
  // the one-process and the tensor-parallel runs' last bits on this CI machine's CPU, with and
  // without the latent-attention change, and the runs drifted 2e-4 apart by step 6.)
  check_model_parallel(kMoe + " --set model.kv_heads=2 --set model.init_std=0.05", " --set parallel.expert=2 --set parallel.tensor=2", 3, 2, 4, kMoeNorms);
}

TEST_CASE("context parallelism with MoE layers follows one process: the balance loss over whole sequences, and V3's router with expert 2 over the context ranks", "[training][context][expert]") {
  check_model_parallel(kMoe, " --set parallel.context=2", 1, 1, 2, kMoeNorms);
  // DeepSeek-V3's router: sigmoid scores, group-limited choice, balance by bias, the sequence-wise
  // balance loss; the experts sharded over the two ranks that split each sequence.
  const std::string v3_router = kMoe + " --set model.moe.scoring_func=\\\"sigmoid\\\" --set model.moe.n_group=2 --set model.moe.topk_group=1"
                                       " --set model.moe.balance=\\\"bias\\\" --set model.moe.seq_aux_loss_weight=0.01 --set model.moe.norm_topk_prob=true";
  check_model_parallel(v3_router, " --set parallel.context=2 --set parallel.expert=2", 2, 1, 2, kMoeNorms);
}

TEST_CASE("expert parallelism with lopsided routing follows one process: every token to one expert, a rank without tokens", "[training][expert]") {
  // Top-1 with expert 0 biased to win: rank 0 runs every token, rank 1's experts get none.
  check_model_parallel(kMoe + " --set model.moe.top_k=1 --set model.moe.route_bias=[100,0,0,0]", " --set parallel.expert=2", 1, 2, 2, kMoeNorms);
}

TEST_CASE("an offloaded run follows the non-offloaded trajectory bitwise (fp32, ZeRO 1-3, 1-3 ranks)", "[training][offload]") {
  // On CPU ranks host and device are one memory: offload keeps separate host copies of the master
  // weights and states and takes the same fused host step, so the losses are the same bits.
  dsrun::test::TempDir dir;
  struct Case {
    int stage, ranks;
    const char* offload;
  };
  for (const Case& c : {Case{1, 1, "optimizer"}, Case{2, 2, "optimizer"}, Case{3, 3, "optimizer"}, Case{3, 2, "optimizer+params"}}) {
    INFO("ZeRO-" << c.stage << " on " << c.ranks << " rank(s), offload " << c.offload);
    const std::string common = layout(c.stage, c.ranks) + " --set run.steps=6";
    Run plain = train(dir, common);
    Run offloaded = train(dir, common + " --set parallel.offload=\\\"" + c.offload + "\\\"");
    INFO(offloaded.text);
    REQUIRE(plain.losses.size() == 6);
    CHECK(offloaded.losses == plain.losses);
  }
}

TEST_CASE("the delayed update computes step t's gradients on the parameters of update t-2", "[training][offload]") {
  // Semantics (docs/plan.md): step 1 at w0; update 1 runs beside step 2, which still computes at w0;
  // step 3 computes at w1 = update 1 applied to w0. Runs whose hook skips update 1 (or 2) see the
  // same parameters at step 2 (or 3): those losses are the same bits.
  dsrun::test::TempDir dir;
  auto skipping = [&](int step) {
    const std::string script = dir.write("skip" + std::to_string(step) + ".lua",
                                         "function on_step(ctx) if ctx.step == " + std::to_string(step) + " then return {skip = true} end end\n");
    return " --set hooks.script=\\\"" + script + "\\\"";
  };
  for (const std::string& common : {layout(2, 2) + " --set parallel.offload=\\\"optimizer\\\"", layout(3, 2) + " --set parallel.offload=\\\"optimizer+params\\\""}) {
    INFO(common);
    Run delayed = train(dir, common + " --set run.steps=4 --set parallel.delayed_update=true");
    Run plain = train(dir, common + " --set run.steps=4");
    Run skip1 = train(dir, common + " --set run.steps=4" + skipping(1));
    Run skip2 = train(dir, common + " --set run.steps=4" + skipping(2));
    INFO(delayed.text);
    REQUIRE(delayed.losses.size() == 4);
    REQUIRE(skip1.losses.size() == 4);
    REQUIRE(skip2.losses.size() == 4);
    CHECK(delayed.losses[0] == plain.losses[0]);
    CHECK(delayed.losses[1] == skip1.losses[1]);
    CHECK(delayed.losses[2] == skip2.losses[2]);
    CHECK(delayed.losses[3] != plain.losses[3]);  // stale by one update: a different trajectory
  }
  // Refused where nothing is offloaded.
  Run refused = train(dir, layout(2, 1) + " --set parallel.delayed_update=true");
  CHECK(refused.code != 0);
  CHECK(contains(refused.text, "parallel.delayed_update"));
}

TEST_CASE("a CPU run's peak resident memory is within 10% of the plan's host term, offloaded or not", "[training][offload][memory]") {
  // A 27 M-parameter decoder, so that model states (not the process's libraries) are most of it.
  dsrun::test::TempDir dir;
  const std::string model = " --set run.steps=3 --set model.hidden=512 --set model.layers=8 --set model.heads=8 --set model.kv_heads=8 --set model.intermediate=1536";
  // ZeRO-2 without offload, the quickstart's layout, measured 25% above the plan while every unit's
  // gradient copy stayed in flight to the end of backward (zero.cpp now bounds them). ZeRO-3 on
  // Gloo, 12-19% above before the plan counted those reductions in flight at stage 3 too; with
  // full recomputation 11-39% above while glibc's moving mmap threshold kept freed units' holes
  // resident (CPU ranks now fix it: trainer.cpp, map_large_host_blocks).
  for (const std::string& layout_sets : {layout(2, 2) + " --set parallel.offload=\\\"optimizer\\\"", layout(1, 3) + " --set parallel.offload=\\\"optimizer\\\"",
                                         layout(2, 2) + " --set batch.micro=6 --set batch.seq_len=128", layout(3, 2) + " --set batch.micro=6 --set batch.seq_len=128",
                                         layout(3, 2) + " --set batch.micro=6 --set batch.seq_len=128 --set parallel.activation_checkpointing=\\\"full\\\""}) {
    Run run = train(dir, layout_sets + model);
    INFO(run.text);
    REQUIRE(run.code == 0);
    dsrun::Store store(dir.file("runs.db"));
    auto latest = store.latest_metrics(run.id);
    double rank0_measured = 0;
    for (int rank = 0; rank < (contains(layout_sets, "data_parallel=3") ? 3 : 2); ++rank) {
      const std::string prefix = "memory/rank" + std::to_string(rank) + "/";
      REQUIRE(latest.count(prefix + "peak_rss_bytes"));
      const double measured = latest[prefix + "peak_rss_bytes"].value, planned = latest[prefix + "predicted_host_bytes"].value;
      INFO(layout_sets << " rank " << rank << ": peak RSS " << measured / 1048576 << " MiB, plan " << planned / 1048576 << " MiB");
      CHECK(std::fabs(measured - planned) <= 0.10 * planned);
      // Data-parallel ranks hold the same tensors, and with large blocks mapped (not left in the
      // heap's holes) the same resident memory: before, ranks of one run differed by up to 12%.
      if (rank == 0) rank0_measured = measured;
      CHECK(std::fabs(measured - rank0_measured) <= 0.02 * rank0_measured);
      CHECK(latest[prefix + "model_state_bytes"].value == Approx(latest[prefix + "predicted_model_state_bytes"].value).epsilon(0.001));  // padding per unit
    }
  }
}

TEST_CASE("a recipe whose host memory does not fit is refused before launch, naming the key", "[training][offload]") {
  dsrun::test::TempDir dir;
  Run run = train(dir, layout(2, 2) + " --set parallel.offload=\\\"optimizer\\\" --set hardware.memory_gib=8 --set hardware.host_memory_gib=0.3");
  INFO(run.text);
  CHECK(run.code == 2);
  CHECK(contains(run.text, "does not fit: host memory (hardware.host_memory_gib)"));
  CHECK(run.losses.empty());
  auto plan = dsrun::test::run_command("cd '" + dsrun::test::source_dir() + "' && '" DSRUN_BINARY "' plan recipes/rtx4090x3_deepseek7b.toml --set hardware.host_memory_gib=64");
  INFO(plan.text);
  CHECK(plan.code == 2);
  CHECK(contains(plan.text, "does not fit: host memory (hardware.host_memory_gib)"));
  CHECK(contains(plan.text, "device memory fits"));
  CHECK(contains(plan.text, "--set hardware.host_memory_gib="));
  CHECK(contains(plan.text, "3 rank(s) x"));
}

TEST_CASE("the same seed gives bitwise-identical losses on rerun", "[training]") {
  dsrun::test::TempDir dir;
  Run first = train(dir, layout(2, 2) + " --set run.steps=8");
  Run second = train(dir, layout(2, 2) + " --set run.steps=8");
  INFO(first.text << second.text);
  REQUIRE(first.losses.size() == 8);
  CHECK(first.losses == second.losses);
}

TEST_CASE("a crashing rank stops the others and the run is failed with its error", "[training][failure]") {
  dsrun::test::TempDir dir;
  Run run = train(dir, layout(2, 2) + " --set run.steps=200", "DSRUN_TEST_CRASH_AT=1:3");
  INFO(run.text);
  CHECK(run.code == 1);
  CHECK(contains(run.text, "rank 1 was killed by signal 9"));
  CHECK(run.seconds < 30);  // the surviving rank is stopped within seconds, not left waiting
  dsrun::Store store(dir.file("runs.db"));
  dsrun::RunRecord r = store.get_run(run.id);
  CHECK(r.status == dsrun::RunStatus::Failed);
  CHECK(contains(r.error, "rank 1"));
  bool logged = false;
  for (const auto& e : store.events(run.id)) logged |= e.kind == "failed" && e.rank == 1;
  CHECK(logged);
}

TEST_CASE("a rank that stops making progress is reported as a hang, by rank", "[training][failure]") {
  dsrun::test::TempDir dir;
  Run run = train(dir, layout(0, 3) + " --set run.steps=200 --set run.step_timeout_s=3", "DSRUN_TEST_HANG_AT=1:4");
  INFO(run.text);
  CHECK(run.code == 1);
  CHECK(contains(run.text, "rank 1 hung: it never started step 4"));
  dsrun::Store store(dir.file("runs.db"));
  CHECK(store.get_run(run.id).status == dsrun::RunStatus::Failed);
  // With model parallelism the rank is named with its place in the mesh.
  Run staged = train(dir, layout(0, 1) + " --set parallel.pipeline=2 --set run.steps=200 --set run.step_timeout_s=3", "DSRUN_TEST_HANG_AT=1:4");
  INFO(staged.text);
  CHECK(staged.code == 1);
  CHECK(contains(staged.text, "rank 1 (pipeline stage 1, data 0, tensor 0) hung: it never started step 4"));
}

TEST_CASE("a rank stopped by SIGSTOP is named with its place in the mesh, in steps and during start-up", "[training][failure]") {
  dsrun::test::TempDir dir;
  struct Trial {
    std::string sets, stop;
    const char* named;
  };
  // The red team's layouts (pp2, tp2 × pp2, pp2 × dp2, pp4), a stage stopped mid-run, and a rank
  // stopped before it finished start-up (step 0: before the rendezvous).
  const std::vector<Trial> trials{
      {layout(0, 1) + " --set parallel.pipeline=2", "1:4", "rank 1 (pipeline stage 1, data 0, tensor 0) hung: its process is stopped"},
      {layout(0, 1) + " --set hardware.devices_per_node=4 --set parallel.pipeline=2 --set parallel.tensor=2", "2:3", "rank 2 (pipeline stage 1, data 0, tensor 0) hung: its process is stopped"},
      {layout(0, 2) + " --set hardware.devices_per_node=4 --set parallel.pipeline=2", "3:5", "rank 3 (pipeline stage 1, data 1, tensor 0) hung: its process is stopped"},
      {layout(0, 1) + " --set hardware.devices_per_node=4 --set parallel.pipeline=4", "0:0", "rank 0 (pipeline stage 0, data 0, tensor 0) hung: its process is stopped"},
  };
  for (const Trial& t : trials) {
    Run run = train(dir, t.sets + " --set run.steps=200 --set run.step_timeout_s=4 --set checkpoint.every=0", "DSRUN_TEST_STOP_AT=" + t.stop);
    INFO(run.text);
    CHECK(run.code == 1);
    CHECK(contains(run.text, t.named));
    CHECK(run.seconds < 60);  // the step timeout and a few seconds, not the 900 s start-up timeout
  }
}

TEST_CASE("Ctrl-C stops the ranks cleanly and marks the run killed", "[training][failure]") {
  dsrun::test::TempDir dir;
  Run run = train(dir, layout(1, 2) + " --set run.steps=100000", "timeout --preserve-status -s INT 6");
  INFO(run.text);
  CHECK(run.code == 130);
  dsrun::Store store(dir.file("runs.db"));
  CHECK(store.get_run(run.id).status == dsrun::RunStatus::Killed);
  CHECK_FALSE(run.losses.empty());
  // checkpoint.at_end: the ranks finished their step and saved it before exiting.
  auto saved = store.checkpoints(run.id);
  REQUIRE(saved.size() == 1);
  CHECK(saved[0].step == static_cast<int64_t>(run.losses.size()));
}

TEST_CASE("smoke runs a GPU recipe's layout on CPU ranks and says what it shrank", "[training][smoke]") {
  dsrun::test::TempDir dir;
  Run run = train(dir, "--smoke", "", "recipes/deepseek7b_zero2.toml");
  INFO(run.text);
  CHECK(run.code == 0);
  CHECK(contains(run.text, "smoke run"));
  CHECK(contains(run.text, "8 CPU ranks"));
  CHECK(contains(run.text, "finished"));
}

TEST_CASE("smoke runs cover MoE, grouped-query attention and ZeRO-3 with offload", "[training][smoke]") {
  dsrun::test::TempDir dir;
  Run moe = train(dir, "--smoke", "", "recipes/deepseek_moe16b_h100.toml");
  INFO(moe.text);
  CHECK(moe.code == 0);
  Run gqa = train(dir, "--smoke", "", "recipes/rtx4090x3_deepseek7b.toml --set model.kv_heads=8");
  INFO(gqa.text);
  CHECK(gqa.code == 0);
  CHECK(contains(gqa.text, "3 CPU ranks"));
  Run resnet = train(dir, "--smoke", "", "recipes/rtx4090x3_resnet50_cifar10.toml");
  INFO(resnet.text);
  CHECK(resnet.code == 0);
  CHECK(contains(resnet.text, "ResNet-18"));
}

TEST_CASE("smoke keeps a tensor-parallel layout, with whole heads per rank", "[training][smoke][tensor]") {
  dsrun::test::TempDir dir;
  Run run = train(dir, "--smoke", "", "recipes/deepseek7b_zero2.toml --set parallel.tensor=2 --set parallel.data_parallel=2 --set parallel.sequence_parallel=true --set checkpoint.every=0");
  INFO(run.text);
  CHECK(run.code == 0);
  CHECK(contains(run.text, "4 CPU ranks (tensor 2 × pipeline 1 × data 2, sequence-parallel)"));
  CHECK(contains(run.text, "finished"));
}

TEST_CASE("ranks started from outside (torchrun style, dsrun worker) train without the launcher", "[training][worker]") {
  dsrun::test::TempDir dir;
  std::string recipe = dir.write("two.toml", "base = \"" + dsrun::test::source_dir() + "/tests/recipes/tiny_train.toml\"\n"
                                             "[run]\nsteps = 3\n[parallel]\ndata_parallel = 2\nzero_stage = 1\n"
                                             "[checkpoint]\ndir = \"" + dir.file("ckpt") + "\"\n");
  std::string common = "WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=19731 '" DSRUN_BINARY "' worker '" + recipe + "'";
  dsrun::test::CommandOutput out = dsrun::test::run_command("(RANK=0 LOCAL_RANK=0 " + common + " & RANK=1 LOCAL_RANK=1 " + common + "; wait)");
  const std::string& text = out.text;
  INFO(text);
  CHECK(out.code == 0);
  CHECK(contains(text, "\"rank\":0") );
  CHECK(contains(text, "\"type\":\"done\""));
  CHECK(contains(text, "\"step\":3"));
  CHECK(dsrun::file_exists(dir.file("ckpt/step_00000003/COMPLETE")));  // without a launcher, checkpoint.dir itself
}

TEST_CASE("two launchers as two nodes run pipeline 2 x tensor 2 (a stage per node), follow one process and record one run", "[training][pipeline][nodes]") {
  // Each `dsrun run --nnodes 2 --node-rank k` starts its node's two ranks; node 0 hosts the
  // rendezvous. Stages are the outermost mesh dimension, so each node holds one stage's tensor pair.
  // Both launchers write one store: node 0 records the run, node 1 finds it by the rendezvous
  // address and joins it with its own row.
  dsrun::test::TempDir dir;
  const std::string steps = " --set run.steps=4";
  Run one = train(dir, layout(0, 1) + steps);
  REQUIRE(one.code == 0);
  const std::string sets = layout(1, 1) + steps + " --set hardware.devices_per_node=2 --set hardware.nodes=2 --set hardware.inter_node_bandwidth_gbs=10" +
                           " --set parallel.tensor=2 --set parallel.pipeline=2 --set checkpoint.at_end=false";
  const int port = 20000 + static_cast<int>(::getpid() % 20000);
  const std::string db = dir.file("nodes.db");
  auto launcher = [&](int node) {
    return "'" DSRUN_BINARY "' run tests/recipes/tiny_train.toml --nnodes 2 --node-rank " + std::to_string(node) + " --master-port " + std::to_string(port) +
           " --db '" + db + "' " + sets;
  };
  dsrun::test::CommandOutput out = dsrun::test::run_command("cd '" + dsrun::test::source_dir() + "' && (" + launcher(1) + " > '" + dir.file("node1.log") +
                                                            "' 2>&1 &) && " + launcher(0) + "; sleep 2; cat '" + dir.file("node1.log") + "'");
  INFO(out.text);
  size_t at = out.text.find("\nrun ");
  REQUIRE(at != std::string::npos);
  Run two{out.code, out.text, out.text.substr(at + 5, 8), {}, 0};
  dsrun::Store store(db);
  for (const auto& m : store.metric_history(two.id, "loss")) two.losses.push_back(m.value);
  check_same_trajectory(one.losses, two, 1e-5);
  REQUIRE(store.list_runs({}).size() == 1);  // one run for both nodes
  CHECK(store.get_run(two.id).status == dsrun::RunStatus::Finished);
  CHECK(contains(out.text, "run " + two.id + ": node 1 of 2"));
  const std::vector<dsrun::NodeRecord> nodes = store.nodes(two.id);
  REQUIRE(nodes.size() == 2);
  for (const auto& n : nodes) {
    CHECK(n.status == "finished");
    CHECK(n.heartbeat_at > 0);
    CHECK(n.pid > 0);
  }
  int launches = 0;
  for (const auto& e : store.events(two.id)) launches += e.kind == "launch";
  CHECK(launches == 2);
  // Each node's ranks reported their own memory into the one run.
  const auto latest = store.latest_metrics(two.id);
  CHECK(latest.count("memory/rank0/peak_rss_bytes") == 1);
  CHECK(latest.count("memory/rank3/peak_rss_bytes") == 1);
  CHECK(store.get_run(two.id).job_id == "rendezvous 127.0.0.1:" + std::to_string(port));
}

TEST_CASE("a node whose launcher is killed is named in the run's error and its row marked lost", "[training][nodes][reliability]") {
  dsrun::test::TempDir dir;
  const std::string sets = layout(1, 2) + " --set run.steps=100000 --set schedule.name=\\\"constant\\\" --set hardware.devices_per_node=1 --set hardware.nodes=2"
                           " --set hardware.inter_node_bandwidth_gbs=10 --set checkpoint.at_end=false";
  const int port = 20000 + static_cast<int>((::getpid() + 7919) % 20000);
  const std::string db = dir.file("nodes.db");
  auto launcher = [&](int node) {
    return "'" DSRUN_BINARY "' run tests/recipes/tiny_train.toml --nnodes 2 --node-rank " + std::to_string(node) + " --master-port " + std::to_string(port) +
           " --db '" + db + "' " + sets + " > '" + dir.file("node" + std::to_string(node) + ".log") + "' 2>&1";
  };
  // Both nodes in the background; node 1's launcher is killed -9 once the run has trained a few steps.
  dsrun::test::run_command("cd '" + dsrun::test::source_dir() + "' && (" + launcher(1) + " & echo $! > '" + dir.file("pid1") + "') && (" + launcher(0) +
                           "; echo $? > '" + dir.file("code0") + "') > /dev/null 2>&1 &");
  int64_t steps = 0;
  for (int i = 0; i < 1200 && steps < 3; ++i) {
    ::usleep(50000);
    if (!dsrun::file_exists(db)) continue;
    dsrun::Store store(db);
    for (const auto& r : store.list_runs({})) steps = std::max<int64_t>(steps, store.latest_metrics(r.id).count("loss") ? store.latest_metrics(r.id).at("loss").step : 0);
  }
  REQUIRE(steps >= 3);
  dsrun::test::run_command("kill -9 $(cat '" + dir.file("pid1") + "'); for i in $(seq 600); do [ -f '" + dir.file("code0") + "' ] && break; sleep 0.1; done");
  INFO(dsrun::read_file(dir.file("node0.log")));
  REQUIRE(dsrun::file_exists(dir.file("code0")));
  CHECK(dsrun::trim(dsrun::read_file(dir.file("code0"))) == "1");
  dsrun::Store store(db);
  const auto runs = store.list_runs({});
  REQUIRE(runs.size() == 1);
  const dsrun::RunRecord r = store.get_run(runs[0].id);
  CHECK(r.status == dsrun::RunStatus::Failed);
  CHECK(contains(r.error, "node 1 ("));
  CHECK(contains(r.error, "is gone: its launcher, process " + dsrun::trim(dsrun::read_file(dir.file("pid1"))) + " on this host, has exited"));
  for (const auto& n : store.nodes(r.id)) {
    INFO("node " << n.node_rank << ": " << n.status << " " << n.error);
    CHECK(n.status == (n.node_rank == 1 ? "lost" : "failed"));
  }
}

TEST_CASE("a second node that never comes: node 0 fails within run.startup_timeout_s, naming the rendezvous and the node", "[training][nodes][reliability]") {
  dsrun::test::TempDir dir;
  const int port = 20000 + static_cast<int>((::getpid() + 104729) % 20000);
  const std::string db = dir.file("nodes.db");
  const auto t0 = std::chrono::steady_clock::now();
  dsrun::test::CommandOutput out = dsrun::test::run_command(
      "cd '" + dsrun::test::source_dir() + "' && '" DSRUN_BINARY "' run tests/recipes/tiny_train.toml --nnodes 2 --node-rank 0 --master-port " + std::to_string(port) +
      " --db '" + db + "' " + layout(0, 2) + " --set hardware.devices_per_node=1 --set hardware.nodes=2 --set hardware.inter_node_bandwidth_gbs=10 --set run.startup_timeout_s=6");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(out.text);
  CHECK(out.code == 1);
  CHECK(seconds < 6 + 20);  // the timeout, then the ranks' stop
  dsrun::Store store(db);
  const auto runs = store.list_runs({});
  REQUIRE(runs.size() == 1);
  const dsrun::RunRecord r = store.get_run(runs[0].id);
  CHECK(r.status == dsrun::RunStatus::Failed);
  CHECK(contains(r.error, "no rank finished start-up"));
  CHECK(contains(r.error, "node 1 of 2 never joined the rendezvous at 127.0.0.1:" + std::to_string(port) + " within run.startup_timeout_s"));
  CHECK(contains(r.error, "--node-rank 1 --master-addr 127.0.0.1 --master-port " + std::to_string(port)));
}

TEST_CASE("two nodes started with different settings are refused at the rendezvous, naming the key, before any step", "[training][nodes][reliability]") {
  dsrun::test::TempDir dir;
  const int port = 20000 + static_cast<int>((::getpid() + 15485863) % 20000);
  const std::string db = dir.file("nodes.db");
  const std::string sets = layout(0, 2) + " --set hardware.devices_per_node=1 --set hardware.nodes=2 --set hardware.inter_node_bandwidth_gbs=10 --set run.steps=3";
  auto launcher = [&](int node, const std::string& more) {
    return "'" DSRUN_BINARY "' run tests/recipes/tiny_train.toml --nnodes 2 --node-rank " + std::to_string(node) + " --master-port " + std::to_string(port) +
           " --db '" + db + "' " + sets + more;
  };
  // Node 1 was given another learning rate: its rank and rank 0 both see it as they rendezvous.
  const auto t0 = std::chrono::steady_clock::now();
  dsrun::test::CommandOutput out = dsrun::test::run_command("cd '" + dsrun::test::source_dir() + "' && (" + launcher(1, " --set optimizer.lr=0.002") + " > '" +
                                                            dir.file("node1.log") + "' 2>&1 &) && " + launcher(0, "") + "; sleep 2; cat '" + dir.file("node1.log") + "'");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(out.text);
  CHECK(seconds < 60);  // refused at once, not at run.startup_timeout_s (300 s)
  dsrun::Store store(db);
  const auto runs = store.list_runs({});
  REQUIRE(runs.size() == 1);
  const dsrun::RunRecord r = store.get_run(runs[0].id);
  CHECK(r.status == dsrun::RunStatus::Failed);
  CHECK(contains(r.error, "runs other settings than this rank"));
  CHECK(contains(r.error, "optimizer.lr = "));
  CHECK(contains(r.error, "same recipe, the same --set overrides and the same dsrun build"));
  CHECK(store.metric_history(r.id, "loss").empty());
}

TEST_CASE("a recipe whose layout is \"auto\" runs the layout its plan chose", "[training][search]") {
  dsrun::test::TempDir dir;
  Run run = train(dir, " --set run.steps=3 --set hardware.devices_per_node=2 --set parallel.data_parallel=\\\"auto\\\" --set parallel.tensor=\\\"auto\\\""
                       " --set parallel.pipeline=\\\"auto\\\" --set parallel.pipeline_schedule=\\\"auto\\\" --set parallel.sequence_parallel=\\\"auto\\\"");
  INFO(run.text);
  REQUIRE(run.code == 0);
  CHECK(contains(run.text, "parallel.tensor = "));
  CHECK(contains(run.text, "layouts searched"));
  CHECK(run.losses.size() == 3);
}

TEST_CASE("pipeline 2, tensor 2 and expert 2 with the optimizer offloaded follow the same layouts without offload bitwise", "[training][pipeline][tensor][expert][offload]") {
  // Pipeline: the first stage awaits the embedding's host update before sending it to the last
  // stage's tied head. Tensor: the host step's shards hold split and replicated weights apart.
  // Expert: the routed experts' units are updated and published over their own replicas.
  dsrun::test::TempDir dir;
  for (const std::string& parallel : {std::string(" --set parallel.pipeline=2 --set model.tie_embeddings=true"), std::string(" --set parallel.tensor=2"),
                                      " --set parallel.data_parallel=2 --set parallel.expert=2" + kMoe}) {
    const std::string common = layout(2, 1) + " --set run.steps=6 --set hardware.devices_per_node=2" + parallel;
    Run plain = train(dir, common);
    Run offloaded = train(dir, common + " --set parallel.offload=\\\"optimizer\\\"");
    INFO(parallel << "\n" << offloaded.text);
    REQUIRE(plain.losses.size() == 6);
    CHECK(offloaded.losses == plain.losses);
  }
}

TEST_CASE("recipes whose layout is all \"auto\" start as planned on CPU ranks, and what the plan refuses never launches", "[training][layout]") {
  dsrun::test::TempDir dir;
  const std::string all_auto = " --set parallel.tensor='\"auto\"' --set parallel.pipeline='\"auto\"' --set parallel.sequence_parallel='\"auto\"' --set parallel.data_parallel='\"auto\"'"
                               " --set parallel.pipeline_schedule='\"auto\"' --set parallel.virtual_stages='\"auto\"' --set parallel.zero_stage='\"auto\"' --set batch.micro='\"auto\"'"
                               " --set run.steps=3 --set schedule.warmup_steps=1 --set checkpoint.every=0";
  // Two and four CPU ranks: the search picks its layout, the ranks read it from their config and run it.
  for (const std::string devices : {"2", "4"}) {
    Run run = train(dir, all_auto + " --set hardware.devices_per_node=" + devices);
    INFO(run.text);
    CHECK(run.code == 0);
    CHECK(contains(run.text, "finished"));
    CHECK(run.losses.size() == 3);
  }
  // batch.seq_len above model.max_seq_len with the layout searched: refused before anything is recorded.
  Run refused = train(dir, all_auto + " --set batch.seq_len=64 --set model.max_seq_len=32");
  INFO(refused.text);
  CHECK(refused.code == 1);
  CHECK(contains(refused.text, "batch.seq_len: sequence length 64 exceeds model.max_seq_len = 32"));
  CHECK(refused.id.empty());
}

TEST_CASE("bf16 with fp32 gradients (auto: 6 micro-batches a step) trains at data 2 ZeRO-3, tensor 2 and pipeline 2 (tied embeddings too): each follows one micro-batch a step within bf16's noise, with the planned states", "[training][grad_dtype]") {
  // The exact check (the sum of the micro-batches' gradients to fp32 rounding) is engine-level
  // (test_zero.cpp, test_parallel.cpp); here real ranks run the path the plan pins for them.
  dsrun::test::TempDir dir;
  const std::string bf16 = " --set precision.dtype='\"bf16\"' --set run.steps=10 --set model.kv_heads=2";
  Run one = train(dir, bf16 + " --set batch.micro=12");  // one micro-batch a step, one rank: auto keeps bf16
  INFO(one.text);
  REQUIRE(one.code == 0);
  CHECK(nlohmann::json::parse(dsrun::Store(dir.file("runs.db")).get_run(one.id).plan_json)["execution"]["grad_dtype"] == "bf16");
  // Tied embeddings: the last pipeline stage sums the head's gradient of the tied weight in fp32 too.
  Run tied = train(dir, bf16 + " --set batch.micro=12 --set model.tie_embeddings=true");
  REQUIRE(tied.code == 0);
  for (const std::string& layout : {std::string(" --set parallel.data_parallel=2 --set parallel.zero_stage=3"), std::string(" --set parallel.tensor=2"),
                                    std::string(" --set parallel.pipeline=2"), std::string(" --set parallel.pipeline=2 --set model.tie_embeddings=true")}) {
    Run run = train(dir, bf16 + layout + (contains(layout, "data_parallel=2") ? " --set batch.micro=1" : ""));
    const Run& one_step = contains(layout, "tie_embeddings") ? tied : one;
    INFO(layout);
    check_same_trajectory(one_step.losses, run, 5e-3);
    const int ranks = 2;
    check_memory_matches_plan(dir, run, ranks);
    const auto plan = nlohmann::json::parse(dsrun::Store(dir.file("runs.db")).get_run(run.id).plan_json);
    CHECK(plan["execution"]["grad_dtype"] == "fp32");
  }
}

TEST_CASE("CUDA: fp16 steps that overflow run again at half the scale: none skipped, and the losses of a run started at the scale they settled on", "[training][cuda][fp16]") {
  if (dsrun::test::run_command("nvidia-smi -L").code != 0) {
    WARN("SKIPPED: no GPU visible (fp16 needs one: libtorch 1.13's CPU build has no half kernels; runs on GPU machines: scripts/gpu_build.sh)");
    return;
  }
  dsrun::test::TempDir dir;
  const std::string recipe = "recipes/gpu/small_gpu_check.toml", common = " --set precision.dtype=fp16 --set run.steps=6 --set checkpoint.at_end=false";
  // 2^40 overflows at once (fp16 ends at 65504): the first step halves until its gradients are finite.
  const Run retried = train(dir, common + " --set precision.loss_scale.initial_power=40 --set precision.loss_scale.overflow_retries=40", "", recipe);
  INFO(retried.text);
  REQUIRE(retried.code == 0);
  dsrun::Store store(dir.file("runs.db"));
  const auto scales = store.metric_history(retried.id, "loss_scale"), retries = store.metric_history(retried.id, "overflow_retries"),
             skipped = store.metric_history(retried.id, "skipped_steps");
  REQUIRE(scales.size() == 6);
  CHECK(scales[0].value < std::ldexp(1.0, 40));
  CHECK(retries[0].value == std::log2(std::ldexp(1.0, 40) / scales[0].value));  // one retry per halving
  CHECK(skipped.back().value == 0);
  // The same run started at the scale the first step settled on: its first step retries nothing, and
  // from there the two are the same run (retries stay on in both, so a later overflow at the edge
  // the first step found is met alike).
  const int settled = static_cast<int>(std::lround(std::log2(scales[0].value)));
  const Run direct = train(dir, common + " --set precision.loss_scale.initial_power=" + std::to_string(settled) + " --set precision.loss_scale.overflow_retries=40", "", recipe);
  check_same_trajectory(retried.losses, direct, 1e-3);
  CHECK(store.metric_history(direct.id, "overflow_retries").front().value == 0);
  CHECK(store.metric_history(direct.id, "overflow_retries").back().value == retries.back().value - retries.front().value);
}

TEST_CASE("CUDA: a step replayed as a CUDA graph gives the eager step's losses for 10 steps, and the run says it was captured", "[training][cuda][graphs]") {
  if (dsrun::test::run_command("nvidia-smi -L").code != 0) {
    WARN("SKIPPED: no GPU visible (CUDA graphs need one; runs on GPU machines: scripts/gpu_build.sh)");
    return;
  }
  dsrun::test::TempDir dir;
  // One micro-batch a step in bf16 on one GPU: what execution.cuda_graphs needs.
  // An evaluation and a save between replays: the graph's inputs, parameters and pool outlive both.
  const std::string recipe = "recipes/gpu/small_gpu_check.toml",
                    common = " --set precision.dtype=bf16 --set batch.micro=16 --set run.steps=10 --set checkpoint.at_end=false"
                             " --set checkpoint.every=5 --set eval.every=4 --set eval.batches=1";
  const Run eager = train(dir, common + " --set execution.cuda_graphs=false", "", recipe);
  INFO(eager.text);
  REQUIRE(eager.code == 0);
  const Run graphed = train(dir, common + " --set execution.cuda_graphs=true", "", recipe);
  check_same_trajectory(eager.losses, graphed, 1e-3);
  // The gradients the replays hand back are the step's: their norms follow the eager run's.
  const std::vector<double> norms = dsrun::test::recorded_metric(dir, eager.id, "grad_norm"),
                            replayed = dsrun::test::recorded_metric(dir, graphed.id, "grad_norm");
  REQUIRE(norms.size() == replayed.size());
  for (size_t i = 0; i < norms.size(); ++i) {
    INFO("gradient norm at step " << i + 1);
    CHECK(replayed[i] == Approx(norms[i]).epsilon(1e-2));
  }
  // ZeRO-2 on one rank leaves the gradients to autograd as ZeRO-0 does: the same replay, the same losses.
  check_same_trajectory(eager.losses, train(dir, common + " --set execution.cuda_graphs=true --set parallel.zero_stage=2", "", recipe), 1e-3);
  dsrun::Store store(dir.file("runs.db"));
  bool captured = false;
  for (const auto& e : store.events(graphed.id))
    if (e.kind == "cuda_graphs") captured = contains(e.message, "captured as one CUDA graph");
  CHECK(captured);
  for (const auto& e : store.events(eager.id)) CHECK(e.kind != "cuda_graphs");
}
