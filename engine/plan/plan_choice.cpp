// What the planner chooses for fixed degrees: the ZeRO stage, recomputation, micro batch and loss
// chunk left "auto", only among what the layout rules allow; and what would fit instead.
#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/text.hpp"
#include "engine/parallel/pipeline_schedule.hpp"
#include "engine/plan/planner.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace dsrun::planning {

Layout Planner::layout_with(const Choice& c) const {
  Layout l = degrees_;
  l.sequence_parallel &= degrees_.tensor > 1;
  l.zero_stage = c.stage, l.micro = c.micro, l.recomputation = c.checkpointing;
  return l;
}

bool Planner::allowed(const Choice& c, bool stage_decided, bool micro_decided) const {
  LayoutDecided d;
  d.zero_stage = stage_decided;
  d.micro = micro_decided;
  return layout_problems(r_, layout_with(c), d).empty();
}

std::vector<int> Planner::stage_candidates() const {
  if (r_.parallel.zero_stage) return {*r_.parallel.zero_stage};
  std::vector<int> out;
  for (int stage = 0; stage <= 3; ++stage)
    if (allowed({stage, false, 1}, /*stage_decided=*/true, /*micro_decided=*/false)) out.push_back(stage);
  if (out.empty()) {  // fixed degrees that no stage can run: say why, on the keys
    LayoutDecided decided;
    decided.micro = false;
    Layout l = layout_with({3, false, 1});
    const std::vector<LayoutProblem> problems = problems_at_every_stage(r_, l, decided);
    DSRUN_ASSERT(!problems.empty(), "stage 3 was refused by its rules a moment ago");
    ErrorContext c;
    c.key = problems.front().key;
    std::vector<std::string> why, fixes;
    for (const LayoutProblem& p : problems) {
      why.push_back(p.message + " (" + p.key + ")");
      fixes.push_back(p.fix);
    }
    c.hint = join(fixes, "; or ");
    throw Error("no ZeRO stage can run this layout: " + join(why, "; "), c);
  }
  return out;
}

std::vector<bool> Planner::checkpointing_candidates() const {
  switch (r_.parallel.activation_checkpointing) {
    case Checkpointing::None: return {false};
    case Checkpointing::Full: return {true};
    case Checkpointing::Auto: return {false, true};
  }
  return {false};
}

std::vector<int64_t> Planner::micro_candidates() const {  // largest first
  if (r_.batch.micro) return {*r_.batch.micro};
  // Divisors of the per-rank batch, found in pairs up to its square root (batches can be huge).
  int64_t per_rank = r_.batch.global / degrees_.data;
  std::vector<int64_t> out;
  // The rules decide which divide (the interleaved schedule wants multiples of the stages).
  auto ok = [&](int64_t micro) { return allowed({0, false, micro}, /*stage_decided=*/false); };
  for (int64_t d = 1; d * d <= per_rank; ++d)
    if (per_rank % d == 0) {
      if (ok(d)) out.push_back(d);
      if (d != per_rank / d && ok(per_rank / d)) out.push_back(per_rank / d);
    }
  std::sort(out.rbegin(), out.rend());
  return out;
}

// The planner's choices in order, each given the ones before: ZeRO stage and recomputation, micro
// batch, loss chunk; then the chosen layout's memory and verdict, and what would fit instead.
void Planner::choose_layout(Plan& p) {
  const std::vector<int64_t> micros = micro_candidates();
  Chosen c = choose_stage_and_recomputation(p, micros.back());
  c.choice.micro = choose_micro(p, c, micros);
  choose_loss_chunk(p, c);
  const Evaluation ev = settle(p, c.choice);
  memory_verdict(p, ev);
  if (!p.fits && options_.full) suggest(p, c.choice, ev);
}

