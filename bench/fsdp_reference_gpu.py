"""PyTorch's own several-GPU stack as torchtitan runs it, the FSDP2 + tensor-parallel peer of
python_reference_gpu.py: a torchtitan-style Llama decoder (RMSNorm with fp32 inside, RoPE,
SwiGLU, SDPA; separate wq/wk/wv/wo and w1/w2/w3 so tensor parallelism shards whole heads),
parallelized in torchtitan's order: tensor parallelism, activation checkpointing, per-block
torch.compile, then FSDP2 (fully_shard per block and at the root) with bf16 compute, fp32 gradient
reduction and the sharded fp32 parameters as AdamW's master weights.

    python3 -m torch.distributed.run --nproc-per-node 4 bench/fsdp_reference_gpu.py \\
        --model 1b --tensor 1 --micro 8 --seq 2048 --steps 20 --compile

Rank 0 prints one summary line (s/step, tokens/s, MFU, peak allocated, loss) for the steps after
--warmup. Like torchtitan: the tensor-parallel plan for blocks, embedding and output head, the
checkpoint_wrapper, compile and fully_shard calls, and not resharding the last block after forward.
Unlike it: no pipeline parallelism (torch.distributed.pipelining is left out to keep this a short
faithful FSDP2+TP program), no sequence parallelism, async TP, float8 or loss parallelism; the
model is built whole in fp32 on each GPU and then sharded (torchtitan builds it on the meta device),
so the peak-memory counter is reset once the model is sharded; the tokens are random.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

try:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # before PyTorch 2.6 FSDP2 lived here
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

MODELS = {
    "1b": dict(hidden=2048, layers=16, heads=16, kv_heads=16, inter=5504, vocab=32000),
    "7b": dict(hidden=4096, layers=30, heads=32, kv_heads=32, inter=11008, vocab=102400),  # DeepSeek-LLM-7B
}


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        # Under TP the weight is a DTensor replicated over tp, so that every parameter lives on the
        # (dp, tp) mesh for FSDP, clipping and the fused optimizer; the activations are plain tensors.
        w = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * w


def rope(t, cos, sin):
    half = t.shape[-1] // 2
    return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, self.head_dim = c["hidden"], c["hidden"] // c["heads"]
        self.attention_norm, self.ffn_norm = RMSNorm(h), RMSNorm(h)
        self.wq = nn.Linear(h, c["heads"] * self.head_dim, bias=False)
        self.wk = nn.Linear(h, c["kv_heads"] * self.head_dim, bias=False)
        self.wv = nn.Linear(h, c["kv_heads"] * self.head_dim, bias=False)
        self.wo = nn.Linear(c["heads"] * self.head_dim, h, bias=False)
        self.w1 = nn.Linear(h, c["inter"], bias=False)
        self.w3 = nn.Linear(h, c["inter"], bias=False)
        self.w2 = nn.Linear(c["inter"], h, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        h = self.attention_norm(x)
        # -1: the heads this rank holds, from its shard of wq/wk/wv, so the same code runs under TP
        q, k, v = (w(h).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(rope(q, cos, sin), rope(k, cos, sin), v, is_causal=True,
                                           enable_gqa=k.shape[1] != q.shape[1])
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Decoder(nn.Module):
    def __init__(self, c, seq):
        super().__init__()
        self.tok_embeddings = nn.Embedding(c["vocab"], c["hidden"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["hidden"])
        self.output = nn.Linear(c["hidden"], c["vocab"], bias=False)
        d = c["hidden"] // c["heads"]
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
        full = torch.cat([ang, ang], -1)
        self.register_buffer("cos", full.cos().float(), persistent=False)
        self.register_buffer("sin", full.sin().float(), persistent=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


def parallelize(model, mesh, args):
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    if tp_mesh.size() > 1:
        # torchtitan's plan without sequence parallelism: vocab-sharded embedding and output head
        # whose results are all-reduced / all-gathered back to replicated activations.
        parallelize_module(model, tp_mesh, {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        })
        for block in model.layers:
            parallelize_module(block, tp_mesh, {
                "wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel(),
                "w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel(),
            })
        for norm in [m for m in model.modules() if isinstance(m, RMSNorm)]:
            distribute_module(norm, tp_mesh)  # replicate the weight; see RMSNorm.forward
    for i, block in enumerate(model.layers):
        if args.ac == "full":
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        if args.compile:
            block = torch.compile(block, fullgraph=True)
        model.layers[i] = block
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers):
        # torchtitan's default: the last block stays gathered, backward would all-gather it at once
        fully_shard(block, mesh=dp_mesh, mp_policy=mp,
                    reshard_after_forward=args.reshard and i < len(model.layers) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=args.reshard)


def adamw(model, fused):
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, **kind)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="1b")
    ap.add_argument("--layers", type=int, help="override the preset's layer count")
    ap.add_argument("--tensor", type=int, default=1, help="tensor-parallel degree; dp = world / tensor")
    ap.add_argument("--micro", type=int, default=8, help="sequences per data-parallel rank per micro-batch")
    ap.add_argument("--accumulation", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--grad-sync", choices=["last", "every"], default="last",
                    help="reduce-scatter after the last micro-batch only, holding unsharded fp32 gradients in "
                         "between, or after every one (torchtitan's way, less memory)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block")
    ap.add_argument("--ac", choices=["none", "full"], default="none", help="activation checkpointing per block")
    ap.add_argument("--reshard-after-forward", choices=["true", "false"], default="true",
                    help="true frees gathered parameters after forward (ZeRO-3-like), false keeps them (ZeRO-2-like)")
    ap.add_argument("--peak-tflops", type=float, default=989.4, help="dense bf16 peak per GPU for MFU")
    args = ap.parse_args()
    args.reshard = args.reshard_after_forward == "true"
    cfg = dict(MODELS[args.model])
    if args.layers:
        cfg["layers"] = args.layers
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    tp = args.tensor
    if tp < 1:
        ap.error("--tensor must be at least 1")
    # Checked before any collective so that a bad layout exits on every rank instead of hanging.
    problems = [msg for bad, msg in [
        (world % tp, f"--tensor {tp} must divide the world size {world}"),
        (cfg["heads"] % tp or cfg["kv_heads"] % tp,
         f"heads {cfg['heads']} and kv_heads {cfg['kv_heads']} must be divisible by --tensor {tp}"),
        (cfg["inter"] % tp or cfg["vocab"] % tp,
         f"intermediate {cfg['inter']} and vocab {cfg['vocab']} must be divisible by --tensor {tp}"),
        (args.steps <= args.warmup, f"--steps {args.steps} must exceed --warmup {args.warmup}"),
        (not torch.cuda.is_available(), "no CUDA device"),
    ] if bad]
    if problems:
        if rank == 0:
            print("fsdp_reference_gpu.py: " + "; ".join(problems), file=sys.stderr)
        sys.exit(2)
    dp = world // tp
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.backends.cuda.matmul.allow_tf32 = True

    torch.manual_seed(0)  # identical full weights on every rank: TP and FSDP each keep their slice
    with torch.device("cuda"):
        model = Decoder(cfg, args.seq)
    n_params = sum(p.numel() for p in model.parameters()) - cfg["vocab"] * cfg["hidden"]
    parallelize(model, mesh, args)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    opt, opt_kind = adamw(model, fused=True), "fused"

    dp_rank = mesh.get_local_rank("dp")
    gen = torch.Generator(device="cuda")
    times = []
    for step in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen.manual_seed(1000 * step + dp_rank)  # the same batch on all TP ranks of a dp group
        step_loss = torch.zeros((), device="cuda")
        for m in range(args.accumulation):
            model.set_requires_gradient_sync(args.grad_sync == "every" or m == args.accumulation - 1)
            tokens = torch.randint(cfg["vocab"], (args.micro, args.seq), device="cuda", generator=gen)
            logits = model(tokens)
            loss = F.cross_entropy(logits.float().flatten(0, 1), torch.roll(tokens, -1, 1).flatten())
            (loss / args.accumulation).backward()
            step_loss += loss.detach() / args.accumulation
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        try:
            opt.step()
        except (RuntimeError, NotImplementedError) as e:  # fused AdamW on DTensors is a late addition
            if opt_kind != "fused":
                raise
            if rank == 0:
                print(f"fused AdamW failed on DTensor parameters ({e}); using foreach", flush=True)
            opt, opt_kind = adamw(model, fused=False), "foreach"
            opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)

    dist.all_reduce(step_loss, op=dist.ReduceOp.AVG, group=mesh.get_group("dp"))
    peak = torch.tensor(float(torch.cuda.max_memory_allocated()), device="cuda", dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        dt = sum(times[args.warmup:]) / len(times[args.warmup:])
        tokens_per_s = args.micro * args.accumulation * args.seq * dp / dt
        flops_per_token = 6 * n_params + 12 * cfg["layers"] * cfg["hidden"] * args.seq
        mfu = tokens_per_s * flops_per_token / (args.peak_tflops * 1e12 * world)
        print(f"optimizer: AdamW {opt_kind}", flush=True)
        print(f"fsdp2 model={args.model} layers={cfg['layers']} ranks={world} dp={dp} tp={tp} micro={args.micro} "
              f"accumulation={args.accumulation} seq={args.seq} compile={int(args.compile)} ac={args.ac} "
              f"reshard={int(args.reshard)}: {dt:.4f} s/step, {tokens_per_s:.0f} tokens/s, "
              f"{tokens_per_s / world:.0f} tokens/s/GPU, MFU {100 * mfu:.1f}%, "
              f"peak allocated {peak.item() / 2**30:.2f} GiB, loss {step_loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
