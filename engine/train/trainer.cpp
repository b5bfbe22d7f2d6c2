#include "engine/train/trainer.hpp"

#include "engine/common/build_kernels.hpp"
#include "engine/common/environment.hpp"
#include "engine/common/host_cores.hpp"
#include "engine/common/error.hpp"
#include "engine/common/files.hpp"
#include "engine/common/host.hpp"
#include "engine/common/mapped_file.hpp"
#include "engine/common/tensor_pack.hpp"
#include "engine/common/text.hpp"
#include "engine/common/torch_compat.hpp"
#include "engine/data/data_identity.hpp"
#include "engine/data/dataset.hpp"
#include "engine/dist/mesh.hpp"
#include "engine/hooks/hooks.hpp"
#include "engine/model/model.hpp"
#include "engine/parallel/copy_stream.hpp"
#include "engine/parallel/parallelize.hpp"
#include "engine/plan/plan.hpp"
#include "engine/recipe/load.hpp"
#include "engine/train/checkpointing.hpp"
#include "engine/train/fault_injection.hpp"
#include "engine/train/loss.hpp"
#include "engine/train/loss_scaler.hpp"
#include "engine/train/optimizer.hpp"
#include "engine/protocol/rank_reports.hpp"
#include "engine/train/schedule.hpp"
#include "engine/train/step_graph.hpp"

#ifdef DSRUN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif
#include <torch/cuda.h>

#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <cstdio>
#include <csignal>
#include <cstring>
#include <cstdlib>
#include <optional>
#include <iostream>
#include <limits>
#include <map>

// A debugger attached to a rank started with --debug-rank sets this to 1 to let it go on.
extern "C" {
volatile int dsrun_debugger_attached = 0;
}

namespace dsrun {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double peak_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) * 1024.0;
}

// A line of /proc/self/status in bytes ("RssAnon:  1234 kB"): anonymous memory is the rank's own;
// mapped token files are RssFile, the page cache's, shared by every rank on the host.
double status_bytes(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(field) + ":";
  while (std::getline(in, line))
    if (line.compare(0, prefix.size(), prefix) == 0) return std::atof(line.c_str() + prefix.size()) * 1024.0;
  return 0;
}

// Metrics as reported. Hooks see them as JSON, where a hook may have put a value that is not a
// number: that becomes NaN, which the launcher names instead of storing.
Metrics to_metrics(const nlohmann::json& metrics) {
  Metrics out;
  for (const auto& [name, value] : metrics.items())
    out.emplace_back(name, value.is_number() ? value.get<double>() : std::numeric_limits<double>::quiet_NaN());
  return out;
}

// What every rank checks against rank 0's at the rendezvous (RendezvousOptions::identity): the
// resolved settings it runs, less those each node resolves for itself (its memory with "auto", paths
// made absolute from its own directory), and this build's torch and kernels. Two nodes started with
// different recipes, overrides or builds are refused there, naming the keys.
std::string rank_identity(const std::string& config_toml) {
  static const char* const kPerNode[] = {"hardware.memory_gib", "hardware.host_memory_gib", "data.path", "data.val_path", "data.blend",
                                         "hooks.script", "model.init_from", "checkpoint.dir"};
  std::string out;
  for (const auto& [key, value] : toml_settings(config_toml))
    if (std::none_of(std::begin(kPerNode), std::end(kPerNode), [&](const char* k) { return key == k; })) out += key + " = " + value + "\n";
  const BuildKernels k = this_build_kernels();
  out += "\n[build]\ntorch = \"" + std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." + std::to_string(TORCH_VERSION_PATCH) +
         "\"\ncuda = " + (k.cuda ? "true" : "false") + "\ndevice_adam = " + (k.device_adam ? "true" : "false") + "\nfused_adam = " + (k.fused_adam ? "true" : "false") +
         "\nvarlen_attention = " + (k.varlen_attention ? "true" : "false") + "\nfp8_products = " + (k.fp8_products ? "true" : "false") +
         "\nfp8_grouped_products = " + (k.fp8_grouped_products ? "true" : "false") + "\n";
  return out;
}

volatile std::sig_atomic_t stop_requested = 0;
void on_stop_signal(int) { stop_requested = 1; }
volatile std::sig_atomic_t save_requested = 0;  // SIGUSR1: checkpoint after the current step
void on_save_signal(int) { save_requested = 1; }

struct RankContext {
  int rank = 0, world = 1, local_rank = 0, local_world = 1;
  std::string run_id;           // DSRUN_RUN_ID from the launcher; "" under torchrun
  std::string config_toml;      // the resolved config this rank runs, recorded in checkpoints
  std::string checkpoint_root;  // where step_N/ directories go
  std::string resume_from;      // a checkpoint directory to start from, or ""
};

// What every rank agrees on after a step: signals travel in the metrics' all-reduce, hook
// decisions in a broadcast from rank 0.
struct StepOutcome {
  bool stop = false;        // a rank was asked to stop, or a hook stopped the run
  bool save = false;        // a rank or a hook asked for a checkpoint
  bool hook_failed = false; // rank 0's hook failed under hooks.on_error = "fail"
  std::string why;          // "signal" or the hook's reason
};

class Trainer {
 public:
  Trainer(const Recipe& recipe, const Plan& plan, const RankContext& ctx, RankReporter& reporter)
      : r_(recipe), plan_(plan), ctx_(ctx), report_(reporter) {}

  void run() {
    auto t_start = std::chrono::steady_clock::now();
    select_device();
    if (fault_requested(Fault::StopAt, ctx_.rank, 0)) ::raise(SIGSTOP);  // step 0: stopped during start-up
    connect_to_mesh();
    build_the_model();
    apply_parallelism();
    create_optimizer();
    open_data();
    const int64_t first_step = start_hooks_and_resume();
    report_.send(ReadyReport{seconds_since(t_start), first_step + 1});

    if (hooks_) run_hook([&] { hooks_->on_start(hook_context(first_step, {})); });
    if (plan_.checkpoint_disk.saves > 0) {  // the staging memory now, not in the first save's pause
      RankTrainingState state = training_state();
      checkpoint_saver().reserve(state);
    }

    // Steps are numbered from 1 in reports and checkpoints; `step` here counts those completed.
    LrScheduleOptions lr_options{r_.schedule, r_.optimizer.lr, r_.run.steps};
    StepOutcome last;
    int64_t done = first_step;
    profile_ = profile_request();
    for (int64_t step = first_step; step < r_.run.steps; ++step) {
      if (fault_requested(Fault::CrashAt, ctx_.rank, step + 1)) ::raise(SIGKILL);
      while (fault_requested(Fault::HangAt, ctx_.rank, step + 1)) ::sleep(1);
      if (fault_requested(Fault::StopAt, ctx_.rank, step + 1)) ::raise(SIGSTOP);  // as `kill -STOP` would
      report_.send(BeatReport{step + 1});  // "started step N": the launcher names a rank that falls behind
      profile_steps(step + 1, /*before=*/true);
      // The schedule counts applied updates: an fp16 step skipped for overflow does not advance it
      // (Megatron-LM and DeepSpeed alike), so that skipped warm-up steps do not move Adam's first
      // updates, each about lr per weight whatever the gradient, to a later and larger rate.
      const int64_t skipped_for_overflow = scaler_ ? scaler_->skipped_steps() : 0;
      StepOutcome outcome = train_step(step, learning_rate_at(lr_options, step - skipped_for_overflow));
      profile_steps(step + 1, /*before=*/false);
      if (step == first_step) report_memory();
      done = step + 1;
      if (!outcome.stop && r_.eval.every > 0 && (done % r_.eval.every == 0 || done == r_.run.steps)) merge(outcome, evaluate(step));
      const bool at_interval = r_.checkpoint.every > 0 && done % r_.checkpoint.every == 0;
      const bool at_end = r_.checkpoint.at_end && (done == r_.run.steps || outcome.stop) && !outcome.hook_failed;
      if (at_interval || at_end || outcome.save) save(done, outcome.save ? "requested" : at_interval ? "interval" : "end");
      else if (saver_) report_saved(saver_->finished());
      last = outcome;
      if (outcome.stop) {
        if (outcome.why == "signal")
          report_.send(EventReport{"stopped", "stopped by signal after step " + std::to_string(done)});
        else if (ctx_.rank == 0 && !outcome.hook_failed)
          report_.send(EventReport{"hook_stop", "stopped by a hook after step " + std::to_string(done) + ": " + outcome.why});
        break;
      }
    }
    zero_->offload().wait_host_update();  // the last host update's errors surface here, not in a destructor
    if (saver_) report_saved(saver_->wait());  // the last asynchronous save is complete before the run is
    // The GPU allocator's peaks again, over the whole run: evaluations, saves and a CUDA graph's pool
    // come after the first step (the store keeps the latest report: after a resume, the resumed
    // launch's peaks). The host's peak RSS stays the first step's: over a whole CPU run with the optimizer offloaded it grew 20% past the
    // plan's host term (found here, not yet planned: docs/benchmarks.md, 2026-11-28).
    if (done > first_step) report_device_peaks();
    if (hooks_ && !last.hook_failed)
      run_hook([&] { hooks_->on_end(hook_context(done, {}), {{"steps", done}, {"reason", last.stop ? last.why : "finished"}, {"loss", last_loss_}}); });
    mesh_->world().barrier();
    // A hook that failed under hooks.on_error = "fail": every rank stopped cleanly at the same step;
    // rank 0 now fails the run with the hook's error.
    if (pending_hook_error_) throw *pending_hook_error_;
  }

