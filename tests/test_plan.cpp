// The plan: model costs against published figures, ZeRO memory against the paper, batch math,
// automatic choices with reasons, verdicts and suggestions.
#include "engine/plan/plan.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

using namespace dsrun;
using dsrun::test::load_text;
using dsrun::test::contains;

namespace {

Plan plan_of(const std::string& text, std::vector<std::string> overrides = {}) {
  LoadedRecipe r = load_text(text, std::move(overrides));
  INFO(r.report());
  REQUIRE(r.ok());
  return make_plan(r.recipe, dsrun::test::small_host());
}

ModelSpec model_from(const std::string& template_name) {
  LoadedRecipe r = load_text("base = \"models/" + template_name + "\"\n");
  INFO(r.report());
  REQUIRE(r.ok());
  return r.recipe.model;
}

const std::string kSevenB = "base = [\"hardware/a100-40gb-x8\", \"models/deepseek-llm-7b\"]\n[precision]\ndtype = \"bf16\"\n[batch]\nseq_len = 4096\n";

}  // namespace

TEST_CASE("parameter counts match the published models", "[plan][cost]") {
  ModelCost seven = model_cost(model_from("deepseek-llm-7b"), 4096, DType::Bf16, AttentionKernel::Flash);
  CHECK(seven.params == 6910365696.0);  // 2·V·h + 30·(4h² + 3hf + 2h) + h
  ModelCost big = model_cost(model_from("deepseek-llm-67b"), 4096, DType::Bf16, AttentionKernel::Flash);
  CHECK(big.params == Approx(67.4e9).epsilon(0.01));
  ModelCost moe = model_cost(model_from("deepseek-moe-16b"), 4096, DType::Bf16, AttentionKernel::Flash);
  CHECK(moe.params == Approx(16.4e9).epsilon(0.01));        // DeepSeek-MoE paper: 16.4B total
  CHECK(moe.active_params == Approx(2.8e9).epsilon(0.02));  // and 2.8B activated
  ModelCost tiny = model_cost(model_from("deepseek-tiny"), 128, DType::Fp32, AttentionKernel::Math);
  CHECK(tiny.params == Approx(0.857e6).epsilon(0.01));
}

TEST_CASE("ResNet parameter counts match torchvision's CIFAR variants", "[plan][cost]") {
  ModelSpec m = model_from("resnet50-cifar10");
  CHECK(model_cost(m, 0, DType::Fp32, AttentionKernel::Flash).params == 23520842.0);
  m.resnet.depth = 18;
  CHECK(model_cost(m, 0, DType::Fp32, AttentionKernel::Flash).params == 11173962.0);
}

TEST_CASE("training FLOPs are 6N + 12·L·h·s per token", "[plan][cost]") {
  ModelSpec m = model_from("deepseek-tiny");
  const double s = 128, h = 128, L = 4, V = 256;
  ModelCost c = model_cost(m, 128, DType::Fp32, AttentionKernel::Math);
  const double matmul_params = c.params - V * h;  // the embedding lookup is no matmul
  CHECK(c.model_flops_per_sample == Approx(s * (6 * matmul_params + 12 * L * h * s)));
}

TEST_CASE("activation bytes follow what autograd keeps in a DeepSeek block", "[plan][cost]") {
  ModelSpec m = model_from("deepseek-llm-7b");
  const double s = 4096, h = 4096, f = 11008, V = 102400, L = 30, e = 2;
  ModelCost flash = model_cost(m, 4096, DType::Bf16, AttentionKernel::Flash);
  // The reference RMSNorm (no fused kernels) also keeps x·rsqrt: h per norm, 2h per layer.
  const double head = s * (e * 3 * h + 4 * V);  // final norm in, x·rsqrt and out; fp32 log-softmax
  CHECK(flash.activation_bytes_per_sample == Approx(e * s * L * (10 * h + 4 * f) + head));
  CHECK(flash.checkpointed_activation_bytes_per_sample == Approx(e * s * L * h + head));
  CHECK(flash.recomputed_layer_bytes_per_sample == Approx(e * s * (10 * h + 4 * f)));
  CHECK(flash.head_backward_bytes_per_sample == Approx(s * 8 * V));
  CHECK(flash.attention_backward_bytes_per_sample == 0);
  // The fused RMSNorm/SwiGLU kernels (CUDA builds) keep gate|up and the product, not silu(gate),
  // and the norms' input and scale only.
  ModelCost fused = model_cost(m, 4096, DType::Bf16, AttentionKernel::Flash, ModelCostOptions{/*fused_elementwise=*/true});
  CHECK(flash.activation_bytes_per_sample - fused.activation_bytes_per_sample == Approx(e * s * L * (f + 2 * h) + e * s * h));
  // The math kernel also keeps the s x s probabilities of every head and, with as many KV heads as
  // query heads, the projection's output and the rotated q|k that its views hold: 6h, not 3h.
  ModelCost math = model_cost(m, 4096, DType::Bf16, AttentionKernel::Math);
  CHECK(math.activation_bytes_per_sample - flash.activation_bytes_per_sample == Approx(e * s * L * (32 * s + 3 * h)));
  CHECK(math.attention_backward_bytes_per_sample == Approx(8.0 * 32 * s * s));  // fp32 gradients of probabilities and scores
  // Grouped-query attention keeps smaller k and v with the flash kernel.
  ModelSpec gqa = m;
  gqa.kv_heads = 8;
  ModelCost g = model_cost(gqa, 4096, DType::Bf16, AttentionKernel::Flash);
  CHECK(flash.activation_bytes_per_sample - g.activation_bytes_per_sample == Approx(e * s * L * 2 * (h - 8 * 128)));
}

TEST_CASE("model-state memory per rank matches the ZeRO paper", "[plan][memory]") {
  const double psi = 7.5e9;  // the paper's example model
  for (int n : {1, 2, 4, 8, 64}) {
    ModelStateOptions o;
    o.params = psi;
    o.data_parallel = n;
    o.dtype = DType::Bf16;
    o.optimizer = OptimizerKind::AdamW;
    o.zero_stage = 0;
    CHECK(plan_model_states_per_rank(o).device_total() == Approx(16 * psi));
    o.zero_stage = 1;
    CHECK(plan_model_states_per_rank(o).device_total() == Approx(4 * psi + 12 * psi / n));
    o.zero_stage = 2;
    CHECK(plan_model_states_per_rank(o).device_total() == Approx(2 * psi + 14 * psi / n));
    o.zero_stage = 3;
    CHECK(plan_model_states_per_rank(o).device_total() == Approx(16 * psi / n));
  }
  // The paper's headline: 7.5B on 64 GPUs: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB.
  ModelStateOptions o;
  o.params = psi;
  o.data_parallel = 64;
  o.dtype = DType::Fp16;
  o.zero_stage = 1;
  CHECK(plan_model_states_per_rank(o).device_total() / 1e9 == Approx(31.4).epsilon(0.01));
  o.zero_stage = 2;
  CHECK(plan_model_states_per_rank(o).device_total() / 1e9 == Approx(16.6).epsilon(0.01));
  o.zero_stage = 3;
  CHECK(plan_model_states_per_rank(o).device_total() / 1e9 == Approx(1.88).epsilon(0.01));
}

TEST_CASE("shards that do not divide are padded, and offload moves optimizer states to the host", "[plan][memory]") {
  ModelStateOptions o;
  o.params = 10;
  o.data_parallel = 3;
  o.zero_stage = 3;
  o.dtype = DType::Fp32;
  ModelStateBytes b = plan_model_states_per_rank(o);
  CHECK(b.params == 4 * 4);  // ceil(10/3) = 4 elements of 4 bytes
  CHECK(b.optimizer == 4 * 8);

  o.params = 1e9;
  o.data_parallel = 4;
  o.dtype = DType::Bf16;
  o.zero_stage = 2;
  o.offload = Offload::Optimizer;
  b = plan_model_states_per_rank(o);
  CHECK(b.master == 0);
  CHECK(b.optimizer == 0);
  CHECK(b.host == Approx((12 + 2 + 2) * 1e9 / 4));  // master + Adam moments + pinned bf16 gradient and upload buffers
  o.delayed_update = true;  // a second gradient buffer: one read by the host step, one filled by backward
  CHECK(plan_model_states_per_rank(o).host == Approx((12 + 2 + 2 + 2) * 1e9 / 4));
  o.same_memory = true;  // CPU ranks: the gradient is copied out of the reduction, the parameters written in place
  o.delayed_update = false;
  CHECK(plan_model_states_per_rank(o).host == Approx((12 + 2) * 1e9 / 4));
  o.delayed_update = true;  // ... except with the delayed update (they change only between steps)
  CHECK(plan_model_states_per_rank(o).host == Approx((12 + 2 + 2 + 2) * 1e9 / 4));
  o.delayed_update = false;
  o.same_memory = false;
  o.zero_stage = 3;
  o.offload = Offload::OptimizerAndParams;
  b = plan_model_states_per_rank(o);
  CHECK(b.params == 0);
  CHECK(b.device_total() == Approx(2 * 1e9 / 4));  // only the bf16 gradient shard stays
  CHECK(b.host == Approx((12 + 2 + 2) * 1e9 / 4));  // + the bf16 parameter shard and the gradient staging
  o.delayed_update = true;  // + a second gradient staging and a buffer the host step writes the next parameters into
  CHECK(plan_model_states_per_rank(o).host == Approx((12 + 2 + 2 + 2 + 2) * 1e9 / 4));
  o.delayed_update = false;

  o.offload = Offload::None;
  o.optimizer = OptimizerKind::Sgd;
  o.momentum = 0;
  o.zero_stage = 0;
  CHECK(plan_model_states_per_rank(o).optimizer == 0);  // plain SGD keeps no state
}

