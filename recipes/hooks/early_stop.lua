-- Early stopping on a validation plateau: stop when val_loss has not improved by more than
-- min_delta for `patience` evaluations in a row. The best value is recorded as a metric.
-- Options ([hooks.options]): patience (default 3), min_delta (default 0).
local patience = options.patience or 3
local min_delta = options.min_delta or 0.0

function on_eval(ctx, metrics)
  if state.best == nil or metrics.val_loss < state.best - min_delta then
    state.best, state.best_step, state.bad = metrics.val_loss, ctx.step, 0
    return {metrics = {best_val_loss = state.best}}
  end
  state.bad = state.bad + 1
  if state.bad >= patience then
    return {
      stop = string.format("val_loss has not improved for %d evaluations (best %.4f at step %d)", state.bad, state.best, state.best_step),
      metrics = {best_val_loss = state.best},
    }
  end
  return {metrics = {best_val_loss = state.best}}
end