Planner::Chosen Planner::choose_stage_and_recomputation(Plan& p, int64_t smallest_micro) {
  const std::vector<int> stages = stage_candidates();
  const std::vector<bool> ckpts = checkpointing_candidates();
  Choice chosen{stages.back(), ckpts.back(), smallest_micro};
  bool found = false;
  std::string stage_reason, ckpt_reason;
  for (int stage : stages) {
    for (bool ckpt : ckpts) {
      Evaluation ev = evaluate({stage, ckpt, smallest_micro});
      if (ev.fits) {
        chosen = {stage, ckpt, smallest_micro};
        found = true;
        break;
      }
    }
    if (found) break;
  }
  if (!r_.parallel.zero_stage) {
    Evaluation ev = evaluate(chosen);
    if (!found) stage_reason = "no stage fits; the highest allowed is shown";
    else if (chosen.stage == stages.front())
      stage_reason = degrees_.data_ranks() == 1 ? "one data-parallel rank: ZeRO has nothing to shard; stage " + std::to_string(chosen.stage) + " fits (" + usage(ev) + ")"
                              : "the lowest stage, and it fits (" + usage(ev) + ")";
    else {
      Evaluation lower = evaluate({chosen.stage - 1, chosen.checkpointing, smallest_micro});
      stage_reason = "stage " + std::to_string(chosen.stage - 1) + " would need " + format_bytes(rank_total(lower)) + " of " +
                     format_bytes(capacity_) + "; stage " + std::to_string(chosen.stage) + " is the lowest that fits (" + usage(ev) + ")";
    }
    p.choices.push_back({"parallel.zero_stage", std::to_string(chosen.stage), stage_reason});
  }
  if (r_.parallel.activation_checkpointing == Checkpointing::Auto) {
    if (!chosen.checkpointing)
      ckpt_reason = "activations fit without recomputation, which would cost about a third more compute";
    else {
      Evaluation without = evaluate({chosen.stage, false, smallest_micro});
      ckpt_reason = "without recomputation micro batch " + std::to_string(smallest_micro) + " needs " + format_bytes(rank_total(without)) +
                    " of " + format_bytes(capacity_) + "; full recomputation keeps each block's input only";
    }
    p.choices.push_back({"parallel.activation_checkpointing", chosen.checkpointing ? "full" : "none", ckpt_reason});
  }
  return {chosen, found};
}

int64_t Planner::choose_micro(Plan& p, const Chosen& c, const std::vector<int64_t>& micros) {
  // 2. The largest micro-batch that fits under that layout (fewer accumulation steps, better
  //    kernels); a pipeline's the smallest, for the most micro-batches a step and the least bubble
  //    ((p-1)/(m+p-1): the whole per-rank batch as one micro-batch leaves a stage idle (p-1)/p of it).
  const bool least_bubble = degrees_.pipeline > 1 && !r_.batch.micro;
  Choice chosen = c.choice;
  const bool found = c.fits;
  if (found && !least_bubble) {
    for (int64_t micro : micros) {
      if (evaluate({chosen.stage, chosen.checkpointing, micro}).fits) {
        chosen.micro = micro;
        break;
      }
    }
  }
  if (!r_.batch.micro) {
    int64_t per_rank = r_.batch.global / degrees_.data;
    std::string reason;
    if (!found) reason = "nothing fits; the smallest micro batch is shown";
    else if (least_bubble)
      reason = "a pipeline: the smallest micro batch, " + std::to_string(per_rank / chosen.micro) + " micro-batches a step, for the least bubble (" +
               format_double(100 * bubble_fraction(per_rank / chosen.micro), 3) + "%)";
    else if (chosen.micro == per_rank) reason = "the whole per-rank batch (" + std::to_string(per_rank) + ") fits: no accumulation";
    else {
      int64_t next = 0;
      for (int64_t m : micros)
        if (m > chosen.micro) next = m;  // the next larger divisor
      if (next == 0) {
        reason = "the largest that leaves the interleaved schedule a multiple of " + std::to_string(degrees_.pipeline) + " micro-batches per step";
      } else {
        Evaluation bigger = evaluate({chosen.stage, chosen.checkpointing, next});
        reason = "largest divisor of the per-rank batch " + std::to_string(per_rank) + " that fits; micro " + std::to_string(next) +
                 " would need " + format_bytes(rank_total(bigger)) + " of " + format_bytes(capacity_);
      }
    }
    p.choices.push_back({"batch.micro", std::to_string(chosen.micro), reason});
  }
  return chosen.micro;
}