 private:
  // ---- set-up, in run()'s order ----

  // cuda:LOCAL_RANK on GPU recipes; the CPU otherwise.
  void select_device() {
    if (r_.hardware.device != Device::Cuda) return;
    if (!torch::cuda::is_available() || static_cast<int>(torch::cuda::device_count()) <= ctx_.local_rank) {
      ErrorContext c;
      c.rank = ctx_.rank;
      c.hint = "run where the GPUs are, or try the layout on CPU ranks with --smoke";
      throw Error("the recipe needs CUDA device " + std::to_string(ctx_.local_rank) + "; this process sees " +
                      std::to_string(torch::cuda::is_available() ? torch::cuda::device_count() : 0) + " GPU(s)",
                  c);
    }
#ifdef DSRUN_WITH_CUDA
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(ctx_.local_rank));
    // execution.cuda_graphs: every step on a stream of its own, not the legacy default stream. A
    // graph is captured on the stream the step runs on, and autograd's gradient accumulators keep
    // the stream they were made on: made on the default stream, the captured backward would make
    // it wait on the capture ("operation would make the legacy stream depend on a capturing
    // blocking stream", the first GPU run of this mode).
    if (plan_.modes.cuda_graphs) c10::cuda::setCurrentCUDAStream(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, static_cast<c10::DeviceIndex>(ctx_.local_rank)));
