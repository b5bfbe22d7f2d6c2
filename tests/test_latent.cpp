// DeepSeek-V2/V3's parts against a one-process reference written here from the papers' equations
// (DeepSeek-V2 section 2.1 and appendix B, V3 sections 2.1-2.2): latent attention with YaRN, the
// sigmoid router with group-limited choice, the sequence-wise balance loss and multi-token
// prediction; and V3's Hugging Face weights (FP8 blocks included) in and out.
#include "engine/checkpoint/export.hpp"
#include "engine/checkpoint/safetensors.hpp"
#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "engine/model/model.hpp"
#include "engine/train/checkpointing.hpp"
#include "engine_util.hpp"
#include "test_util.hpp"

#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>

using namespace dsrun;
using dsrun::test::one_rank_loss;
using dsrun::test::token_batch;
using torch::Tensor;

namespace {

// V2-Lite's choices on the same sizes: a full query projection, softmax routing (groups by their
// best expert), no normalisation, the expert-level balance loss, no MTP.
ModelSpec tiny_v2_lite() {
  ModelSpec m = dsrun::test::tiny_v3_decoder();
  m.mla.q_lora_rank = 0;
  m.moe.scoring = RouterScore::Softmax;
  m.moe.norm_topk_prob = false;
  m.moe.routed_scaling_factor = 1;
  m.moe.balance = MoeBalance::AuxLoss;
  m.moe.aux_loss_weight = 0.01;
  m.moe.seq_aux_loss_weight = 0;
  m.mtp.depth = 0;
  return m;
}

// ---- The reference, in fp64, one equation at a time ----

struct Ref {
  const ModelSpec& m;
  std::map<std::string, Tensor> p;  // the model's parameters and buffers, fp64 leaves

  const Tensor& w(const std::string& name) const { return p.at(name); }
  Tensor rms(const Tensor& x, const std::string& weight) const { return x * torch::rsqrt(x.pow(2).mean(-1, true) + m.norm_eps) * w(weight); }
  Tensor swiglu(const Tensor& x, const std::string& prefix) const {
    const Tensor gate_up = w(prefix + ".gate_up.weight");
    const int64_t f = gate_up.size(0) / 2;
    return (torch::silu(x.matmul(gate_up.narrow(0, 0, f).t())) * x.matmul(gate_up.narrow(0, f, f).t())).matmul(w(prefix + ".down.weight").t());
  }

  // DeepSeek-V3's precompute_freqs_cis: angles [s, rope/2] with YaRN's blend of each frequency,
  // and the rotation of each pair (x_2i, x_2i+1) as the complex number x_2i + i·x_2i+1.
  Tensor angles(int64_t s) const {
    const int64_t dim = m.mla.qk_rope_head_dim;
    const RopeScaling& y = m.rope_scaling;
    Tensor freqs = 1.0 / torch::pow(m.rope_theta, torch::arange(0, dim, 2, torch::kFloat64) / static_cast<double>(dim));
    auto correction_dim = [&](double rotations) { return dim * std::log(y.original_max_position_embeddings / (rotations * 2 * M_PI)) / (2 * std::log(m.rope_theta)); };
    const double low = std::max(std::floor(correction_dim(y.beta_fast)), 0.0), high = std::min(std::ceil(correction_dim(y.beta_slow)), dim - 1.0);
    Tensor smooth = 1 - ((torch::arange(dim / 2, torch::kFloat64) - low) / (high - low)).clamp(0, 1);
    freqs = freqs / y.factor * (1 - smooth) + freqs * smooth;
    return torch::outer(torch::arange(s, torch::kFloat64), freqs);
  }
  double mscale(double factor, double ms) const { return factor <= 1 ? 1 : 0.1 * ms * std::log(factor) + 1; }
  // x [b, s, n, rope]; Hugging Face's cos/sin carry mscale(factor, mscale) / mscale(factor, mscale_all_dim).
  Tensor rotate(const Tensor& x) const {
    const int64_t s = x.size(1), half = x.size(3) / 2;
    const Tensor a = angles(s).view({1, s, 1, half});
    const Tensor pairs = x.reshape({x.size(0), s, x.size(2), half, 2});
    const Tensor x0 = pairs.select(4, 0), x1 = pairs.select(4, 1);  // the pair (x_2i, x_2i+1)
    const double factor = mscale(m.rope_scaling.factor, m.rope_scaling.mscale) / mscale(m.rope_scaling.factor, m.rope_scaling.mscale_all_dim);
    return torch::stack({x0 * a.cos() - x1 * a.sin(), x0 * a.sin() + x1 * a.cos()}, -1).reshape(x.sizes()) * factor;
  }

