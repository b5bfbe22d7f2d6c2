#include "engine/parallel/pipeline.hpp"

#include "engine/common/error.hpp"

#include <iostream>
#include <map>
#include <utility>
#include <set>
#include <sstream>

namespace dsrun {

namespace {
// Tags beyond the schedule's (message_tag < 2 · pieces, each carrying two tensors).
int tied_weight_tag(const PipelineSchedule& s) { return 4 * s.pieces(); }
int tied_gradient_tag(const PipelineSchedule& s) { return 4 * s.pieces() + 1; }
}  // namespace

// Forward keeps the chunk's inputs (leaves whose gradients go back to the previous stage) and
// outputs (whose gradients come from the next), or on the last piece the loss.
struct PipelineStage::Live {
  Tensors inputs, outputs, output_gradients;
  torch::Tensor loss;
};

PipelineStage::PipelineStage(Model& model, UnitRunner& runner, ZeroDataParallel& zero, Communicator& pipeline, std::vector<UnitRange> chunks, PipelineOptions options)
    : model_(model), runner_(runner), zero_(zero), pipeline_(pipeline), chunks_(std::move(chunks)), options_(std::move(options)) {
  int next = 0;
  for (const UnitRange& c : chunks_) {
    local_.push_back({next, next + c.size()});
    next += c.size();
  }
  open_connections();
}

// NCCL opens a pair's connections at their first use and swaps both sides' connection details in
// one message, which each side takes to mirror its own (NVIDIA/nccl pull request 2407 describes
// it). A schedule with fewer micro-batches than stages broke that: the first stage's first group
// sends activations and receives their gradient, while the second stage's first group only
// receives ("Message truncated: received 16384 bytes instead of 8192" in bootstrap.cc with
// pipeline 2 x data 2, a hang with pipeline 4, on 4 H200s). So every pair opens both directions
// here, together: each rank sends to and receives from every peer of its schedule in one group,
// messages of the schedule's own shape. Gloo needs none of it and takes it as two messages.
void PipelineStage::open_connections() {
  std::set<int> peers;
  for (const PipelineAction& a : options_.schedule.actions.at(stage()))
    if (a.communicates()) peers.insert(a.peer);
  const int tag = tied_gradient_tag(options_.schedule) + 1;
  const auto like = torch::TensorOptions().dtype(options_.dtype).device(options_.device);
  std::vector<PointToPoint> operations;
  for (int peer : peers) {
    operations.push_back({PointToPoint::Send, torch::zeros(options_.activation_shape, like), peer, tag});
    operations.push_back({PointToPoint::Receive, torch::empty(options_.activation_shape, like), peer, tag});
  }
  if (operations.empty()) return;
  Exchange opened = pipeline_.exchange(operations);
  opened.received.wait();
  opened.sent.wait();
}

PipelineTotals PipelineStage::train_step(const BatchFn& batch, const LossFn& loss, double loss_multiplier) {
  return run(options_.schedule, batch, loss, loss_multiplier);
}

PipelineTotals PipelineStage::evaluate(const BatchFn& batch, const LossFn& loss, int micro_batches) {
  torch::NoGradGuard no_grad;
  return run(build_forward_schedule(stages(), micro_batches, options_.schedule.virtual_stages), batch, loss, 0);
}

// What a stage sends is what its peer posted a receive for: [micro, seq (/ tensor), hidden] in the
// compute dtype. NCCL matches a pair's messages by order alone and reports a mismatch as a
// truncated message deep inside its transport; this names it here instead. A tensor in another
// dtype is converted (and said once): the receiver's buffer is the contract.
torch::Tensor PipelineStage::as_message(const torch::Tensor& t, const PipelineAction& a) {
  if (t.sizes() != c10::IntArrayRef(options_.activation_shape)) {
    std::ostringstream got, want;
    got << t.sizes();
    want << c10::IntArrayRef(options_.activation_shape);
    throw Error("pipeline stage " + std::to_string(stage()) + " would send " + std::string(a.kind == PipelineAction::SendGradient ? "a gradient" : "activations") + " of shape " +
                got.str() + " to stage " + std::to_string(a.peer) + ", which expects " + want.str() + " (micro-batch " + std::to_string(a.micro_batch) + ")");
  }
  if (t.scalar_type() == options_.dtype) return t;
  if (!warned_dtype_) {
    std::cerr << "pipeline stage " << stage() << ": " << (a.kind == PipelineAction::SendGradient ? "gradients" : "activations") << " in " << c10::toString(t.scalar_type())
              << " sent as " << c10::toString(options_.dtype) << ", the receiver's dtype" << std::endl;
    warned_dtype_ = true;
  }
  return t.to(options_.dtype);
}

// Tags as message_tag's, doubled: a message is the activations (or their gradient) and, for MoE
// models, the running balance loss.
void PipelineStage::communicate(const PipelineSchedule& s, const PipelineAction* begin, const PipelineAction* end, LiveMap& live) {
  std::vector<PointToPoint> operations;
  std::vector<std::pair<const PipelineAction*, Tensors>> received;
  for (const PipelineAction* a = begin; a != end; ++a) {
    Live& l = live[{a->micro_batch, a->chunk}];
    const int tag = 2 * message_tag(s, stage(), *a);
    if (a->sends()) {
      Tensors tensors = l.outputs;
      if (a->kind == PipelineAction::SendGradient) {
        tensors.clear();
        for (auto& x : l.inputs) tensors.push_back(x.grad().defined() ? x.grad() : torch::zeros_like(x));
      }
      operations.push_back({PointToPoint::Send, as_message(tensors[0].detach(), *a), a->peer, tag});
      if (options_.carries_aux_loss) operations.push_back({PointToPoint::Send, tensors[1].detach(), a->peer, tag + 1});
    } else {
      Tensors t{torch::empty(options_.activation_shape, torch::TensorOptions().dtype(options_.dtype).device(options_.device)),
                torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat32).device(options_.device))};
      operations.push_back({PointToPoint::Receive, t[0], a->peer, tag});
      if (options_.carries_aux_loss) operations.push_back({PointToPoint::Receive, t[1], a->peer, tag + 1});
      received.push_back({a, std::move(t)});
    }
  }
  Exchange exchanged = pipeline_.exchange(operations);
  sends_.push_back(std::move(exchanged.sent));
  exchanged.received.wait();
  for (auto& [a, t] : received) {
    Live& l = live[{a->micro_batch, a->chunk}];
    if (a->kind == PipelineAction::ReceiveGradient) {
      l.output_gradients = std::move(t);
      continue;
    }
    if (torch::GradMode::is_enabled())
      for (auto& x : t) x.requires_grad_(true);  // leaves: their gradients go back to the sender
    l.inputs = std::move(t);
  }
  for (const PipelineAction* a = begin; a != end; ++a)  // what was sent is no longer needed here
    if (a->kind == PipelineAction::SendGradient || (a->kind == PipelineAction::SendActivation && !torch::GradMode::is_enabled()))
      live.erase({a->micro_batch, a->chunk});
}