#endif
    device_ = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(ctx_.local_rank));
    cap_device_memory();
  }

  // The recipe's GPU memory is what the plan promised to fit in, so the allocator keeps to it: on a
  // GPU larger than the recipe's (a 24 GiB card stood in for by an H100) a run that would not fit
  // the real card runs out of memory here too. The allocator never sees the runtime's share (the
  // CUDA context, NCCL), so it gets hardware.memory_gib less hardware.runtime_memory_gib.
  void cap_device_memory() {
#ifdef DSRUN_WITH_CUDA
    const double total = static_cast<double>(at::cuda::getDeviceProperties(device_.index())->totalGlobalMem);
    const double allowed = r_.hardware.memory_bytes - r_.hardware.runtime_memory_bytes;
    if (allowed <= 0 || allowed >= total) return;
    torch::empty({1}, torch::TensorOptions().device(device_));  // the allocator exists once the device has been used
    c10::cuda::CUDACachingAllocator::setMemoryFraction(allowed / total, device_.index());
    if (ctx_.local_rank == 0)
      report_.send(EventReport{"memory_cap", "the allocator capped at " + format_bytes(allowed) + " of each GPU's " + format_bytes(total) +
                                                 " (hardware.memory_gib less hardware.runtime_memory_gib)"});
#endif
  }

  // The rendezvous, then the world's group and one per mesh dimension (docs/parallelism.md).
  void connect_to_mesh() {
    RendezvousOptions rv;
    rv.use_nccl = device_.is_cuda();
    rv.cuda_device = ctx_.local_rank;
    rv.master_addr = env_string("MASTER_ADDR", "127.0.0.1");
    rv.master_port = env_int("MASTER_PORT", 29500);
    rv.rank = ctx_.rank;
    rv.world_size = ctx_.world;
    rv.timeout_s = plan_.startup_timeout_seconds;
    rv.identity = rank_identity(ctx_.config_toml);
    mesh_ = connect_mesh(rv, plan_.layout.mesh_shape());
  }

  // Identical weights on every rank and layout. A decoder is built deferred: ZeRO builds one unit
  // at a time and keeps what this rank holds (weights from a file load whole).
  void build_the_model() {
    torch::manual_seed(static_cast<uint64_t>(r_.run.seed));  // whatever else draws from torch's generator
    ModelBuild build;
    build.seed = static_cast<uint64_t>(r_.run.seed);
    build.deferred = r_.model.arch == ModelArch::DeepSeek && r_.model.init_from.empty();
    if (r_.model.arch == ModelArch::DeepSeek) {  // the plan's choices, pinned by the launcher
      build.loss_chunk_tokens = plan_.modes.loss_chunk_tokens;
      build.loss_gradients_in_forward = plan_.modes.loss_gradients_in_forward;
      build.variable_length_attention = plan_.modes.variable_length_attention;
      build.fp8 = r_.precision.fp8;
      build.fp8_routed_experts = plan_.modes.fp8_routed_experts;
    }
    model_ = build_model(r_.model, r_.batch.seq_len, build);
    if (!r_.model.init_from.empty()) {
      load_pretrained_weights(*model_, r_.model, r_.model.init_from);
      if (ctx_.rank == 0) report_.send(EventReport{"init", "weights initialised from " + r_.model.init_from});
    }
    if (!build.deferred) model_->module().to(device_);
    // Buffers (BatchNorm statistics) in the compute dtype; parameters are converted by ZeRO,
    // which keeps their fp32 initial values as the master copy.
    compute_dtype_ = torch_dtype(plan_.dtype);
    torch::NoGradGuard no_grad;
    // BatchNorm statistics stay per rank (not synchronised), as with PyTorch's DDP.
    // Kept fp32, on the device: the MoE selection bias (its steps of 1e-3 would round away in
    // bf16), and on a GPU BatchNorm's statistics (cuDNN's batch norm wants them so, resnet.cpp).
    for (auto& b : model_->module().named_buffers()) {
      const bool fp32 = ends_with(b.key(), "moe.expert_bias") ||
                        (device_.is_cuda() && (ends_with(b.key(), "running_mean") || ends_with(b.key(), "running_var")));
      if (fp32) b.value().set_data(b.value().to(device_));
      else if (b.value().is_floating_point()) b.value().set_data(b.value().to(compute_dtype_));
    }
  }

  // parallelize(): pipeline split, tensor sharding, recomputation, ZeRO over the data dimension.
  void apply_parallelism() {
    ParallelizeOptions po;
    if (plan_.layout.pipeline > 1) {
      for (auto [begin, end] : plan_.pipeline_pieces) po.pipeline_pieces.push_back({begin, end});
      PipelineOptions& pipe = po.pipeline;
      pipe.schedule = build_pipeline_schedule(plan_.layout.schedule, plan_.layout.pipeline, static_cast<int>(plan_.accumulation), plan_.layout.virtual_stages);
      const int64_t t = plan_.layout.tensor;
      pipe.activation_shape = {plan_.layout.micro, r_.batch.seq_len / (plan_.layout.sequence_parallel ? t : 1), r_.model.hidden};
      pipe.carries_aux_loss = r_.model.moe.enabled() || r_.model.mtp.enabled();  // (the MTP loss joins it on the last stage)
      if (r_.model.tie_embeddings || r_.model.mtp.enabled()) pipe.tied_embedding_shape = {r_.model.vocab / t, r_.model.hidden};
      pipe.dtype = torch_dtype(plan_.dtype);
      pipe.gradient_dtype = torch_dtype(plan_.modes.gradient_dtype);
      pipe.device = device_;
    }
    po.sequence_parallel = plan_.layout.sequence_parallel;
    po.shared_experts_beside_dispatch = plan_.modes.shared_experts_beside_dispatch;
    po.tokens_once_per_rank = plan_.modes.tokens_once_per_rank;
    po.recomputation = plan_.layout.recomputation;
    ZeroOptions& zo = po.zero;
    zo.stage = plan_.layout.zero_stage;
    zo.dtype = plan_.dtype;
    zo.grad_dtype = plan_.modes.gradient_dtype;
    zo.offload = plan_.layout.offload != Offload::None;
    zo.offload_params = plan_.layout.offload == Offload::OptimizerAndParams;
    zo.delayed_update = plan_.layout.delayed_update;
    zo.bucket_bytes = r_.parallel.bucket_bytes;
    zo.device = device_;
    // How the step runs, as the plan decided and priced it (execution_modes.hpp).
    const ExecutionModes& modes = plan_.modes;
    zo.step_applies_scales = modes.step_applies_scales;
    zo.step_reads_working_gradient = modes.update_on_device;
    zo.gradients_left_to_autograd = modes.gradients_left_to_autograd;
    parallel_ = parallelize(*model_, *mesh_, po);
    zero_ = &parallel_->zero();
  }

  void create_optimizer() {
    // The host step of offloaded GPU ranks gets this rank's share of the node's cores, less one
    // that stays with the thread launching the GPU's work; CPU ranks compute on theirs, one thread each.
    // Its workers run on the cores near the rank's GPU (its NUMA node), so the host memory they
    // stream through is the node's own and the pinned copies cross one socket.
    int host_threads = 1;
    std::vector<int> host_cores;
    if (device_.is_cuda() && plan_.layout.offload != Offload::None) {
      const std::string pci = cuda_pci_bus_id(device_);
      const RankCores share = rank_host_cores(usable_cpus(), pci_local_cpus(pci), ctx_.local_rank, ctx_.local_world);
      const HostStepThreads step = host_step_threads(share);
      host_threads = step.threads;
      host_cores = step.cores;
      report_.send(EventReport{"host_step", "rank " + std::to_string(ctx_.rank) + ": the host step's " + std::to_string(host_threads) + " thread(s) on cores " +
                                                 (host_cores.empty() ? std::string("any") : format_cpu_list(host_cores)) + ": " + share.why + (pci.empty() ? "" : " (GPU " + pci + ")") +
                                                 "; " + step.why});
    }
    optimizer_ = std::make_unique<ShardOptimizer>(r_.optimizer, zero_->shards(), host_threads, host_cores);
    if (plan_.dtype == DType::Fp16) scaler_ = std::make_unique<DynamicLossScaler>(r_.precision.loss_scale);
    if (plan_.modes.cuda_graphs) {
      std::vector<torch::Tensor> params;
      for (const auto& p : model_->module().parameters())
        if (p.requires_grad()) params.push_back(p);
      step_graph_ = std::make_unique<StepGraph>(std::move(params));
    }
  }

  void open_data() {
    data_ = open_dataset(r_.data, r_.model, r_.batch.seq_len, r_.run.seed);
    data_files_ = identify_data_files(data_->files());
    if (ctx_.rank == 0) {
      report_.send(EventReport{"data", data_->describe()});
      for (const std::string& w : data_->warnings()) report_.send(EventReport{"warning", "data: " + w});
    }
    if (r_.eval.every > 0) data_->val_batch(0, 1);  // a validation split too small fails now, not at the first evaluation
  }

  // Hooks run on rank 0 only; every rank learns their decisions from a broadcast. Returns the
  // steps already done (those of the checkpoint resumed from).
  int64_t start_hooks_and_resume() {
    hooks_active_ = !r_.hooks.script.empty();
    if (hooks_active_ && ctx_.rank == 0) hooks_ = std::make_unique<RecipeHooks>(r_.hooks);
    if (ctx_.resume_from.empty()) return 0;
    check_resumed_data();
    RankTrainingState state = training_state();
    RestoredProgress p = restore_checkpoint(state, ctx_.resume_from);
    last_saved_step_ = p.step;
    if (hooks_) restore_hook_state(p.hook_state);
    if (ctx_.rank == 0) {
      report_.send(EventReport{"resumed", "resumed from " + ctx_.resume_from + " at step " + std::to_string(p.step) + " (saved by " +
                                              std::to_string(p.from_world) + " rank(s), ZeRO stage " + std::to_string(p.from_stage) +
                                              (p.format_version < 3 ? ", checkpoint format " + std::to_string(p.format_version) : "") + ")"});
      report_.send(RestoreReport{p.step, ctx_.resume_from, static_cast<int64_t>(p.bytes_read), p.seconds});
    }
    return p.step;
  }

  // The data a checkpoint trained on must be the data read now: a file truncated, rewritten or
  // replaced since would change what each step reads, silently. Refused unless `dsrun resume
  // --force` said to go on (DSRUN_ACCEPT_DATA_CHANGE), which the launcher records.
  void check_resumed_data() {
    const CheckpointManifest m = read_checkpoint(ctx_.resume_from, /*verify_files=*/false);
    if (m.data_files.empty()) return;  // saved before dsrun recorded its data
    const DataChanges changes = compare_data_files(m.data_files, data_files_);
    if (ctx_.rank == 0)
      for (const std::string& t : changes.touched) report_.send(EventReport{"data", "resumed on data modified since the checkpoint: " + t});
    if (changes.same()) return;
    if (env_int("DSRUN_ACCEPT_DATA_CHANGE", 0) == 1) {
      if (ctx_.rank == 0) report_.send(EventReport{"data", "resumed on changed data (--force): " + join(changes.differ, "; ")});
      return;
    }
    ErrorContext c;
    c.file = path_join(ctx_.resume_from, kManifestFile);
    c.key = "data.path";
    c.rank = ctx_.rank;
    c.hint = "put the data back as it was, or pass --force to dsrun resume to train on it as it is now";
    throw Error("the data differs from what the checkpoint at step " + std::to_string(m.step) + " trained on: " + join(changes.differ, "; "), c);
  }

  // The batch's replica this rank reads: ranks of one replica (its tensor ranks, its context ranks)
  // read the same samples.
  int data_rank() const { return mesh_->shape().replica(mesh_->rank()); }
  // This rank's share of a batch: all of it, or under context parallelism its tokens of each
  // sequence (ZigzagSplit::take).
  Batch sequence_share(Batch whole) const {
    if (plan_.layout.context == 1) return whole;
    return parallel_->sequence_split(r_.batch.seq_len).take(whole, mesh_->shape().context_rank(mesh_->rank()));
  }
  // The ranks whose losses the metrics average: the last pipeline stage's.
  int loss_ranks() const { return ctx_.world / plan_.layout.pipeline; }
  PipelineStage::LossFn loss_function() {
    return [this](const ModelOutput& out, const Batch& batch) { return micro_batch_loss(out, batch, parallel_->tensor()); };
  }

  // DSRUN_PROFILE=DIR[:FIRST:LAST]: torch's profiler over steps FIRST..LAST (default 6..8) on
  // every rank, a Chrome trace per rank in DIR (bench/trace_summary.py reads them). For finding
  // where a step goes; never in tests. Read once, before the first step.
  struct ProfileRequest {
    std::string dir;
    long long first = 6, last = 8;
  };
  static std::optional<ProfileRequest> profile_request() {
    const char* spec = std::getenv("DSRUN_PROFILE");
    if (!spec || !*spec) return std::nullopt;
    ProfileRequest p{spec};
    if (const size_t colon = p.dir.find(':'); colon != std::string::npos) {
      std::sscanf(p.dir.c_str() + colon, ":%lld:%lld", &p.first, &p.last);
      p.dir.resize(colon);
    }
    if (!compat::kHasTraceProfiler) {
      ErrorContext c;
      c.key = "DSRUN_PROFILE";
      c.hint = "unset DSRUN_PROFILE, or profile with dsrun built against PyTorch 2.x's libtorch (scripts/gpu_build.sh)";
      throw Error("this libtorch has no Kineto profiler to write traces with", c);
    }
    return p;
  }

  void profile_steps(int64_t step, bool before) {
    if (!profile_) return;
    if (before && step == profile_->first) {
      make_directories(profile_->dir);
      compat::start_profiler(device_.is_cuda());
    }
    if (!before && step == profile_->last) {
      if (device_.is_cuda()) torch::cuda::synchronize();
      const std::string path = path_join(profile_->dir, "trace_rank" + std::to_string(ctx_.rank) + ".json");
      compat::stop_profiler(path);
      report_.send(EventReport{"profile", "rank " + std::to_string(ctx_.rank) + ": steps " + std::to_string(profile_->first) + "-" +
                                              std::to_string(profile_->last) + " traced in " + path});
    }
  }

  // MoE routing this step, for the metrics' all-reduce: per MoE layer (in model order) the pairs
  // routed to each expert and the pairs dropped, this rank's layers filled, the others 0.
  // Built on `where` (the device: no host read here).
  torch::Tensor routing_rows(torch::Device where) {
    const MoeSpec& moe = r_.model.moe;
    const auto f64 = torch::TensorOptions().dtype(torch::kFloat64).device(where);
    if (!moe.enabled()) return torch::zeros({0}, f64);
    const int first = moe.first_dense_layers, layers = r_.model.moe_layers();
    torch::Tensor rows = torch::zeros({layers, moe.routed_experts + 1}, f64);
    for (const auto& [layer, routing] : parallel_->take_routing()) {
      rows[layer - first].narrow(0, 0, moe.routed_experts).copy_(routing.routed.to(where, torch::kFloat64));
      if (routing.dropped != 0) rows[layer - first][moe.routed_experts].fill_(static_cast<double>(routing.dropped));
    }
    return rows.flatten();
  }

  // Per MoE layer, the busiest expert's pairs over the mean (1: perfectly even; expert_load/N),
  // their maximum (expert_load_max), and the pairs a capacity dropped (dropped_tokens). Tensor
  // ranks of one data rank route the same tokens: their sums count once.
  void add_routing_metrics(const torch::Tensor& summed, nlohmann::json& metrics) const {
    const MoeSpec& moe = r_.model.moe;
    if (!moe.enabled()) return;
    const int first = moe.first_dense_layers;
    torch::Tensor rows = summed.view({r_.model.moe_layers(), moe.routed_experts + 1}) / plan_.layout.tensor;
    double worst = 0, dropped = 0;
    for (int64_t l = 0; l < rows.size(0); ++l) {
      torch::Tensor routed = rows[l].narrow(0, 0, moe.routed_experts);
      const double mean = routed.mean().item<double>();
      const double load = mean > 0 ? routed.max().item<double>() / mean : 0;
      metrics["expert_load/" + std::to_string(first + l)] = load;
      worst = std::max(worst, load);
      dropped += rows[l][moe.routed_experts].item<double>();
    }
    metrics["expert_load_max"] = worst;
    metrics["dropped_tokens"] = dropped;
  }

  // Balance by bias: every rank moves every MoE layer's bias by the loads summed over the world
  // (routing_rows), so all hold the same bias; the sign ignores that tensor ranks count alike.
  void balance_experts(const torch::Tensor& summed) {
    const MoeSpec& moe = r_.model.moe;
    if (!moe.learns_bias()) return;
    const int first = moe.first_dense_layers;
    torch::Tensor rows = summed.view({r_.model.moe_layers(), moe.routed_experts + 1});
    for (int64_t l = 0; l < rows.size(0); ++l) model_->balance_experts(first + static_cast<int>(l), rows[l].narrow(0, 0, moe.routed_experts), moe.bias_update_rate);
  }

  RankTrainingState training_state() { return {*model_, *zero_, *optimizer_, scaler_.get(), *mesh_}; }

  void save(int64_t step, const std::string& why) {
    if (step == last_saved_step_) return;  // already on disk (resumed from it, or saved just now)
    CheckpointRunFacts facts;
    facts.run_id = ctx_.run_id;
    facts.config_toml = ctx_.config_toml;
    facts.dtype = to_string(plan_.dtype);
    facts.optimizer = to_string(r_.optimizer.kind);
    facts.zero_stage = plan_.layout.zero_stage;
    facts.global_batch = r_.batch.global;
    facts.data_files = data_files_;
    RankTrainingState state = training_state();
    checkpoint_saver().save(state, facts, step, hooks_ ? hook_state() : "", why);
    last_saved_step_ = step;
    report_saved(saver_->finished());
  }

  // Collective the first time (every rank makes it at the start, or at the first save): rank 0's
  // plan says whether saves are asynchronous, so that ranks planning on different hosts agree.
  CheckpointSaver& checkpoint_saver() {
    if (saver_) return *saver_;
    torch::Tensor async = torch::tensor({plan_.checkpoint_disk.async ? 1 : 0}, torch::kInt64);
    mesh_->world().broadcast(async, 0);
    saver_ = std::make_unique<CheckpointSaver>(CheckpointSaveOptions{ctx_.checkpoint_root, r_.checkpoint.keep_last, r_.checkpoint.keep_every, async.item<int64_t>() != 0},
                                               ctx_.rank, ctx_.world);
    return *saver_;
  }

  // Saves complete since the last look (asynchronous ones finish during later steps): rank 0
  // records them and runs on_checkpoint. A failed write throws here, failing the run.
  void report_saved(const std::vector<SavedCheckpoint>& saved) {
    if (ctx_.rank != 0) return;
    for (const SavedCheckpoint& c : saved) {
      const double seconds = c.async ? c.pause_seconds + c.write_seconds : c.pause_seconds;
      report_.send(CheckpointReport{c.step, c.path, static_cast<int64_t>(c.bytes), c.checksum, c.removed, c.why, seconds, c.pause_seconds, c.async, c.waited_seconds});
      if (c.waited_seconds > 0.1)
        report_.send(EventReport{"warning", "the save of step " + std::to_string(c.step) + " waited " + format_seconds(c.waited_seconds) +
                                                " for the previous one's write: saves come faster than the disk takes them (raise checkpoint.every)"});
      if (hooks_) run_hook([&] { hooks_->on_checkpoint(hook_context(c.step, {{"checkpoint", {{"step", c.step}, {"path", c.path}, {"bytes", c.bytes}}}})); });
    }
  }

  // ---- hooks (rank 0 runs them; decisions reach every rank through broadcast_decision) ----

  // The context a hook sees: where the run is, plus `extra` fields.
  nlohmann::json hook_context(int64_t step, nlohmann::json extra) const {
    nlohmann::json ctx = {{"step", step}, {"steps", r_.run.steps}, {"run_id", ctx_.run_id}, {"world_size", ctx_.world},
                          {"global_batch", r_.batch.global}, {"samples_seen", step * r_.batch.global}};
    for (auto& [k, v] : extra.items()) ctx[k] = v;
    return ctx;
  }

  // Calls a hook on rank 0 under hooks.on_error: a failure is kept to fail the run after every
  // rank has stopped; errors of disabled hooks become events.
  template <typename Fn>
  bool run_hook(Fn&& fn) {
    bool ok = true;
    try {
      fn();
    } catch (const Error& e) {
      if (!pending_hook_error_) pending_hook_error_ = std::make_unique<Error>(e);
      report_.send(EventReport{"hook_error", e.describe()});
      ok = false;
    }
    for (const auto& message : hooks_->take_errors()) report_.send(EventReport{"hook_error", message});
    return ok;
  }

  // Rank 0's hook actions, as every rank learns them in one broadcast. Reasons travel only to
  // the launcher (rank 0 reports them); other ranks need the decision alone.
  struct Decision {
    bool stop = false, save = false, skip = false;
    bool failed = false;  // a hook failed under hooks.on_error = "fail" (this step's or an earlier one's)
    double lr = 0;        // the learning rate this step's update uses
    std::string why;      // rank 0: the hook's reason to stop
    std::map<std::string, double> metrics;  // rank 0: what the hooks added to the step's metrics
  };

  Decision broadcast_decision(const HookActions& a, bool failed, double lr) {
    failed |= pending_hook_error_ != nullptr;  // also on_start's or on_checkpoint's failure
    TensorPack pack;
    const auto stop = pack.add_flag(!a.stop.empty() || failed), save = pack.add_flag(a.save), skip = pack.add_flag(a.skip),
               failed_piece = pack.add_flag(failed), lr_piece = pack.add(lr);
    torch::Tensor d = pack.joined();
    mesh_->world().broadcast(d, 0);
    Decision out;
    out.stop = TensorPack::flag(d, stop);
    out.save = TensorPack::flag(d, save);
    out.skip = TensorPack::flag(d, skip);
    out.failed = TensorPack::flag(d, failed_piece);
    out.lr = TensorPack::value(d, lr_piece);
    out.why = failed ? "hook failed" : a.stop;
    out.metrics = a.metrics;
    return out;
  }

  static StepOutcome outcome_of(const Decision& d) {
    StepOutcome o;
    o.stop = d.stop;
    o.save = d.save;
    o.hook_failed = d.failed;
    o.why = d.why;
    return o;
  }

  void apply_actions_on_rank0(const HookActions& a, int64_t step) {
    for (const auto& m : a.logs) report_.send(EventReport{"hook", "step " + std::to_string(step) + ": " + m});
    if (a.lr) lr_override_ = *a.lr;
  }

  std::string hook_state() {
    nlohmann::json s = {{"state", nullptr}, {"lr_override", lr_override_ ? nlohmann::json(*lr_override_) : nlohmann::json()}};
    run_hook([&] { s["state"] = nlohmann::json::parse(hooks_->save_state()); });
    return s.dump();
  }

  void restore_hook_state(const std::string& text) {
    if (text.empty()) return;
    nlohmann::json s = nlohmann::json::parse(text, nullptr, false);
    if (!s.is_object()) return;
    if (s.contains("lr_override") && s["lr_override"].is_number()) lr_override_ = s["lr_override"].get<double>();
    if (s.contains("state") && !s["state"].is_null()) hooks_->restore_state(s["state"].dump());
  }

  static void merge(StepOutcome& into, const StepOutcome& more) {
    into.stop |= more.stop;
    into.save |= more.save;
    into.hook_failed |= more.hook_failed;
    if (into.why.empty()) into.why = more.why;
  }

  // ---- one training step, in the order train_step runs them ----

  // What forward and backward left on this rank: a pipeline's totals read already, or the plain
  // path's per-micro-batch losses still on the device (read with the gradients' norm).
  struct StepLosses {
    double loss_sum = 0, aux_sum = 0, mtp_sum = 0;   // read on the host
    torch::Tensor loss_values, aux_values, mtp_values;  // per micro-batch, not yet read
    int64_t items = 0, correct = 0;
    double loss_scale = 1;                     // the scale the backward ran under (fp16)
  };

  // The reduced gradients: whether they overflowed (fp16), their global norm (on the device), and
  // whether their update is decided on the device and queued before the host reads anything.
  struct GradientState {
    bool overflow = false;  // fp16: the step is skipped
    bool retry = false;     // fp16: overflowed; run the step again (DynamicLossScaler::retry_overflow)
    torch::Tensor norm;
    bool update_on_device = false;
  };

  // This rank's numbers, read back in one transfer.
  struct RankNumbers {
    double grad_norm = 0, loss_sum = 0, aux_sum = 0, mtp_sum = 0;
    torch::Tensor routing;  // routing_rows(), on the host
  };

  // What every rank agrees on after a step (one all-reduce over the world).
  struct StepTotals {
    double loss = 0, aux_loss = 0, mtp_loss = 0;  // means over the ranks computing a loss
    double correct = 0;             // ResNet: right answers in the global batch
    bool stop = false, save = false;  // some rank had a signal
    torch::Tensor routing;          // routing_rows() summed over the world
  };

  // Every rank agrees on the outcome, so all stop (or save) after the same step. The metrics are
  // agreed before the update, so that a hook can see them and skip the update.
  StepOutcome train_step(int64_t step, double lr) {
    const auto t0 = std::chrono::steady_clock::now();
    StepLosses losses = forward_backward(step);
    GradientState gradients = finish_gradients(losses.loss_scale);
    while (gradients.retry) {  // fp16: overflowed; the same batch again at half the scale
      zero_->after_step();     // the overflowed gradients dropped, as a skipped step drops them
      losses = forward_backward(step);
      gradients = finish_gradients(losses.loss_scale);
    }
    const RankNumbers mine = read_step_numbers(losses, gradients, lr);
    const double backward_end_seconds = seconds_since(t0);  // the norm waited for the device
    const StepTotals totals = agree(losses, mine);
    nlohmann::json metrics = step_metrics(totals, mine, losses);
    const Decision decision = consult_hooks(step + 1, lr, metrics);
    const bool skipped = gradients.overflow || decision.skip;
    update(gradients, decision, skipped, mine.grad_norm, totals.routing);
    StepOutcome outcome{totals.stop, totals.save, false, totals.stop ? "signal" : ""};
    merge(outcome, outcome_of(decision));
    report(step, t0, backward_end_seconds, totals.loss, losses.items, decision, skipped, metrics);
    return outcome;
  }

  // Forward and backward over this rank's micro-batches: through the pipeline's schedule, or
  // one after another with ZeRO's hooks around each backward.
  StepLosses forward_backward(int64_t step) {
    const int64_t micro = plan_.layout.micro, accumulation = plan_.accumulation;
    const int64_t per_rank = micro * accumulation;
    StepLosses out;
    out.loss_scale = scaler_ ? scaler_->scale() : 1.0;
    const double backward_scale = out.loss_scale / static_cast<double>(accumulation);
    model_->module().train();
    parallel_->take_routing();  // (what evaluation routed is not this step's)
    // This rank's slice of the global batch: the same samples whatever the number of ranks.
    auto batch_of = [&](int64_t m) {
      Batch batch = on_device(sequence_share(data_->train_batch(step * r_.batch.global + data_rank() * per_rank + m * micro, micro)));
      data_->augment(batch);
      return batch;
    };
    if (PipelineStage* pipeline = parallel_->pipeline()) {
      // Every stage reads each micro-batch (positions, targets); the schedule runs forwards and backwards.
      const PipelineTotals t = pipeline->train_step(batch_of, loss_function(), backward_scale);
      out.loss_sum = t.loss_sum;
      out.aux_sum = t.aux_loss_sum;
      out.mtp_sum = t.mtp_loss_sum;
      out.items = t.items;
      return out;
    }
    if (step_graph_ && ++graph_eager_steps_ > kEagerStepsBeforeCapture) {  // execution.cuda_graphs: one micro-batch a step
      Batch batch = batch_of(0);
      zero_->begin_micro_batch(true);
      out.loss_values = graph_step(batch, backward_scale).reshape({1});
      zero_->after_backward();
      out.items = batch.items;
      return out;
    }
    std::vector<torch::Tensor> task_values, aux_values, mtp_values;  // read once, after every backward
    for (int64_t m = 0; m < accumulation; ++m) {
      Batch batch = batch_of(m);
      zero_->begin_micro_batch(m == accumulation - 1);
      MicroBatchLoss loss = micro_batch_loss(model_->forward(batch, *parallel_), batch, parallel_->tensor(), /*read_now=*/false);
      (loss.loss * backward_scale).backward();
      zero_->after_backward();
      task_values.push_back(loss.task_value.reshape({1}));
      if (loss.aux_value.defined()) aux_values.push_back(loss.aux_value.reshape({1}));
      if (loss.mtp_value.defined()) mtp_values.push_back(loss.mtp_value.reshape({1}));
      out.items += batch.items;
      if (loss.correct >= 0) out.correct += loss.correct;
    }
    out.loss_values = torch::cat(task_values);
    if (!aux_values.empty()) out.aux_values = torch::cat(aux_values);
    if (!mtp_values.empty()) out.mtp_values = torch::cat(mtp_values);
    return out;
  }

  // The step's forward and backward through its CUDA graph: captured at the first call (the steps
  // before ran eagerly: lazy initialisation and autotuning happen outside the capture), replayed at
  // the next. A capture that fails says why and the run goes on eagerly.
  torch::Tensor graph_step(const Batch& batch, double backward_scale) {
    auto pass = [this, backward_scale](const Batch& b) {
      MicroBatchLoss loss = micro_batch_loss(model_->forward(b, *parallel_), b, parallel_->tensor(), /*read_now=*/false);
      (loss.loss * backward_scale).backward();
      return loss.task_value;
    };
    if (step_graph_->captured()) return step_graph_->replay(batch);
    try {
      torch::Tensor value = step_graph_->capture(batch, pass);
      report_.send(EventReport{"cuda_graphs", "rank " + std::to_string(ctx_.rank) + ": forward and backward captured as one CUDA graph after " +
                                                  std::to_string(kEagerStepsBeforeCapture) + " eager steps, replayed from now on"});
      return value;
    } catch (const Error& e) {
      report_.send(EventReport{"cuda_graphs", "rank " + std::to_string(ctx_.rank) + ": eager steps from now on: " + e.what()});
      step_graph_.reset();
      return pass(batch);
    }
  }

  // Reduction, the fp16 overflow check and unscaling, the global norm. Without hooks or loss
  // scaling nothing on the host decides the update: on a GPU with dsrun's Adam kernel the clip
  // is decided on the device and the update queued at once (read_step_numbers), so the GPU does
  // not wait for the host between backward and the update.
  GradientState finish_gradients(double loss_scale) {
    zero_->reduce_gradients();
    GradientState g;
    g.update_on_device = plan_.modes.update_on_device && !hooks_active_ && !scaler_;
    if (scaler_) {
      const bool overflowed = parallel_->gradients_overflowed();  // every rank's answer alike
      if (overflowed && scaler_->retry_overflow()) {
        g.retry = true;
        return g;
      }
      g.overflow = scaler_->update(overflowed);
      if (!g.overflow) zero_->masters().scale_gradients(1.0 / loss_scale);
    }
    g.norm = g.overflow ? torch::zeros({}, torch::kFloat64) : parallel_->global_grad_norm_tensor();
    if (g.update_on_device && r_.optimizer.grad_clip > 0) zero_->masters().clip_on_device(g.norm, r_.optimizer.grad_clip);
    return g;
  }

  // Norm, losses (micro-batch order), auxiliary losses and routing in one transfer; an update
  // decided on the device is queued while it is under way.
  RankNumbers read_step_numbers(const StepLosses& losses, const GradientState& g, double lr) {
    TensorPack pack(g.norm.device());
    const auto norm = pack.add(g.norm);
    const auto loss_values = pack.add(losses.loss_values.defined() ? losses.loss_values : torch::zeros({0}));
    const auto aux_values = pack.add(losses.aux_values.defined() ? losses.aux_values : torch::zeros({0}));
    const auto mtp_values = pack.add(losses.mtp_values.defined() ? losses.mtp_values : torch::zeros({0}));
    const auto routing = pack.add(routing_rows(g.norm.device()));
    HostReadback values = read_back(pack.joined());
    if (g.update_on_device) {
      optimizer_->step(lr);
      zero_->after_step();
    }
    values.arrived.synchronize();
    RankNumbers out;
    out.grad_norm = TensorPack::value(values.host, norm);
    out.loss_sum = losses.loss_sum + TensorPack::sum(values.host, loss_values);
    out.aux_sum = losses.aux_sum + TensorPack::sum(values.host, aux_values);
    out.mtp_sum = losses.mtp_sum + TensorPack::sum(values.host, mtp_values);
    out.routing = TensorPack::piece(values.host, routing);
    return out;
  }

  // One all-reduce over the world: the metrics averaged over the ranks that compute a loss
  // (every rank has the same number of samples; tensor ranks of one data index agree on theirs;
  // only the last pipeline stage has losses), with the signal flags and the routing.
  StepTotals agree(const StepLosses& losses, const RankNumbers& mine) {
    const double accumulation = static_cast<double>(plan_.accumulation);
    TensorPack pack;
    const auto loss = pack.add(mine.loss_sum / accumulation), aux = pack.add(mine.aux_sum / accumulation), mtp = pack.add(mine.mtp_sum / accumulation),
               correct = pack.add(static_cast<double>(losses.correct)), stop = pack.add_flag(stop_requested != 0),
               save = pack.add_flag(save_requested != 0), routing = pack.add(mine.routing);
    save_requested = 0;
    torch::Tensor summed = pack.joined();
    mesh_->world().all_reduce_sum(summed);
    StepTotals t;
    t.loss = TensorPack::value(summed, loss) / loss_ranks();
    t.aux_loss = TensorPack::value(summed, aux) / loss_ranks();
    t.mtp_loss = TensorPack::value(summed, mtp) / loss_ranks();
    t.correct = TensorPack::value(summed, correct);
    t.stop = TensorPack::flag(summed, stop);
    t.save = TensorPack::flag(summed, save);
    t.routing = TensorPack::piece(summed, routing);
    last_loss_ = t.loss;
    return t;
  }

  nlohmann::json step_metrics(const StepTotals& totals, const RankNumbers& mine, const StepLosses& losses) const {
    nlohmann::json metrics = {{"loss", totals.loss}, {"grad_norm", mine.grad_norm}};
    if (r_.model.moe.enabled() || r_.model.mtp.enabled()) metrics["aux_loss"] = totals.aux_loss;
    if (r_.model.mtp.enabled()) metrics["mtp_loss"] = totals.mtp_loss;  // unweighted; aux_loss holds it times loss_weight
    if (r_.model.arch == ModelArch::ResNet) metrics["accuracy"] = totals.correct / static_cast<double>(r_.batch.global);
    if (scaler_) metrics["loss_scale"] = losses.loss_scale;
    add_routing_metrics(totals.routing, metrics);
    return metrics;
  }

  // Rank 0 asks the hooks lr(), metrics() and on_step(), which see `metrics`; every rank gets
  // the same decision. Without hooks: nothing stops or skips, and the lr is the schedule's.
  Decision consult_hooks(int64_t step, double lr, const nlohmann::json& metrics) {
    if (!hooks_active_) {
      Decision none;
      none.lr = lr;
      return none;
    }
    HookActions actions;
    bool ok = true;
    if (hooks_) {
      if (lr_override_) lr = *lr_override_;
      nlohmann::json seen = metrics;
      ok = run_hook([&] {
        nlohmann::json ctx = hook_context(step, {{"lr", lr}});
        if (auto custom = hooks_->lr(step, ctx)) lr = *custom;
        ctx["lr"] = lr;
        ctx["metrics"] = seen;
        for (const auto& [name, value] : hooks_->metrics(ctx)) {
          seen[name] = value;
          actions.metrics[name] = value;
        }
        ctx["metrics"] = seen;
        HookActions on_step = hooks_->on_step(ctx);
        for (const auto& [name, value] : on_step.metrics) actions.metrics[name] = value;
        on_step.metrics = actions.metrics;
        actions = std::move(on_step);
      });
      apply_actions_on_rank0(actions, step);
    }
    return broadcast_decision(actions, !ok, lr);
  }

  // The optimizer's step (clipped on the host) unless it was queued already or is skipped; the
  // routing bias moves with every applied update.
  void update(const GradientState& g, const Decision& d, bool skipped, double grad_norm, const torch::Tensor& routing) {
    const bool applies = !skipped && !d.failed;
    if (!g.update_on_device && applies) {
      if (r_.optimizer.grad_clip > 0 && grad_norm > r_.optimizer.grad_clip) zero_->masters().scale_gradients(r_.optimizer.grad_clip / (grad_norm + 1e-6));
      if (zero_->offload().enabled()) zero_->offload().start_host_update(optimizer_->host_update(d.lr));
      else optimizer_->step(d.lr);
    }
    if (applies) balance_experts(routing);
    if (d.skip) ++hook_skipped_steps_;
    if (!g.update_on_device) zero_->after_step();
  }

  // Rank 0 records the step. Where its time went (docs/plan.md): until the gradients' norm
  // (forward, backward, reductions, the device finishing), and with offload the host update
  // (previous step's, beside this one's compute) and the time compute waited for it.
  void report(int64_t step, std::chrono::steady_clock::time_point t0, double backward_end_seconds, double loss, int64_t items, const Decision& d,
              bool skipped, nlohmann::json& metrics) {
    const OffloadPipeline::Times offload_times = zero_->offload().take_times();
    if (ctx_.rank != 0) return;
    const double step_seconds = seconds_since(t0);
    for (const auto& [name, value] : d.metrics) metrics[name] = value;
    metrics["backward_end_seconds"] = backward_end_seconds;
    if (plan_.layout.offload != Offload::None) {
      metrics["host_update_seconds"] = offload_times.host_update_s;
      metrics["host_update_wait_seconds"] = offload_times.waited_s;
    }
    metrics["lr"] = d.lr;
    metrics["step_seconds"] = step_seconds;
    metrics["tokens_per_second"] = static_cast<double>(items) * plan_.layout.data_ranks() / step_seconds;  // items: this rank's share
    if (scaler_) {
      metrics["skipped_steps"] = static_cast<double>(scaler_->skipped_steps());
      metrics["overflow_retries"] = static_cast<double>(scaler_->retried_steps());
    }
    if (hooks_active_) metrics["hook_skipped_steps"] = static_cast<double>(hook_skipped_steps_);
    Metrics reported = to_metrics(metrics);
    if (fault_requested(Fault::NanLossAt, ctx_.rank, step + 1))  // a test's diverged loss, as the launcher sees one
      for (auto& [name, value] : reported)
        if (name == "loss") value = std::numeric_limits<double>::quiet_NaN();
    // The step is reported first, its loss too when it is not finite: the launcher names it (and
    // alerts on it) before the rank's error ends the run.
    report_.send(StepReport{step + 1, r_.run.steps, std::move(reported), skipped});
    if (!std::isfinite(loss) && !d.skip)
      throw Error("loss is " + std::to_string(loss) + " at step " + std::to_string(step + 1), ErrorContext{"", 0, 0, "optimizer.lr", 0, "lower the learning rate or enable clipping"});
  }

  StepOutcome evaluate(int64_t step) {
    torch::NoGradGuard no_grad;
    model_->module().eval();
    double loss_sum = 0, correct = 0, items = 0;
    const int64_t micro = plan_.layout.micro;
    auto batch_of = [&](int64_t i) { return on_device(sequence_share(data_->val_batch((data_rank() * r_.eval.batches + i) * micro, micro))); };
    if (PipelineStage* pipeline = parallel_->pipeline()) {
      loss_sum = pipeline->evaluate(batch_of, loss_function(), static_cast<int>(r_.eval.batches)).loss_sum;
    } else {
      for (int64_t i = 0; i < r_.eval.batches; ++i) {
        Batch batch = batch_of(i);
        MicroBatchLoss out = micro_batch_loss(model_->forward(batch, *parallel_), batch, parallel_->tensor());
        loss_sum += out.task_loss;
        if (out.correct >= 0) correct += static_cast<double>(out.correct);
        items += static_cast<double>(batch.targets.size(0));
      }
    }
    torch::Tensor totals = torch::tensor({loss_sum / static_cast<double>(r_.eval.batches), correct, items}, torch::kFloat64);
    mesh_->world().all_reduce_sum(totals);
    model_->module().train();
    const double val_loss = totals[0].item<double>() / loss_ranks();
    nlohmann::json metrics = {{"val_loss", val_loss}};
    if (r_.model.arch == ModelArch::ResNet) metrics["val_accuracy"] = totals[1].item<double>() / totals[2].item<double>();
    else metrics["val_perplexity"] = std::exp(val_loss);
    StepOutcome outcome;
    if (hooks_active_) {
      HookActions actions;
      bool ok = true;
      if (hooks_) {
        ok = run_hook([&] { actions = hooks_->on_eval(hook_context(step + 1, {}), metrics); });
        for (const auto& [name, value] : actions.metrics) metrics[name] = value;
        apply_actions_on_rank0(actions, step + 1);
      }
      outcome = outcome_of(broadcast_decision(actions, !ok, 0.0));
    }
    if (ctx_.rank == 0) report_.send(EvalReport{step + 1, to_metrics(metrics)});
    return outcome;
  }

  Batch on_device(Batch b) const {
    if (b.inputs.is_floating_point()) b.inputs = b.inputs.to(compute_dtype_);  // images
    if (device_.is_cpu()) return b;
    b.inputs = b.inputs.to(device_, /*non_blocking=*/true);
    b.targets = b.targets.to(device_, /*non_blocking=*/true);
    return b;
  }

  // Model states this rank holds, measured from its tensors, beside the plan's prediction; on a GPU
  // also the caching allocator's peaks (allocated, and reserved: a CUDA graph's pool keeps blocks
  // reserved that nothing else may use), beside the plan's total.
  void report_memory() {
    const ZeroDataParallel::StateBytes held = zero_->state_bytes();
    const double measured = held.parameters_and_gradients + held.masters + held.offload_buffers + optimizer_->state_bytes();
    // Every rank beside its own pipeline stage's prediction, not the fullest stage's.
    const StageMemory& stage = plan_.stage_memory.at(mesh_->coordinates().pipeline);
    const double predicted = stage.model_state_bytes;
    MemoryReport m;
    m.model_state_bytes = measured;
    m.predicted_model_state_bytes = predicted;
    m.peak_rss_bytes = peak_rss_bytes();
    m.anon_rss_bytes = status_bytes("RssAnon");
    m.file_rss_bytes = status_bytes("RssFile");
    m.predicted_total_bytes = stage.device_bytes;
    m.predicted_host_bytes = stage.host_bytes;
    add_device_peaks(m);
    report_.send(m);
  }

  void report_device_peaks() {
    MemoryReport m;
    add_device_peaks(m);
    if (m.peak_allocated_bytes) report_.send(m);
  }

  void add_device_peaks(MemoryReport& m) const {
#ifdef DSRUN_WITH_CUDA
    if (device_.is_cuda()) {
      auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device_.index());
      m.peak_allocated_bytes = static_cast<double>(stats.allocated_bytes[0].peak);
      m.peak_reserved_bytes = static_cast<double>(stats.reserved_bytes[0].peak);
    }
