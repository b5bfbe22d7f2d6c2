#include "engine/parallel/sequence_collectives.hpp"

#include "engine/common/autograd_pointer.hpp"
#include "engine/common/error.hpp"

namespace dsrun {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

Tensor gather_along_sequence(const Tensor& part, Communicator& group) {
  const int64_t t = group.world_size();
  Tensor full = torch::empty({t * part.numel()}, part.options());
  group.all_gather(part.contiguous().view({-1}), full);
  std::vector<int64_t> shape = part.sizes().vec();  // [t, b, n, ...] -> [b, t·n, ...]
  shape.insert(shape.begin(), t);
  Tensor stacked = full.view(shape).transpose(0, 1);
  std::vector<int64_t> whole = part.sizes().vec();
  whole[1] *= t;
  return stacked.reshape(whole);
}

Tensor scatter_along_sequence(const Tensor& whole, Communicator& group) {
  const int64_t t = group.world_size();
  DSRUN_ASSERT(whole.size(1) % t == 0, "the sequence divides by the group's ranks (checked by the recipe)");
  Tensor stacked = torch::stack(whole.chunk(t, 1)).contiguous();  // [t, b, s/t, ...]
  std::vector<int64_t> shape = whole.sizes().vec();
  shape[1] /= t;
  Tensor part = torch::empty(shape, whole.options());
  Tensor flat_part = part.view({-1});
  group.reduce_scatter_sum(stacked.view({-1}), flat_part);
  return part;
}

struct GatherSequence : torch::autograd::Function<GatherSequence> {
  static Tensor forward(AutogradContext* ctx, const Tensor& part, int64_t group) {
    ctx->saved_data["group"] = group;
    return gather_along_sequence(part, *pointer_from_argument<Communicator>(group));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {scatter_along_sequence(grads[0], *saved_pointer<Communicator>(ctx, "group")), Tensor()};
  }
};

struct ReduceScatterSequence : torch::autograd::Function<ReduceScatterSequence> {
  static Tensor forward(AutogradContext* ctx, const Tensor& whole, int64_t group) {
    ctx->saved_data["group"] = group;
    return scatter_along_sequence(whole, *pointer_from_argument<Communicator>(group));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {gather_along_sequence(grads[0], *saved_pointer<Communicator>(ctx, "group")), Tensor()};
  }
};

struct SumOverSequence : torch::autograd::Function<SumOverSequence> {
  static Tensor forward(AutogradContext* ctx, const Tensor& part, int64_t group) {
    ctx->saved_data["group"] = group;
    Tensor sum = part.contiguous().clone();
    pointer_from_argument<Communicator>(group)->all_reduce_sum(sum);
    return sum;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Tensor sum = grads[0].contiguous().clone();
    saved_pointer<Communicator>(ctx, "group")->all_reduce_sum(sum);
    return {sum, Tensor()};
  }
};

}  // namespace

Tensor all_reduce_sequence_sum(const Tensor& part, Communicator& group) { return SumOverSequence::apply(part, pointer_argument(&group)); }

Tensor all_gather_sequence(const Tensor& part, Communicator& group) { return GatherSequence::apply(part, pointer_argument(&group)); }

Tensor reduce_scatter_sequence(const Tensor& whole, Communicator& group) { return ReduceScatterSequence::apply(whole, pointer_argument(&group)); }

}  // namespace dsrun
