// Pipeline schedules as data: every schedule the recipe can ask for meets its sends and receives,
// its bubble is the textbook one, and 1F1B holds fewer activations than GPipe.
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
