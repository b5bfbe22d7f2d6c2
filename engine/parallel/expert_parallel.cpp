#include "engine/parallel/expert_parallel.hpp"

#include "engine/common/autograd_pointer.hpp"
#include "engine/common/error.hpp"
#include "engine/model/fused_ops.hpp"

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

// Where each block begins when blocks of these sizes lie one after another (an exclusive running sum).
Tensor block_starts(const Tensor& sizes) { return sizes.cumsum(0) - sizes; }

// Rows read from `source` by index, each source row by up to `width` readers; `place` [N · width]
// lists source row n's readers (-1: none), so the gradient sums back by gathering (fused::
// combine_rows with weights of 1): deterministic, no atomic adds (index_select's backward has them).
struct GatherRows : torch::autograd::Function<GatherRows> {
  static Tensor forward(AutogradContext* ctx, const Tensor& source, const Tensor& index, const Tensor& place, int64_t width) {
    ctx->save_for_backward({place});
    ctx->saved_data["width"] = width;
    return source.index_select(0, index);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {fused::combine_rows(grads[0], ctx->get_saved_variables()[0], Tensor(), ctx->saved_data["width"].toInt()), Tensor(), Tensor(), Tensor()};
  }
};

// `place` for GatherRows from its index: each source row's readers in order, [sources · width].
// No row may have more than `width` readers (a token's top-k experts are distinct, so at most
// min(k, experts here) of its pairs read it); more would be written into the next row's places.
Tensor readers_of(const Tensor& index, int64_t sources, int64_t width) {
  const auto longs = index.options().dtype(torch::kInt64);
  const auto [sorted, order] = index.sort(/*stable=*/true, 0, false);
  const Tensor readers = torch::zeros({sources}, longs).scatter_add_(0, index, torch::ones_like(index));
  const Tensor rank = torch::arange(index.numel(), longs) - block_starts(readers).index_select(0, sorted);  // among its source row's readers
  return torch::full({sources * width}, -1, longs).scatter_(0, sorted * width + rank, order);
}

// Where each arrived row sits once regrouped expert by expert (source by source within), worked
// out where the counts are, so that the host waits for nothing more. `from` [S·P]: source q's rows
// for local expert j at q·P + j, the order they arrive in; `total` their sum (the host knows it).
Tensor expert_major_places(const Tensor& from, int shards, int64_t per_shard, int64_t total) {
  const auto longs = from.options().dtype(torch::kInt64);
  const Tensor arrival_start = block_starts(from);  // where block (q, j) begins as arrived
  const Tensor by_expert = from.view({shards, per_shard}).t().reshape({-1});  // blocks (j, q)
  const Tensor expert_start = block_starts(by_expert).view({per_shard, shards}).t().reshape({-1});  // back to (q, j)
  // Each arrived row's block (q, j). (The optional names the overload that takes the output size,
  // so the device is not asked for it; a plain integer picks the one repeating each count.)
  const Tensor block = torch::repeat_interleave(from, c10::optional<int64_t>(total));
  return expert_start.index_select(0, block) + (torch::arange(total, longs) - arrival_start.index_select(0, block));
}

}  // namespace

