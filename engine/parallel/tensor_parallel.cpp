#include "engine/parallel/tensor_parallel.hpp"

#include "engine/common/autograd_pointer.hpp"
#include "engine/common/error.hpp"
#include "engine/parallel/sequence_collectives.hpp"

namespace dsrun {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// The group travels through autograd as an address (engine/common/autograd_pointer.hpp).
Communicator& group_at(int64_t address) { return *pointer_from_argument<Communicator>(address); }
Communicator& group_at(AutogradContext* ctx) { return *saved_pointer<Communicator>(ctx, "group"); }

Tensor summed(const Tensor& t, Communicator& group) {
  Tensor out = t.contiguous().clone();
  group.all_reduce_sum(out);
  return out;
}

struct EnterRegion : torch::autograd::Function<EnterRegion> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) { return {summed(grads[0], group_at(ctx)), Tensor()}; }
};

struct LeaveRegion : torch::autograd::Function<LeaveRegion> {
  static Tensor forward(AutogradContext*, const Tensor& partial, int64_t group) { return summed(partial, group_at(group)); }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], Tensor()}; }
};

// Megatron's vocabulary-parallel cross-entropy: log Σ_v exp(z_v) - z_target, with the sum and the
// target's logit assembled over ranks; backward is softmax - one_hot on the local slice.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static Tensor forward(AutogradContext* ctx, const Tensor& logits, const Tensor& targets, int64_t group_address) {
    Communicator& group = group_at(group_address);
    const int64_t n = logits.size(0), local_vocab = logits.size(1), first = group.rank() * local_vocab;
    // The global maximum per token, for a stable exponent (gathered: the maximum has no gradient).
    Tensor local_max = std::get<0>(logits.max(1)).contiguous();
    Tensor maxima = torch::empty({group.world_size() * n}, local_max.options());
    group.all_gather(local_max, maxima);
    Tensor shifted = logits - std::get<0>(maxima.view({group.world_size(), n}).max(0)).unsqueeze(1);
    Tensor exp = shifted.exp();
    Tensor sum_exp = summed(exp.sum(1), group);
    Tensor local_target = targets - first;
    Tensor here = (local_target >= 0).logical_and(local_target < local_vocab);
    Tensor index = local_target.clamp(0, local_vocab - 1);
    Tensor target_logit = summed(shifted.gather(1, index.unsqueeze(1)).squeeze(1) * here, group);
    Tensor losses = sum_exp.log() - target_logit;
    ctx->save_for_backward({exp.div_(sum_exp.unsqueeze(1)), index, here});
    return losses.mean();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    Tensor grad = saved[0].clone();  // softmax on the local slice
    grad.scatter_add_(1, saved[1].unsqueeze(1), -saved[2].to(grad.scalar_type()).unsqueeze(1));
    return {grad.mul_(grads[0] / static_cast<double>(grad.size(0))), Tensor(), Tensor()};
  }
};

}  // namespace

Tensor TensorParallel::enter(const Tensor& x) {
  if (size() == 1) return x;
  if (sequence_) return all_gather_sequence(x, group_);  // [b, s/t, h] -> [b, s, h]
  return EnterRegion::apply(x, pointer_argument(&group_));
}

Tensor TensorParallel::leave(const Tensor& partial) {
  if (size() == 1) return partial;
  if (sequence_) return reduce_scatter_sequence(partial, group_);
  return LeaveRegion::apply(partial, pointer_argument(&group_));
}

void TensorParallel::sum_gradient_over_group(Tensor& parameter, torch::ScalarType reduce_dtype) {
  Communicator* group = &group_;
  parameter.register_hook([group, reduce_dtype](const Tensor& grad) {
    if (grad.scalar_type() == reduce_dtype) return summed(grad, *group);
    Tensor wide = grad.to(reduce_dtype).contiguous();
    group->all_reduce_sum(wide);
    return wide.to(grad.scalar_type());
  });
}

Tensor TensorParallel::embedding(const Tensor& local_weight, const Tensor& ids) {
  if (size() == 1) return torch::embedding(local_weight, ids);
  const int64_t rows = local_weight.size(0), first = rank() * rows;
  Tensor local = ids - first;
  Tensor outside = (local < 0).logical_or(local >= rows);
  Tensor found = torch::embedding(local_weight, local.masked_fill(outside, 0));
  return leave(found.masked_fill(outside.unsqueeze(-1), 0.0));
}

Tensor TensorParallel::cross_entropy(const Tensor& local_logits, const Tensor& targets) {
  if (size() == 1) return torch::nn::functional::cross_entropy(local_logits, targets);
  return VocabParallelCrossEntropy::apply(local_logits, targets, pointer_argument(&group_));
}

