-- Custom metrics, recorded with the built-in ones at every step: an exponential moving average of
-- the loss (smoother curves) and the tokens seen so far. Options: ema (default 0.9), seq_len (default 32).
local ema = options.ema or 0.9
local seq_len = options.seq_len or 32

function metrics(ctx)
  local loss = ctx.metrics.loss
  state.loss_ema = state.loss_ema and (ema * state.loss_ema + (1 - ema) * loss) or loss
  return {loss_ema = state.loss_ema, tokens_seen = ctx.step * ctx.global_batch * seq_len}
end
