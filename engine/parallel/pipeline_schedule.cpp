#include "engine/parallel/pipeline_schedule.hpp"

#include <algorithm>
#include <deque>
#include <map>
#include <numeric>
#include <tuple>

namespace dsrun {

const char* to_string(PipelineTransport t) {
  for (const auto& [transport, name] : kPipelineTransports)
    if (transport == t) return name;
  return "?";
}

std::string describe(const PipelineAction& a) {
  static const char* kNames[] = {"forward", "backward", "send activation", "receive activation", "send gradient", "receive gradient"};
  std::string s = std::string(kNames[a.kind]) + " of micro-batch " + std::to_string(a.micro_batch) + " chunk " + std::to_string(a.chunk);
  if (a.peer >= 0) s += (a.kind == PipelineAction::SendActivation || a.kind == PipelineAction::SendGradient ? " to rank " : " from rank ") + std::to_string(a.peer);
  return s;
}

std::vector<std::pair<int, int>> communication_groups(const std::vector<PipelineAction>& actions) {
  std::vector<std::pair<int, int>> groups;
  const int n = static_cast<int>(actions.size());
  for (int i = 0; i < n;) {
    if (!actions[i].communicates()) {
      ++i;
      continue;
    }
    int end = i;
    while (end < n && actions[end].communicates()) ++end;
    groups.push_back({i, end});
    i = end;
  }
  return groups;
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
  bool paired = false;  // a backward that forms one unit with the forward before it
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
    // Interleaved ranks are two warmup forwards apart, not one: with a receive before every
    // computation, each rank's (send gradient, receive activation) would wait for its previous
    // neighbour's receive gradient, all around the ring, over NCCL. Megatron-LM's unit of a
    // forward and a backward, with their messages issued together, is what meets.
    order.back().paired = kind == PipelineScheduleKind::Interleaved;
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
    const std::vector<Compute> order = compute_order(kind, P, micro_batches, virtual_stages, r);
    std::vector<PipelineAction> list;
    // Each unit (a computation, or a paired forward and backward): its receives, its computations, its sends.
    for (size_t u = 0; u < order.size();) {
      size_t end = u + 1;
      while (end < order.size() && order[end].paired) ++end;
      std::vector<PipelineAction> receives, computes, sends;
      for (size_t i = u; i < end; ++i) {
        const Compute& c = order[i];
        const int g = s.piece(r, c.chunk);
        if (c.forward) {
          if (g > 0) receives.push_back({PipelineAction::ReceiveActivation, c.micro_batch, c.chunk, previous});
          computes.push_back({PipelineAction::Forward, c.micro_batch, c.chunk, -1});
          if (g < last_piece) sends.push_back({PipelineAction::SendActivation, c.micro_batch, c.chunk, next});
        } else {
          if (g < last_piece) receives.push_back({PipelineAction::ReceiveGradient, c.micro_batch, c.chunk, next});
          computes.push_back({PipelineAction::Backward, c.micro_batch, c.chunk, -1});
          if (g > 0) sends.push_back({PipelineAction::SendGradient, c.micro_batch, c.chunk, previous});
        }
      }
      for (auto* part : {&receives, &computes, &sends}) list.insert(list.end(), part->begin(), part->end());
      u = end;
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

PipelineSimulation simulate(const PipelineSchedule& s, double forward_cost, double backward_cost, PipelineTransport transport) {
  PipelineSimulation sim;
  const int P = s.stages;
  const bool rendezvous = transport != PipelineTransport::Queued;
  // What each rank issues at once: one operation, or (coalesced) its whole communication group.
  std::vector<std::vector<size_t>> unit_end(P);
  for (int r = 0; r < P; ++r) {
    unit_end[r].resize(s.actions[r].size());
    for (size_t i = 0; i < unit_end[r].size(); ++i) unit_end[r][i] = i + 1;
    if (transport == PipelineTransport::RendezvousCoalesced)
      for (auto [begin, end] : communication_groups(s.actions[r]))
        for (int i = begin; i < end; ++i) unit_end[r][i] = end;
  }
  // Operations issued and not yet matched, per channel: (from, to, tag) for Gloo, which matches
  // by tag; (from, to) for NCCL, which matches a pair's messages in order whatever their tag.
  struct Issued {
    int rank;
    size_t index;
    double time;
  };
  struct Channel {
    std::deque<Issued> sends, receives;
  };
  std::map<std::tuple<int, int, int>, Channel> channels;
  std::vector<std::vector<double>> done(P);  // when each operation was done; -1 while it is not
  for (int r = 0; r < P; ++r) done[r].assign(s.actions[r].size(), -1);
  std::vector<size_t> next(P, 0), issued_end(P, 0);  // issued_end > next: [next, issued_end) is issued, awaited
  std::vector<double> clock(P, 0), busy(P, 0);
  std::vector<int> live(P, 0);
  sim.peak_live.assign(P, 0);

  auto issue = [&](int r, size_t i) {
    const PipelineAction& a = s.actions[r][i];
    const int tag = message_tag(s, r, a);
    Channel& c = channels[{a.sends() ? r : a.peer, a.sends() ? a.peer : r, rendezvous ? -1 : tag}];
    (a.sends() ? c.sends : c.receives).push_back({r, i, clock[r]});
    if (a.sends() && !rendezvous) done[r][i] = clock[r];  // queued: the message waits, not its sender
    for (; !c.sends.empty() && !c.receives.empty(); c.sends.pop_front(), c.receives.pop_front()) {
      const Issued snd = c.sends.front(), rcv = c.receives.front();
      const PipelineAction &sa = s.actions[snd.rank][snd.index], &ra = s.actions[rcv.rank][rcv.index];
      if (sa.micro_batch != ra.micro_batch || message_tag(s, snd.rank, sa) != message_tag(s, rcv.rank, ra)) {
        const std::string got = message_tag(s, snd.rank, sa) == message_tag(s, rcv.rank, ra)
                                    ? "micro-batch " + std::to_string(sa.micro_batch)
                                    : "the message of rank " + std::to_string(snd.rank) + "'s " + describe(sa);
        sim.problem = "rank " + std::to_string(rcv.rank) + "'s " + describe(ra) + " would get " + got + ": sends and receives are in different orders";
        return false;
      }
      const double t = std::max(snd.time, rcv.time);
      done[rcv.rank][rcv.index] = t;
      if (rendezvous) done[snd.rank][snd.index] = t;
    }
    return true;
  };

  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r) {
      while (next[r] < s.actions[r].size()) {
        if (issued_end[r] > next[r]) {
          double t = clock[r];
          bool all_done = true;
          for (size_t i = next[r]; i < issued_end[r] && all_done; ++i) {
            all_done = done[r][i] >= 0;
            t = std::max(t, done[r][i]);
          }
          if (!all_done) break;
          clock[r] = t;
          next[r] = issued_end[r];
        } else if (const PipelineAction& a = s.actions[r][next[r]]; !a.communicates()) {
          const double cost = a.kind == PipelineAction::Forward ? forward_cost : backward_cost;
          clock[r] += cost;
          busy[r] += cost;
          live[r] += a.kind == PipelineAction::Forward ? 1 : -1;
          sim.peak_live[r] = std::max(sim.peak_live[r], live[r]);
          ++next[r];
        } else {
          issued_end[r] = unit_end[r][next[r]];
          for (size_t i = next[r]; i < issued_end[r]; ++i)
            if (!issue(r, i)) return sim;
        }
        progress = true;
      }
    }
  }
  for (int r = 0; r < P; ++r) {
    if (next[r] == s.actions[r].size()) continue;
    std::string waits;
    for (size_t i = next[r]; i < issued_end[r]; ++i)
      if (done[r][i] < 0) waits += (waits.empty() ? "its " : " and its ") + describe(s.actions[r][i]);
    sim.problem += (sim.problem.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " waits forever at " + waits;
  }
  if (!sim.problem.empty()) return sim;
  for (const auto& [key, c] : channels)
    if (!c.sends.empty()) {
      const PipelineAction& a = s.actions[c.sends.front().rank][c.sends.front().index];
      sim.problem = "rank " + std::to_string(std::get<0>(key)) + " sends micro-batch " + std::to_string(a.micro_batch) + " to rank " +
                    std::to_string(std::get<1>(key)) + ", which never receives it";
      return sim;
    }
  sim.makespan = *std::max_element(clock.begin(), clock.end());
  const double total_busy = std::accumulate(busy.begin(), busy.end(), 0.0);
  sim.bubble_fraction = sim.makespan > 0 ? 1 - total_busy / (P * sim.makespan) : 0;
  return sim;
}

std::string pipeline_deadlock_problem(PipelineScheduleKind kind, int stages, int micro_batches, int virtual_stages, PipelineTransport transport) {
  if (std::string problem = pipeline_schedule_problem(kind, stages, micro_batches, virtual_stages); !problem.empty()) return problem;
  const std::string over = transport == PipelineTransport::Queued ? "" : std::string("over NCCL (") + to_string(transport) + "): ";
  const double v = virtual_stages;
  if (std::string problem = simulate(build_pipeline_schedule(kind, stages, micro_batches, virtual_stages), 1 / v, 2 / v, transport).problem; !problem.empty())
    return over + problem;
  // Evaluation runs forwards alone over the same pieces (its micro-batch count may differ; its
  // order does not depend on it).
  if (std::string problem = simulate(build_forward_schedule(stages, micro_batches, virtual_stages), 1 / v, 2 / v, transport).problem; !problem.empty())
    return over + "evaluation's forward schedule: " + problem;
  return "";
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