  // Multi-head latent attention of x [b, s, h] in block `pre` ("block1.attn"), causal.
  Tensor mla(const Tensor& x, const std::string& pre) const {
    const MlaSpec& a = m.mla;
    const int64_t b = x.size(0), s = x.size(1), H = m.heads;
    const Tensor q = (a.q_lora_rank > 0 ? rms(x.matmul(w(pre + ".wq_a.weight").t()), pre + ".q_norm.weight").matmul(w(pre + ".wq_b.weight").t())
                                        : x.matmul(w(pre + ".wq.weight").t()))
                         .view({b, s, H, a.qk_head_dim()});
    const Tensor kv_a = x.matmul(w(pre + ".wkv_a.weight").t());
    const Tensor kv = rms(kv_a.narrow(-1, 0, a.kv_lora_rank), pre + ".kv_norm.weight").matmul(w(pre + ".wkv_b.weight").t()).view({b, s, H, a.qk_nope_head_dim + a.v_head_dim});
    const Tensor q_nope = q.narrow(-1, 0, a.qk_nope_head_dim), q_pe = rotate(q.narrow(-1, a.qk_nope_head_dim, a.qk_rope_head_dim));
    const Tensor k_nope = kv.narrow(-1, 0, a.qk_nope_head_dim), v = kv.narrow(-1, a.qk_nope_head_dim, a.v_head_dim);
    const Tensor k_pe = rotate(kv_a.narrow(-1, a.kv_lora_rank, a.qk_rope_head_dim).unsqueeze(2));  // one key for every head
    const double ms = mscale(m.rope_scaling.factor, m.rope_scaling.mscale_all_dim);
    const double scale = ms * ms / std::sqrt(static_cast<double>(a.qk_head_dim()));
    // scores[b, head, i, j] = (q_nope·k_nope + q_pe·k_pe) · scale, j <= i
    Tensor scores = (torch::einsum("bihd,bjhd->bhij", {q_nope, k_nope}) + torch::einsum("bihd,bjd->bhij", {q_pe, k_pe.squeeze(2)})) * scale;
    scores = scores.masked_fill(torch::ones({s, s}, torch::kBool).triu(1), -std::numeric_limits<double>::infinity());
    const Tensor out = torch::einsum("bhij,bjhd->bihd", {torch::softmax(scores, -1), v}).reshape({b, s, H * a.v_head_dim});
    return out.matmul(w(pre + ".wo.weight").t());
  }

