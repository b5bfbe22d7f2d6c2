#include "engine/probe/device_probe.hpp"

#include "engine/common/environment.hpp"
#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/host_cores.hpp"
#include "engine/common/host.hpp"
#include "engine/common/torch_compat.hpp"
#include "engine/dist/communicator.hpp"
#include "engine/model/fp8_linear.hpp"
#include "engine/model/model.hpp"
#include "engine/parallel/copy_stream.hpp"
#include "engine/parallel/zero_options.hpp"  // torch_dtype
#include "engine/plan/cost.hpp"
#include "engine/plan/plan.hpp"
#include "engine/probe/host_probe.hpp"
#include "engine/recipe/load.hpp"

#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#ifdef DSRUN_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif
#include <c10/core/DeviceGuard.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <sstream>
#include <thread>

namespace dsrun {
namespace {

std::string mib(double bytes) { return probe_number(bytes / (1 << 20), 0) + " MiB"; }

// How many times each measurement runs: untimed warm-up calls, then timed calls.
struct Repeats {
  int warmup = 2, timed = 5;
};

// Seconds of each timed call of `work`, the device drained around each; `before` (untimed, then
// drained) ahead of every timed call: a barrier, where the node's ranks start each call together.
std::vector<double> call_seconds(const torch::Device& device, const Repeats& n, const std::function<void()>& work, const std::function<void()>& before = {}) {
  auto drain = [&] {
    if (device.is_cuda()) torch::cuda::synchronize(device.index());
  };
  for (int i = 0; i < n.warmup; ++i) work();
  drain();
  std::vector<double> seconds;
  for (int i = 0; i < n.timed; ++i) {
    if (before) {
      before();
      drain();
    }
    const double start = steady_seconds();
    work();
    drain();
    seconds.push_back(steady_seconds() - start);
  }
  return seconds;
}

// The median call (probe_median): on CPU ranks the fastest made plans 25-35% optimistic.
double median(std::vector<double> v) { return probe_median(std::move(v)); }

double time_per_call(const torch::Device& device, const Repeats& n, const std::function<void()>& work) { return median(call_seconds(device, n, work)); }

double peak_for(const HardwareSpec& hw, DType d) { return d == DType::Bf16 ? hw.peak_flops_bf16 : d == DType::Fp16 ? hw.peak_flops_fp16 : hw.peak_flops_fp32; }

// The group sizes a node of `world` ranks allows: every divisor above 1, so that the node splits
// into equal groups that all run at once, as a layout's tensor or data groups do.
std::vector<int> group_sizes(int world) {
  std::vector<int> sizes;
  for (int g = 2; g <= world; ++g)
    if (world % g == 0) sizes.push_back(g);
  return sizes;
}

// The message size whose bus bandwidth goes into the template's tables: gradient buckets and a
// micro-batch's activations are tens of MiB (64 MiB reached 90% or more of 256 MiB's over NVLink).
constexpr double kTableBytes = 64 << 20;

// hardware.overlap_cost: matrix products alone, the node's all-reduces alone (about a third of
// the products' time), then both at once, the reductions issued first on NCCL's stream as ZeRO's
// are during backward. What the pair takes beyond the products, over the reductions' time alone,
// is the share of a collective beside compute that a step still pays.
ProbeFigure probe_overlap_cost(const torch::Device& device, Communicator& world_comm, torch::ScalarType dtype, double buffer_bytes, const Repeats& repeats) {
  const auto options = torch::TensorOptions().dtype(dtype).device(device);
  const int64_t n = 8192, products = 12;
  const torch::Tensor a = torch::randn({n, n}, options), b = torch::randn({n, n}, options);
  torch::Tensor c = torch::empty({n, n}, options);
  torch::Tensor buffer = torch::ones({static_cast<int64_t>(buffer_bytes) / static_cast<int64_t>(c10::elementSize(dtype))}, options);
  auto multiply = [&] {
    for (int64_t i = 0; i < products; ++i) torch::mm_out(c, a, b);
  };
  world_comm.barrier();
  const double one_reduction = time_per_call(device, repeats, [&] { world_comm.all_reduce_sum(buffer); });
  world_comm.barrier();
  const double alone = time_per_call(device, repeats, multiply);
  // Every rank runs as many reductions (rank 0's count), or the collectives would not match.
  torch::Tensor count = torch::full({1}, std::max(1.0, std::round(alone / 3 / one_reduction)), torch::TensorOptions().dtype(torch::kFloat32).device(device));
  world_comm.broadcast(count, 0);
  const int reductions = static_cast<int>(count.item<double>());
  auto reduce = [&](bool wait) {
    std::vector<PendingCollective> pending;
    for (int i = 0; i < reductions; ++i) pending.push_back(world_comm.all_reduce_sum_async(buffer));
    if (wait)
      for (PendingCollective& p : pending) p.wait();
    return pending;
  };
  world_comm.barrier();
  const double reduce_alone = time_per_call(device, repeats, [&] { reduce(true); });
  world_comm.barrier();
  const double both = time_per_call(device, repeats, [&] {
    std::vector<PendingCollective> pending = reduce(false);
    multiply();
    for (PendingCollective& p : pending) p.wait();
  });
  const double cost = std::clamp((both - alone) / reduce_alone, 0.0, 2.0);
  return {"hardware.overlap_cost", cost,
          std::to_string(products) + " products of " + std::to_string(n) + "² " + std::string(c10::toString(dtype)) + " alone " + probe_number(alone * 1e3, 3) + " ms, " +
              std::to_string(reductions) + " all-reduces of " + mib(buffer_bytes) + " over the node alone " + probe_number(reduce_alone * 1e3, 3) + " ms, both at once " +
              probe_number(both * 1e3, 3) + " ms: (both - products) / reductions"};
}

// Collectives across this node's ranks, as nccl-tests reports them: bus bandwidth (an all-reduce
// moves 2(n-1)/n of the buffer per rank, an all-gather, reduce-scatter or all-to-all (n-1)/n), for
// each group size the node allows, every group of that size at once; then point-to-point between
// pairs of ranks, both ways at once. Every rank runs it; rank 0 keeps the figures.
// comm_efficiency: the whole node's largest all-reduce against link_bandwidth_gbs.
void probe_collectives(const Recipe& r, Rendezvous& rendezvous, Communicator& world_comm, const torch::Device& device, torch::ScalarType dtype, bool quick,
                       std::vector<ProbeFigure>& figures) {
  const int world = world_comm.world_size(), rank = world_comm.rank();
  std::vector<double> sizes = quick ? std::vector<double>{1 << 20, 8 << 20} : device.is_cuda() ? std::vector<double>{1 << 20, 16 << 20, kTableBytes, 256 << 20} : std::vector<double>{1 << 20, 16 << 20, kTableBytes};
  const double table_bytes = quick ? sizes.back() : kTableBytes;
  const Repeats repeats = quick ? Repeats{1, 3} : Repeats{3, 10};
  const std::string backend = device.is_cuda() ? "NCCL" : "Gloo";
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  const auto options = torch::TensorOptions().dtype(dtype).device(device);
  double largest_all_reduce = 0;
  for (int g : group_sizes(world)) {
    // Groups of consecutive ranks, as the mesh puts the innermost dimension (tensor) on a node.
    std::unique_ptr<Communicator> comm = g == world ? nullptr : rendezvous.group("probe-" + std::to_string(g) + "-" + std::to_string(rank / g), rank % g, g);
    Communicator& group = comm ? *comm : world_comm;
    for (double bytes : sizes) {
      const int64_t numel = static_cast<int64_t>(bytes) / element / g * g;
      torch::Tensor full = torch::ones({numel}, options), out = torch::empty({numel}, options);
      torch::Tensor shard = torch::empty({numel / g}, options);
      struct Op {
        Collective op;
        double traffic;  // bus bytes per buffer byte
        std::function<void()> run;
      };
      const std::vector<Op> ops = {
          {Collective::AllReduce, 2.0 * (g - 1) / g, [&] { group.all_reduce_sum(full); }},
          {Collective::AllGather, 1.0 * (g - 1) / g, [&] { group.all_gather(shard, full); }},
          {Collective::ReduceScatter, 1.0 * (g - 1) / g, [&] { group.reduce_scatter_sum(full, shard); }},
          {Collective::AllToAll, 1.0 * (g - 1) / g, [&] { group.all_to_all(full, out); }},
      };
      for (const Op& op : ops) {
        world_comm.barrier();
        const double seconds = time_per_call(device, repeats, op.run);
        const double bus = op.traffic * static_cast<double>(numel * element) / seconds;
        if (op.op == Collective::AllReduce && g == world) largest_all_reduce = bus;
        const std::string how = collective_words(op.op) + " of " + mib(static_cast<double>(numel * element)) + " " + std::string(c10::toString(dtype)) + " over " + std::to_string(g) +
                                " ranks (" + (g == world ? std::string("the node's ") : std::to_string(world / g) + " groups at once, ") + backend + "), " + probe_number(seconds * 1e3, 3) + " ms";
        figures.push_back({"", bus / 1e9, "GB/s bus bandwidth: " + how});
        if (bytes == table_bytes) figures.push_back({collective_key(op.op), bus / 1e9, how, g});
      }
    }
  }
  if (world >= 2) {
    // Pairs (0,1), (2,3), ... send to each other at once, as a pipeline's neighbours do in 1F1B's
    // steady state; a rank left without a partner only waits.
    const int partner = rank ^ 1;
    const int64_t numel = static_cast<int64_t>(table_bytes) / element;
    torch::Tensor sent = torch::ones({numel}, options), received = torch::empty({numel}, options);
    world_comm.barrier();
    double seconds = 0;
    if (partner < world) {
      seconds = time_per_call(device, repeats, [&] {
        Exchange x = world_comm.exchange({{PointToPoint::Send, sent, partner, 0}, {PointToPoint::Receive, received, partner, 0}});
        x.received.wait();
        x.sent.wait();
      });
    }
    world_comm.barrier();
    if (seconds > 0)
      figures.push_back({"hardware.p2p_gbs", static_cast<double>(numel * element) / seconds / 1e9,
                         "send and receive of " + mib(static_cast<double>(numel * element)) + " between neighbouring ranks, every pair both ways at once (" + backend + "), " +
                             probe_number(seconds * 1e3, 3) + " ms"});
  }
  if (device.is_cuda() && world >= 2) figures.push_back(probe_overlap_cost(device, world_comm, dtype, table_bytes, repeats));
  figures.push_back({"hardware.comm_efficiency", std::min(1.0, largest_all_reduce / r.hardware.link_bandwidth),
                     "the node's largest all-reduce's bus bandwidth (" + probe_number(largest_all_reduce / 1e9, 2) + " GB/s, " + backend + ") over hardware.link_bandwidth_gbs (" +
                         probe_number(r.hardware.link_bandwidth / 1e9, 2) + ")"});
}

// The model's own matrix products, forward and both backward products, outside the model: what
// cuBLAS (or the CPU's BLAS) gives at these shapes. Recorded, not a key: training adds the rest.
ProbeFigure probe_matrix_products(const Recipe& r, const torch::Device& device, DType dt, int64_t tokens, const Repeats& repeats) {
  const torch::ScalarType dtype = torch_dtype(dt);
  const ModelSpec& m = r.model;
  const int64_t h = m.hidden, d = m.head_dim();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {h, (m.heads + 2 * m.kv_heads) * d}, {m.heads * d, h}, {h, 2 * m.intermediate}, {m.intermediate, h}, {h, m.vocab}};
  struct Product {
    torch::Tensor x, w, gy;
  };
  std::vector<Product> products;
  double flops = 0;
  const auto o = torch::TensorOptions().dtype(dtype).device(device);
  for (const auto& [k, n] : shapes) {
    products.push_back({torch::randn({tokens, k}, o), torch::randn({n, k}, o), torch::randn({tokens, n}, o)});
    flops += 3 * 2.0 * static_cast<double>(tokens * k * n);
  }
  const double seconds = time_per_call(device, repeats, [&] {
    for (const Product& p : products) {
      torch::mm(p.x, p.w.t());
      torch::mm(p.gy, p.w);
      torch::mm(p.gy.t(), p.x);
    }
  });
  const double peak = peak_for(r.hardware, dt);
  return {"", flops / seconds / peak,
          std::string("of the ") + to_string(dt) + " peak: the model's 5 matrix products (q/k/v, output, gate/up, down, head) in " + to_string(dt) + " at " +
              std::to_string(tokens) + " tokens, forward and both backward products alone, " + probe_number(flops / seconds / 1e12, 2) + " TFLOP/s"};
}

// precision.fp8's products at the blocks' four shapes (q/k/v, output, gate/up, down), forward and both
// backward products, alone, operands quantised beforehand (tensorwise), beside the same products in
// bf16: {FP8 TFLOP/s over the FP8 peak, bf16's over the bf16 peak}. Training reaches a fraction of
// products alone (kernel gaps, the rest of the layer): the caller scales by the bf16 layers' own.
std::pair<double, double> probe_fp8_products(const Recipe& r, const torch::Device& device, int64_t tokens, const Repeats& repeats) {
  const ModelSpec& m = r.model;
  const int64_t h = m.hidden, d = m.head_dim();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{h, (m.heads + 2 * m.kv_heads) * d}, {m.heads * d, h}, {h, 2 * m.intermediate}, {m.intermediate, h}};
  struct Product {
    Fp8Operand x, w, gy;
    torch::Tensor xb, wb, gb;
  };
  std::vector<Product> products;
  double flops = 0;
  const auto o = torch::TensorOptions().dtype(torch::kBFloat16).device(device);
  for (const auto& [k, n] : shapes) {
    Product p;
    p.xb = torch::randn({tokens, k}, o);
    p.wb = torch::randn({n, k}, o) * 0.02;
    p.gb = torch::randn({tokens, n}, o);
    p.x = quantize_fp8(p.xb, Fp8Scaling::Tensorwise, false, true, true);
    p.w = quantize_fp8(p.wb, Fp8Scaling::Tensorwise, false, true, true);
    p.gy = quantize_fp8(p.gb, Fp8Scaling::Tensorwise, true, true, true);
    products.push_back(std::move(p));
    flops += 3 * 2.0 * static_cast<double>(tokens * k * n);
  }
  const double fp8_seconds = time_per_call(device, repeats, [&] {
    for (const Product& p : products) {
      compat::scaled_mm(p.x.q, p.w.q.t(), p.x.inv_q, p.w.inv_q);
      compat::scaled_mm(p.gy.q, p.w.qt.t(), p.gy.inv_q, p.w.inv_t);
      compat::scaled_mm(p.gy.qt, p.x.qt.t(), p.gy.inv_t, p.x.inv_t);
    }
  });
  const double bf16_seconds = time_per_call(device, repeats, [&] {
    for (const Product& p : products) {
      torch::mm(p.xb, p.wb.t());
      torch::mm(p.gb, p.wb);
      torch::mm(p.gb.t(), p.xb);
    }
  });
  return {flops / fp8_seconds / r.hardware.peak_flops_fp8, flops / bf16_seconds / r.hardware.peak_flops_bf16};
}