#else
    (void)m;
#endif
  }

  const Recipe& r_;
  const Plan& plan_;
  RankContext ctx_;
  torch::Device device_{torch::kCPU};
  torch::ScalarType compute_dtype_ = torch::kFloat32;
  RankReporter& report_;
  std::unique_ptr<DeviceMesh> mesh_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<ParallelModel> parallel_;
  std::optional<ProfileRequest> profile_;  // DSRUN_PROFILE, read when the steps start
  ZeroDataParallel* zero_ = nullptr;  // parallel_'s
  std::unique_ptr<ShardOptimizer> optimizer_;
  std::unique_ptr<DynamicLossScaler> scaler_;
  std::unique_ptr<Dataset> data_;
  std::vector<DataFileIdentity> data_files_;  // identified when opened: what checkpoints record
  int64_t last_saved_step_ = -1;
  std::unique_ptr<CheckpointSaver> saver_;  // made at the first save
  bool hooks_active_ = false;             // the recipe has a hook script (known to every rank)
  std::unique_ptr<RecipeHooks> hooks_;    // rank 0 only
  std::optional<double> lr_override_;     // rank 0: set by a hook's lr action
  std::unique_ptr<Error> pending_hook_error_;
  int64_t hook_skipped_steps_ = 0;
  double last_loss_ = 0;
  // execution.cuda_graphs: the graph, and the steps run eagerly before it is captured.
  static constexpr int64_t kEagerStepsBeforeCapture = 2;
  std::unique_ptr<StepGraph> step_graph_;
  int64_t graph_eager_steps_ = 0;
};

}  // namespace