TEST_CASE("batch math: global = micro x accumulation x data parallel", "[plan][batch]") {
  Plan p = plan_of(kSevenB, {"batch.global=256"});
  CHECK(p.layout.data == 8);
  CHECK(p.layout.micro * p.accumulation * p.layout.data == 256);
  CHECK(p.tokens_per_step == 256.0 * 4096);
  Plan fixed = plan_of(kSevenB, {"batch.global=64", "batch.micro=2", "parallel.zero_stage=3", "parallel.activation_checkpointing=full"});
  CHECK(fixed.layout.micro == 2);
  CHECK(fixed.accumulation == 4);
}

TEST_CASE("auto choices take the lowest ZeRO stage that fits and say why", "[plan][auto]") {
  Plan p = plan_of(kSevenB, {"batch.global=64", "batch.micro=1", "parallel.activation_checkpointing=full"});
  CHECK(p.fits);
  CHECK(p.layout.zero_stage == 2);  // stage 1 needs 4Ψ + 12Ψ/8 = 37 GiB of states alone
  bool explained = false;
  for (const auto& c : p.choices)
    if (c.key == "parallel.zero_stage") explained = c.reason.find("stage 1 would need") != std::string::npos;
  CHECK(explained);
}

TEST_CASE("a higher ZeRO stage is chosen where a larger micro batch fits under it and plans faster, and says why", "[plan][auto]") {
  // DeepSeek-LLM-7B's shape in FP8 on 4 H200 (measured: ZeRO-0 at micro 1, 1.021 s a step; ZeRO-3 at micro 4, 0.945 s).
  const std::string seven_b_h200 =
      "base = [\"hardware/4x-nvidia-h200-probed\", \"models/deepseek-llm-7b\"]\n[precision]\ndtype = \"bf16\"\nfp8 = \"tensorwise\"\n"
      "grad_dtype = \"bf16\"\n"  // (as measured)
      "[batch]\nglobal = 16\nseq_len = 4096\n[hardware]\nhost_memory_gib = 500\n";
  Plan p = plan_of(seven_b_h200);
  Plan lowest = plan_of(seven_b_h200, {"parallel.zero_stage=0"});
  REQUIRE(p.fits);
  REQUIRE(lowest.fits);
  CHECK(lowest.layout.micro == 1);
  CHECK(p.layout.zero_stage > 0);
  CHECK(p.layout.micro > lowest.layout.micro);
  CHECK(p.step_seconds < lowest.step_seconds * 0.99);
  bool explained = false;
  for (const auto& c : p.choices)
    if (c.key == "parallel.zero_stage") explained = contains(c.reason, "stage 0 is the lowest that fits, at micro batch 1");
  CHECK(explained);
  // No stage planned on its own is more than 1% faster than the one chosen.
  for (int stage = 0; stage <= 3; ++stage) {
    Plan pinned = plan_of(seven_b_h200, {"parallel.zero_stage=" + std::to_string(stage)});
    if (pinned.fits) CHECK(p.step_seconds <= pinned.step_seconds * 1.01);
  }
}

TEST_CASE("auto checkpointing and micro batch pick the largest that fits", "[plan][auto]") {
  Plan p = plan_of(kSevenB, {"batch.global=256", "parallel.zero_stage=2", "parallel.activation_checkpointing=auto"});
  CHECK(p.fits);
  CHECK(p.layout.recomputation);  // micro 1 without recomputation needs ~48 GiB
  CHECK(p.layout.micro >= 1);
  CHECK(p.memory.total() <= p.memory_capacity);
  REQUIRE(p.choices.size() == 4);  // data_parallel, precision.grad_dtype, activation_checkpointing, micro
  // The next larger micro batch would not fit.
  Plan bigger = plan_of(kSevenB, {"batch.global=256", "parallel.zero_stage=2", "parallel.activation_checkpointing=full",
                                  "batch.micro=" + std::to_string(p.layout.micro * 2)});
  CHECK_FALSE(bigger.fits);
}

TEST_CASE("a plan that does not fit says so and suggests what would", "[plan][verdict]") {
  Plan p = plan_of("base = [\"hardware/a100-80gb-x8\", \"models/deepseek-llm-67b\"]\n[precision]\ndtype = \"bf16\"\n",
                   {"parallel.zero_stage=0", "batch.global=8", "batch.micro=1"});
  CHECK_FALSE(p.fits);
  REQUIRE_FALSE(p.suggestions.empty());
  CHECK(p.verdict[0].find("does not fit") == 0);
  CHECK(p.suggestions[0].find("--set parallel.zero_stage=3") != std::string::npos);  // 67B needs ZeRO-3 and offload to 2 TiB of host memory
  CHECK(p.suggestions[0].find("--set parallel.offload=") != std::string::npos);

  // Without host memory to offload into, only more GPUs help.
  Plan q = plan_of("base = [\"hardware/a100-40gb-x8\", \"models/deepseek-llm-67b\"]\n[precision]\ndtype = \"bf16\"\n",
                   {"parallel.zero_stage=0", "batch.global=8", "batch.micro=1", "hardware.host_memory_gib=64"});
  CHECK_FALSE(q.fits);
  REQUIRE(q.suggestions.size() == 1);
  CHECK(q.suggestions[0].find("GPUs of this kind would fit") != std::string::npos);
}

TEST_CASE("suggestions prefer recomputation over offload", "[plan][verdict]") {
  Plan p = plan_of(kSevenB, {"parallel.zero_stage=0", "batch.global=64", "batch.micro=1"});
  CHECK_FALSE(p.fits);
  REQUIRE_FALSE(p.suggestions.empty());
  CHECK(p.suggestions[0].find("zero_stage=2 --set parallel.activation_checkpointing=full") != std::string::npos);
  CHECK(p.suggestions[0].find("offload") == std::string::npos);
}

TEST_CASE("communication per step follows the ring formulas", "[plan][comm]") {
  Plan p0 = plan_of(kSevenB, {"batch.global=64", "batch.micro=1", "parallel.zero_stage=0", "parallel.activation_checkpointing=full", "precision.grad_dtype=\"bf16\""});
  const double psi = p0.cost.params;
  REQUIRE(p0.comm.size() == 1);
  CHECK(p0.comm[0].bytes == Approx(2.0 * 7 / 8 * psi * 2));
  Plan p3 = plan_of(kSevenB, {"batch.global=64", "batch.micro=1", "parallel.zero_stage=3", "parallel.activation_checkpointing=full", "precision.grad_dtype=\"bf16\""});
  double total = 0;
  for (const auto& c : p3.comm) total += c.bytes;
  CHECK(total == Approx(3.0 * 8 * 7 / 8 * psi * 2));  // 3 passes per micro-batch, 8 micro-batches
  // fp32 gradients (auto's choice here): the reductions move 4 bytes an element, the gathers still 2.
  Plan wide0 = plan_of(kSevenB, {"batch.global=64", "batch.micro=1", "parallel.zero_stage=0", "parallel.activation_checkpointing=full"});
  REQUIRE(wide0.comm.size() == 1);
  CHECK(wide0.comm[0].bytes == Approx(2.0 * 7 / 8 * psi * 4));
  Plan wide3 = plan_of(kSevenB, {"batch.global=64", "batch.micro=1", "parallel.zero_stage=3", "parallel.activation_checkpointing=full"});
  total = 0;
  for (const auto& c : wide3.comm) total += c.bytes;
  CHECK(total == Approx(8 * 7.0 / 8 * psi * (2 + 2 + 4)));
}