// execution.fp8_routed_experts' four FP8 grouped products (forward's gate/up and down, the input
// gradients' through down and gate/up), their operands quantised beforehand (priced apart, as
// memory traffic), at the shape probe_grouped_products takes -> hardware.fp8_grouped_matmul_efficiency.
ProbeFigure probe_fp8_grouped_products(const Recipe& r, const torch::Device& device, int64_t tokens, const Repeats& repeats) {
  const MoeSpec& moe = r.model.moe;
  const int64_t h = r.model.hidden, inner = moe.intermediate, experts = moe.routed_experts;
  const int64_t per_expert = std::max<int64_t>(16, tokens * moe.top_k / experts), rows = per_expert * experts;
  const auto o = torch::TensorOptions().dtype(torch::kBFloat16).device(device);
  auto operand = [&](int64_t m, int64_t k) { return quantize_fp8(torch::randn({m, k}, o), Fp8Scaling::Rowwise, false, true, false); };
  const Fp8Operand x = operand(rows, h), a = operand(rows, inner), dy = operand(rows, h), dh = operand(rows, 2 * inner);
  const Fp8Operand w1 = quantize_fp8_experts((torch::randn({experts, 2 * inner, h}, o) * 0.02).contiguous(), true, true);
  const Fp8Operand w2 = quantize_fp8_experts((torch::randn({experts, h, inner}, o) * 0.02).contiguous(), true, true);
  const torch::Tensor offs = torch::arange(1, experts + 1, torch::TensorOptions().dtype(torch::kInt32).device(device)) * static_cast<int32_t>(per_expert);
  // As training runs them: forward's two with fast accumulation (grouped_experts.cpp), then all four without.
  auto four = [&](bool fast_forward) {
    return time_per_call(device, repeats, [&] {
      compat::scaled_grouped_mm(x.q, w1.q.transpose(1, 2), x.inv_q.view({-1}), w1.inv_q, offs, fast_forward);
      compat::scaled_grouped_mm(a.q, w2.q.transpose(1, 2), a.inv_q.view({-1}), w2.inv_q, offs, fast_forward);
      compat::scaled_grouped_mm(dy.q, w2.qt.transpose(1, 2), dy.inv_q.view({-1}), w2.inv_t, offs);
      compat::scaled_grouped_mm(dh.q, w1.qt.transpose(1, 2), dh.inv_q.view({-1}), w1.inv_t, offs);
    });
  };
  const double seconds = four(true), exact = four(false);
  const double flops = 2 * 2.0 * static_cast<double>(rows) * static_cast<double>(h * 2 * inner + inner * h);
  return {"hardware.fp8_grouped_matmul_efficiency", std::min(1.0, flops / seconds / r.hardware.peak_flops_fp8),
          "the routed experts' forward and input-gradient grouped products in FP8 (row scales, operands quantised beforehand, forward's with "
          "fast accumulation) over " + std::to_string(experts) + " experts of " + std::to_string(per_expert) + " rows each, " +
              probe_number(flops / seconds / 1e12, 3) + " TFLOP/s (" + probe_number(flops / exact / 1e12, 3) + " without fast accumulation)"};
}

