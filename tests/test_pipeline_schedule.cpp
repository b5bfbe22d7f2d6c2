// Pipeline schedules as data: every schedule the recipe can ask for meets its sends and receives (over
// Gloo, and over NCCL with each communication group issued at once), its bubble is the textbook one,
// and 1F1B holds fewer activations than GPipe.
#include "engine/parallel/pipeline_schedule.hpp"

#include <catch2/catch.hpp>

using namespace dsrun;

namespace {
int count(const PipelineSchedule& s, int rank, PipelineAction::Kind kind) {
  int n = 0;
  for (const auto& a : s.actions[rank]) n += a.kind == kind;
  return n;
}
}  // namespace

TEST_CASE("every schedule runs each micro-batch's forward and backward once per chunk, and all sends meet their receives", "[pipeline]") {
  for (auto [kind, name] : kPipelineSchedules)
    for (int P : {1, 2, 3, 4})
      for (int M : {1, 2, 4, 8, 12})
        for (int v : {1, 2, 3}) {
          if (!pipeline_schedule_problem(kind, P, M, v).empty()) continue;
          INFO(name << " P=" << P << " M=" << M << " v=" << v);
          PipelineSchedule s = build_pipeline_schedule(kind, P, M, v);
          for (int r = 0; r < P; ++r) {
            CHECK(count(s, r, PipelineAction::Forward) == M * v);
            CHECK(count(s, r, PipelineAction::Backward) == M * v);
          }
          PipelineSimulation sim = simulate(s);
          CHECK(sim.problem.empty());
          CHECK(simulate(build_forward_schedule(P, M, v)).problem.empty());
        }
}

TEST_CASE("the bubble is (p-1)/(m+p-1) for GPipe and 1F1B, and interleaving shrinks it by the virtual stages", "[pipeline]") {
  const int P = 4, M = 8;
  const double ideal = double(P - 1) / (M + P - 1);
  CHECK(simulate(build_pipeline_schedule(PipelineScheduleKind::GPipe, P, M)).bubble_fraction == Approx(ideal));
  CHECK(simulate(build_pipeline_schedule(PipelineScheduleKind::OneFOneB, P, M)).bubble_fraction == Approx(ideal));
  // Interleaved with v chunks per rank (each 1/v of the work): Narayanan et al. 2021, (p-1)/(v·m + p-1).
  const int v = 2;
  PipelineSimulation inter = simulate(build_pipeline_schedule(PipelineScheduleKind::Interleaved, P, M, v), 1.0 / v, 2.0 / v);
  CHECK(inter.problem.empty());
  CHECK(inter.bubble_fraction == Approx(double(P - 1) / (v * M + P - 1)));
}

TEST_CASE("1F1B keeps at most p - r micro-batches live on rank r, GPipe all of them", "[pipeline]") {
  const int P = 4, M = 8;
  PipelineSimulation gpipe = simulate(build_pipeline_schedule(PipelineScheduleKind::GPipe, P, M));
  PipelineSimulation one = simulate(build_pipeline_schedule(PipelineScheduleKind::OneFOneB, P, M));
  for (int r = 0; r < P; ++r) {
    CHECK(gpipe.peak_live[r] == M);
    CHECK(one.peak_live[r] == P - r);
  }
  // Interleaved: rank 0 holds (p-1)·2 + (v-1)·p + 1 chunk activations at its peak, each 1/v of a stage's.
  PipelineSimulation inter = simulate(build_pipeline_schedule(PipelineScheduleKind::Interleaved, P, M, 2));
  CHECK(inter.peak_live[0] == (P - 1) * 2 + P + 1);
}

TEST_CASE("a schedule whose receives are out of order, or never sent, is refused with the rank and action", "[pipeline]") {
  PipelineSchedule s = build_pipeline_schedule(PipelineScheduleKind::GPipe, 2, 2);
  // Rank 1 receives micro-batch 1's activation before micro-batch 0's.
  auto& r1 = s.actions[1];
  std::swap(r1[0], r1[2]);
  std::swap(r1[1], r1[3]);
  PipelineSimulation sim = simulate(s);
  CHECK_THAT(sim.problem, Catch::Contains("rank 1") && Catch::Contains("receive activation of micro-batch 1") && Catch::Contains("different orders"));

  PipelineSchedule lost = build_pipeline_schedule(PipelineScheduleKind::OneFOneB, 2, 1);
  lost.actions[0].erase(lost.actions[0].begin() + 1);  // rank 0 never sends micro-batch 0's activation
  CHECK_THAT(simulate(lost).problem, Catch::Contains("rank 1 waits forever at its receive activation of micro-batch 0"));
}