TEST_CASE("precision.grad_dtype: auto takes fp32 where bf16 gradients would be summed, says why, and the plan counts 4 bytes a gradient", "[plan][memory][grad_dtype]") {
  // 8 data ranks and 8 micro-batches a step: auto is fp32, listed among the choices with its reason.
  Plan summed = plan_of(kSevenB, {"batch.global=64", "batch.micro=1", "parallel.zero_stage=1", "parallel.activation_checkpointing=full"});
  CHECK(summed.modes.gradient_dtype == DType::Fp32);
  bool listed = false;
  for (const auto& c : summed.choices)
    if (c.key == "precision.grad_dtype") listed = c.value == "fp32" && contains(c.reason, "8 micro-batches");
  CHECK(listed);
  CHECK(contains(render_plan(summed), "fp32 (accumulated and reduced in fp32)"));
  Plan narrow = plan_of(kSevenB, {"batch.global=64", "batch.micro=1", "parallel.zero_stage=1", "parallel.activation_checkpointing=full", "precision.grad_dtype=\"bf16\""});
  CHECK(narrow.modes.gradient_dtype == DType::Bf16);
  const double psi = summed.cost.params;
  // ZeRO-1: the whole gradient on every rank, 4 bytes an element against 2.
  CHECK(summed.memory.states.grads == Approx(4 * psi).epsilon(1e-6));
  CHECK(narrow.memory.states.grads == Approx(2 * psi).epsilon(1e-6));
  // ... and autograd's bf16 gradients of the largest unit until they are added in.
  CHECK(summed.memory.comm_buffers - narrow.memory.comm_buffers >= 2 * summed.cost.largest_unit_params);
  CHECK(summed.optimizer_seconds > narrow.optimizer_seconds);
  // One data rank, one micro-batch: nothing is summed, and auto keeps bf16 (gradients left to autograd stay possible).
  Plan one = plan_of(kSevenB, {"batch.global=1", "batch.micro=1", "parallel.data_parallel=1", "parallel.activation_checkpointing=full"});
  CHECK(one.modes.gradient_dtype == DType::Bf16);
  // fp32 training has nothing to choose; a gradient dtype that is neither fp32 nor the working one is refused by key.
  LoadedRecipe wrong = load_text(kSevenB, {"precision.grad_dtype=\"fp16\""});
  CHECK_FALSE(wrong.ok());
  CHECK(contains(wrong.report(), "precision.grad_dtype"));
  CHECK(contains(wrong.report(), "not in fp16"));
}

TEST_CASE("probed collectives price each group by its collective and size, and without them by the link", "[plan][comm][probe]") {
  // Bus bandwidths as `dsrun probe` writes them: every collective slower at 8 ranks than at 2 and 4.
  const std::string probed = kSevenB + "[hardware]\ncollective_ranks = [2, 4, 8]\nall_reduce_gbs = [300, 250, 200]\nall_gather_gbs = [280, 240, 160]\n"
                                       "reduce_scatter_gbs = [270, 230, 150]\nall_to_all_gbs = [260, 220, 180]\np2p_gbs = 100\n";
  const std::vector<std::string> zero2 = {"batch.global=64", "batch.micro=1", "parallel.zero_stage=2", "parallel.activation_checkpointing=full"};
  Plan p = plan_of(probed, zero2);
  REQUIRE(p.comm.size() == 2);
  for (const auto& c : p.comm) {
    INFO(c.collective);
    const double gbs = c.collective.rfind("all-gather", 0) == 0 ? 160 : 150;  // the 8-rank figures
    CHECK(c.seconds == Approx(c.bytes / (gbs * 1e9)));
  }
  // A data group of 2 (tensor 4 inside it) takes the 2-rank figure; the tensor group of 4 the 4-rank all-reduce.
  Plan t = plan_of(probed, {"batch.global=64", "batch.micro=1", "parallel.zero_stage=1", "parallel.tensor=4", "parallel.activation_checkpointing=full"});
  bool saw_tensor = false;
  for (const auto& c : t.comm) {
    INFO(c.collective);
    if (c.collective.find("(tensor") != std::string::npos) {
      saw_tensor = true;
      CHECK(c.seconds == Approx(c.bytes / 250e9));
    } else {
      CHECK(c.seconds == Approx(c.bytes / ((c.collective.rfind("all-gather", 0) == 0 ? 280 : 270) * 1e9)));
    }
  }
  CHECK(saw_tensor);
  // Pipeline sends at the probed point-to-point figure.
  Plan pp = plan_of(probed, {"batch.global=64", "batch.micro=1", "parallel.zero_stage=1", "parallel.pipeline=2", "parallel.activation_checkpointing=full"});
  bool saw_pipeline = false;
  for (const auto& c : pp.comm)
    if (c.collective.find("(pipeline") != std::string::npos) {
      saw_pipeline = true;
      CHECK(c.seconds == Approx(c.bytes / 100e9));
    }
  CHECK(saw_pipeline);
  // Without a table: link_bandwidth_gbs × comm_efficiency, as before.
  Plan plain = plan_of(kSevenB, zero2);
  const HardwareSpec hw = load_text(kSevenB, zero2).recipe.hardware;
  const double link = hw.link_bandwidth * hw.comm_efficiency;
  for (const auto& c : plain.comm) CHECK(c.seconds == Approx(c.bytes / link));
  bool says = false;
  for (const auto& n : p.notes) says = says || n.find("probed bus bandwidth") != std::string::npos;
  CHECK(says);
}

TEST_CASE("collectives beside compute still cost it hardware.overlap_cost of their time, and the updated parameters' gather is never beside it", "[plan][comm]") {
  const std::vector<std::string> zero2 = {"batch.global=64", "batch.micro=1", "parallel.zero_stage=2", "parallel.activation_checkpointing=full"};
  const Plan free = plan_of(kSevenB + "[hardware]\noverlap_cost = 0\n", zero2);
  const Plan half = plan_of(kSevenB + "[hardware]\noverlap_cost = 0.5\n", zero2);
  const Plan paid = plan_of(kSevenB + "[hardware]\noverlap_cost = 1\n", zero2);
  double beside = 0;
  for (const auto& c : paid.comm) {
    INFO(c.collective);
    CHECK(c.beside_compute == (c.collective.rfind("all-gather updated", 0) != 0));
    if (c.beside_compute) beside += c.seconds;
  }
  REQUIRE(beside > 0);
  CHECK(free.comm_slowdown_seconds == 0);
  CHECK(paid.comm_slowdown_seconds > 0);
  CHECK(paid.comm_slowdown_seconds <= beside);
  CHECK(half.comm_slowdown_seconds == Approx(paid.comm_slowdown_seconds / 2));
  CHECK(paid.step_seconds - free.step_seconds == Approx(paid.comm_slowdown_seconds));
  CHECK(contains(render_plan(paid), "hardware.overlap_cost"));
  // Tensor-parallel all-reduces sit between the products that need them: never beside compute.
  const Plan tensor = plan_of(kSevenB, {"batch.global=64", "batch.micro=1", "parallel.zero_stage=1", "parallel.tensor=2", "parallel.activation_checkpointing=full"});
  for (const auto& c : tensor.comm)
    if (c.collective.find("(tensor") != std::string::npos) CHECK_FALSE(c.beside_compute);
}

TEST_CASE("every pipeline stage has its own memory prediction, device and host, and the fullest is the plan's", "[plan][memory][pipeline]") {
  const Plan p = plan_of(kSevenB, {"batch.global=64", "batch.micro=1", "parallel.zero_stage=1", "parallel.pipeline=4", "parallel.activation_checkpointing=full",
                                   "checkpoint.at_end=false"});
  REQUIRE(p.stage_memory.size() == 4);
  CHECK(p.stage_memory[p.memory_stage].device_bytes == Approx(p.memory.total()));
  CHECK(p.stage_memory[p.memory_stage].host_bytes == Approx(p.host.total()));
  for (const StageMemory& st : p.stage_memory) CHECK(st.device_bytes <= p.memory.total() * (1 + 1e-12));
  // 1F1B: stage s holds p - s micro-batches' activations.
  CHECK(p.stage_memory[2].device_bytes < p.stage_memory[1].device_bytes);
  // A GPU rank's host peak: the embedding's (and the untied head's) fp32 build on the first and
  // last stages; the middle stages' largest weights build within the process as it trains.
  CHECK(p.stage_memory[1].host_bytes < p.stage_memory[0].host_bytes);
  CHECK(p.stage_memory[1].host_bytes == Approx(p.stage_memory[2].host_bytes));
  CHECK(contains(render_plan(p), "per pipeline stage"));
  const Plan one = plan_of(kSevenB, {"batch.global=64", "batch.micro=1", "parallel.zero_stage=1", "parallel.activation_checkpointing=full"});
  REQUIRE(one.stage_memory.size() == 1);
  CHECK(one.stage_memory[0].device_bytes == Approx(one.memory.total()));
}