// The routed experts as training runs them on GPUs: each MoE layer's two grouped products
// (gate/up, down) over the tokens' top_k rows spread evenly over the experts, forward and
// backward (autograd's four products) -> hardware.grouped_matmul_efficiency.
ProbeFigure probe_grouped_products(const Recipe& r, const torch::Device& device, DType dt, int64_t tokens, const Repeats& repeats) {
  const MoeSpec& moe = r.model.moe;
  const int64_t h = r.model.hidden, inner = moe.intermediate, experts = moe.routed_experts;
  const int64_t per_expert = std::max<int64_t>(1, tokens * moe.top_k / experts), rows = per_expert * experts;
  const auto o = torch::TensorOptions().dtype(torch_dtype(dt)).device(device);
  torch::Tensor x = torch::randn({rows, h}, o).requires_grad_();
  torch::Tensor gate_up = (torch::randn({experts, h, 2 * inner}, o) * 0.02).requires_grad_(), down = (torch::randn({experts, inner, h}, o) * 0.02).requires_grad_();
  torch::Tensor middle_grad = torch::randn({rows, inner}, o), out_grad = torch::randn({rows, h}, o);
  const torch::Tensor offs = torch::arange(1, experts + 1, torch::TensorOptions().dtype(torch::kInt32).device(device)) * static_cast<int32_t>(per_expert);
  const double seconds = time_per_call(device, repeats, [&] {
    torch::Tensor middle = compat::grouped_mm(x, gate_up, offs).narrow(1, 0, inner);
    torch::Tensor y = compat::grouped_mm(middle.detach().requires_grad_(), down, offs);
    torch::autograd::backward({y, middle}, {out_grad, middle_grad});
  });
  const double flops = 3 * 2.0 * static_cast<double>(rows) * static_cast<double>(h * 2 * inner + inner * h);
  const double peak = peak_for(r.hardware, dt);
  return {"hardware.grouped_matmul_efficiency", flops / seconds / peak,
          "the routed experts' grouped products (gate/up " + std::to_string(h) + " x " + std::to_string(2 * inner) + ", down " + std::to_string(inner) + " x " + std::to_string(h) +
              ") over " + std::to_string(experts) + " experts of " + std::to_string(per_expert) + " rows each, forward and backward in " + to_string(dt) + ", " +
              probe_number(flops / seconds / 1e12, 2) + " TFLOP/s"};
}

