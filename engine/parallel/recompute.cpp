#include "engine/parallel/recompute.hpp"

#include "engine/common/autograd_pointer.hpp"
#include "engine/common/error.hpp"

namespace dsrun {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

thread_local bool recomputing_now = false;

// Autograd functions take tensors and scalars, not callables: the unit's function travels as the
// address of a UnitFn, and a missing second input as an undefined tensor.
struct CheckpointedUnit : torch::autograd::Function<CheckpointedUnit> {
  static variable_list forward(AutogradContext* ctx, Tensor a, Tensor b, int64_t fn_address) {
    ctx->saved_data["fn"] = fn_address;
    ctx->saved_data["inputs"] = static_cast<int64_t>(b.defined() ? 2 : 1);
    ctx->save_for_backward({a, b});
    Tensors inputs{a};
    if (b.defined()) inputs.push_back(b);
    Tensors out;
    {
      torch::NoGradGuard no_grad;
      out = (*pointer_from_argument<const UnitFn>(fn_address))(inputs);
    }
    for (auto& o : out)  // an input passed straight through must still be a new output
      if (o.is_same(a) || (b.defined() && o.is_same(b))) o = o.clone();
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const UnitFn& fn = *saved_pointer<const UnitFn>(ctx, "fn");
    const int64_t count = ctx->saved_data["inputs"].toInt();
    variable_list saved = ctx->get_saved_variables();
    Tensors inputs;
    for (int64_t i = 0; i < count; ++i) {
      Tensor x = saved[i].detach();
      if (x.is_floating_point()) x.requires_grad_(true);
      inputs.push_back(x);
    }
    Tensors out;
    {
      torch::AutoGradMode with_grad(true);
      struct Recomputing {
        Recomputing() { recomputing_now = true; }
        ~Recomputing() { recomputing_now = false; }
      } flag;
      out = fn(inputs);
    }
    Tensors roots, root_grads;
    for (size_t i = 0; i < out.size(); ++i)
      if (out[i].requires_grad() && grads[i].defined()) {
        roots.push_back(out[i]);
        root_grads.push_back(grads[i]);
      }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    variable_list result{inputs[0].requires_grad() ? inputs[0].grad() : Tensor(),
                         count > 1 && inputs[1].requires_grad() ? inputs[1].grad() : Tensor(), Tensor()};
    return result;
  }
};

}  // namespace

bool recomputing() { return recomputing_now; }

Tensors run_recomputed(const std::shared_ptr<UnitFn>& fn, const Tensors& inputs) {
  DSRUN_ASSERT(!inputs.empty() && inputs.size() <= 2, "checkpointed units take one or two tensors");
  return CheckpointedUnit::apply(inputs[0], inputs.size() > 1 ? inputs[1] : Tensor(), pointer_argument(fn.get()));
}

}  // namespace dsrun