Tensor ExpertParallel::run(const RoutedPairs& pairs, const Tensor& counts_on_device, const ExpertsFn& local, const std::function<void()>& meanwhile) {
  const int shards = size();
  const int64_t experts = counts_on_device.numel(), per_shard = experts / shards;
  DSRUN_ASSERT(experts % shards == 0, "routed experts divide by the expert-parallel ranks (checked by the recipe)");
  const bool once = exchange_.tokens_once_per_rank;
  if (!exchange_.beside_dispatch) meanwhile();
  const auto longs = counts_on_device.options().dtype(torch::kInt64);
  const Tensor counts = counts_on_device.to(torch::kInt64);
  // Tokens once per rank: which (shard, token) pairs exist (reads[s·T + t]), each one's row among
  // the rows sent (shard by shard, tokens in order), and how many go to each shard.
  Tensor reads, slot, distinct, pair_shard, pair_key;
  const int64_t T = pairs.tokens.size(0), P = pairs.token.numel();
  if (once) {
    pair_shard = torch::repeat_interleave(counts, c10::optional<int64_t>(P)).div(per_shard, "floor");  // pairs come grouped by expert
    pair_key = pair_shard * T + pairs.token;  // each pair's (shard, token)
    reads = torch::zeros({shards * T}, longs).index_fill_(0, pair_key, 1);
    slot = reads.cumsum(0) - 1;
    distinct = reads.view({shards, T}).sum(1);
  }
  // 1. Counts, exchanged where they are; the host reads what it sends and receives per rank (the
  //    exchange's sizes) in one copy, the layer's one wait. Row q of `got` holds source q's counts
  //    for this shard's experts (and, tokens once per rank, how many tokens it sends).
  Tensor sent = counts.view({shards, per_shard});
  if (once) sent = torch::cat({sent, distinct.view({shards, 1})}, 1);
  sent = sent.contiguous();
  Tensor got = torch::empty_like(sent);
  group_.all_to_all(sent, got);
  const Tensor from = got.narrow(1, 0, per_shard).contiguous().view({-1});  // source q's pairs for local expert j at q·per_shard + j
  const Tensor pairs_from = from.view({shards, per_shard}).sum(1);            // pairs from each source
  std::vector<Tensor> exchanged{sent.narrow(1, 0, per_shard).sum(1), pairs_from};
  if (once) exchanged.insert(exchanged.end(), {distinct, got.select(1, per_shard)});
  const Tensor per_rank = torch::stack(exchanged).to(torch::kCPU).contiguous();
  const int64_t* sizes = per_rank.data_ptr<int64_t>();
  auto row = [&](int i) { return std::vector<int64_t>(sizes + i * shards, sizes + (i + 1) * shards); };
  const std::vector<int64_t> send_rows = row(0), recv_rows = row(1);
  const std::vector<int64_t> send_tokens = once ? row(2) : std::vector<int64_t>(), recv_tokens = once ? row(3) : std::vector<int64_t>();
  const int64_t arrived_rows = std::accumulate(recv_rows.begin(), recv_rows.end(), int64_t{0});
  // 3's regrouping, queued before the rows leave: arrival[i] is where arrived row i goes, order its inverse.
  const Tensor arrival = expert_major_places(from, shards, per_shard, arrived_rows);
  const Tensor order = torch::empty_like(arrival).scatter_(0, arrival, torch::arange(arrived_rows, arrival.options()));
  const Tensor local_counts = from.view({shards, per_shard}).sum(0);
  const std::vector<int64_t>& dispatched = once ? send_tokens : send_rows;
  rows_sent_ += std::accumulate(dispatched.begin(), dispatched.end(), int64_t{0}) - dispatched[rank()];
  // 2. Dispatch, and the layer's own work while the rows travel.
  const int64_t address = pointer_argument(&group_);
  PendingCollective in_flight, pair_reads_in_flight;
  Tensor arrived, arrived_tokens, pair_reads;
  if (once) {
    const int64_t sent_tokens = std::accumulate(send_tokens.begin(), send_tokens.end(), int64_t{0});
    // The token of each row sent ((shard, token) pairs that do not exist go to a spare last slot),
    // and each token's rows, one per shard, for the gradient's sum.
    const Tensor exists = reads.to(torch::kBool);
    Tensor which = torch::empty({sent_tokens + 1}, longs);
    which.scatter_(0, torch::where(exists, slot, torch::full_like(slot, sent_tokens)), torch::arange(shards * T, longs).remainder(T));
    const Tensor token_rows = torch::where(exists, slot, torch::full_like(slot, -1)).view({shards, T}).t().contiguous().view({-1});
    const Tensor outgoing = GatherRows::apply(pairs.tokens, which.narrow(0, 0, sent_tokens), token_rows, int64_t{shards});
    // Each pair's token as a row of what its shard receives from this rank.
    const Tensor pair_slot = slot.index_select(0, pair_key) - block_starts(distinct).index_select(0, pair_shard);
    pair_reads = torch::empty({arrived_rows}, longs);
    pair_reads_in_flight = group_.all_to_all_async(pair_slot, pair_reads, send_rows, recv_rows);
    arrived_tokens = ExchangeRows::apply(outgoing, address, send_tokens, recv_tokens, pointer_argument(&in_flight));
  } else {
    arrived = ExchangeRows::apply(pairs.rows(), address, send_rows, recv_rows, pointer_argument(&in_flight));
  }
  if (exchange_.beside_dispatch) meanwhile();
  in_flight.wait();
  if (once) {
    pair_reads_in_flight.wait();
    // Arrived pair i reads arrived token (source q's first) + pair_reads[i]; a token has at most
    // min(choices, per_shard) pairs here.
    const int64_t arrived_token_count = std::accumulate(recv_tokens.begin(), recv_tokens.end(), int64_t{0});
    const Tensor source = torch::repeat_interleave(pairs_from, c10::optional<int64_t>(arrived_rows));
    const Tensor read = block_starts(got.select(1, per_shard)).index_select(0, source) + pair_reads;
    const int64_t width = std::min<int64_t>(pairs.choices, per_shard);
    arrived = GatherRows::apply(arrived_tokens, read, readers_of(read, arrived_token_count, width), width);
  }
  // 3. Expert by expert, run, and back to the order they arrived in.
  Tensor outputs = local(PermuteRows::apply(arrived, order, arrival), local_counts);
  Tensor back = PermuteRows::apply(outputs, arrival, order);
  // 4. Combine.
  return ExchangeRows::apply(back, address, recv_rows, send_rows, int64_t{0});
}

}  // namespace dsrun