// The recipe's decoder cut to `layers` dense layers, on `samples` rows of `seq` tokens, ready to
// run forward and backward as the engine runs them: the layers, the head and the loss.
class CutDecoder {
 public:
  CutDecoder(ModelSpec spec, int layers, const Recipe& r, const torch::Device& device, torch::ScalarType dtype, int64_t samples, int64_t seq) : vocab_(spec.vocab) {
    spec.layers = layers;
    spec.moe = MoeSpec{};  // dense: the grouped experts have their own efficiency
    spec.init_from.clear();
    ModelBuild build;
    build.seed = 1;
    build.loss_chunk_tokens = loss_chunk_tokens(r.batch, spec.vocab);
    model_ = build_model(spec, seq, build);
    model_->module().to(device, dtype);
    const auto ids = torch::TensorOptions().dtype(torch::kInt64).device(device);
    batch_.inputs = torch::randint(0, spec.vocab, {samples, seq}, ids);
    batch_.targets = torch::randint(0, spec.vocab, {samples, seq}, ids);
    batch_.items = samples * seq;
  }
  void forward_backward() {
    for (auto& p : model_->module().parameters()) p.mutable_grad() = torch::Tensor();
    ModelOutput out = model_->forward(batch_, runner_);
    torch::Tensor loss = out.loss.defined() ? out.loss : torch::nll_loss(torch::log_softmax(out.logits.reshape({-1, vocab_}).to(torch::kFloat32), -1), batch_.targets.reshape({-1}));
    loss.backward();
  }