TEST_CASE("a GPU rank's host peak: the build's fp32 weight on the process as it was then, the whole weight and its slice under tensor parallelism, NCCL's share with several ranks", "[plan][memory][host]") {
  // (no checkpoint: an asynchronous one's staging would hide the build)
  const std::vector<std::string> layout = {"batch.global=64", "batch.micro=1", "parallel.zero_stage=1", "parallel.activation_checkpointing=full", "checkpoint.at_end=false"};
  const Plan one = plan_of(kSevenB, layout);
  std::vector<std::string> tp2 = layout;
  tp2.push_back("parallel.tensor=2");
  const Plan tensor = plan_of(kSevenB, tp2);
  const double embedding32 = 4 * one.cost.embedding_params;
  REQUIRE(one.host.model_build > 0);
  CHECK(one.host.model_build == Approx(0.5 * (1 << 30) + embedding32 - one.host.process - one.host.data - one.host.checkpoint_staging));
  // The build's peak (the process then, plus the weights) grows by half the embedding; the process
  // itself by the tensor group's NCCL communicator (a quarter of host_nccl_memory_gib).
  CHECK((tensor.host.model_build + tensor.host.process) - (one.host.model_build + one.host.process) == Approx(embedding32 / 2));
  CHECK(tensor.host.process - one.host.process == Approx(0.1 * (1 << 30)));
  CHECK(one.host.process == Approx((1.0 + 0.4) * (1 << 30)));  // host_runtime_memory_gib + host_nccl_memory_gib
  const Plan alone = plan_of(kSevenB, {"batch.global=64", "batch.micro=1", "parallel.data_parallel=1", "hardware.devices_per_node=1", "parallel.zero_stage=1",
                                       "parallel.activation_checkpointing=full", "checkpoint.at_end=false"});
  CHECK(alone.host.process == Approx(1.0 * (1 << 30)));
}

TEST_CASE("a probed collective table must be whole: one figure per group size, sizes ascending", "[recipe][probe]") {
  LoadedRecipe short_list = load_text(kSevenB + "[hardware]\ncollective_ranks = [2, 4]\nall_reduce_gbs = [300]\n");
  auto errors = dsrun::test::errors_of(short_list);
  REQUIRE(errors.size() == 1);
  CHECK(errors[0].key == "hardware.all_reduce_gbs");
  CHECK(errors[0].message.find("1 figure(s) for 2 group size(s)") != std::string::npos);
  LoadedRecipe unsorted = load_text(kSevenB + "[hardware]\ncollective_ranks = [4, 2]\n");
  errors = dsrun::test::errors_of(unsorted);
  REQUIRE(errors.size() == 1);
  CHECK(errors[0].key == "hardware.collective_ranks");
}

TEST_CASE("tensor parallelism without GPU peer access is refused, naming parallel.tensor, and the search never picks it", "[plan][layout]") {
  LoadedRecipe r = load_text(kSevenB + "[hardware]\np2p = false\n", {"parallel.tensor=2"});
  auto errors = dsrun::test::errors_of(r);
  REQUIRE_FALSE(errors.empty());
  CHECK(errors[0].key == "parallel.tensor");
  CHECK(errors[0].message.find("hardware.p2p = false") != std::string::npos);
  Plan searched = plan_of(kSevenB + "[hardware]\np2p = false\n", {"parallel.tensor=auto", "parallel.pipeline=auto", "parallel.data_parallel=auto"});
  CHECK(searched.layout.tensor == 1);
}

TEST_CASE("speed: MFU is model FLOPs over time x peak x ranks", "[plan][speed]") {
  Plan p = plan_of(kSevenB, {"batch.global=64", "batch.micro=1", "parallel.zero_stage=2", "parallel.activation_checkpointing=full"});
  CHECK(p.step_seconds >= p.compute_seconds);
  CHECK(p.mfu == Approx(p.model_flops_per_step / (p.step_seconds * 312e12 * 8)));
  CHECK(p.mfu < 0.5);  // never above the assumed matmul efficiency
  CHECK(p.total_seconds == Approx(p.step_seconds * 100));
}

TEST_CASE("the plan is a pure function of recipe and host", "[plan]") {
  LoadedRecipe r = load_text(kSevenB);
  REQUIRE(r.ok());
  HostFacts host = dsrun::test::small_host();
  CHECK(render_plan(make_plan(r.recipe, host)) == render_plan(make_plan(r.recipe, host)));
  CHECK_FALSE(make_plan(r.recipe, host).hardware_present);  // no GPUs on the test host
  host.cuda_devices = 8;
  CHECK(make_plan(r.recipe, host).hardware_present);
}

TEST_CASE("plan JSON carries the same numbers as the table", "[plan][json]") {
  Plan p = plan_of(kSevenB, {"batch.global=64"});
  nlohmann::json j = nlohmann::json::parse(plan_to_json(p));
  CHECK(j["batch"]["micro"].get<int64_t>() * j["batch"]["accumulation"].get<int64_t>() * j["topology"]["data_parallel"].get<int>() == 64);
  CHECK(j["memory_per_rank"]["total"].get<double>() == Approx(p.memory.total()));
  CHECK(j["fits"].get<bool>() == p.fits);
  CHECK(j["auto_choices"].size() == p.choices.size());
}

TEST_CASE("CPU ranks share the host's memory", "[plan][cpu]") {
  Plan p = plan_of("base = [\"hardware/cpu\", \"models/deepseek-tiny\"]\n[batch]\nglobal = 16\n");
  CHECK(p.world_size == 2);
  CHECK(p.memory_capacity == Approx(dsrun::test::small_host().memory_bytes / 2));
  CHECK(p.attention == AttentionKernel::Math);
  CHECK(p.fits);
}

TEST_CASE("the plan counts checkpoint disk: one that cannot fit is refused, retention that cannot is said", "[plan][checkpoint]") {
  const std::string tiny = "base = [\"hardware/cpu\", \"models/deepseek-tiny\"]\n";
  LoadedRecipe r = load_text(tiny + "[run]\nsteps = 1000\n[checkpoint]\nevery = 100\nkeep_last = 2\n");
  INFO(r.report());
  REQUIRE(r.ok());
  HostFacts host = dsrun::test::small_host();
  const Plan unknown = make_plan(r.recipe, host);
  const CheckpointDisk& d = unknown.checkpoint_disk;
  // AdamW: the fp32 master (4 bytes) and m, v (8) per parameter, once over all ranks.
  CHECK(d.bytes == Approx(unknown.cost.params * 12));
  CHECK(d.saves == 10);
  CHECK(d.kept == 3);  // keep_last, and the new one written before the oldest goes
  CHECK(d.needed == Approx(3 * d.bytes));
  CHECK(d.free == -1);
  CHECK(unknown.fits);  // free space not known: nothing said

  host.checkpoint_free_bytes = 0.5 * d.bytes;
  const Plan small = make_plan(r.recipe, host);
  CHECK(!small.fits);
  CHECK(small.binds == "disk");
  REQUIRE(!small.verdict.empty());
  CHECK(small.verdict.front().find("does not fit: disk (checkpoint.dir): one checkpoint is") == 0);
  CHECK(render_plan(small).find("checkpoint.dir to a disk with") != std::string::npos);

  host.checkpoint_free_bytes = 2.5 * d.bytes;
  const Plan two = make_plan(r.recipe, host);
  CHECK(two.fits);
  bool said = false;
  for (const auto& v : two.verdict) said = said || v.find("holds 2 checkpoint(s)") != std::string::npos;
  CHECK(said);

  // keep_every adds the checkpoints kept forever; no saves, nothing to count.
  LoadedRecipe forever = load_text(tiny + "[run]\nsteps = 1000\n[checkpoint]\nevery = 100\nkeep_last = 2\nkeep_every = 500\n");
  CHECK(make_plan(forever.recipe, dsrun::test::small_host()).checkpoint_disk.kept == 5);
  LoadedRecipe none = load_text(tiny + "[checkpoint]\nat_end = false\n");
  CHECK(make_plan(none.recipe, host).checkpoint_disk.saves == 0);
  CHECK(make_plan(none.recipe, host).fits);
  // A plan for GPUs this machine lacks is about the cluster's disks, not this one's.
  LoadedRecipe seven = load_text(kSevenB);
  host.checkpoint_free_bytes = 1e6;
  const Plan elsewhere = make_plan(seven.recipe, host);
  CHECK(!elsewhere.hardware_present);
  CHECK(elsewhere.binds != "disk");
}