Tensor TensorParallel::projected_loss(const Tensor& hidden, const Tensor& local_weight, const Tensor& targets, int64_t chunk_tokens, bool gradients_in_forward) {
  LinearCrossEntropyOptions o;
  o.chunk_tokens = chunk_tokens;
  o.gradient_in_forward = gradients_in_forward;
  o.group = size() > 1 ? &vocabulary_ : nullptr;
  return linear_cross_entropy(hidden, local_weight, targets, o);
}

namespace {
// The row counts of a Rows split's parts in a tensor of `rows` rows (a full tensor or a slice).
std::vector<int64_t> row_parts(const TensorSplit& split, int64_t rows) {
  if (!split.segments.empty()) return split.segments;
  return std::vector<int64_t>(static_cast<size_t>(split.equal_parts), rows / split.equal_parts);
}
}  // namespace

std::string tensor_split_problem(const std::vector<int64_t>& shape, const TensorSplit& split, int size) {
  if (split.kind == TensorSplit::Replicated || size == 1) return "";
  if (split.kind == TensorSplit::Columns) return shape.at(1) % size == 0 ? "" : std::to_string(shape[1]) + " columns";
  if (shape.at(0) % split.equal_parts != 0) return std::to_string(shape[0]) + " rows";
  for (int64_t p : row_parts(split, shape.at(0)))
    if (p % size != 0) return std::to_string(p) + " rows";
  return "";
}

std::vector<int64_t> tensor_slice_shape(const std::vector<int64_t>& full_shape, const TensorSplit& split, int size) {
  std::vector<int64_t> shape = full_shape;
  if (split.kind == TensorSplit::Rows) shape[0] /= size;
  if (split.kind == TensorSplit::Columns) shape[1] /= size;
  return shape;
}

TensorRegion tensor_region(const std::vector<int64_t>& full_shape, const TensorSplit& split, int rank, int size) {
  TensorRegion region;
  if (split.kind == TensorSplit::Replicated || size == 1) return region;
  if (split.kind == TensorSplit::Columns) {
    const int64_t cols = full_shape.at(1) / size;
    region.dim = 1;
    region.ranges = {{rank * cols, cols}};
    return region;
  }
  region.dim = 0;  // as tensor_slice: this rank's rows of every part
  int64_t begin = 0;
  for (int64_t p : row_parts(split, full_shape.at(0))) {
    region.ranges.push_back({begin + rank * (p / size), p / size});
    begin += p;
  }
  return region;
}

std::vector<int64_t> tensor_whole_shape(const std::vector<int64_t>& slice_shape, const TensorSplit& split, int size) {
  std::vector<int64_t> shape = slice_shape;
  if (split.kind == TensorSplit::Rows) shape.at(0) *= size;
  if (split.kind == TensorSplit::Columns) shape.at(1) *= size;
  return shape;
}

namespace {
// This rank's slice as views of `full`: the columns, or each row part's rows, in order (whole
// heads of q, then of k, then of v).
std::vector<Tensor> slice_views(const Tensor& full, const TensorSplit& split, int rank, int size) {
  DSRUN_ASSERT(tensor_split_problem(full.sizes().vec(), split, size).empty(), "tensor splits validated by the recipe");
  if (split.kind == TensorSplit::Replicated || size == 1) return {full};
  if (split.kind == TensorSplit::Columns) {
    const int64_t cols = full.size(1) / size;
    return {full.narrow(1, rank * cols, cols)};
  }
  std::vector<Tensor> slices;
  int64_t begin = 0;
  for (int64_t p : row_parts(split, full.size(0))) {
    slices.push_back(full.narrow(0, begin + rank * (p / size), p / size));
    begin += p;
  }
  return slices;
}
}  // namespace

Tensor tensor_slice(const Tensor& full, const TensorSplit& split, int rank, int size) {
  std::vector<Tensor> views = slice_views(full, split, rank, size);
  return views.size() == 1 ? views[0].clone(at::MemoryFormat::Contiguous) : torch::cat(views, 0);
}

void copy_tensor_slice(Tensor& out, const Tensor& full, const TensorSplit& split, int rank, int size) {
  int64_t row = 0;  // the views stack along rows (one view: all of `out`)
  for (const Tensor& v : slice_views(full, split, rank, size)) {
    out.narrow(0, row, v.size(0)).copy_(v);
    row += v.size(0);
  }
}

Tensor tensor_join(const std::vector<Tensor>& slices, const TensorSplit& split) {
  const int size = static_cast<int>(slices.size());
  if (split.kind == TensorSplit::Replicated || size == 1) return slices.at(0).clone();
  if (split.kind == TensorSplit::Columns) return torch::cat(slices, 1);
  // Rows: part by part, every rank's slice of it in rank order.
  std::vector<int64_t> parts = row_parts(split, slices[0].size(0) * size);
  std::vector<Tensor> pieces;
  int64_t begin = 0;  // within each rank's slice
  for (int64_t p : parts) {
    for (const Tensor& s : slices) pieces.push_back(s.narrow(0, begin, p / size));
    begin += p / size;
  }
  return torch::cat(pieces, 0);
}

}  // namespace dsrun