  // The MoE layer `pre` ("block1.moe") on x [b, s, h], token by token; adds the sequence-wise loss.
  Tensor moe(const Tensor& x, const std::string& pre, Tensor& aux) const {
    const MoeSpec& e = m.moe;
    const int64_t b = x.size(0), s = x.size(1), h = x.size(2), E = e.routed_experts, per_group = E / e.n_group;
    const Tensor tokens = x.reshape({-1, h});
    const Tensor logits = tokens.matmul(w(pre + ".router.weight").t());
    const Tensor scores = e.scoring == RouterScore::Sigmoid ? logits.sigmoid() : torch::softmax(logits, -1);
    Tensor bias = torch::zeros({E}, torch::kFloat64);
    if (p.count(pre + ".expert_bias")) bias = w(pre + ".expert_bias");
    std::vector<Tensor> outs;
    Tensor counts = torch::zeros({b, E}, torch::kFloat64);
    for (int64_t t = 0; t < tokens.size(0); ++t) {
      const Tensor choice = (scores[t] + bias).detach();
      std::vector<double> group_score(e.n_group);
      for (int g = 0; g < e.n_group; ++g) {
        Tensor in_group = std::get<0>(choice.narrow(0, g * per_group, per_group).sort(0, true));
        group_score[g] = e.scoring == RouterScore::Sigmoid ? in_group[0].item<double>() + in_group[1].item<double>() : in_group[0].item<double>();
      }
      std::vector<int> order(e.n_group);
      for (int g = 0; g < e.n_group; ++g) order[g] = g;
      std::stable_sort(order.begin(), order.end(), [&](int a, int c) { return group_score[a] > group_score[c]; });
      std::vector<std::pair<double, int>> allowed;
      for (int r = 0; r < e.topk_group; ++r)
        for (int i = 0; i < per_group; ++i) allowed.push_back({choice[order[r] * per_group + i].item<double>(), order[r] * per_group + i});
      std::sort(allowed.begin(), allowed.end(), [](auto& a, auto& c) { return a.first > c.first; });
      std::vector<Tensor> weights;
      for (int j = 0; j < e.top_k; ++j) weights.push_back(scores[t][allowed[j].second]);
      Tensor sum = torch::zeros({}, torch::kFloat64);
      for (auto& wt : weights) sum = sum + wt;
      Tensor y = swiglu(tokens[t], pre + ".shared");
      for (int j = 0; j < e.top_k; ++j) {
        Tensor weight = e.norm_topk_prob ? weights[j] / sum : weights[j];
        y = y + weight * e.routed_scaling_factor * swiglu(tokens[t], pre + ".expert" + std::to_string(allowed[j].second));
        counts[t / s][allowed[j].second] += 1;
      }
      outs.push_back(y);
    }
    const Tensor normalised = e.scoring == RouterScore::Sigmoid ? scores / scores.sum(-1, true) : scores;
    if (e.seq_aux_loss_weight > 0) {  // V3 eq. 17-20, per sequence, then their mean
      const Tensor f = counts * (static_cast<double>(E) / (e.top_k * s));
      const Tensor P = normalised.view({b, s, E}).mean(1);
      aux = aux + e.seq_aux_loss_weight * (f * P).sum(-1).mean();
    }
    if (!e.learns_bias() && e.aux_loss_weight > 0) {  // DeepSeek-MoE eq. 12 over the micro-batch
      const Tensor f = counts.sum(0) * (static_cast<double>(E) / (e.top_k * b * s));
      aux = aux + e.aux_loss_weight * (f * normalised.mean(0)).sum();
    }
    return torch::stack(outs).view({b, s, h});
  }

  Tensor block(const Tensor& x, const std::string& pre, bool is_moe, Tensor& aux) const {
    const Tensor h = x + mla(rms(x, pre + ".attn_norm.weight"), pre + ".attn");
    const Tensor normed = rms(h, pre + ".mlp_norm.weight");
    return h + (is_moe ? moe(normed, pre + ".moe", aux) : swiglu(normed, pre + ".mlp"));
  }

  // The mean token cross-entropy of the head's logits.
  Tensor cross_entropy(const Tensor& hidden, const Tensor& targets) const {
    const Tensor logits = hidden.matmul(w("head.weight").t());
    return torch::nll_loss(torch::log_softmax(logits.reshape({-1, logits.size(-1)}), -1), targets.reshape({-1}));
  }