TEST_CASE("the plan counts asynchronous checkpoints' staging memory and says each save's pause", "[plan][checkpoint]") {
  // GPUs: asynchronous unless the recipe says otherwise; the pause is the copy over PCIe alone.
  const LoadedRecipe seven = load_text(kSevenB + "[run]\nsteps = 100\n[checkpoint]\nevery = 50\n");
  const Plan gpu = make_plan(seven.recipe, dsrun::test::small_host());
  const dsrun::HardwareSpec& hw = seven.recipe.hardware;
  const CheckpointDisk& d = gpu.checkpoint_disk;
  CHECK(d.async);
  CHECK(d.staging_per_rank == Approx(d.bytes / gpu.world_size));
  CHECK(gpu.host.checkpoint_staging == Approx(d.staging_per_rank));  // pinned host memory, per rank
  CHECK(d.pause_seconds == Approx(d.copy_seconds));
  // Over PCIe at hardware.host_link_bandwidth_gbs: each GPU's rate with the node's all copying at once.
  CHECK(d.copy_seconds == Approx(d.staging_per_rank / hw.host_link_bandwidth));
  CHECK(d.write_seconds == Approx(d.staging_per_rank * gpu.ranks_per_node / 1e9));  // hardware.disk_write_gbs = 1
  CHECK(render_plan(gpu).find("asynchronous (checkpoint.async): training pauses") != std::string::npos);
  CHECK(d.staging_pinned);
  // Offloaded states are in host memory already: a memory copy (a read and a write), unpinned.
  const Plan offload = make_plan(load_text(kSevenB + "[parallel]\nzero_stage = 2\noffload = \"optimizer\"\n[run]\nsteps = 100\n[checkpoint]\nevery = 50\n").recipe,
                                 dsrun::test::small_host());
  CHECK_FALSE(offload.checkpoint_disk.staging_pinned);
  CHECK(offload.checkpoint_disk.copy_seconds == Approx(offload.checkpoint_disk.staging_per_rank / (hw.host_memory_bandwidth / 2)));
  const Plan offload_sync = make_plan(load_text(kSevenB + "[parallel]\nzero_stage = 2\noffload = \"optimizer\"\n[run]\nsteps = 100\n[checkpoint]\nevery = 50\nasync = false\n").recipe,
                                      dsrun::test::small_host());
  CHECK(offload_sync.checkpoint_disk.pause_seconds == Approx(offload_sync.checkpoint_disk.write_seconds));  // host shards are written as they stand
  CHECK(d.read_seconds == Approx(d.staging_per_rank * gpu.ranks_per_node / 2e9));  // hardware.disk_read_gbs = 2
  // Synchronous: no staging kept, and the pause includes the write.
  const Plan sync = make_plan(load_text(kSevenB + "[run]\nsteps = 100\n[checkpoint]\nevery = 50\nasync = false\n").recipe, dsrun::test::small_host());
  CHECK_FALSE(sync.checkpoint_disk.async);
  CHECK(sync.host.checkpoint_staging == 0);
  // (or, where it passes that, the model build's peak: the embedding's fp32 values on the process as it was then)
  const double build_peak = 0.5 * (1 << 30) + 4 * gpu.cost.embedding_params;
  CHECK(sync.host.total() == Approx(std::max(gpu.host.total() - d.staging_per_rank, build_peak)));
  CHECK(sync.checkpoint_disk.pause_seconds == Approx(d.copy_seconds + d.write_seconds));
  // CPU ranks: synchronous unless asked.
  const std::string tiny = "base = [\"hardware/cpu\", \"models/deepseek-tiny\"]\n";
  CHECK_FALSE(make_plan(load_text(tiny).recipe, dsrun::test::small_host()).checkpoint_disk.async);
  CHECK(make_plan(load_text(tiny + "[checkpoint]\nasync = true\n").recipe, dsrun::test::small_host()).host.checkpoint_staging > 0);
  // Left unset, asynchronous saves give way when their staging copy is what host memory lacks.
  const double between = (sync.host_memory_needed + gpu.host_memory_needed) / 2 / (1024.0 * 1024 * 1024);
  const std::string tight = kSevenB + "[parallel]\nzero_stage = 3\nactivation_checkpointing = \"full\"\n[run]\nsteps = 100\n[hardware]\nhost_memory_gib = " + std::to_string(between) + "\n[checkpoint]\nevery = 50\n";
  const Plan chosen = make_plan(load_text(tight).recipe, dsrun::test::small_host());
  CHECK(chosen.fits);
  CHECK_FALSE(chosen.checkpoint_disk.async);
  bool said = false;
  for (const auto& c : chosen.choices) said = said || (c.key == "checkpoint.async" && c.value == "false");
  CHECK(said);
  const Plan asked = make_plan(load_text(tight + "async = true\n").recipe, dsrun::test::small_host());
  CHECK_FALSE(asked.fits);  // written by the user: kept, and the plan says it does not fit
  CHECK(asked.binds == "host memory");
}

TEST_CASE("the fused projection and loss: the plan counts one chunk's transient, not the whole logits'", "[plan][loss]") {
  const std::string one_gpu = "base = [\"hardware/h100-80gb-x8\", \"models/deepseek-llm-7b\"]\n[hardware]\ndevices_per_node = 1\n"
                              "[precision]\ndtype = \"bf16\"\n[parallel]\nzero_stage = 3\nactivation_checkpointing = \"full\"\n[batch]\nseq_len = 4096\nglobal = 8\n";
  const Plan whole = plan_of(one_gpu + "micro = 2\nloss_chunk_tokens = 0\n");
  const Plan fused = plan_of(one_gpu + "micro = 2\n");
  const Plan fused4 = plan_of(one_gpu + "micro = 4\n");
  const double V = 102400, h = 4096, s = 4096;
  CHECK(whole.modes.loss_chunk_tokens == 0);
  CHECK(static_cast<int64_t>(kAutoLossChunkBytes / (4 * V)) == 655);                          // 256 MiB of fp32 logits: too few rows for the products
  CHECK(fused.modes.loss_chunk_tokens == kAutoLossChunkMinTokens);                              // so 2,048
  CHECK(whole.memory.backward_peak == Approx(2 * s * 8 * V));                                  // fp32 softmax gradients of every token
  CHECK(fused.memory.backward_peak == Approx((4 + 2) * 2048 * V + (4 + 2) * V * h));             // a chunk, and the head's weight gradient
  CHECK(fused4.memory.backward_peak == Approx(fused.memory.backward_peak));                     // whatever the micro-batch
  CHECK(fused.memory.total() < whole.memory.total());
  CHECK(fused.step_seconds < whole.step_seconds);  // fewer bytes through memory
  CHECK_THAT(render_plan(fused), Catch::Contains("output projection and loss fused, 2048 tokens' logits at a time"));
  // Under tensor parallelism each rank's chunk spans its slice of the vocabulary: there a micro-batch's
  // 8,192 tokens of 51,200 fp32 logits (1.6 GiB, under 1/32 of 80 GB) fit, and auto takes them in one chunk.
  const Plan split = plan_of(one_gpu + "micro = 2\n", {"hardware.devices_per_node=2", "parallel.tensor=2"});
  CHECK(split.modes.loss_chunk_tokens == 2 * 4096);
  bool said = false;
  for (const auto& c : split.choices) said = said || (c.key == "batch.loss_chunk_tokens" && c.value == "8192");
  CHECK(said);
  CHECK(split.memory.backward_peak == Approx((4 + 2) * 8192 * V / 2 + (4 + 2) * V / 2 * h));
  // Asked for, a chunk is kept.
  const Plan asked = plan_of(one_gpu + "micro = 2\nloss_chunk_tokens = 655\n", {"hardware.devices_per_node=2", "parallel.tensor=2"});
  CHECK(asked.modes.loss_chunk_tokens == 655);
}