TEST_CASE("schedules that cannot be built say why", "[pipeline]") {
  CHECK_THAT(pipeline_schedule_problem(PipelineScheduleKind::Interleaved, 4, 6, 2), Catch::Contains("multiple of the pipeline stages (4)"));
  CHECK_THAT(pipeline_schedule_problem(PipelineScheduleKind::Interleaved, 4, 8, 1), Catch::Contains("at least 2 virtual stages"));
  CHECK_THAT(pipeline_schedule_problem(PipelineScheduleKind::OneFOneB, 4, 8, 2), Catch::Contains("one chunk per rank"));
  CHECK(pipeline_schedule_problem(PipelineScheduleKind::GPipe, 4, 3, 1).empty());
}

TEST_CASE("a balanced split minimises the costliest stage and leaves none empty", "[pipeline]") {
  // Embedding, 6 equal blocks, a head as costly as two blocks: stages of 4.1 and 4.
  std::vector<double> costs{0.1, 1, 1, 1, 1, 1, 1, 2};
  auto split = balanced_split(costs, 2);
  REQUIRE(split.size() == 2);
  CHECK(split[0] == std::pair<int, int>{0, 5});
  CHECK(split[1] == std::pair<int, int>{5, 8});
  // As many stages as units: one each.
  auto each = balanced_split({1, 1, 1}, 3);
  CHECK(each == std::vector<std::pair<int, int>>{{0, 1}, {1, 2}, {2, 3}});
  // A very costly first unit still leaves every stage a unit.
  auto heavy = balanced_split({10, 1, 1, 1}, 3);
  CHECK(heavy == std::vector<std::pair<int, int>>{{0, 1}, {1, 3}, {3, 4}});
}

TEST_CASE("over NCCL, 1F1B stalls when each send and receive is issued alone, GPipe does not", "[pipeline]") {
  // NCCL matches a pair's messages in order and a large send waits for its receive: in 1F1B's
  // steady state both neighbours send first.
  for (int P = 2; P <= 8; ++P)
    for (int M : {2, 4, 8, 16}) {
      INFO("P=" << P << " M=" << M);
      CHECK_THAT(simulate(build_pipeline_schedule(PipelineScheduleKind::OneFOneB, P, M), 1, 2, PipelineTransport::Rendezvous).problem,
                 Catch::Contains("waits forever at its send"));
      CHECK(simulate(build_pipeline_schedule(PipelineScheduleKind::GPipe, P, M), 1, 2, PipelineTransport::Rendezvous).problem.empty());
    }
  // Every waiting rank is named with its action.
  CHECK(simulate(build_pipeline_schedule(PipelineScheduleKind::OneFOneB, 2, 2), 1, 2, PipelineTransport::Rendezvous).problem ==
        "rank 0 waits forever at its send activation of micro-batch 1 chunk 0 to rank 1; "
        "rank 1 waits forever at its send gradient of micro-batch 0 chunk 0 to rank 0");
  CHECK_THAT(pipeline_deadlock_problem(PipelineScheduleKind::OneFOneB, 4, 8, 1, PipelineTransport::Rendezvous),
             Catch::StartsWith("over NCCL (rendezvous): rank 0 waits forever"));
}

TEST_CASE("over NCCL with each communication group issued together, every schedule completes with the queued bubble", "[pipeline]") {
  int checked = 0;
  for (auto [kind, name] : kPipelineSchedules)
    for (int P = 2; P <= 8; ++P)
      for (int M = 1; M <= 16; ++M)
        for (int v : {1, 2, 4}) {
          if (!pipeline_schedule_problem(kind, P, M, v).empty()) continue;
          INFO(name << " P=" << P << " M=" << M << " v=" << v);
          const PipelineSchedule s = build_pipeline_schedule(kind, P, M, v);
          const PipelineSimulation queued = simulate(s, 1.0 / v, 2.0 / v);
          const PipelineSimulation coalesced = simulate(s, 1.0 / v, 2.0 / v, PipelineTransport::RendezvousCoalesced);
          REQUIRE(coalesced.problem.empty());
          // A group waits for its sends' receives too, but each rank's neighbour issues them no
          // later than the messages this rank waits for anyway: nothing starts later.
          CHECK(coalesced.makespan == Approx(queued.makespan));
          CHECK(coalesced.bubble_fraction == Approx(queued.bubble_fraction).margin(1e-12));
          CHECK(coalesced.peak_live == queued.peak_live);
          CHECK(pipeline_deadlock_problem(kind, P, M, v, PipelineTransport::RendezvousCoalesced).empty());
          ++checked;
        }
  CHECK(checked == 2 * 7 * 16 + 2 * 26);  // GPipe and 1F1B at every size, interleaved at 26 sizes, v = 2 and 4
  // Other costs (a backward no dearer than a forward) change nothing either.
  const PipelineSchedule s = build_pipeline_schedule(PipelineScheduleKind::Interleaved, 4, 8, 2);
  CHECK(simulate(s, 1, 1, PipelineTransport::RendezvousCoalesced).makespan == Approx(simulate(s, 1, 1).makespan));
}

