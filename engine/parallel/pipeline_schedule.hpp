// Pipeline schedules as data: for each pipeline rank, the ordered list of forward, backward, send and
// receive actions of one training step (GPipe, 1F1B, interleaved 1F1B), and a simulation that checks
// every receive meets its send and measures the bubble. Torch-free: the plan and the engine share it.
#pragma once

#include <array>
#include <string>
#include <utility>
#include <vector>

namespace dsrun {

enum class PipelineScheduleKind { GPipe, OneFOneB, Interleaved };

// One table for the schedules' recipe names (parsing, printing, the schema).
inline constexpr std::array<std::pair<PipelineScheduleKind, const char*>, 3> kPipelineSchedules{
    {{PipelineScheduleKind::GPipe, "gpipe"}, {PipelineScheduleKind::OneFOneB, "1f1b"}, {PipelineScheduleKind::Interleaved, "interleaved"}}};
const char* to_string(PipelineScheduleKind k);

// The model is cut into stages × virtual_stages pieces ("virtual stages", in order); rank r runs
// pieces r, r + stages, r + 2·stages, ... (Megatron-LM's interleaving): its chunk c is piece
// c·stages + r. Without interleaving each rank has one chunk.
struct PipelineAction {
  enum Kind { Forward, Backward, SendActivation, ReceiveActivation, SendGradient, ReceiveGradient };
  Kind kind = Forward;
  int micro_batch = 0;
  int chunk = 0;  // this rank's chunk (0 .. virtual_stages-1)
  // The rank a send goes to or a receive comes from (-1 for Forward/Backward).
  int peer = -1;
  bool operator==(const PipelineAction& o) const { return kind == o.kind && micro_batch == o.micro_batch && chunk == o.chunk && peer == o.peer; }
};
std::string describe(const PipelineAction& a);

struct PipelineSchedule {
  PipelineScheduleKind kind = PipelineScheduleKind::OneFOneB;
  int stages = 1, micro_batches = 1, virtual_stages = 1;
  std::vector<std::vector<PipelineAction>> actions;  // per pipeline rank, in order
  // The piece a rank's chunk runs, and the rank/chunk that runs a piece.
  int piece(int rank, int chunk) const { return chunk * stages + rank; }
  int pieces() const { return stages * virtual_stages; }
};

// Why a schedule cannot be built for these sizes ("" when it can): interleaving needs at least two
// virtual stages and micro-batches in multiples of the stages (as Megatron-LM requires).
std::string pipeline_schedule_problem(PipelineScheduleKind kind, int stages, int micro_batches, int virtual_stages);
// The step's actions. Computation order: GPipe runs every forward, then every backward; 1F1B
// runs stages-1-r forwards, then alternates one forward and one backward, then drains; interleaved
// does the same over virtual stages. Each forward of a piece but the first is preceded by the
// receive of its input and each but the last's is followed by a send; backwards likewise.
PipelineSchedule build_pipeline_schedule(PipelineScheduleKind kind, int stages, int micro_batches, int virtual_stages = 1);
// The tag a send and its receive share: one channel per receiving piece and direction, so that
// activations and gradients between the same two ranks never overtake each other.
int message_tag(const PipelineSchedule& schedule, int rank, const PipelineAction& action);
// Forwards alone (evaluation): each rank runs its chunks of micro-batch 0, then of 1, and so on.
PipelineSchedule build_forward_schedule(int stages, int micro_batches, int virtual_stages = 1);

// What running the schedule would do, with sends that do not wait (they are queued) and receives
// that wait for their message. A forward of one piece costs forward_cost, a backward backward_cost.
struct PipelineSimulation {
  std::string problem;          // "" if every receive meets its send, in order, and nothing waits forever
  double makespan = 0;          // time until the last rank finishes
  double bubble_fraction = 0;   // idle share of the ranks' time: 1 - busy / (ranks · makespan)
  std::vector<int> peak_live;   // per rank: most micro-batch pieces whose forward ran and backward has not (activations held)
};
PipelineSimulation simulate(const PipelineSchedule& schedule, double forward_cost = 1, double backward_cost = 2);

// Contiguous split of `costs` (one per unit, in order) into `parts` ranges [begin, end), each
// non-empty, minimising the largest range's sum. parts <= costs.size().
std::vector<std::pair<int, int>> balanced_split(const std::vector<double>& costs, int parts);

}  // namespace dsrun