TEST_CASE("separate documents on a GPU: the plan measures the corpus's documents and prices attention within them", "[plan][documents]") {
  dsrun::test::TempDir dir;
  // A nanoGPT-layout corpus (raw uint16) whose documents are 64 tokens long (token 0 closes each).
  std::vector<uint16_t> tokens(1 << 18);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = (i % 64 == 63) ? 0 : static_cast<uint16_t>(1 + i % 30000);
  const std::string path = dir.file("docs.bin");
  std::string bytes(reinterpret_cast<const char*>(tokens.data()), tokens.size() * sizeof(uint16_t));
  dir.write("docs.bin", bytes);
  const std::string recipe = "base = [\"hardware/h100-80gb-x8\"]\n[hardware]\ndevices_per_node = 1\n[model]\nhidden = 1024\nlayers = 4\nheads = 8\n"
                             "intermediate = 2816\nvocab = 32000\nmax_seq_len = 4096\n[precision]\ndtype = \"bf16\"\n[batch]\nseq_len = 4096\nglobal = 4\nmicro = 4\n"
                             "[data]\nkind = \"tokens\"\npath = \"" + path + "\"\nformat = \"nanogpt\"\ntoken_width = 2\ndocument_token = 0\n";
  const Plan across = plan_of(recipe);
  const Plan separate = plan_of(recipe, {"data.separate_documents=true"});
  CHECK(across.attention_fraction == 1);
  CHECK(across.document_attention.empty());
  CHECK(separate.document_attention == "variable-length");
  CHECK(separate.attention_fraction == Approx(64.0 * 64 / (4096.0 * 4096) * 64).epsilon(0.05));  // 64 documents a row: 1/64
  // Attention (half its counted FLOPs, causal, at attention_efficiency) is about 1/6 of this model's compute at 4096: nearly all of it goes.
  CHECK(separate.compute_seconds < 0.87 * across.compute_seconds);
  CHECK(separate.compute_seconds > 0.75 * across.compute_seconds);
  CHECK(separate.memory.activations == Approx(across.memory.activations + 4 * 4096 * 8));  // positions, no s x s mask
  CHECK_THAT(render_plan(separate), Catch::Contains("attention within documents (variable-length)"));
  // In fp32 the flash kernel does not run: the mask path, its s x s bias and the whole square.
  const Plan masked = plan_of(recipe, {"data.separate_documents=true", "precision.dtype=\"fp32\""});
  CHECK(masked.document_attention == "masked");
  CHECK(masked.memory.activations > across.memory.activations * 1.5 + 4 * 4096.0 * 4096 * 4);
}

TEST_CASE("an offloaded step runs at the probed host step's throughput where hardware.host_optimizer_gbs is given", "[plan][offload][probe]") {
  const std::string offload = kSevenB + "[parallel]\nzero_stage = 2\noffload = \"optimizer\"\n";
  const Plan memory_bound = make_plan(load_text(offload).recipe, dsrun::test::small_host());
  const Plan probed = make_plan(load_text(offload + "[hardware]\nhost_optimizer_gbs = 20\n").recipe, dsrun::test::small_host());
  const Plan faster = make_plan(load_text(offload + "[hardware]\nhost_optimizer_gbs = 40\n").recipe, dsrun::test::small_host());
  const double host_memory = load_text(offload).recipe.hardware.host_memory_bandwidth;  // what binds when the key is unset
  REQUIRE(memory_bound.optimizer_seconds > 0);
  CHECK(probed.optimizer_seconds == Approx(memory_bound.optimizer_seconds * host_memory / 20e9));
  CHECK(faster.optimizer_seconds == Approx(probed.optimizer_seconds / 2));
  CHECK(probed.step_seconds > faster.step_seconds);
}

TEST_CASE("without the delayed update only the next step's first micro-batch forward hides the host step, and with it the host step runs slower beside compute", "[plan][offload]") {
  const std::string offload = "base = [\"hardware/h100-80gb-x1\", \"models/deepseek-llm-7b\"]\n[precision]\ndtype = \"bf16\"\ngrad_dtype = \"bf16\"\n"
                              "[parallel]\nzero_stage = 1\noffload = \"optimizer\"\nactivation_checkpointing = \"none\"\n[batch]\nseq_len = 2048\nmicro = 4\n";
  // The next step's forward waits for each unit's update, and its backward for the whole forward:
  // one micro-batch's forward hides the same host step whether a step holds one or eight of them.
  const Plan one = make_plan(load_text(offload + "global = 4\n").recipe, dsrun::test::small_host());
  const Plan eight = make_plan(load_text(offload + "global = 32\n").recipe, dsrun::test::small_host());
  REQUIRE(one.accumulation == 1);
  REQUIRE(eight.accumulation == 8);
  CHECK(eight.compute_seconds == Approx(8 * one.compute_seconds));
  CHECK(eight.optimizer_seconds == Approx(one.optimizer_seconds));
  CHECK(eight.offload_hidden_seconds == Approx(one.offload_hidden_seconds));
  CHECK(eight.offload_hidden_seconds < eight.compute_seconds / 3 / 8 + eight.offload_seconds);
  // The delayed update of a step whose host step outlasts its compute (7B: 1.9 s of host step
  // beside 0.6 s of compute) lasts the host step beside compute, hardware.host_step_beside_compute times its time alone.
  std::string delayed = offload + "global = 4\n";
  delayed.replace(delayed.find("offload = "), 0, "delayed_update = true\n");
  const Plan twice = make_plan(load_text(delayed + "[hardware]\nhost_step_beside_compute = 2\n").recipe, dsrun::test::small_host());
  const Plan thrice = make_plan(load_text(delayed + "[hardware]\nhost_step_beside_compute = 3\n").recipe, dsrun::test::small_host());
  REQUIRE(twice.optimizer_seconds > 2 * twice.compute_seconds);
  CHECK(thrice.step_seconds - twice.step_seconds == Approx(twice.optimizer_seconds));
  CHECK(thrice.offload_hidden_seconds < 0);
  CHECK_THAT(render_plan(thrice), Catch::Contains("+ host step slowed beside compute") && Catch::Contains("more sequences per step (batch.global) hide it"));
}

TEST_CASE("offload = \"auto\" takes the least offload that fits, says why, and pins it for the ranks", "[plan][auto][offload]") {
  auto reason_of = [](const Plan& p, const std::string& key) {
    for (const auto& c : p.choices)
      if (c.key == key) return c.reason;
    return std::string("(no choice for ") + key + ")";
  };
  auto pinned = [](const Plan& p) {
    for (const auto& [key, value] : p.layout.to_config_keys())
      if (key == "parallel.offload") return value.toml();
    return std::string();
  };
  // The 7B on one 80 GB H100 with 125 GiB of host: 110 GB of model states need the host.
  const std::string seven = "base = [\"hardware/h100-80gb-x1\", \"models/deepseek-llm-7b\"]\n[precision]\ndtype = \"bf16\"\n"
                            "[parallel]\noffload = \"auto\"\ndelayed_update = true\nactivation_checkpointing = \"auto\"\n[batch]\nseq_len = 2048\nglobal = 32\n";
  const Plan big = make_plan(load_text(seven).recipe, dsrun::test::small_host());
  REQUIRE(big.fits);
  CHECK(big.layout.offload == Offload::Optimizer);
  CHECK(big.layout.delayed_update);
  INFO(reason_of(big, "parallel.offload"));
  CHECK(reason_of(big, "parallel.offload").find("none would need") != std::string::npos);
  CHECK(reason_of(big, "parallel.offload").find("optimizer is the least that fits") != std::string::npos);
  CHECK(pinned(big) == "\"optimizer\"");
  // What fits on the device offloads nothing, and the delayed update asked for goes with it.
  const std::string small = "base = [\"hardware/h100-80gb-x1\", \"models/deepseek-tiny\"]\n[parallel]\noffload = \"auto\"\ndelayed_update = true\n";
  const LoadedRecipe loaded = load_text(small);
  INFO(loaded.report());
  REQUIRE(loaded.ok());  // the delayed update with offload "auto" is not an error at load
  const Plan tiny = make_plan(loaded.recipe, dsrun::test::small_host());
  CHECK(tiny.fits);
  CHECK(tiny.layout.offload == Offload::None);
  CHECK_FALSE(tiny.layout.delayed_update);
  CHECK(reason_of(tiny, "parallel.offload").find("nothing needs offloading") != std::string::npos);
  CHECK(reason_of(tiny, "parallel.offload").find("delayed_update has nothing to delay") != std::string::npos);
  // Nothing fits: the most offloaded is shown, and why each is refused.
  const Plan huge = make_plan(load_text(seven + "[hardware]\nhost_memory_gib = 16\n").recipe, dsrun::test::small_host());
  CHECK_FALSE(huge.fits);
  CHECK(huge.layout.offload == Offload::OptimizerAndParams);
  CHECK(reason_of(huge, "parallel.offload").find("nothing fits: none would need") != std::string::npos);
}

