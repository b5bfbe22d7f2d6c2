-- Loss-spike skipping: keep an exponential moving mean and variance of the training loss; when a
-- step's loss is more than z_threshold standard deviations above the mean, skip its update (the
-- gradients are dropped on every rank) and log it. Spikes do not enter the statistics.
-- Options: z_threshold (default 4), warmup_steps (default 20: no skipping before), beta (default 0.98).
local threshold = options.z_threshold or 4.0
local warmup = options.warmup_steps or 20
local beta = options.beta or 0.98

function on_step(ctx)
  local loss = ctx.metrics.loss
  local n = state.n or 0
  local z = 0
  if n > 0 and state.var > 0 then z = (loss - state.mean) / math.sqrt(state.var) end
  if n >= warmup and z > threshold then
    state.skipped = (state.skipped or 0) + 1
    return {skip = true, log = string.format("loss %.4f is a spike (z = %.1f): update skipped", loss, z), metrics = {loss_z = z}}
  end
  if n == 0 then
    state.mean, state.var = loss, 0
  else
    local d = loss - state.mean
    state.mean = state.mean + (1 - beta) * d
    state.var = beta * (state.var + (1 - beta) * d * d)
  end
  state.n = n + 1
  return {metrics = {loss_z = z}}
end
