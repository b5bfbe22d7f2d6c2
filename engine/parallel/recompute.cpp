#include "engine/parallel/recompute.hpp"

#include "engine/common/error.hpp"

namespace dsrun {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

thread_local bool recomputing_now = false;

// The unit's function as an IValue (a capsule), so that the node's saved data owns it until its
// backward has run; a missing second input travels as an undefined tensor.
struct KeptUnitFn : torch::CustomClassHolder {
  explicit KeptUnitFn(std::shared_ptr<UnitFn> fn) : fn(std::move(fn)) {}
  std::shared_ptr<UnitFn> fn;
};

const UnitFn& kept_fn(const c10::IValue& capsule) { return *c10::static_intrusive_pointer_cast<KeptUnitFn>(capsule.toCapsule())->fn; }

struct CheckpointedUnit : torch::autograd::Function<CheckpointedUnit> {
  static variable_list forward(AutogradContext* ctx, Tensor a, Tensor b, c10::IValue fn) {
    ctx->saved_data["fn"] = fn;
    ctx->saved_data["inputs"] = static_cast<int64_t>(b.defined() ? 2 : 1);
    ctx->save_for_backward({a, b});
    Tensors inputs{a};
    if (b.defined()) inputs.push_back(b);
    Tensors out;
    {
      torch::NoGradGuard no_grad;
      out = kept_fn(fn)(inputs);
    }
    for (auto& o : out)  // an input passed straight through must still be a new output
      if (o.is_same(a) || (b.defined() && o.is_same(b))) o = o.clone();
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const UnitFn& fn = kept_fn(ctx->saved_data["fn"]);
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

Tensors run_recomputed(std::shared_ptr<UnitFn> fn, const Tensors& inputs) {
  DSRUN_ASSERT(!inputs.empty() && inputs.size() <= 2, "checkpointed units take one or two tensors");
  return CheckpointedUnit::apply(inputs[0], inputs.size() > 1 ? inputs[1] : Tensor(), c10::IValue::make_capsule(c10::make_intrusive<KeptUnitFn>(std::move(fn))));
}

Recomputation::Recomputation(Model& model, bool enabled) {
  for (const ParameterUnit& pu : model.parameter_units()) recomputed_.push_back(enabled && pu.checkpointable);
}

Tensors Recomputation::run(int unit, const UnitFn& fn, const Tensors& inputs) const {
  if (!recomputed_.at(static_cast<size_t>(unit)) || !torch::GradMode::is_enabled()) return fn(inputs);
  return run_recomputed(std::make_shared<UnitFn>(fn), inputs);
}

}  // namespace dsrun