 private:
  int64_t vocab_;
  std::unique_ptr<Model> model_;
  UnitRunner runner_;
  Batch batch_;
};

// Copies between host and GPU, each way, from pinned and from pageable host memory, by one GPU
// alone (the node's other ranks wait). Where the node has several (`node`), the pinned copies
// again with every GPU's at once, each started together: training makes them so (offload's
// traffic every step, checkpoint staging), through one host's memory and PCIe switches, and
// hardware.host_link_bandwidth_gbs is that rate per GPU. (Alone, an H200 moved 55 GB/s; four at
// once into one host's memory paused a checkpoint as if each moved about 30.)
void probe_copies(const torch::Device& device, bool quick, Communicator* node, std::vector<ProbeFigure>& figures) {
  const int64_t bytes = quick ? int64_t{32} << 20 : int64_t{256} << 20;
  const Repeats repeats = quick ? Repeats{1, 3} : Repeats{2, 10};
  torch::Tensor on_device = torch::empty({bytes}, torch::TensorOptions().dtype(torch::kUInt8).device(device));
  torch::Tensor pinned = pinned_host_tensor(bytes, torch::kUInt8);
  torch::Tensor pageable = torch::empty({bytes}, torch::TensorOptions().dtype(torch::kUInt8));
  pageable.fill_(1);
  auto up = [&](torch::Tensor& host, bool is_pinned) { on_device.copy_(host, /*non_blocking=*/is_pinned); };
  auto down = [&](torch::Tensor& host, bool is_pinned) { host.copy_(on_device, /*non_blocking=*/is_pinned); };
  double pinned_up = 0, pinned_down = 0;
  if (!node || node->rank() == 0) {
    for (bool is_pinned : {true, false}) {
      torch::Tensor& host = is_pinned ? pinned : pageable;
      const double rate_up = bytes / time_per_call(device, repeats, [&] { up(host, is_pinned); });
      const double rate_down = bytes / time_per_call(device, repeats, [&] { down(host, is_pinned); });
      const std::string kind = is_pinned ? "pinned" : "pageable";
      figures.push_back({"", rate_up / 1e9, "GB/s: host to GPU, " + mib(static_cast<double>(bytes)) + " from " + kind + " memory, one GPU alone"});
      figures.push_back({"", rate_down / 1e9, "GB/s: GPU to host, " + mib(static_cast<double>(bytes)) + " into " + kind + " memory, one GPU alone"});
      if (is_pinned) pinned_up = rate_up, pinned_down = rate_down;
    }
  }
  std::string together;
  if (node) {
    node->barrier();  // rank 0 measured alone
    auto start_together = [&] { node->barrier(); };
    const double alone_up = pinned_up, alone_down = pinned_down;
    pinned_up = bytes / median(call_seconds(device, repeats, [&] { up(pinned, true); }, start_together));
    pinned_down = bytes / median(call_seconds(device, repeats, [&] { down(pinned, true); }, start_together));
    together = ", every one of the node's " + std::to_string(node->world_size()) + " GPUs copying at once (one GPU alone: " + probe_number(alone_up / 1e9, 1) + " and " +
               probe_number(alone_down / 1e9, 1) + ")";
  }
  // Offload moves as many bytes each way (gradients down, parameters up): the harmonic mean.
  figures.push_back({"hardware.host_link_bandwidth_gbs", 2 / (1 / pinned_up + 1 / pinned_down) / 1e9,
                     "pinned copies of " + mib(static_cast<double>(bytes)) + ", the harmonic mean of host to GPU (" + probe_number(pinned_up / 1e9, 1) + " GB/s) and back (" +
                         probe_number(pinned_down / 1e9, 1) + ")" + together});
}