void PipelineStage::send_tied_weight() {
  if (options_.tied_embedding_shape.empty()) return;
  TiedEmbedding tied = model_.tied_embedding();
  if (tied.weight.defined()) zero_.offload().await_parameters(static_cast<size_t>(local_.at(0).begin));  // offload: the update may still be going up
  if (tied.weight.defined()) sends_.push_back(pipeline_.send_async(tied.weight.detach(), stages() - 1, tied_weight_tag(options_.schedule)));
  if (tied.head_copy.defined()) {
    torch::Tensor w = torch::empty(options_.tied_embedding_shape, torch::TensorOptions().dtype(options_.dtype).device(options_.device));
    pipeline_.recv(w, 0, tied_weight_tag(options_.schedule));
    torch::NoGradGuard no_grad;
    tied.head_copy.set_data(w);
  }
}

// The head's gradient of the tied weight joins the embedding's before the first stage's last
// backward reaches the embedding, so ZeRO reduces their sum (and the optimizer sees one parameter).
void PipelineStage::receive_tied_gradient() {
  if (options_.tied_embedding_shape.empty() || !torch::GradMode::is_enabled()) return;
  TiedEmbedding tied = model_.tied_embedding();
  if (!tied.weight.defined()) return;
  torch::Tensor head_gradient = torch::empty(options_.tied_embedding_shape, torch::TensorOptions().dtype(options_.gradient_dtype).device(options_.device));
  pipeline_.recv(head_gradient, stages() - 1, tied_gradient_tag(options_.schedule));
  torch::NoGradGuard no_grad;
  torch::Tensor& g = tied.weight.mutable_grad();
  if (g.defined()) g.add_(head_gradient);  // (a wider sum rounded once, into the working dtype)
  else g = head_gradient.to(options_.dtype);
}

void PipelineStage::add_tied_gradient() {
  if (options_.tied_embedding_shape.empty() || options_.gradient_dtype == options_.dtype) return;
  TiedEmbedding tied = model_.tied_embedding();
  if (!tied.head_copy.defined() || !tied.head_copy.grad().defined()) return;
  torch::NoGradGuard no_grad;
  torch::Tensor& g = tied.head_copy.mutable_grad();
  if (!tied_gradient_sum_.defined()) tied_gradient_sum_ = torch::zeros(options_.tied_embedding_shape, g.options().dtype(options_.gradient_dtype));
  tied_gradient_sum_.add_(g);
  g = torch::Tensor();  // the next micro-batch's is made afresh
}