TEST_CASE("communication groups pair a rank's send with its neighbour's receive of the same micro-batch", "[pipeline]") {
  std::vector<PipelineAction> list{{PipelineAction::ReceiveActivation, 0, 0, 0}, {PipelineAction::Forward, 0, 0, -1},
                                   {PipelineAction::SendActivation, 0, 0, 2},   {PipelineAction::ReceiveGradient, 0, 0, 2},
                                   {PipelineAction::Backward, 0, 0, -1},         {PipelineAction::SendGradient, 0, 0, 0}};
  CHECK(communication_groups(list) == std::vector<std::pair<int, int>>{{0, 1}, {2, 4}, {5, 6}});
  CHECK(communication_groups({}).empty());

  // 1F1B's steady state: rank r's (send activation k, receive gradient j) meets rank r+1's
  // (send gradient j, receive activation k): Megatron-LM's send_forward_recv_backward.
  const int P = 4, M = 8;
  const PipelineSchedule s = build_pipeline_schedule(PipelineScheduleKind::OneFOneB, P, M);
  int pairs = 0, expected_pairs = 0;
  for (int r = 0; r + 1 < P; ++r) expected_pairs += M - (P - 1 - r);  // one per forward of the steady state
  for (int r = 0; r + 1 < P; ++r)
    for (auto [b, e] : communication_groups(s.actions[r])) {
      const auto& a = s.actions[r];
      if (e - b != 2 || a[b].kind != PipelineAction::SendActivation || a[b + 1].kind != PipelineAction::ReceiveGradient) continue;
      const std::vector<PipelineAction> expected{{PipelineAction::SendGradient, a[b + 1].micro_batch, 0, r},
                                                 {PipelineAction::ReceiveActivation, a[b].micro_batch, 0, r}};
      bool found = false;
      for (auto [nb, ne] : communication_groups(s.actions[r + 1]))
        found |= std::vector<PipelineAction>(s.actions[r + 1].begin() + nb, s.actions[r + 1].begin() + ne) == expected;
      INFO("rank " << r << " group at " << b);
      CHECK(found);
      ++pairs;
    }
  CHECK(pairs == expected_pairs);
}

TEST_CASE("NCCL matches messages whatever their tag: a gradient sent before an activation is refused", "[pipeline]") {
  // Two ranks, two chunks each: rank 0 sends piece 2's gradient, then piece 0's activation; rank 1
  // receives the activation first. Gloo tells them apart by tag, NCCL would swap them.
  PipelineSchedule s;
  s.kind = PipelineScheduleKind::Interleaved;
  s.stages = 2, s.micro_batches = 1, s.virtual_stages = 2;
  s.actions = {{{PipelineAction::SendGradient, 0, 1, 1}, {PipelineAction::SendActivation, 0, 0, 1}},
               {{PipelineAction::ReceiveActivation, 0, 0, 0}, {PipelineAction::ReceiveGradient, 0, 0, 0}}};
  CHECK(simulate(s).problem.empty());
  for (PipelineTransport t : {PipelineTransport::Rendezvous, PipelineTransport::RendezvousCoalesced}) {
    INFO(to_string(t));
    CHECK_THAT(simulate(s, 1, 2, t).problem,
               Catch::Contains("rank 1's receive activation of micro-batch 0 chunk 0 from rank 0 would get the message of rank 0's send gradient of "
                               "micro-batch 0 chunk 1 to rank 1") &&
                   Catch::Contains("different orders"));
  }
}

TEST_CASE("the deadlock check names the sizes' problem first, and passes what runs", "[pipeline]") {
  CHECK_THAT(pipeline_deadlock_problem(PipelineScheduleKind::Interleaved, 4, 6, 2, PipelineTransport::RendezvousCoalesced),
             Catch::Contains("multiple of the pipeline stages (4)"));
  CHECK(pipeline_deadlock_problem(PipelineScheduleKind::OneFOneB, 4, 8, 1, PipelineTransport::Queued).empty());
  CHECK(pipeline_deadlock_problem(PipelineScheduleKind::GPipe, 4, 8, 1, PipelineTransport::Rendezvous).empty());
  CHECK(std::string(to_string(PipelineTransport::RendezvousCoalesced)) == "coalesced rendezvous");
}
