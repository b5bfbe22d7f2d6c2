#include "engine/parallel/expert_parallel.hpp"

#include "engine/common/autograd_pointer.hpp"
#include "engine/common/error.hpp"

#include <numeric>

namespace dsrun {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// Rows to the shards and back, started: `out` is usable once the returned collective is waited for.
PendingCollective start_exchange(const Tensor& rows, Communicator& group, const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows,
                                 Tensor& out) {
  std::vector<int64_t> shape = rows.sizes().vec();
  shape[0] = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
  out = torch::empty(shape, rows.options());
  return group.all_to_all_async(rows.contiguous(), out, send_rows, recv_rows);
}

// The exchange under autograd; the gradient makes the opposite trip (waited for at once). With
// `in_flight` (a PendingCollective's address) forward only starts it and leaves the wait to the
// caller, who queues other work first; with 0 it waits too.
struct ExchangeRows : torch::autograd::Function<ExchangeRows> {
  static Tensor forward(AutogradContext* ctx, const Tensor& rows, int64_t group, std::vector<int64_t> send_rows, std::vector<int64_t> recv_rows,
                        int64_t in_flight) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["send"] = send_rows;
    ctx->saved_data["recv"] = recv_rows;
    Tensor out;
    PendingCollective started = start_exchange(rows, *pointer_from_argument<Communicator>(group), send_rows, recv_rows, out);
    if (in_flight != 0) *pointer_from_argument<PendingCollective>(in_flight) = std::move(started);
    else started.wait();
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Communicator& group = *saved_pointer<Communicator>(ctx, "group");
    const std::vector<int64_t> send = ctx->saved_data["send"].toIntVector(), recv = ctx->saved_data["recv"].toIntVector();
    Tensor out;
    start_exchange(grads[0], group, recv, send, out).wait();
    return {out, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// Rows put in another order by a permutation; the gradient goes back by the inverse permutation,
// a gather like forward. (index_select's own backward scatter-adds, needless for a permutation:
// 0.84 ms a call on the MoE recipe's [49k, 2048] rows on an H200.)
struct PermuteRows : torch::autograd::Function<PermuteRows> {
  static Tensor forward(AutogradContext* ctx, const Tensor& rows, const Tensor& permutation, const Tensor& inverse) {
    ctx->save_for_backward({inverse});
    return rows.index_select(0, permutation);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {grads[0].index_select(0, ctx->get_saved_variables()[0]), Tensor(), Tensor()};
  }
};

// Where each arrived row sits once regrouped expert by expert (source by source within), worked
// out where the counts are, so that the host waits for nothing more. `from` [S·P]: source q's rows
// for local expert j at q·P + j, the order they arrive in; `total` their sum (the host knows it).
Tensor expert_major_places(const Tensor& from, int shards, int64_t per_shard, int64_t total) {
  const auto longs = from.options().dtype(torch::kInt64);
  const Tensor arrival_start = from.cumsum(0) - from;  // where block (q, j) begins as arrived
  const Tensor by_expert = from.view({shards, per_shard}).t().reshape({-1});  // blocks (j, q)
  const Tensor expert_start = (by_expert.cumsum(0) - by_expert).view({per_shard, shards}).t().reshape({-1});  // back to (q, j)
  // Each arrived row's block (q, j). (The optional names the overload that takes the output size,
  // so the device is not asked for it; a plain integer picks the one repeating each count.)
  const Tensor block = torch::repeat_interleave(from, c10::optional<int64_t>(total));
  return expert_start.index_select(0, block) + (torch::arange(total, longs) - arrival_start.index_select(0, block));
}

}  // namespace

Tensor ExpertParallel::run(const Tensor& rows, const Tensor& counts_on_device, const ExpertsFn& local, const std::function<void()>& meanwhile) {
  const int shards = size();
  const int64_t experts = counts_on_device.numel(), per_shard = experts / shards;
  DSRUN_ASSERT(experts % shards == 0, "routed experts divide by the expert-parallel ranks (checked by the recipe)");
  if (!beside_dispatch_) meanwhile();
  // 1. Counts, exchanged where they are; the host reads what it sends and receives per rank (the
  //    exchange's sizes) in one copy, the layer's one wait. Slice q of `from` holds source q's counts
  //    for this shard's experts.
  const Tensor counts = counts_on_device.to(torch::kInt64).contiguous();
  Tensor from = torch::empty_like(counts);
  group_.all_to_all(counts, from);
  const Tensor per_rank = torch::stack({counts.view({shards, per_shard}).sum(1), from.view({shards, per_shard}).sum(1)}).to(torch::kCPU);
  const int64_t* sizes = per_rank.data_ptr<int64_t>();
  const std::vector<int64_t> send_rows(sizes, sizes + shards), recv_rows(sizes + shards, sizes + 2 * shards);
  const int64_t arrived_rows = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
  // 3's regrouping, queued before the rows leave: arrival[i] is where arrived row i goes, order its inverse.
  const Tensor arrival = expert_major_places(from, shards, per_shard, arrived_rows);
  const Tensor order = torch::empty_like(arrival).scatter_(0, arrival, torch::arange(arrived_rows, arrival.options()));
  const Tensor local_counts = from.view({shards, per_shard}).sum(0);
  // 2. Dispatch, and the layer's own work while the rows travel.
  const int64_t address = pointer_argument(&group_);
  PendingCollective in_flight;
  Tensor arrived = ExchangeRows::apply(rows, address, send_rows, recv_rows, pointer_argument(&in_flight));
  if (beside_dispatch_) meanwhile();
  in_flight.wait();
  // 3. Expert by expert, run, and back to the order they arrived in.
  Tensor outputs = local(PermuteRows::apply(arrived, order, arrival), local_counts);
  Tensor back = PermuteRows::apply(outputs, arrival, order);
  // 4. Combine.
  return ExchangeRows::apply(back, address, recv_rows, send_rows, int64_t{0});
}

}  // namespace dsrun