namespace {

// The kernels this engine was compiled with, as the core's CMake definitions must also say.
BuildKernels compiled_kernels() {
  BuildKernels k;
#ifdef DSRUN_WITH_CUDA
  k.cuda = true;
  k.varlen_attention = DSRUN_TORCH_AT_LEAST(2, 2);
  k.fp8_products = compat::kHasScaledMm;
  k.fp8_grouped_products = compat::kHasScaledGroupedMm;
#endif
  k.device_adam = kHasDeviceAdamKernel;
  k.fused_adam = compat::kHasFusedAdam;
  return k;
}

// The plan's execution modes (pinned by the launcher) must be what this rank's build can run: a
// plan made elsewhere for other kernels is refused here, naming the mode, not run on a different path.
void check_execution_modes(const Recipe& recipe, const Plan& plan, const BuildKernels& here, int rank) {
  DSRUN_ASSERT(here == compiled_kernels(), "CMake's kernel definitions (engine/common/build_kernels.cpp) disagree with the engine's");
  if (recipe.hardware.device == Device::Cuda && !here.cuda) return;  // select_device says what is missing
  std::vector<RefusedMode> refused;
  const ExecutionModes can = decide_execution_modes(recipe, plan.layout, plan.modes.loss_chunk_tokens, here, &refused);
  for (const ExecutionModeRow& row : execution_mode_rows()) {
    if (plan.modes.*row.field == can.*row.field) continue;
    ErrorContext c;
    c.key = std::string("execution.") + row.name;
    c.rank = rank;
    c.hint = "run the ranks with dsrun built for this machine (scripts/gpu_build.sh on GPUs), or set " + c.key + " = " + (can.*row.field ? "true" : "false");
    std::string why;
    for (const RefusedMode& m : refused)
      if (m.name == row.name) why = m.why;
    throw Error("the plan runs " + c.key + " = " + (plan.modes.*row.field ? "true" : "false") + ", which this rank's build cannot" + (why.empty() ? "" : ": " + why), c);
  }
}

// CPU ranks map every host block of 1 MiB or more and unmap it when freed: glibc's mmap threshold
// fixed, where by default each freed block raises it (up to 32 MiB) and later blocks of that size
// come from the heap. There c10's 64-byte-aligned blocks left holes that the next identical
// request did not fit, and freed holes stayed resident: 10-40% above the live peak, by layout and
// by run. Fixed, resident memory is live memory, the same on every rank, as the plan counts it
// (issue 64; docs/benchmarks.md). Mapping costs a page fault per page touched, small beside a CPU step.
void map_large_host_blocks() {
  constexpr int kThreshold = 1 << 20;
  if (::mallopt(M_MMAP_THRESHOLD, kThreshold) != 1) fail_at(__FILE__, __LINE__, "mallopt(M_MMAP_THRESHOLD) refused " + std::to_string(kThreshold));
}

}  // namespace