void Planner::choose_loss_chunk(Plan& p, const Chosen& c) {
  // 3. The loss chunk left to auto: a micro-batch's whole logits in one chunk where their fp32
  // values take at most 1/32 of the device and the layout still fits (one projection each way and
  // no fp32 weight-gradient sum across chunks: the 1B at 8 x 2048 on an H100, 2,097-token chunks
  // against one, ran 0.7% slower), else 256 MiB chunks.
  const Choice& chosen = c.choice;
  if (c.fits && !r_.batch.loss_chunk_tokens && cost_.loss_chunk_tokens > 0) {
    const int64_t tokens = static_cast<int64_t>(chosen.micro * rank_sequence());  // a rank's share of the micro-batch
    const double logits_bytes = 4.0 * static_cast<double>(tokens) * static_cast<double>(cost_options_.local_vocab);
    if (tokens > cost_.loss_chunk_tokens && logits_bytes <= capacity_ / 32) {
      const ModelCost chunked = cost_;
      ModelCostOptions whole = cost_options_;
      whole.loss_chunk_tokens = tokens;
      cost_ = model_cost(r_.model, r_.batch.seq_len, r_.precision.dtype, kernel_, whole);
      if (evaluate(chosen).fits)
        p.choices.push_back({"batch.loss_chunk_tokens", std::to_string(tokens),
                             "a micro-batch's logits in one chunk: " + format_bytes(logits_bytes) + " of fp32 logits, at most 1/32 of the device, and the layout still fits"});
      else
        cost_ = chunked;
    }
  }
}

// The chosen layout's batch math and memory, per pipeline stage too.
Evaluation Planner::settle(Plan& p, const Choice& chosen) {
  Evaluation ev = evaluate(chosen);
  p.layout = layout_with(chosen);
  p.accumulation = r_.batch.global / (chosen.micro * degrees_.data);
  DSRUN_ASSERT(p.accumulation * chosen.micro * degrees_.data == r_.batch.global, "batch divisibility was validated");
  p.tokens_per_step = static_cast<double>(r_.batch.global) * cost_.tokens_per_sample;
  p.memory = ev.memory;
  p.memory_stage = ev.stage;
  p.live_micro_batches = live_micro_batches(p.accumulation, ev.stage);
  for (size_t st = 0; st < stages_.size(); ++st) {
    const Evaluation stage = evaluate_stage(chosen, static_cast<int>(st));
    p.stage_memory.push_back({stage.memory.states.device_total() + stage.memory.states.host, stage.memory.total(), stage.host.total()});
  }
  p.host = ev.host;
  p.host_memory_needed = ev.host_needed;
  p.fits = ev.fits;
  p.binds = ev.binds();
  return ev;
}

void Planner::memory_verdict(Plan& p, const Evaluation& ev) const {
  // The verdict names what binds first (device memory per rank, host memory per node), then
  // how the other fares: never "does not fit" followed by a bare "fits".
  const HardwareSpec& hw = r_.hardware;
  const double total = rank_total(ev);
  const std::string device_line = ev.device_fits ? "fits: " + format_bytes(total) + " of " + format_bytes(capacity_) + " per rank, headroom " +
                                                       format_bytes(capacity_ - total) + " (" + format_double(100.0 * (capacity_ - total) / capacity_, 3) + "%)"
                                                 : "needs " + format_bytes(total) + " per rank, " + format_bytes(capacity_) + " available (short by " +
                                                       format_bytes(total - capacity_) + ")";
  const std::string host_line = format_bytes(ev.host_needed) + " of " + format_bytes(hw.host_memory_bytes) + " per node (" + std::to_string(ranks_per_node_) +
                                " rank(s) x " + format_bytes(ev.host.total()) + ")";
  const std::string host_short = "needs " + format_bytes(ev.host_needed) + " per node, " + format_bytes(hw.host_memory_bytes) + " available (short by " +
                                 format_bytes(ev.host_needed - hw.host_memory_bytes) + "; " + std::to_string(ranks_per_node_) + " rank(s) x " +
                                 format_bytes(ev.host.total()) + ")";
  if (!ev.device_fits) p.verdict.push_back("does not fit: device memory " + device_line);
  else if (!ev.host_fits) p.verdict.push_back("does not fit: host memory (hardware.host_memory_gib) " + host_short);
  else p.verdict.push_back(device_line);
  if (!ev.device_fits && !ev.host_fits) p.verdict.push_back("host memory does not fit either (hardware.host_memory_gib): " + host_short);
  else if (!ev.device_fits && (hw.device == Device::Cuda)) p.verdict.push_back("host memory fits: " + host_line);
  else if (ev.device_fits && !ev.host_fits) p.verdict.push_back("device memory fits: " + format_bytes(total) + " of " + format_bytes(capacity_) + " per rank");
  else if (hw.device == Device::Cuda) p.verdict.push_back("host memory fits: " + host_line);
}