TEST_CASE("one GPU rank at ZeRO 0-2 plans no gradient buffer: the gradients, less the head's, come after the activations' peak", "[plan][memory]") {
  // The engine leaves gradients to autograd there (ZeroOptions::gradients_left_to_autograd); the
  // fused loss makes the head's weight gradient during forward, so that one is held at the peak.
  const std::string one_gpu = "base = [\"hardware/h100-80gb-x1\", \"models/deepseek-llm-7b\"]\n[precision]\ndtype = \"bf16\"\n"
                              "[model]\nlayers = 4\n[batch]\nseq_len = 2048\nglobal = 4\nmicro = 4\n[parallel]\nzero_stage = 0\n";
  const Plan alone = plan_of(one_gpu);
  const MemoryBreakdown& m = alone.memory;
  const double head_gradient = 2.0 * 102400 * 4096;
  REQUIRE(m.states.grads > head_gradient);
  CHECK(m.gradients_after_peak == Approx(std::min(m.states.grads - head_gradient, m.activations + m.backward_peak)));
  CHECK(m.total() == Approx(m.states.device_total() - m.gradients_after_peak + m.activations + m.backward_peak + m.comm_buffers - m.comm_after_peak + m.runtime + m.fragmentation));
  // Two data ranks reduce through a buffer; SGD and offload take other paths: none of them subtract.
  CHECK(plan_of(one_gpu, {"parallel.data_parallel=2", "hardware.devices_per_node=2", "batch.global=8"}).memory.gradients_after_peak == 0);
  CHECK(plan_of(one_gpu, {"optimizer.name=sgd"}).memory.gradients_after_peak == 0);
  CHECK(plan_of(one_gpu, {"parallel.zero_stage=3"}).memory.gradients_after_peak == 0);
  // Without a gradient buffer one micro-batch adds nothing to the step's bytes; four add 3/4 of 3e.
  const double one = alone.optimizer_seconds;
  const double four = plan_of(one_gpu, {"batch.micro=1"}).optimizer_seconds;
  CHECK(four > one);
}

TEST_CASE("optimizer states in bf16 halve the states' memory and take 8 bytes per parameter off the step's update", "[plan][memory]") {
  const std::string one_gpu = "base = [\"hardware/h100-80gb-x1\", \"models/deepseek-llm-7b\"]\n[precision]\ndtype = \"bf16\"\n"
                              "[model]\nlayers = 4\n[batch]\nseq_len = 2048\nglobal = 4\nmicro = 4\n[parallel]\nzero_stage = 0\n";
  const Plan fp32 = plan_of(one_gpu), bf16 = plan_of(one_gpu, {"optimizer.state_dtype=bf16"});
  CHECK(bf16.memory.states.optimizer == Approx(fp32.memory.states.optimizer / 2));
  CHECK(bf16.memory.states.master == Approx(fp32.memory.states.master));
  // One micro-batch, gradients left to autograd: 28 + e (the norm) bytes per parameter with fp32 states.
  CHECK(bf16.optimizer_seconds == Approx(fp32.optimizer_seconds * (22.0 / 30.0)));
  // Checkpoints store fp32 states either way.
  CHECK(bf16.checkpoint_disk.bytes == Approx(fp32.checkpoint_disk.bytes));
  // SGD's momentum follows the same setting.
  CHECK(plan_of(one_gpu, {"optimizer.name=sgd", "optimizer.state_dtype=bf16"}).memory.states.optimizer ==
        Approx(plan_of(one_gpu, {"optimizer.name=sgd"}).memory.states.optimizer / 2));
}

TEST_CASE("precision.fp8 prices the blocks' linear layers at the FP8 peak and their operands' quantisation as memory traffic", "[plan][fp8]") {
  const std::string recipe = "base = \"hardware/h100-80gb-x1\"\n[model]\nhidden = 2048\nlayers = 4\nheads = 16\nkv_heads = 16\nintermediate = 5504\nvocab = 32000\n"
                             "max_seq_len = 2048\n[precision]\ndtype = \"bf16\"\n[batch]\nglobal = 8\nmicro = 8\nseq_len = 2048\n";
  const Plan bf16 = plan_of(recipe);
  const Plan fp8 = plan_of(recipe, {"precision.fp8=\"tensorwise\""});
  CHECK(bf16.fp8_quantization_seconds == 0);
  CHECK(fp8.fp8_quantization_seconds > 0);
  CHECK(fp8.elementwise_seconds == Approx(bf16.elementwise_seconds + fp8.fp8_quantization_seconds));
  // The FP8 share: 6 FLOPs per parameter of attention (4·h²) and the MLP (3·h·f) per token.
  const double h = 2048, f = 5504, tokens = 8 * 2048.0, layers = 4;
  const double fp8_flops = 6 * tokens * layers * (4 * h * h + 3 * h * f);
  const double saved = fp8_flops / (989.4e12 * 0.52) - fp8_flops / (1978.9e12 * 0.55);
  CHECK(bf16.compute_seconds - fp8.compute_seconds == Approx(saved).epsilon(1e-3));
  CHECK(fp8.step_seconds < bf16.step_seconds);
  CHECK(fp8.model_flops_per_step == Approx(bf16.model_flops_per_step));  // the same work, done faster
  CHECK(contains(render_plan(fp8), "FP8 products (tensorwise scaling)"));
  // Each token's operands: 6 bytes of traffic per element on each side (6·h + 2·kv + 3·f per layer), the weights' per micro-batch.
  const double widths = 6 * h + 2 * h + 3 * f, params = 4 * h * h + 3 * h * f;
  CHECK(fp8.fp8_quantization_seconds == Approx((tokens * 6 * widths * layers + 6 * params * layers) / 2900e9).epsilon(1e-3));
  // Each scaling's products at its own rate beside tensorwise's (rowwise 0.95, blockwise 0.78,
  // measured on an H200); blockwise reads each operand once (4 bytes an element, not 6).
  const Plan rowwise = plan_of(recipe, {"precision.fp8=\"rowwise\""}), blockwise = plan_of(recipe, {"precision.fp8=\"blockwise\""});
  const double at_tensorwise = fp8_flops / (1978.9e12 * 0.55);
  CHECK(rowwise.compute_seconds - fp8.compute_seconds == Approx(at_tensorwise / 0.95 - at_tensorwise).epsilon(1e-3));
  CHECK(blockwise.compute_seconds - fp8.compute_seconds == Approx(at_tensorwise / 0.78 - at_tensorwise).epsilon(1e-3));
  CHECK(rowwise.fp8_quantization_seconds == Approx(fp8.fp8_quantization_seconds));
  CHECK(blockwise.fp8_quantization_seconds == Approx(fp8.fp8_quantization_seconds * 4 / 6));
  CHECK(blockwise.step_seconds < bf16.step_seconds);
}

TEST_CASE("execution.fp8_routed_experts: auto where the hardware's figures say FP8 pays for its quantisation, priced as two thirds of the experts' FLOPs in FP8, their quantisation and their kept transposes", "[plan][fp8][moe]") {
  // The MoE benchmark's shape (recipes/gpu/deepseek_moe_h100.toml): 4 MoE layers of 64 experts, top-6.
  const std::string recipe = "base = [\"hardware/h100-80gb-x1\", \"models/deepseek-moe-16b\"]\n[model]\nlayers = 5\nmax_seq_len = 2048\n"
                             "[precision]\ndtype = \"bf16\"\nfp8 = \"rowwise\"\n[parallel]\nzero_stage = 0\n[batch]\nglobal = 4\nmicro = 4\nseq_len = 2048\n";
  const Recipe loaded = load_text(recipe).recipe;
  const HardwareSpec hw = loaded.hardware;
  // micro 4 x 2048 tokens x 6 choices / 64 experts = 768 rows an expert.
  const Plan off = plan_of(recipe), on = plan_of(recipe, {"execution.fp8_routed_experts=true"});
  REQUIRE(on.modes.fp8_routed_experts);
  CHECK(contains(on.modes.describe(), "the routed experts' grouped products in FP8"));
  // `auto`: per row the products' saving against its four operands' quantisation, per expert its
  // weights' quantisation, from the hardware's figures.
  const double h = 2048, i = 1408;
  auto gain = [&](const HardwareSpec& x, double rows) {
    const double saved = 12 * h * i * (1 / (x.peak_flops_bf16 * x.grouped_matmul_efficiency) - 1 / (x.peak_flops_fp8 * x.fp8_grouped_matmul_efficiency));
    return rows * (saved - 3 * (2 * h + 3 * i) / x.memory_bandwidth) - 12 * 3 * h * i / x.memory_bandwidth;
  };
  CHECK(fp8_routed_expert_gain_seconds(loaded, 768) == Approx(gain(hw, 768)).epsilon(1e-9));
  CHECK(off.modes.fp8_routed_experts == (gain(hw, 768) > 0));
  // A grouped FP8 kernel at 0.9 of its peak pays from about 1200 rows; at the bf16 kernel's rate never.
  const std::vector<std::string> fast = {"hardware.fp8_grouped_matmul_efficiency=0.9", "batch.micro=16", "batch.global=16"};
  CHECK(plan_of(recipe, fast).modes.fp8_routed_experts);
  std::vector<std::string> fast_off = fast;
  fast_off.push_back("execution.fp8_routed_experts=false");
  CHECK_FALSE(plan_of(recipe, fast_off).modes.fp8_routed_experts);
  CHECK_FALSE(plan_of(recipe, {"hardware.fp8_grouped_matmul_efficiency=0.3", "hardware.grouped_matmul_efficiency=0.6", "batch.micro=64", "batch.global=64"})
                  .modes.fp8_routed_experts);
  // Forward's and the input gradients' products (4 of 6) at the FP8 peak and the grouped FP8 efficiency.
  const double tokens = 4 * 2048.0, moe_layers = 4, routed_params = moe_layers * 64 * 3 * h * i;
  const double routed_flops = 6 * tokens * 6 * 3 * h * i * moe_layers;
  const double saved = 2.0 / 3 * routed_flops * (1 / (hw.peak_flops_bf16 * hw.grouped_matmul_efficiency) - 1 / (hw.peak_flops_fp8 * hw.fp8_grouped_matmul_efficiency));
  CHECK(off.compute_seconds - on.compute_seconds == Approx(saved).epsilon(1e-3));
  // Every local expert weight each micro-batch (12 bytes a parameter: 6 move, at what measured as
  // half the bandwidth), and four rowwise operands of each routed row per layer (3 bytes an element
  // of 2·h + 3·i, in one pass).
  const double bytes = 12 * routed_params + tokens * 6 * moe_layers * 3 * (2 * h + 3 * i);
  CHECK(on.fp8_quantization_seconds - off.fp8_quantization_seconds == Approx(bytes / hw.memory_bandwidth).epsilon(1e-6));
  // The transposed FP8 weights held until backward: a byte a parameter and a scale a column.
  CHECK(on.memory.activations - off.memory.activations == Approx(routed_params * (1 + 4 * (h + i) / (3 * h * i))).epsilon(1e-6));
  CHECK(contains(render_plan(on), "hardware.fp8_grouped_matmul_efficiency"));
  // Without FP8 there is nothing to turn on: true is refused with the reason.
  const Plan none = plan_of(recipe, {"precision.fp8=\"none\"", "execution.fp8_routed_experts=true"});
  CHECK_FALSE(none.modes.fp8_routed_experts);
  CHECK(std::any_of(none.notes.begin(), none.notes.end(), [](const std::string& n) { return contains(n, "execution.fp8_routed_experts = true does not hold here"); }));
}