// The GPU's memory: its size as the driver reports it, and what a large device-to-device copy
// moves per second (read + write), the rate the plan's memory-bound terms run at.
void probe_device_memory(const torch::Device& device, bool quick, std::vector<ProbeFigure>& figures) {
#ifdef DSRUN_WITH_CUDA
  size_t free_bytes = 0, total_bytes = 0;
  const cudaError_t status = ::cudaMemGetInfo(&free_bytes, &total_bytes);
  if (status != cudaSuccess) fail_at(__FILE__, __LINE__, std::string("cudaMemGetInfo: ") + ::cudaGetErrorString(status));
  figures.push_back({"hardware.memory_gib", static_cast<double>(total_bytes) / double(1 << 30), "read: the GPU's memory as cudaMemGetInfo reports it"});
#endif
  const int64_t bytes = quick ? int64_t{64} << 20 : int64_t{1} << 30;
  torch::Tensor from = torch::ones({bytes / 4}, torch::TensorOptions().dtype(torch::kFloat32).device(device)), to = torch::empty_like(from);
  const double seconds = time_per_call(device, quick ? Repeats{1, 3} : Repeats{2, 10}, [&] { to.copy_(from); });
  figures.push_back({"hardware.memory_bandwidth_gbs", 2.0 * static_cast<double>(bytes) / seconds / 1e9,
                     "a copy of " + mib(static_cast<double>(bytes)) + " on the GPU, bytes read and written per second"});
}