  // The loss as the trainer adds it: main cross-entropy + balance losses + λ·mean MTP cross-entropy.
  Tensor loss(const Batch& batch, double& task) const {
    Tensor aux = torch::zeros({}, torch::kFloat64);
    const Tensor embedded = torch::embedding(w("embedding.weight"), batch.inputs);
    Tensor x = embedded;
    for (int i = 0; i < m.layers; ++i) x = block(x, "block" + std::to_string(i), i >= m.moe.first_dense_layers && m.moe.enabled(), aux);
    Tensor h = rms(x, "norm.weight");
    const Tensor main = cross_entropy(h, batch.targets);
    task = main.item<double>();
    const int64_t s = batch.inputs.size(1);
    Tensor mtp = torch::zeros({}, torch::kFloat64);
    for (int k = 1; k <= m.mtp.depth; ++k) {  // V3 eq. 21-25
      const std::string pre = "mtp" + std::to_string(k - 1);
      const int64_t n = s - k;
      const Tensor joined = torch::cat({rms(embedded.narrow(1, k, n), pre + ".enorm.weight"), rms(h.narrow(1, 0, n), pre + ".hnorm.weight")}, -1);
      h = rms(block(joined.matmul(w(pre + ".eh_proj.weight").t()), pre + ".block", m.moe.enabled(), aux), pre + ".norm.weight");
      mtp = mtp + cross_entropy(h, batch.targets.narrow(1, k, n));
    }
    if (m.mtp.depth > 0) mtp = mtp * (m.mtp.loss_weight / m.mtp.depth);
    return main + aux + mtp;
  }
};

// The model's loss and every parameter's gradient against the reference's on one batch.
void check_against_reference(const ModelSpec& m, uint64_t seed) {
  auto model = build_model(m, 16, {seed});
  torch::NoGradGuard no_grad_for_setup;
  // A selection bias that matters: the learned one set by hand (its update is tested elsewhere).
  for (auto& b : model->module().named_buffers())
    if (b.key().find("expert_bias") != std::string::npos) b.value().copy_(torch::randn({m.moe.routed_experts}) * 0.05);
  Ref ref{m, {}};
  for (auto& p : model->module().named_parameters()) ref.p[p.key()] = p.value().detach().to(torch::kFloat64).requires_grad_(true);
  for (auto& b : model->module().named_buffers()) ref.p[b.key()] = b.value().detach().to(torch::kFloat64);
  const Batch batch = token_batch(2, 16, m.vocab, seed + 1);
  Tensor ref_loss;
  double ref_task = 0;
  {
    torch::AutoGradMode grad(true);
    ref_loss = ref.loss(batch, ref_task);
    ref_loss.backward();
  }
  torch::AutoGradMode grad(true);
  UnitRunner plain;
  MicroBatchLoss out = one_rank_loss(*model, batch, plain);
  out.loss.backward();
  CHECK(out.task_loss == Approx(ref_task).epsilon(1e-5));
  CHECK(out.loss.item<double>() == Approx(ref_loss.item<double>()).epsilon(1e-5));
  int compared = 0;
  for (auto& p : model->module().named_parameters()) {
    const Tensor want = ref.p.at(p.key()).grad();
    const Tensor got = p.value().grad();
    if (!want.defined()) {
      CHECK((!got.defined() || got.abs().max().item<double>() == 0));
      continue;
    }
    REQUIRE(got.defined());
    const double error = (got.to(torch::kFloat64) - want).norm().item<double>(), scale = want.norm().item<double>();
    INFO(p.key() << ": |grad - reference| = " << error << " of " << scale);
    CHECK(error <= 1e-4 * scale + 1e-9);
    ++compared;
  }
  CHECK(compared > 20);
}

}  // namespace

TEST_CASE("V3: latent attention with YaRN, the sigmoid router within groups, the sequence-wise loss and MTP match the papers' equations", "[engine][latent]") {
  check_against_reference(dsrun::test::tiny_v3_decoder(), 5);
}

TEST_CASE("V2-Lite: latent attention without a query latent, softmax routing within groups by their best expert", "[engine][latent]") {
  check_against_reference(tiny_v2_lite(), 9);
}

TEST_CASE("MTP of depth 2 on a dense latent-attention model with tied embeddings", "[engine][latent][mtp]") {
  ModelSpec m = dsrun::test::tiny_v3_decoder();
  m.moe = MoeSpec{};
  m.mtp.depth = 2;
  m.mtp.loss_weight = 0.1;
  m.rope_scaling = RopeScaling{};
  m.rope_scaling.kind = RopeScalingKind::Yarn;  // factor 1 would extend nothing: plain tables through YaRN's path
  m.rope_scaling.factor = 2;
  m.rope_scaling.original_max_position_embeddings = 16;
  m.rope_scaling.mscale_all_dim = 1;
  check_against_reference(m, 13);
  m.tie_embeddings = true;
  // (the reference reads head.weight: tied, the embedding is the head)
  auto model = build_model(m, 16, {3});
  bool has_head = false;
  for (auto& p : model->module().named_parameters()) has_head |= p.key() == "head.weight";
  CHECK_FALSE(has_head);
  UnitRunner plain;
  MicroBatchLoss out = one_rank_loss(*model, token_batch(2, 16, m.vocab, 4), plain);
  CHECK(std::isfinite(out.loss.item<double>()));
  CHECK(out.aux_loss > 0);  // λ · the MTP modules' cross-entropy
}

TEST_CASE("the MoE selection bias of the MTP block moves with the others' (its layer follows the last block)", "[engine][latent][mtp]") {
  const ModelSpec m = dsrun::test::tiny_v3_decoder();
  CHECK(m.moe_layers() == m.layers - m.moe.first_dense_layers + 1);
  auto model = build_model(m, 16, {3});
  model->balance_experts(m.layers, torch::arange(m.moe.routed_experts, torch::kFloat64), 0.01);
  Tensor bias;
  for (auto& b : model->module().named_buffers())
    if (b.key() == "mtp0.block.moe.expert_bias") bias = b.value();
  REQUIRE(bias.defined());
  CHECK(bias[0].item<double>() == Approx(0.01));   // below the mean load: up
  CHECK(bias[7].item<double>() == Approx(-0.01));  // above: down
}

