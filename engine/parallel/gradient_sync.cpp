#include "engine/parallel/gradient_sync.hpp"

#include "engine/common/error.hpp"

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace dsrun {

using torch::Tensor;

namespace {

// Runs after a parameter's AccumulateGrad node: its gradient for this backward is complete.
struct GradientReadyHook : torch::autograd::FunctionPostHook {
  explicit GradientReadyHook(std::function<void()> fn) : fn(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs, const torch::autograd::variable_list& /*inputs*/) override {
    fn();
    return outputs;
  }
  std::function<void()> fn;
};

}  // namespace

GradientSync::~GradientSync() { *alive_ = nullptr; }

void GradientSync::attach_hooks(const FlatUnit& u) {
  const size_t index = u.index;
  if (states_.size() <= index) states_.resize(index + 1);
  for (const auto& p : u.params) {
    std::shared_ptr<torch::autograd::Node> accumulator = torch::autograd::impl::grad_accumulator(p);
    DSRUN_ASSERT(accumulator != nullptr, "model parameters require gradients");
    accumulator->add_post_hook(std::make_unique<GradientReadyHook>([alive = alive_, index] {
      if (*alive) (*alive)->on_gradient_ready(index);
    }));
    grad_accumulators_.push_back(std::move(accumulator));
  }
}

void GradientSync::on_gradient_ready(size_t index) {
  FlatUnit& u = units_[index];
  offload_.await_updates_for_backward();
  if (++states_[index].grads_ready == u.params.size() && u.always_gets_gradients) start_reduction(u, /*during_backward=*/true);
}

// Runs on autograd's thread (from the hooks) or the trainer's (after_backward), always in the
// same order on every rank: the backward graph is the same on all of them.
void GradientSync::start_reduction(FlatUnit& u, bool during_backward) {
  UnitState& s = states_[u.index];
  if (s.reduction_started || options_.gradients_left_to_autograd) return;  // (one rank: nothing to reduce)
  s.reduction_started = true;
  torch::NoGradGuard no_grad;
  // A group of one rank (one data rank beside tensor or pipeline ranks, or experts on every data
  // rank) has nothing to reduce: the accumulator is the sum. (Before, stage 0 still joined and
  // copied a bucket, and stages 1-2 a shard, every step: memory the plan never counted.)
  const bool alone = u.group->world_size() == 1 && options_.stage <= 2 && !offload_.sends_gradients_down();
  if ((options_.stage <= 1 && options_.gradients_widened()) || (alone && options_.stage == 2)) add_into_accumulator(u);
  if (alone) {
    if (options_.stage == 1 && last_micro_batch_) s.reduced = u.grad_acc;  // (one rank's shard is the whole unit)
    return;
  }
  if (options_.stage <= 1 && !last_micro_batch_) return;  // keep accumulating in grad_acc; reduced once per step
  if (during_backward && options_.stage > 0) ++overlapped_reductions_;
  if (options_.stage <= 1) {
    if (options_.stage == 0) {
      const double bytes = static_cast<double>(u.grad_acc.numel()) * static_cast<double>(u.grad_acc.element_size());
      if (!bucket_.empty() && (bucket_.front()->group != u.group || bucket_.front()->grad_acc.scalar_type() != u.grad_acc.scalar_type()))
        flush_bucket(during_backward);
      if (bytes < options_.bucket_bytes) {  // joins the bucket, which goes once full
        bucket_.push_back(&u);
        bucket_fill_ += bytes;
        if (bucket_fill_ >= options_.bucket_bytes) flush_bucket(during_backward);
        return;
      }
      flush_bucket(during_backward);  // (the order of the reductions stays the order the units became ready)
      if (during_backward) ++overlapped_reductions_;
      const int64_t bucket = std::max<int64_t>(1, static_cast<int64_t>(options_.bucket_bytes / u.grad_acc.element_size()));
      for (int64_t begin = 0; begin < u.layout.padded; begin += bucket) {
        Tensor slice = u.grad_acc.narrow(0, begin, std::min(bucket, u.layout.padded - begin));
        pending_.push_back(u.group->all_reduce_sum_async(slice));
      }
    } else {
      s.reduced = torch::empty({u.layout.shard}, u.grad_acc.options());
      PendingCollective reduce = u.group->reduce_scatter_sum_async(u.grad_acc, s.reduced);
      if (offload_.sends_gradients_down()) offload_.send_gradient_down(u, std::move(reduce), Tensor(), s.reduced);
      else track_reduction(std::move(reduce), static_cast<double>(u.grad_acc.numel()) * static_cast<double>(u.grad_acc.element_size()));
    }
    return;
  }
  // Stage 2-3: this micro-batch's full gradient goes to one flat buffer and is reduce-scattered;
  // the parameters' own gradients (and at stage 3 their gathered values) are freed now.
  Tensor flat = torch::empty({u.layout.padded}, u.grad_acc.options());
  if (u.layout.padded > u.layout.numel) flat.narrow(0, u.layout.numel, u.layout.padded - u.layout.numel).zero_();
  for (size_t i = 0; i < u.params.size(); ++i) {
    Tensor& g = u.params[i].mutable_grad();
    Tensor slot = flat.narrow(0, u.layout.offsets[i], u.layout.numels[i]);
    if (g.defined()) slot.copy_(g.flatten());
    else slot.zero_();  // an MoE expert no token chose: zero gradient
    g = Tensor();
  }
  if (u.gathered_for_backward) units_.release(u);
  Tensor mine = torch::empty({u.layout.shard}, flat.options());
  PendingCollective reduce = u.group->reduce_scatter_sum_async(flat, mine);
  if (offload_.sends_gradients_down() && last_micro_batch_) {
    offload_.send_gradient_down(u, std::move(reduce), flat, mine);
    return;
  }
  Tensor acc = u.grad_acc;
  track_reduction(PendingCollective([reduce, acc, mine]() mutable {
                    reduce.wait();
                    acc.add_(mine);
                  }),
                  static_cast<double>(flat.numel()) * static_cast<double>(flat.element_size()));
}

// This micro-batch's gradients (made by autograd in the working dtype) added into the accumulator
// and freed, so that the next micro-batch's are made afresh: stages 0-1 with a wider accumulator,
// and stage 2 in a group of one rank (where the accumulator is the whole unit).
void GradientSync::add_into_accumulator(FlatUnit& u) {
  for (size_t i = 0; i < u.params.size(); ++i) {
    Tensor& g = u.params[i].mutable_grad();
    if (!g.defined()) continue;  // an MoE expert no token chose
    u.grad_acc.narrow(0, u.layout.offsets[i], u.layout.numels[i]).add_(g.flatten());
    g = Tensor();
  }
}

// One all-reduce for the bucket's units: their gradients joined into one buffer, reduced, and
// copied back when it is waited for (at most two such copies in flight). A bucket of one unit is
// reduced in place. Each unit counts as overlapped where its all-reduce was issued while backward ran.
void GradientSync::flush_bucket(bool during_backward) {
  if (bucket_.empty()) return;
  std::vector<FlatUnit*> units = std::exchange(bucket_, {});
  bucket_fill_ = 0;
  if (during_backward) overlapped_reductions_ += static_cast<int64_t>(units.size());
  if (units.size() == 1) {
    pending_.push_back(units[0]->group->all_reduce_sum_async(units[0]->grad_acc));
    return;
  }
  std::vector<Tensor> accs;
  for (FlatUnit* u : units) accs.push_back(u->grad_acc);
  Tensor joined = torch::cat(accs);
  PendingCollective reduce = units[0]->group->all_reduce_sum_async(joined);
  // The joined copy counts against the two buckets in flight, as the plan's stage-0 buffers do.
  track_reduction(PendingCollective([reduce, joined, accs]() mutable {
                    reduce.wait();
                    int64_t begin = 0;
                    for (Tensor& acc : accs) {
                      acc.copy_(joined.narrow(0, begin, acc.numel()));
                      begin += acc.numel();
                    }
                  }),
                  static_cast<double>(joined.numel()) * static_cast<double>(joined.element_size()));
}

// At most two buckets of gradient in flight (DeepSpeed's reduce_bucket_size with overlap_comm).
// Unbounded, every unit's gradient copy (stage 2's flat buffer; on Gloo, which has no
// reduce-scatter, the copy it all-reduces) lived until the end of backward: the whole model's
// gradient once or twice over, which the plan never counted (CPU ranks measured 25% above it).
// The oldest reductions finish first; one unit larger than the budget goes alone.
void GradientSync::track_reduction(PendingCollective reduction, double bytes) {
  while (!reductions_.empty() && reduction_bytes_ + bytes > 2 * options_.bucket_bytes) {
    reductions_.front().done.wait();
    reduction_bytes_ -= reductions_.front().bytes;
    reductions_.pop_front();
  }
  reductions_.push_back({std::move(reduction), bytes});
  reduction_bytes_ += bytes;
}

void GradientSync::wait_pending() {
  for (auto& p : pending_) p.wait();
  pending_.clear();
  for (auto& r : reductions_) r.done.wait();
  reductions_.clear();
  reduction_bytes_ = 0;
}

void GradientSync::after_backward(UnitRange range) {
  if (range.end < 0) range.end = static_cast<int>(units_.size());
  // The range's units and the routed experts they read (listed after every other unit).
  std::vector<FlatUnit*> done;
  for (int k = range.begin; k < range.end; ++k)
    if (!units_[k].routed_experts) done.push_back(&units_[k]);
  for (int k = range.begin; k < range.end; ++k)
    for (size_t e : units_[k].experts) done.push_back(&units_[e]);
  for (FlatUnit* u : done) start_reduction(*u, /*during_backward=*/false);  // units the hooks did not start, in unit order
  flush_bucket(/*during_backward=*/false);  // the rest of stage 0's units (empty otherwise)
  if (options_.stage >= 2) wait_pending();
  // The gradients that came down were read on the down stream: what follows (zeroing them, the
  // norm) waits for it.
  if (last_micro_batch_) offload_.compute_waits_for_gradients();
  for (FlatUnit* u : done) {
    states_[u->index].grads_ready = 0;
    states_[u->index].reduction_started = false;
  }
}

void GradientSync::finish() {
  wait_pending();
  last_micro_batch_ = true;
}

Tensor GradientSync::take_reduced(size_t k) {
  if (options_.stage != 1) return units_[k].grad_acc;
  return std::exchange(states_.at(k).reduced, Tensor());
}

}  // namespace dsrun