TEST_CASE("under ZeRO-3 the FP8 layers' gathered weights are not held until backward: their FP8 transposes are", "[plan][fp8][memory]") {
  const std::string recipe = "base = [\"hardware/4x-nvidia-h200-probed\", \"models/deepseek-llm-7b\"]\n[precision]\ndtype = \"bf16\"\n"
                             "[parallel]\nzero_stage = 3\n[batch]\nglobal = 16\nmicro = 4\nseq_len = 4096\n[hardware]\nhost_memory_gib = 500\n";
  const Plan bf16 = plan_of(recipe);
  const Plan fp8 = plan_of(recipe, {"precision.fp8=\"tensorwise\""});
  // 30 layers of 4·h² + 3·h·f parameters, two bytes each gathered under bf16.
  const double h = 4096, f = 11008, fp8_params = 30 * (4 * h * h + 3 * h * f);
  CHECK(bf16.memory.comm_buffers - fp8.memory.comm_buffers == Approx(2 * fp8_params).epsilon(1e-6));
  // Measured (bench/gpu_multi.sh fp8, 4 H200): bf16's peak 108.41 GiB, FP8's 95.86 GiB.
  CHECK(bf16.memory.total() - fp8.memory.total() > 11.0 * (1 << 30));
  // A MoE block's bf16 router and grouped experts keep views of its gathered buffer: only the dense
  // first layer's FP8 weights are freed (DeepSeek-MoE-16B: one dense layer, hidden 2048, MLP 10944).
  const std::string moe = "base = [\"hardware/4x-nvidia-h200-probed\", \"models/deepseek-moe-16b\"]\n[precision]\ndtype = \"bf16\"\n"
                          "[parallel]\nzero_stage = 3\n[batch]\nglobal = 16\nmicro = 1\nseq_len = 2048\n[hardware]\nhost_memory_gib = 500\n";
  const Plan moe_bf16 = plan_of(moe), moe_fp8 = plan_of(moe, {"precision.fp8=\"tensorwise\""});
  const double dense_layer = 4.0 * 2048 * 2048 + 3.0 * 2048 * 10944;
  CHECK(moe_bf16.memory.comm_buffers - moe_fp8.memory.comm_buffers == Approx(2 * dense_layer).epsilon(1e-6));
}

TEST_CASE("context parallelism in the plan: a rank's share of each sequence's activations, the gathered keys and values, their traffic, ZeRO over data x context", "[plan][context]") {
  // DeepSeek-LLM-7B at 32K tokens on 8 A100s: 2 replicas, each sequence split over 4 ranks,
  // against the same 2 replicas holding whole sequences.
  const std::vector<std::string> common{"model.max_seq_len=32768", "batch.seq_len=32768", "batch.global=8", "batch.micro=1", "parallel.zero_stage=3", "parallel.data_parallel=2", "parallel.activation_checkpointing=\"none\""};
  std::vector<std::string> split = common;
  split.push_back("parallel.context=4");
  const Plan whole = plan_of(kSevenB, common), ctx = plan_of(kSevenB, split);
  CHECK(ctx.world_size == 8);
  CHECK(ctx.layout.context == 4);
  CHECK(ctx.accumulation == whole.accumulation);  // the batch math counts replicas: 8 = 1 x 4 x 2
  // A quarter of every activation (tokens and their queries' scores), plus each of the 30 layers'
  // keys and values over the three quarters of the sequence gathered from the group (bf16, 32 heads of 128).
  const double gathered = 30 * 0.75 * 32768 * (2 * 4096) * 2;
  CHECK(ctx.memory.activations == Approx(whole.memory.activations / 4 + gathered).epsilon(1e-9));
  // ZeRO-3 shards the states over all 8 ranks holding the same parameters.
  CHECK(ctx.memory.states.params == Approx(whole.memory.states.params / 4).epsilon(0.001));
  CHECK(ctx.memory.states.optimizer == Approx(whole.memory.states.optimizer / 4).epsilon(0.001));
  // Each layer gathers keys and values in forward and reduce-scatters their gradients in backward.
  const CommTerm* kv = nullptr;
  for (const CommTerm& c : ctx.comm)
    if (contains(c.collective, "all-gather keys and values")) kv = &c;
  REQUIRE(kv != nullptr);
  CHECK(kv->bytes == Approx(whole.accumulation * 2 * 30 * 0.75 * 32768 * (2 * 4096) * 2.0));
  CHECK(kv->seconds > 0);
  for (const CommTerm& c : whole.comm) CHECK_FALSE(contains(c.collective, "keys and values"));
  // Each rank computes a quarter of the FLOPs: the step is shorter, the model FLOPs per step the same.
  CHECK(ctx.model_flops_per_step == Approx(whole.model_flops_per_step));
  CHECK(ctx.step_seconds < whole.step_seconds);
  const std::string text = render_plan(ctx);
  CHECK(contains(text, "each sequence split over 4 context ranks: 8192 tokens each"));
  CHECK(contains(text, "context parallel 4"));
}

TEST_CASE("parallel.context = \"auto\": the search splits sequences where whole ones do not fit, and keeps them whole where they do", "[plan][context][search]") {
  auto planned = [](int64_t seq_len) {
    return plan_of(kSevenB, {"model.max_seq_len=" + std::to_string(seq_len), "batch.seq_len=" + std::to_string(seq_len), "batch.global=8", "batch.micro=1",
                             "parallel.zero_stage=3", "parallel.activation_checkpointing=\"full\"", "parallel.context=\"auto\""});
  };
  auto chosen = [](const Plan& p) {
    for (const auto& c : p.choices)
      if (c.key == "parallel.context") return c.value;
    return std::string("not chosen");
  };
  // 7B on 8 A100 40GB: 4K-token sequences fit a rank whole, and splitting them only adds traffic.
  const Plan short_sequences = planned(4096);
  CHECK(short_sequences.fits);
  CHECK(short_sequences.layout.context == 1);
  CHECK(chosen(short_sequences) == "1");
  // At 128K a rank cannot hold a whole sequence's checkpointed activations beside its states.
  const Plan long_sequences = planned(131072);
  INFO(render_plan(long_sequences));
  CHECK(long_sequences.fits);
  CHECK(long_sequences.layout.context > 1);
  CHECK(long_sequences.world_size == 8);
  CHECK(chosen(long_sequences) == std::to_string(long_sequences.layout.context));
  bool whole_refused = false;  // the layouts searched show the whole-sequence layout not fitting
  for (const LayoutRow& row : long_sequences.layouts)
    if (row.layout.context == 1 && row.layout.tensor == 1 && row.layout.pipeline == 1) whole_refused = !row.fits && contains(row.verdict, "does not fit");
  CHECK(whole_refused);
}