void Planner::suggest(Plan& p, const Choice& current, const Evaluation& now) {
  if (now.device_fits && !now.host_fits) suggest_host(p, now);
  struct Option {
    Choice layout;
    Offload offload;
    std::string sets;
  };
  std::vector<Option> options;
  const int64_t per_rank = r_.batch.global / degrees_.data;
  // Least invasive first: a higher stage, then recomputation, and offload (slow) last.
  for (Offload off : {Offload::None, Offload::Optimizer, Offload::OptimizerAndParams})
    for (int stage = std::max(current.stage, 0); stage <= 3; ++stage)
      for (bool ckpt : {false, true}) {
        if (off == Offload::Optimizer && stage == 0) continue;
        if (off == Offload::OptimizerAndParams && stage != 3) continue;
        std::string sets = "--set parallel.zero_stage=" + std::to_string(stage);
        if (ckpt) sets += " --set parallel.activation_checkpointing=full";
        if (off != r_.parallel.offload) sets += std::string(" --set parallel.offload=") + to_string(off);
        if (r_.batch.micro || per_rank > 1) sets += " --set batch.micro=1";
        options.push_back({{stage, ckpt, 1}, off, sets});
      }
  int shown = 0;
  for (const auto& o : options) {
    Recipe alt = r_;
    alt.parallel.offload = o.offload;
    Planner alt_planner(alt, host_);
    if (!alt_planner.allowed(o.layout)) continue;
    Evaluation ev = alt_planner.evaluate(o.layout);
    if (!ev.fits) continue;
    p.suggestions.push_back("fits with " + o.sets + " (" + alt_planner.usage(ev) + ")");
    if (++shown == 2) break;
  }
  // More GPUs of the same kind, with ZeRO-3, recomputation and micro batch 1 (CPU ranks share
  // one memory, so more of them never helps); not when only host memory binds.
  if (shown > 0 || r_.hardware.device != Device::Cuda || now.device_fits) {
    if (p.suggestions.empty()) p.suggestions.push_back("no configuration of this hardware fits: choose a smaller model or more memory");
    return;
  }
  for (int n = degrees_.data + 1; n <= 65536; n = n < 64 ? n + 1 : n * 2) {
    Recipe alt = r_;
    alt.parallel.data_parallel = n;
    alt.batch.global = n;  // only the memory per rank matters here
    // More nodes of this kind (each with its own host memory), not more GPUs in one node.
    alt.hardware.nodes = std::max(alt.hardware.nodes, (n + alt.hardware.devices_per_node - 1) / alt.hardware.devices_per_node);
    Planner alt_planner(alt, host_);
    if (alt_planner.evaluate({3, true, 1}).fits) {
      p.suggestions.push_back("with ZeRO-3, full recomputation and micro batch 1, " + std::to_string(n) +
                              " GPUs of this kind would fit (batch.global must then be a multiple of " + std::to_string(n) + ")");
      break;
    }
  }
  if (p.suggestions.empty()) p.suggestions.push_back("no configuration of this hardware fits: choose a smaller model or larger devices");
}

void Planner::suggest_host(Plan& p, const Evaluation& now) const {
  const double GiB = 1024.0 * 1024.0 * 1024.0;
  p.suggestions.push_back("if the nodes have more host memory, say so: --set hardware.host_memory_gib=" +
                          std::to_string(static_cast<int64_t>(std::ceil(now.host_needed / GiB))) + " (the plan needs " + format_bytes(now.host_needed) + " per node)");
  const int per_node = static_cast<int>(std::floor(r_.hardware.host_memory_bytes / std::max(1.0, now.host.total())));
  if (per_node >= 1 && per_node < ranks_per_node_)
    p.suggestions.push_back("at most " + std::to_string(per_node) + " rank(s) per node fit in " + format_bytes(r_.hardware.host_memory_bytes) + " (" +
                            format_bytes(now.host.total()) + " each): more hardware.nodes with fewer ranks on each (hardware.devices_per_node = " +
                            std::to_string(per_node) + ")");
}

}  // namespace dsrun::planning