int rank_main(int argc, char** argv) {
  RankContext ctx;
  ctx.rank = env_int("RANK", 0);
  ctx.world = env_int("WORLD_SIZE", 1);
  ctx.local_rank = env_int("LOCAL_RANK", ctx.rank);
  ctx.local_world = env_int("LOCAL_WORLD_SIZE", ctx.world);
  RankReporter reporter(ctx.rank, env_int("DSRUN_REPORT_FD", -1));
  report_mapped_file_faults(env_int("DSRUN_REPORT_FD", -1), [rank = ctx.rank](const std::string& message) { return encode_report(rank, ErrorReport{message}) + "\n"; });
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGUSR1, on_save_signal);
  try {
    if (argc < 2) throw Error("usage: dsrun-rank CONFIG.toml (started by `dsrun run`, or by torchrun via `dsrun worker`)");
    if (env_int("DSRUN_DEBUG_RANK", -1) == ctx.rank) {
      std::cerr << "rank " << ctx.rank << " waiting for a debugger: gdb -p " << ::getpid()
                << ", then `set var dsrun_debugger_attached = 1` and `continue`" << std::endl;
      reporter.send(EventReport{"debug", "waiting for a debugger, pid " + std::to_string(::getpid())});
      while (!dsrun_debugger_attached) ::usleep(100000);
    }
    HostFacts host = read_host_facts();
    LoadOptions options;
    options.host = host;
    LoadedRecipe loaded = load_recipe_file(argv[1], options);
    require_valid(loaded);
    Plan plan = make_plan(loaded.recipe, host);
    if (plan.world_size != ctx.world) {
      ErrorContext c;
      c.rank = ctx.rank;
      c.hint = "start as many ranks as the plan has (" + std::to_string(plan.world_size) + "), or set parallel.data_parallel";
      throw Error("WORLD_SIZE is " + std::to_string(ctx.world) + " but the plan has " + std::to_string(plan.world_size) + " ranks", c);
    }
    check_execution_modes(loaded.recipe, plan, host.kernels, ctx.rank);
    if (loaded.recipe.hardware.device != Device::Cuda) map_large_host_blocks();
    // Compute threads: OMP_NUM_THREADS when set (the launcher sets the rank's share of the cores),
    // else the cores divided among this node's ranks.
    const int threads = env_int("OMP_NUM_THREADS", std::max(1, host.cpu_cores / std::max(1, ctx.local_world)));
    torch::set_num_threads(std::max(1, threads));
    ctx.run_id = env_string("DSRUN_RUN_ID", "");
    ctx.config_toml = read_file(argv[1]);
    ctx.checkpoint_root = env_string("DSRUN_CHECKPOINT_DIR", loaded.recipe.checkpoint.dir.empty() ? "checkpoints" : loaded.recipe.checkpoint.dir);
    ctx.resume_from = env_string("DSRUN_RESUME_FROM", "");
    // Under torchrun, a restarted worker group (TORCHELASTIC_RESTART_COUNT > 0) goes on from the
    // newest complete checkpoint, as the launcher's own restarts do; "latest" asks for the same.
    if (ctx.resume_from == "latest" || (ctx.resume_from.empty() && env_int("TORCHELASTIC_RESTART_COUNT", 0) > 0)) {
      auto newest = find_checkpoint(ctx.checkpoint_root, -1, /*fallback=*/true);
      ctx.resume_from = newest ? newest->path : "";
    }
    Trainer trainer(loaded.recipe, plan, ctx, reporter);
    trainer.run();
    reporter.send(DoneReport{});
    return 0;
  } catch (const Error& e) {
    std::string text = e.describe();
    reporter.send(ErrorReport{text});
    std::cerr << "rank " << ctx.rank << ": error: " << text << std::endl;
    return 1;
  } catch (const c10::Error& e) {
    // libtorch's message without its C++ backtrace, which would bury it in the log tail.
    reporter.send(ErrorReport{e.what_without_backtrace()});
    std::cerr << "rank " << ctx.rank << ": error: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    reporter.send(ErrorReport{e.what()});
    std::cerr << "rank " << ctx.rank << ": error: " << e.what() << std::endl;
    return 1;
  }
}

}  // namespace dsrun
