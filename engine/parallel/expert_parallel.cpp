#include "engine/parallel/expert_parallel.hpp"

#include "engine/common/autograd_pointer.hpp"
#include "engine/common/error.hpp"

#include <numeric>

namespace dsrun {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

Tensor exchange(const Tensor& rows, Communicator& group, const std::vector<int64_t>& send_rows, const std::vector<int64_t>& recv_rows) {
  std::vector<int64_t> shape = rows.sizes().vec();
  shape[0] = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
  Tensor out = torch::empty(shape, rows.options());
  group.all_to_all(rows.contiguous(), out, send_rows, recv_rows);
  return out;
}

// Rows to the shards and back; the gradient makes the opposite trip.
struct ExchangeRows : torch::autograd::Function<ExchangeRows> {
  static Tensor forward(AutogradContext* ctx, const Tensor& rows, int64_t group, std::vector<int64_t> send_rows, std::vector<int64_t> recv_rows) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["send"] = send_rows;
    ctx->saved_data["recv"] = recv_rows;
    return exchange(rows, *pointer_from_argument<Communicator>(group), send_rows, recv_rows);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Communicator& group = *saved_pointer<Communicator>(ctx, "group");
    const std::vector<int64_t> send = ctx->saved_data["send"].toIntVector(), recv = ctx->saved_data["recv"].toIntVector();
    return {exchange(grads[0], group, recv, send), Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

Tensor ExpertParallel::run(const Tensor& rows, const Tensor& counts_on_device, const ExpertsFn& local) {
  const Tensor counts_host = counts_on_device.to(torch::kCPU, torch::kInt64);
  const std::vector<int64_t> counts(counts_host.data_ptr<int64_t>(), counts_host.data_ptr<int64_t>() + counts_host.numel());
  const int shards = size();
  const int64_t experts = static_cast<int64_t>(counts.size()), per_shard = experts / shards;
  DSRUN_ASSERT(experts % shards == 0, "routed experts divide by the expert-parallel ranks (checked by the recipe)");
  // 1. Counts: row q of `received` holds source q's counts for this shard's experts.
  Tensor received = torch::empty({experts}, torch::kInt64);
  group_.all_to_all(counts_host, received);
  std::vector<int64_t> from(received.data_ptr<int64_t>(), received.data_ptr<int64_t>() + experts);  // [source][local expert]
  std::vector<int64_t> send_rows(shards, 0), recv_rows(shards, 0), local_counts(per_shard, 0);
  for (int q = 0; q < shards; ++q)
    for (int64_t j = 0; j < per_shard; ++j) {
      send_rows[q] += counts[q * per_shard + j];
      recv_rows[q] += from[q * per_shard + j];
      local_counts[j] += from[q * per_shard + j];
    }
  // 2. Dispatch.
  const int64_t address = pointer_argument(&group_);
  Tensor arrived = ExchangeRows::apply(rows, address, send_rows, recv_rows);  // source by source, expert by expert within
  // 3. Expert by expert (source by source within), run, and back to the order they arrived in.
  std::vector<int64_t> order;  // order[i]: the arrived row that is row i of the expert-major layout
  order.reserve(static_cast<size_t>(arrived.size(0)));
  std::vector<int64_t> next(shards, 0);  // per source: where its rows for the next local expert begin
  for (int q = 1; q < shards; ++q) next[q] = next[q - 1] + recv_rows[q - 1];
  for (int64_t j = 0; j < per_shard; ++j)
    for (int q = 0; q < shards; ++q)
      for (int64_t r = 0; r < from[q * per_shard + j]; ++r) order.push_back(next[q]++);
  std::vector<int64_t> arrival(order.size());  // its inverse: where arrived row i sits expert-major
  for (size_t i = 0; i < order.size(); ++i) arrival[static_cast<size_t>(order[i])] = static_cast<int64_t>(i);
  auto on_device = [&](const std::vector<int64_t>& v) { return torch::tensor(v, torch::kInt64).to(rows.device()); };
  Tensor outputs = local(arrived.index_select(0, on_device(order)), on_device(local_counts));
  Tensor back = outputs.index_select(0, on_device(arrival));
  // 4. Combine.
  return ExchangeRows::apply(back, address, recv_rows, send_rows);
}

}  // namespace dsrun