// The delayed update's condition: the host step while the device runs the cut decoder forward and
// backward beside it, over its time alone -> hardware.host_step_beside_compute on GPUs (measured
// in training on one H100: 1.7 beside the 1B's compute, about 1 beside the 7B's). On CPU ranks,
// where the same cores do both, it is recorded only.
void probe_host_step_beside_compute(CutDecoder& model, const torch::Device& device, DType dt, int threads, bool quick, std::vector<ProbeFigure>& figures) {
  HostStepBench bench(quick ? int64_t{4} << 20 : int64_t{128} << 20, dt, threads);
  const int repeats = quick ? 3 : 7;
  const double alone = bench.median_seconds(repeats);
  std::atomic<bool> stop{false}, running{false}, errored{false};
  std::exception_ptr failed;  // read once the thread is joined
  std::thread compute([&] {
    try {
      c10::DeviceGuard guard(device);
      while (!stop.load()) {
        model.forward_backward();
        running = true;
      }
      if (device.is_cuda()) torch::cuda::synchronize(device.index());
    } catch (...) {  // rethrown below, once the thread is joined
      failed = std::current_exception();
      errored = true;
      running = true;
    }
  });
  while (!running.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // compute in flight first
  const double beside = errored.load() ? 0 : bench.median_seconds(repeats);
  stop = true;
  compute.join();
  if (failed) std::rethrow_exception(failed);
  const double ratio = beside / alone;
  const std::string how = "the fused host AdamW step on " + std::to_string(threads) + " thread(s) while the cut decoder's forward and backward run on " +
                          (device.is_cuda() ? "the GPU" : "the CPU") + ": " + probe_number(beside * 1e3, 1) + " ms against " + probe_number(alone * 1e3, 1) + " ms alone";
  if (device.is_cuda()) figures.push_back({"hardware.host_step_beside_compute", std::max(1.0, ratio), how + (ratio < 1 ? " (faster beside: written as 1)" : "")});
  else figures.push_back({"", ratio, "times: " + how});
}

// Compute (on every rank at once): the decoder cut to 2 and to 4 (CPU ranks: 6) dense layers, whose
// difference is those layers without the embedding, head or loss; attention alone on GPUs, priced apart there.
void probe_compute(const Recipe& r, const Plan& plan, const torch::Device& device, bool quick, int host_threads, std::vector<ProbeFigure>& figures) {
  const DType dt = r.precision.dtype;
  const torch::ScalarType dtype = torch_dtype(dt);
  const bool gpu = device.is_cuda();
  const Repeats repeats = quick ? Repeats{1, 2} : Repeats{1, 4};
  const int64_t cap = gpu ? (quick ? 2048 : 16384) : (quick ? 128 : 1024);
  const int64_t seq = std::min<int64_t>(r.batch.seq_len, cap);
  const int64_t samples = std::max<int64_t>(1, std::min<int64_t>(plan.layout.micro, cap / seq));
  const double peak = peak_for(r.hardware, dt);
  // The products alone in each dtype a recipe could train in (recorded: the key is the layers').
  for (DType each : gpu ? std::vector<DType>{DType::Bf16, DType::Fp16, DType::Fp32} : std::vector<DType>{DType::Fp32})
    figures.push_back(probe_matrix_products(r, device, each, samples * seq, repeats));
  if (gpu && r.model.moe.enabled() && dt != DType::Fp32) figures.push_back(probe_grouped_products(r, device, dt, samples * seq, repeats));
  if (gpu && compat::kHasScaledGroupedMm && r.model.moe.enabled() && dt == DType::Bf16 && r.hardware.peak_flops_fp8 > 0 && r.model.hidden % 16 == 0 &&
      r.model.moe.intermediate % 16 == 0)
    figures.push_back(probe_fp8_grouped_products(r, device, samples * seq, repeats));
  if (r.model.arch != ModelArch::DeepSeek) return;

  ModelSpec dense = r.model;
  dense.moe = MoeSpec{};
  const AttentionKernel kernel = gpu ? AttentionKernel::Flash : AttentionKernel::Math;
  ModelCostOptions cost_options;
  cost_options.loss_chunk_tokens = loss_chunk_tokens(r.batch, dense.vocab);
  cost_options.local_vocab = dense.vocab;
  auto cost = [&](int layers) {
    ModelSpec s = dense;
    s.layers = layers;
    return model_cost(s, seq, dt, kernel, cost_options);
  };
  // The deeper cut has 4 layers on GPUs, 6 on CPU ranks, where a small model's embedding, head and
  // loss take most of a call and two layers' difference drowned in a loaded machine's noise.
  const int deep = gpu ? 4 : 6, extra = deep - 2;
  const ModelCost two = cost(2), deeper = cost(deep);
  // Both cuts measured in turns, the median call of each kept: a burst of load elsewhere on the
  // machine cannot land on one of them alone. While the deeper cut is not measurably slower, more
  // rounds (up to 8).
  CutDecoder cut2(dense, 2, r, device, dtype, samples, seq), cut_deep(dense, deep, r, device, dtype, samples, seq);
  std::vector<double> calls2, calls_deep;
  for (int round = 0; round < 8; ++round) {
    for (double t : call_seconds(device, repeats, [&] { cut2.forward_backward(); })) calls2.push_back(t);
    for (double t : call_seconds(device, repeats, [&] { cut_deep.forward_backward(); })) calls_deep.push_back(t);
    if (round >= 2 && median(calls_deep) > 1.05 * median(calls2)) break;
  }
  const double t2 = median(calls2), t_deep = median(calls_deep);
  probe_host_step_beside_compute(cut_deep, device, dt, host_threads, quick, figures);
  const double layer_flops = (deeper.model_flops_per_sample - two.model_flops_per_sample) * samples;
  const double attention_flops = (deeper.attention_flops_per_sample - two.attention_flops_per_sample) * samples;
  const std::string shape = std::to_string(samples) + " x " + std::to_string(seq) + " tokens";
  double attention_seconds = 0;  // the extra layers' attention kernels, forward and backward
  if (gpu && dt != DType::Fp32) {
    const auto o = torch::TensorOptions().dtype(dtype).device(device);
    const int64_t d = dense.head_dim();
    torch::Tensor q = torch::randn({samples, dense.heads, seq, d}, o).requires_grad_(), k = torch::randn({samples, dense.heads, seq, d}, o).requires_grad_(),
                  v = torch::randn({samples, dense.heads, seq, d}, o).requires_grad_();
    torch::Tensor grad = torch::randn({samples, dense.heads, seq, d}, o);
    attention_seconds = extra * time_per_call(device, repeats, [&] { compat::causal_attention(q, k, v).backward(grad); });
    // The causal kernels compute half of the 12·h·s FLOPs per token the plan counts.
    figures.push_back({"hardware.attention_efficiency", 0.5 * attention_flops / attention_seconds / peak,
                       "causal flash attention forward and backward at " + shape + ", " + std::to_string(dense.heads) + " heads of " + std::to_string(d) +
                           ", half of the 12·h·s FLOPs per token counted (the causal half)"});
  }
  const double dense_seconds = t_deep - t2 - attention_seconds;
  if (dense_seconds <= 0)
    throw Error("probe: the decoder with " + std::to_string(deep) + " layers took no longer than with 2 (" + probe_number(t_deep, 4) + " s vs " + probe_number(t2, 4) +
                " s) over 8 rounds: the machine is too busy to tell");
  const double flops = attention_seconds > 0 ? layer_flops - attention_flops : layer_flops;
  figures.push_back({"hardware.matmul_efficiency", flops / dense_seconds / peak,
                     "the recipe's decoder cut to " + std::to_string(deep) + " and to 2 dense layers, forward and backward in " + std::string(to_string(dt)) + " at " + shape +
                         ": the " + std::to_string(extra) + " layers' difference (" + probe_number(t_deep - t2, 4) + " s)" + (attention_seconds > 0 ? ", less their attention (priced apart)" : ", attention included") +
                         ", " + probe_number(flops / dense_seconds / 1e12, 3) + " TFLOP/s"});
  if (gpu && compat::kHasScaledMm && dt == DType::Bf16 && r.hardware.peak_flops_fp8 > 0) {
    const auto [fp8_alone, bf16_alone] = probe_fp8_products(r, device, samples * seq, repeats);
    const double in_training = flops / dense_seconds / peak;
    figures.push_back({"hardware.fp8_matmul_efficiency", std::min(1.0, fp8_alone * in_training / bf16_alone),
                       "the blocks' four products in FP8 (tensorwise) alone at " + shape + ": " + probe_number(fp8_alone, 3) + " of the FP8 peak, as the bf16 layers reach " +
                           probe_number(in_training / bf16_alone, 3) + " of their products alone (" + probe_number(bf16_alone, 3) + ")"});
  }
}

}  // namespace

