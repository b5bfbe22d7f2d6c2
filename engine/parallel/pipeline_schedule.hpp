// Pipeline schedules as data: for each pipeline rank, the ordered list of forward, backward, send and
// receive actions of one training step (GPipe, 1F1B, interleaved 1F1B), and a simulation that checks
// every receive meets its send (over Gloo or NCCL) and measures the bubble. Torch-free: the plan and the engine share it.
#pragma once

#include "engine/recipe/kinds.hpp"

#include <array>
#include <string>
#include <utility>
#include <vector>

namespace dsrun {

// The schedules and their recipe names (kinds.hpp).
inline constexpr const auto& kPipelineSchedules = EnumNames<PipelineScheduleKind>::table;

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
  bool communicates() const { return kind != Forward && kind != Backward; }
  bool sends() const { return kind == SendActivation || kind == SendGradient; }
};
std::string describe(const PipelineAction& a);

// The communication groups of one rank's list: each maximal run of sends and receives with no
// forward or backward between them, as [begin, end) indices. The engine issues a group's operations
// together (over NCCL as one ncclGroupStart/End, as Megatron-LM batches its isend/irecv), so that
// two neighbours' sends cannot each wait for the other's receive. The builders make these runs
// Megatron-LM's: in 1F1B's steady state a rank's (send activation, receive gradient) after a forward
// meets its next neighbour's (send gradient, receive activation) after a backward
// (send_forward_recv_backward, send_backward_recv_forward); interleaved 1F1B's steady state
// computes a forward and a backward, then sends both results and receives both next inputs in one
// group (send_forward_backward_recv_forward_backward).
std::vector<std::pair<int, int>> communication_groups(const std::vector<PipelineAction>& actions);

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
// receive of its input and each but the last's is followed by a send; backwards likewise. In
// interleaved 1F1B's steady state a forward and the backward after it are one unit: both receives
// before the forward, both sends after the backward (communication_groups says why).
PipelineSchedule build_pipeline_schedule(PipelineScheduleKind kind, int stages, int micro_batches, int virtual_stages = 1);
// The tag a send and its receive share: one channel per receiving piece and direction, so that
// activations and gradients between the same two ranks never overtake each other.
int message_tag(const PipelineSchedule& schedule, int rank, const PipelineAction& action);
// Forwards alone (evaluation): each rank runs its chunks of micro-batch 0, then of 1, and so on.
PipelineSchedule build_forward_schedule(int stages, int micro_batches, int virtual_stages = 1);

// How sends and receives meet, which decides whether a schedule can stall.
//  - Queued (Gloo, as the engine runs it on CPU ranks): a send does not wait (its message is
//    queued); a receive waits for the message with its tag, whatever else is in flight.
//  - Rendezvous (NCCL, every operation issued alone and waited in list order): the operations
//    between two ranks in one direction match in the order each side issues them, whatever their
//    tag, and a send is done only once its receive is issued (a large message cannot be buffered).
//  - RendezvousCoalesced (NCCL as the engine issues it): the same matching, but each communication
//    group (communication_groups) is issued at once and done when all its operations have matched.
enum class PipelineTransport { Queued, Rendezvous, RendezvousCoalesced };
// One table for the transports' names (messages, tests).
inline constexpr std::array<std::pair<PipelineTransport, const char*>, 3> kPipelineTransports{
    {{PipelineTransport::Queued, "queued"}, {PipelineTransport::Rendezvous, "rendezvous"}, {PipelineTransport::RendezvousCoalesced, "coalesced rendezvous"}}};
const char* to_string(PipelineTransport t);

// What running the schedule would do over `transport`. A forward of one piece costs forward_cost,
// a backward backward_cost; messages take no time, and a rank waits from issuing an operation until
// it is done.
struct PipelineSimulation {
  std::string problem;          // "" if every receive meets its send, in order, and nothing waits forever
  double makespan = 0;          // time until the last rank finishes
  double bubble_fraction = 0;   // idle share of the ranks' time: 1 - busy / (ranks · makespan)
  std::vector<int> peak_live;   // per rank: most micro-batch pieces whose forward ran and backward has not (activations held)
};
PipelineSimulation simulate(const PipelineSchedule& schedule, double forward_cost = 1, double backward_cost = 2,
                            PipelineTransport transport = PipelineTransport::Queued);

// Why this training step's schedule, or the forward schedule evaluation runs over the same pieces,
// would stall or mismatch its messages over `transport` ("" when both run): the sizes' own problem
// (pipeline_schedule_problem) first. The plan asks it for the transport the ranks will use: Queued
// on CPU ranks (Gloo), RendezvousCoalesced on GPUs (NCCL).
std::string pipeline_deadlock_problem(PipelineScheduleKind kind, int stages, int micro_batches, int virtual_stages, PipelineTransport transport);

// Contiguous split of `costs` (one per unit, in order) into `parts` ranges [begin, end), each
// non-empty, minimising the largest range's sum. parts <= costs.size().
std::vector<std::pair<int, int>> balanced_split(const std::vector<double>& costs, int parts);

}  // namespace dsrun
