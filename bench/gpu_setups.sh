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
# Env: STEPS (default 20). Results: $out/summary.txt (bench/gpu_setups_summary.py), logs in $out.
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
      python3 "$(dirname "$0")/gpu_setups_summary.py" "$db" | tee "$out/summary.txt" ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