// Sent after the step's last action, not right after the head's last backward: with two stages the
// schedule's gradients to the first stage follow that backward (with interleaving, several), and
// NCCL delivers a pair's messages in the order they were sent, which must be the order the first
// stage receives them in: every gradient of the schedule, then this.
void PipelineStage::send_tied_gradient() {
  if (options_.tied_embedding_shape.empty() || !torch::GradMode::is_enabled()) return;
  TiedEmbedding tied = model_.tied_embedding();
  if (!tied.head_copy.defined()) return;
  // A wider gradient dtype: the sum add_tied_gradient made; otherwise autograd's, taken over.
  torch::Tensor g = std::exchange(options_.gradient_dtype != options_.dtype ? tied_gradient_sum_ : tied.head_copy.mutable_grad(), torch::Tensor());
  if (!g.defined()) g = torch::zeros(options_.tied_embedding_shape, tied.head_copy.options().dtype(options_.gradient_dtype));
  sends_.push_back(pipeline_.send_async(g, 0, tied_gradient_tag(options_.schedule)));
}

PipelineTotals PipelineStage::run(const PipelineSchedule& s, const BatchFn& batch_of, const LossFn& loss_of, double loss_multiplier) {
  PipelineTotals totals;
  const int last_piece = s.pieces() - 1;
  std::map<int, Batch> batches;                     // micro-batch -> its batch, read at its first forward here
  LiveMap live;
  std::vector<int> backwards(s.virtual_stages, 0);  // backwards done per chunk this step
  const std::vector<PipelineAction>& actions = s.actions.at(stage());
  const auto groups = communication_groups(actions);
  auto group = groups.begin();
  send_tied_weight();
  for (size_t i = 0; i < actions.size(); ++i) {
    if (group != groups.end() && static_cast<int>(i) == group->first) {
      communicate(s, actions.data() + group->first, actions.data() + group->second, live);
      i = group->second - 1;
      ++group;
      continue;
    }
    const PipelineAction& a = actions[i];
    const int piece = s.piece(stage(), a.chunk);
    Live& l = live[{a.micro_batch, a.chunk}];
    if (a.kind == PipelineAction::Forward) {
      auto it = batches.find(a.micro_batch);
      if (it == batches.end()) {
        it = batches.emplace(a.micro_batch, batch_of(a.micro_batch)).first;
        totals.items += it->second.items;
      }
      Tensors out = model_.forward_chunk(a.chunk, it->second, l.inputs, runner_);
      if (piece != last_piece) {
        l.outputs = out;
        continue;
      }
      ModelOutput o;
      (model_.computes_loss() ? o.loss : o.logits) = out[0];
      if (options_.carries_aux_loss) o.aux_loss = out[1];
      o.mtp_loss = model_.last_mtp_loss();
      MicroBatchLoss m = loss_of(o, it->second);
      totals.loss_sum += m.task_loss;
      totals.aux_loss_sum += m.aux_loss;
      totals.mtp_loss_sum += m.mtp_loss;
      if (torch::GradMode::is_enabled()) l.loss = m.loss * loss_multiplier;
      else live.erase({a.micro_batch, a.chunk});
      continue;
    }
    DSRUN_ASSERT(a.kind == PipelineAction::Backward, "a schedule's sends and receives are in its communication groups");
    const bool last_backward = ++backwards[a.chunk] == s.micro_batches;
    if (piece == 0 && last_backward) receive_tied_gradient();
    zero_.begin_micro_batch(last_backward);
    if (piece == last_piece) {
      l.loss.backward();
      add_tied_gradient();
    } else {
      Tensors outputs, grads;
      for (size_t k = 0; k < l.outputs.size(); ++k)
        if (l.outputs[k].requires_grad()) {
          outputs.push_back(l.outputs[k]);
          grads.push_back(l.output_gradients.at(k));
        }
      torch::autograd::backward(outputs, grads);
    }
    zero_.after_backward(local_.at(a.chunk));
    l.outputs.clear();
    l.output_gradients.clear();
    l.loss = torch::Tensor();
    if (piece == 0) live.erase({a.micro_batch, a.chunk});
  }
  send_tied_gradient();
  for (auto& p : sends_) p.wait();
  sends_.clear();
  return totals;
}

}  // namespace dsrun
