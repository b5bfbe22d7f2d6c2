#include "engine/parallel/pipeline_schedule.hpp"

#include <algorithm>
#include <deque>
#include <map>
#include <numeric>
#include <tuple>

namespace dsrun {

const char* to_string(PipelineScheduleKind k) {
  for (const auto& [kind, name] : kPipelineSchedules)
    if (kind == k) return name;
  return "?";
}

std::string describe(const PipelineAction& a) {
  static const char* kNames[] = {"forward", "backward", "send activation", "receive activation", "send gradient", "receive gradient"};
  std::string s = std::string(kNames[a.kind]) + " of micro-batch " + std::to_string(a.micro_batch) + " chunk " + std::to_string(a.chunk);
  if (a.peer >= 0) s += (a.kind == PipelineAction::SendActivation || a.kind == PipelineAction::SendGradient ? " to rank " : " from rank ") + std::to_string(a.peer);
  return s;
}

std::string pipeline_schedule_problem(PipelineScheduleKind kind, int stages, int micro_batches, int virtual_stages) {
  if (stages < 1 || micro_batches < 1 || virtual_stages < 1) return "stages, micro-batches and virtual stages must be at least 1";
  if (kind != PipelineScheduleKind::Interleaved && virtual_stages != 1)
    return std::string(to_string(kind)) + " runs one chunk per rank (virtual stages are for the interleaved schedule)";
  if (kind == PipelineScheduleKind::Interleaved) {
    if (virtual_stages < 2) return "the interleaved schedule needs at least 2 virtual stages per rank";
    if (micro_batches % stages != 0)
      return "the interleaved schedule needs the micro-batches per step (" + std::to_string(micro_batches) + ") to be a multiple of the pipeline stages (" +
             std::to_string(stages) + ")";
  }
  return "";
}

namespace {

struct Compute {
  bool forward;
  int micro_batch, chunk;
};

// The order in which rank r computes, before communication is added.
std::vector<Compute> compute_order(PipelineScheduleKind kind, int P, int M, int v, int r) {
  std::vector<Compute> order;
  if (kind == PipelineScheduleKind::GPipe) {
    for (int m = 0; m < M; ++m) order.push_back({true, m, 0});
    for (int m = 0; m < M; ++m) order.push_back({false, m, 0});
    return order;
  }
  // The k-th forward (and k-th backward) of this rank: micro-batches go through the chunks in
  // groups of P (Megatron-LM's interleaving); backwards visit the chunks in reverse.
  auto forward_k = [&](int k) { return Compute{true, (k / (P * v)) * P + k % P, (k % (P * v)) / P}; };
  auto backward_k = [&](int k) { return Compute{false, (k / (P * v)) * P + k % P, v - 1 - (k % (P * v)) / P}; };
  const int total = M * v;
  int warmup = kind == PipelineScheduleKind::OneFOneB ? P - 1 - r : (P - 1 - r) * 2 + (v - 1) * P;
  warmup = std::min(warmup, total);
  for (int k = 0; k < warmup; ++k) order.push_back(forward_k(k));
  for (int k = 0; k < total - warmup; ++k) {
    order.push_back(forward_k(warmup + k));
    order.push_back(backward_k(k));
  }
  for (int k = total - warmup; k < total; ++k) order.push_back(backward_k(k));
  return order;
}

}  // namespace

PipelineSchedule build_pipeline_schedule(PipelineScheduleKind kind, int stages, int micro_batches, int virtual_stages) {
  PipelineSchedule s;
  s.kind = kind;
  s.stages = stages;
  s.micro_batches = micro_batches;
  s.virtual_stages = virtual_stages;
  const int P = stages, last_piece = s.pieces() - 1;
  for (int r = 0; r < P; ++r) {
    const int next = (r + 1) % P, previous = (r + P - 1) % P;
    std::vector<PipelineAction> list;
    for (const Compute& c : compute_order(kind, P, micro_batches, virtual_stages, r)) {
      const int g = s.piece(r, c.chunk);
      if (c.forward) {
        if (g > 0) list.push_back({PipelineAction::ReceiveActivation, c.micro_batch, c.chunk, previous});
        list.push_back({PipelineAction::Forward, c.micro_batch, c.chunk, -1});
        if (g < last_piece) list.push_back({PipelineAction::SendActivation, c.micro_batch, c.chunk, next});
      } else {
        if (g < last_piece) list.push_back({PipelineAction::ReceiveGradient, c.micro_batch, c.chunk, next});
        list.push_back({PipelineAction::Backward, c.micro_batch, c.chunk, -1});
        if (g > 0) list.push_back({PipelineAction::SendGradient, c.micro_batch, c.chunk, previous});
      }
    }
    s.actions.push_back(std::move(list));
  }
  return s;
}

PipelineSchedule build_forward_schedule(int stages, int micro_batches, int virtual_stages) {
  PipelineSchedule s;
  s.kind = PipelineScheduleKind::GPipe;
  s.stages = stages;
  s.micro_batches = micro_batches;
  s.virtual_stages = virtual_stages;
  for (int r = 0; r < stages; ++r) {
    std::vector<PipelineAction> list;
    for (int m = 0; m < micro_batches; ++m)
      for (int c = 0; c < virtual_stages; ++c) {
        const int g = s.piece(r, c);
        if (g > 0) list.push_back({PipelineAction::ReceiveActivation, m, c, (r + stages - 1) % stages});
        list.push_back({PipelineAction::Forward, m, c, -1});
        if (g < s.pieces() - 1) list.push_back({PipelineAction::SendActivation, m, c, (r + 1) % stages});
      }
    s.actions.push_back(std::move(list));
  }
  return s;
}

int message_tag(const PipelineSchedule& s, int rank, const PipelineAction& a) {
  const int g = s.piece(rank, a.chunk);
  switch (a.kind) {
    case PipelineAction::SendActivation: return 2 * (g + 1);
    case PipelineAction::ReceiveActivation: return 2 * g;
    case PipelineAction::SendGradient: return 2 * (g - 1) + 1;
    case PipelineAction::ReceiveGradient: return 2 * g + 1;
    default: return -1;
  }
}

PipelineSimulation simulate(const PipelineSchedule& s, double forward_cost, double backward_cost) {
  PipelineSimulation sim;
  const int P = s.stages;
  // In flight: (from, to, tag) -> queue of (micro-batch, time sent).
  std::map<std::tuple<int, int, int>, std::deque<std::pair<int, double>>> channels;
  std::vector<size_t> next(P, 0);
  std::vector<double> clock(P, 0), busy(P, 0);
  std::vector<int> live(P, 0);
  sim.peak_live.assign(P, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r) {
      while (next[r] < s.actions[r].size()) {
        const PipelineAction& a = s.actions[r][next[r]];
        if (a.kind == PipelineAction::Forward || a.kind == PipelineAction::Backward) {
          const double cost = a.kind == PipelineAction::Forward ? forward_cost : backward_cost;
          clock[r] += cost;
          busy[r] += cost;
          live[r] += a.kind == PipelineAction::Forward ? 1 : -1;
          sim.peak_live[r] = std::max(sim.peak_live[r], live[r]);
        } else if (a.kind == PipelineAction::SendActivation || a.kind == PipelineAction::SendGradient) {
          channels[{r, a.peer, message_tag(s, r, a)}].push_back({a.micro_batch, clock[r]});
        } else {
          auto& queue = channels[{a.peer, r, message_tag(s, r, a)}];
          if (queue.empty()) break;  // waits for the send
          if (queue.front().first != a.micro_batch) {
            sim.problem = "rank " + std::to_string(r) + "'s " + describe(a) + " would get micro-batch " + std::to_string(queue.front().first) +
                          ": sends and receives are in different orders";
            return sim;
          }
          clock[r] = std::max(clock[r], queue.front().second);
          queue.pop_front();
        }
        ++next[r];
        progress = true;
      }
    }
  }
  for (int r = 0; r < P; ++r)
    if (next[r] < s.actions[r].size()) sim.problem += (sim.problem.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " waits forever at its " + describe(s.actions[r][next[r]]);
  if (!sim.problem.empty()) return sim;
  for (const auto& [key, queue] : channels)
    if (!queue.empty()) {
      sim.problem = "rank " + std::to_string(std::get<0>(key)) + " sends micro-batch " + std::to_string(queue.front().first) + " to rank " +
                    std::to_string(std::get<1>(key)) + ", which never receives it";
      return sim;
    }
  sim.makespan = *std::max_element(clock.begin(), clock.end());
  const double total_busy = std::accumulate(busy.begin(), busy.end(), 0.0);
  sim.bubble_fraction = sim.makespan > 0 ? 1 - total_busy / (P * sim.makespan) : 0;
  return sim;
}

std::vector<std::pair<int, int>> balanced_split(const std::vector<double>& costs, int parts) {
  const int n = static_cast<int>(costs.size());
  // Ranges under `limit`, greedily, leaving at least one unit for each range still to come.
  auto split_under = [&](double limit) {
    std::vector<std::pair<int, int>> ranges;
    int begin = 0;
    double sum = 0;
    for (int i = 0; i < n; ++i) {
      const int ranges_left = parts - static_cast<int>(ranges.size());
      const bool must_close = i > begin && n - i == ranges_left - 1;  // one unit per remaining range
      if (i > begin && (sum + costs[i] > limit || must_close) && ranges_left > 1) {
        ranges.push_back({begin, i});
        begin = i;
        sum = 0;
      }
      sum += costs[i];
    }
    ranges.push_back({begin, n});
    return ranges;
  };
  auto largest = [&](const std::vector<std::pair<int, int>>& ranges) {
    double m = 0;
    for (auto [b, e] : ranges) m = std::max(m, std::accumulate(costs.begin() + b, costs.begin() + e, 0.0));
    return m;
  };
  double lo = *std::max_element(costs.begin(), costs.end()), hi = std::accumulate(costs.begin(), costs.end(), 0.0);
  for (int it = 0; it < 60 && hi - lo > 1e-12 * hi; ++it) {
    const double mid = (lo + hi) / 2;
    if (largest(split_under(mid)) <= mid) hi = mid;
    else lo = mid;
  }
  return split_under(hi);
}

}  // namespace dsrun