TEST_CASE("FP8 E4M3 codes decode and encode as torch's float8_e4m3fn", "[engine][import][fp8]") {
  CHECK(e4m3_to_float(0x7e) == 448.0f);
  CHECK(e4m3_to_float(0x01) == std::ldexp(1.0f, -9));  // smallest subnormal
  CHECK(e4m3_to_float(0x38) == 1.0f);
  CHECK(e4m3_to_float(0xb8) == -1.0f);
  CHECK(std::isnan(e4m3_to_float(0x7f)));
  for (int code = 0; code < 0x7f; ++code) {
    CHECK(float_to_e4m3(e4m3_to_float(static_cast<uint8_t>(code))) == code);
    CHECK(float_to_e4m3(-e4m3_to_float(static_cast<uint8_t>(code))) == (code == 0 ? 0x80 : 0x80 | code));
  }
  CHECK(float_to_e4m3(1000.0f) == 0x7e);  // saturates
  CHECK(float_to_e4m3(1.0625f) == 0x38);  // halfway between 1 and 1.125: to the even code
}

TEST_CASE("init_from reads DeepSeek-V3's Hugging Face layout: FP8 blocks with their scales, the MTP layer after the last block, its copies of the embedding and head", "[engine][import][latent]") {
  ModelSpec m = dsrun::test::tiny_v3_decoder();
  m.hidden = 160;  // the attention output projection [160, 32] and the experts' down projection [160, 16]: partial 128-blocks
  torch::manual_seed(21);
  auto source = build_model(m, 16, {21});
  for (auto& b : source->module().named_buffers())
    if (b.key().find("expert_bias") != std::string::npos) b.value().copy_(torch::randn({m.moe.routed_experts}) * 0.05);

  // Written as DeepSeek releases V3: every block linear FP8 with one scale per 128 x 128 block,
  // the router, norms, embedding, head and eh_proj in bf16 (here F32), the bias F32.
  std::vector<Tensor> keep;
  std::vector<std::vector<uint8_t>> fp8_bytes;
  SafetensorsWriter writer;
  std::map<std::string, Tensor> dequantised;  // what the FP8 pieces stand for
  int fp8_tensors = 0;
  for (const auto& p : source->module().named_parameters())
    for (const auto& piece : hf_pieces(p.key(), p.value().sizes().vec(), m)) {
      Tensor rows = p.value().detach().narrow(0, piece.row_begin, piece.rows).contiguous();
      const bool fp8 = rows.dim() == 2 && piece.name.find("proj") != std::string::npos && piece.name.find("eh_proj") == std::string::npos;
      if (!fp8) {
        keep.push_back(rows);
        writer.add(piece.name, "F32", rows.sizes().vec(), rows.data_ptr());
        continue;
      }
      const int64_t R = rows.size(0), C = rows.size(1), br = (R + 127) / 128, bc = (C + 127) / 128;
      Tensor scale = torch::empty({br, bc});
      std::vector<uint8_t> codes(static_cast<size_t>(R * C));
      Tensor back = torch::empty_like(rows);
      for (int64_t i = 0; i < br; ++i)
        for (int64_t j = 0; j < bc; ++j) {
          Tensor tile = rows.narrow(0, i * 128, std::min<int64_t>(128, R - i * 128)).narrow(1, j * 128, std::min<int64_t>(128, C - j * 128));
          scale[i][j] = tile.abs().max().item<float>() / 448.0f;
        }
      auto acc = rows.accessor<float, 2>();
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) {
          const float sc = scale[r / 128][c / 128].item<float>();
          codes[static_cast<size_t>(r * C + c)] = float_to_e4m3(acc[r][c] / sc);
          back[r][c] = e4m3_to_float(codes[static_cast<size_t>(r * C + c)]) * sc;
        }
      fp8_bytes.push_back(std::move(codes));
      keep.push_back(scale);
      writer.add(piece.name, "F8_E4M3", rows.sizes().vec(), fp8_bytes.back().data());
      writer.add(piece.name + "_scale_inv", "F32", scale.sizes().vec(), scale.data_ptr());
      dequantised[piece.name] = back;
      ++fp8_tensors;
    }
  for (const auto& b : source->module().named_buffers()) {
    const std::string name = hf_buffer_name(b.key(), m);
    if (name.empty()) continue;
    keep.push_back(b.value().contiguous());
    writer.add(name, "F32", b.value().sizes().vec(), keep.back().data_ptr());
  }
  dsrun::test::TempDir dir;
  writer.write_atomic(dir.file("model.safetensors"));
  CHECK(fp8_tensors > 30);
  const SafetensorsFile written(dir.file("model.safetensors"));
  CHECK(written.find("model.layers.2.eh_proj.weight") != nullptr);  // MTP: the layer after the last block (2 layers)
  CHECK(written.find("model.layers.2.shared_head.head.weight") != nullptr);
  CHECK(written.find("model.layers.2.embed_tokens.weight") != nullptr);
  CHECK(written.find("model.layers.1.self_attn.kv_b_proj.weight_scale_inv") != nullptr);
  CHECK(written.find("model.layers.1.mlp.gate.e_score_correction_bias") != nullptr);

  // The source with its FP8 weights dequantised is the model init_from must give, exactly.
  {
    torch::NoGradGuard no_grad;
    for (auto& p : source->module().named_parameters())
      for (const auto& piece : hf_pieces(p.key(), p.value().sizes().vec(), m))
        if (dequantised.count(piece.name) && !piece.copy) p.value().narrow(0, piece.row_begin, piece.rows).copy_(dequantised[piece.name]);
  }
  torch::manual_seed(22);
  auto target = build_model(m, 16, {22});
  load_pretrained_weights(*target, m, dir.path());
  auto want = source->module().named_parameters();
  for (const auto& p : target->module().named_parameters()) {
    INFO(p.key());
    CHECK(torch::equal(p.value(), want[p.key()]));
  }
  auto want_buffers = source->module().named_buffers();
  for (const auto& b : target->module().named_buffers()) CHECK(torch::equal(b.value(), want_buffers[b.key()]));
  UnitRunner plain;
  const Batch batch = token_batch(2, 16, m.vocab, 23);
  CHECK(one_rank_loss(*target, batch, plain).loss.item<double>() == one_rank_loss(*source, batch, plain).loss.item<double>());

  // A recipe whose shapes disagree: the tensor is named.
  ModelSpec other = m;
  other.mla.kv_lora_rank = 24;
  auto wrong = build_model(other, 16, {23});
  try {
    load_pretrained_weights(*wrong, other, dir.path());
    FAIL("a model with another kv_lora_rank accepted the weights");
  } catch (const dsrun::Error& e) {
    CHECK(std::string(e.what()).find("model.layers.0.self_attn.kv_a_proj_with_mqa.weight has shape") != std::string::npos);
    CHECK(e.context().key == "model.init_from");
  }
}