int probe_rank_main(const std::string& config_path, const std::string& out_path, bool quick) {
  const int rank = env_int("RANK", 0), world = env_int("WORLD_SIZE", 1), local_rank = env_int("LOCAL_RANK", rank);
  try {
    HostFacts host = read_host_facts();
    LoadOptions options;
    options.host = host;
    LoadedRecipe loaded = load_recipe_file(config_path, options);
    require_valid(loaded);
    const Recipe& r = loaded.recipe;
    const Plan plan = make_plan(r, host);
    const bool gpu = r.hardware.device == Device::Cuda;
    torch::Device device(torch::kCPU);
    if (gpu) {
      if (!torch::cuda::is_available()) throw Error("probe: hardware.device is \"cuda\" but this libtorch sees no GPU", ErrorContext{config_path, 0, 0, "hardware.device", rank, "probe with a recipe for this machine's devices"});
#ifdef DSRUN_WITH_CUDA
      c10::cuda::set_device(static_cast<c10::DeviceIndex>(local_rank));  // the fused kernels and cuBLAS use the current device
#endif
      device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
    } else {
      // The cores a CPU rank gets when the node's ranks train together.
      torch::set_num_threads(std::max(1, host.cpu_cores / std::max(1, world)));
    }
    std::vector<ProbeFigure> figures;
    std::unique_ptr<Rendezvous> rendezvous;
    std::unique_ptr<Communicator> node;  // the node's ranks (the probe runs on one node)
    if (world > 1) {
      RendezvousOptions rv;
      rv.use_nccl = gpu;
      rv.cuda_device = local_rank;
      rv.master_addr = env_string("MASTER_ADDR", "127.0.0.1");
      rv.master_port = env_int("MASTER_PORT", 29500);
      rv.rank = rank;
      rv.world_size = world;
      rv.timeout_s = 300;
      rendezvous = open_rendezvous(rv);
      node = rendezvous->group("world", rank, world);
      probe_collectives(r, *rendezvous, *node, device, gpu ? torch_dtype(r.precision.dtype) : torch::kFloat32, quick, figures);
      node->barrier();
    }
    // Every rank computes at once, as they train: the cores' caches and memory and the launch
    // threads are shared then (the copies start together by barrier). Rank 0's figures are kept.
    // The host step's threads as an offloaded rank runs it (the trainer's rule), or a CPU rank's cores.
    const int host_threads = gpu ? host_step_threads(rank_host_cores(usable_cpus(), pci_local_cpus(cuda_pci_bus_id(device)), local_rank, world)).threads
                                 : std::max(1, host.cpu_cores / std::max(1, world));
    probe_compute(r, plan, device, quick, host_threads, figures);
    if (gpu) {
      probe_copies(device, quick, node.get(), figures);
      probe_device_memory(device, quick, figures);
    }
    if (rank != 0) return 0;
    nlohmann::json out = nlohmann::json::array();
    for (const auto& f : figures) out.push_back({{"key", f.key}, {"value", f.value}, {"how", f.how}, {"ranks", f.ranks}});
    write_file_atomic(out_path, nlohmann::json{{"figures", out}}.dump(1) + "\n");
    return 0;
  } catch (const Error& e) {
    std::cerr << "dsrun-rank --probe: rank " << rank << ": " << e.describe() << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "dsrun-rank --probe: rank " << rank << ": " << e.what() << std::endl;
  }
  return 1;
}

}  // namespace dsrun
