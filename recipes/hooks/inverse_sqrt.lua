-- Linear warmup, then inverse square-root decay (the original Transformer's schedule, as in
-- fairseq's inverse_sqrt): lr = peak * step / warmup up to `warmup`, then peak * sqrt(warmup / step).
-- Options: peak_lr (default: the recipe's optimizer.lr is not visible here, so 1e-3), warmup_steps (default 100).
local peak = options.peak_lr or 1e-3
local warmup = options.warmup_steps or 100

function lr(step, ctx)
  if step <= warmup then return peak * step / warmup end
  return peak * math.sqrt(warmup / step)
end