TEST_CASE("export's config.json is DeepseekV3's for latent attention with a sigmoid router, DeepseekV2's with softmax", "[engine][export][latent]") {
  const nlohmann::json v3 = nlohmann::json::parse(hf_config_json(dsrun::test::tiny_v3_decoder(), "bfloat16"));
  CHECK(v3["architectures"][0] == "DeepseekV3ForCausalLM");
  CHECK(v3["q_lora_rank"] == 16);
  CHECK(v3["n_group"] == 4);
  CHECK(v3["topk_group"] == 2);
  CHECK(v3["routed_scaling_factor"] == 2.5);
  CHECK(v3["num_nextn_predict_layers"] == 1);
  CHECK(v3["rope_scaling"]["type"] == "yarn");
  CHECK(v3["rope_scaling"]["mscale_all_dim"] == 0.8);
  CHECK(v3["rope_interleave"] == true);
  const nlohmann::json v2 = nlohmann::json::parse(hf_config_json(tiny_v2_lite(), "bfloat16"));
  CHECK(v2["architectures"][0] == "DeepseekV2ForCausalLM");
  CHECK(v2["q_lora_rank"].is_null());
  CHECK(v2["topk_method"] == "group_limited_greedy");
}

namespace {

// The shape bench/hf_deepseek_v3_check.py gives transformers' DeepseekV3Config (the two must agree).
ModelSpec hf_check_spec() {
  ModelSpec m = dsrun::test::tiny_v3_decoder();
  m.hidden = 64;
  m.layers = 3;
  m.intermediate = 96;
  m.vocab = 256;
  m.max_seq_len = 256;
  m.mla.q_lora_rank = 48;
  m.mla.kv_lora_rank = 32;
  m.mla.qk_nope_head_dim = 32;
  m.mla.qk_rope_head_dim = 16;
  m.mla.v_head_dim = 32;
  m.rope_scaling.original_max_position_embeddings = 64;
  m.moe.intermediate = 32;
  m.moe.seq_aux_loss_weight = 0;  // (transformers computes no balance loss: the task losses are compared)
  m.mtp.depth = 0;                // (save_pretrained writes no MTP layer)
  return m;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

// Needs the GPU machine's Python (transformers 5.x): bench/gpu_latent.sh runs the script, this test
// with DSRUN_HF_CHECK set to its folder, and the script again on dsrun's export. Skipped elsewhere.
TEST_CASE("transformers' DeepseekV3ForCausalLM: its saved weights give its loss here, and dsrun's export is written for it", "[engine][latent][hf]") {
  const char* dir_env = std::getenv("DSRUN_HF_CHECK");
  if (!dir_env) {
    WARN("DSRUN_HF_CHECK unset: needs transformers (bench/gpu_latent.sh)");
    return;
  }
  const std::string dir = dir_env;
  const SafetensorsFile tokens(dir + "/tokens.safetensors");
  const SafetensorsEntry& ids_entry = tokens.at("input_ids");
  std::vector<int64_t> ids(static_cast<size_t>(ids_entry.numel()));
  tokens.read(ids_entry, 0, ids.size() * 8, ids.data());
  const Tensor all = torch::from_blob(ids.data(), ids_entry.shape, torch::kInt64).clone();
  const int64_t s = all.size(1) - 1;
  Batch batch;
  batch.inputs = all.narrow(1, 0, s).contiguous();
  batch.targets = all.narrow(1, 1, s).contiguous();
  batch.items = batch.inputs.numel();

  const ModelSpec m = hf_check_spec();
  auto model = build_model(m, s, {1});
  load_pretrained_weights(*model, m, dir + "/hf");
  UnitRunner plain;
  const double theirs = nlohmann::json::parse(read_text(dir + "/hf_loss.json"))["loss"].get<double>();
  const double ours = one_rank_loss(*model, batch, plain).task_loss;
  std::printf("transformers fp32 loss %.7f, dsrun fp32 %.7f (relative %.2e)\n", theirs, ours, std::fabs(ours - theirs) / theirs);
  CHECK(std::fabs(ours - theirs) <= 1e-4 * theirs);
  if (torch::cuda::is_available()) {
    model->module().to(torch::kCUDA, torch::kBFloat16);
    Batch on_gpu = batch;
    on_gpu.inputs = batch.inputs.to(torch::kCUDA);
    on_gpu.targets = batch.targets.to(torch::kCUDA);
    const double bf16 = one_rank_loss(*model, on_gpu, plain).task_loss;
    std::printf("dsrun bf16 on the GPU %.7f (relative %.2e)\n", bf16, std::fabs(bf16 - theirs) / theirs);
    CHECK(std::fabs(bf16 - theirs) <= 2e-2 * theirs);
  }

  // dsrun's own weights (one MTP module too: transformers skips it) as `dsrun export` names them,
  // its config.json, and its loss for the script to compare.
  ModelSpec with_mtp = m;
  with_mtp.mtp.depth = 1;
  auto ours_model = build_model(with_mtp, s, {2});
  std::vector<Tensor> keep;
  SafetensorsWriter writer;
  dsrun::test::add_hf_weights(*ours_model, with_mtp, writer, keep);
  for (const auto& b : ours_model->module().named_buffers()) {
    const std::string name = hf_buffer_name(b.key(), with_mtp);
    if (name.empty()) continue;
    keep.push_back((torch::randn(b.value().sizes()) * 0.01).contiguous());  // a selection bias that matters
    b.value().copy_(keep.back());
    writer.add(name, "F32", keep.back().sizes().vec(), keep.back().data_ptr());
  }
  make_directories(dir + "/export");
  writer.write_atomic(dir + "/export/model.safetensors");
  write_file_atomic(dir + "/export/config.json", hf_config_json(with_mtp, "float32"));
  const double exported = one_rank_loss(*ours_model, batch, plain).task_loss;
  write_file_atomic(dir + "/dsrun_loss.json", "{\"loss\": " + format_double_exact(exported) + "}\n");
  std::printf("dsrun's export: task loss %.7f\n", exported);
}
