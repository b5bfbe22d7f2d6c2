"""PyTorch eager reference for the GPU benchmark: the same ~1B DeepSeek-style decoder as
recipes/gpu/deepseek_1b_h200.toml (RMSNorm, RoPE, SwiGLU, fused-kernel SDPA), bf16 weights with
fp32 master weights in AdamW as DeepSpeed's bf16 mode keeps them, DDP over NCCL.

    torchrun --nproc-per-node N bench/python_reference_gpu.py --steps 30 --micro 8
Prints tokens/s and MFU from rank 0 (mean over the steps after warm-up).
--compile wraps the model in torch.compile (default mode); --hf trains Hugging Face transformers'
LlamaForCausalLM of the same shape instead (SDPA attention, its own loss), where transformers is
installed: the "four lines of Python" a user would otherwise write.
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

H, L, HEADS, INTER, VOCAB, SEQ = 2048, 16, 16, 5504, 32000, 2048


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = RMSNorm(H), RMSNorm(H)
        self.wqkv = nn.Linear(H, 3 * H, bias=False)
        self.wo = nn.Linear(H, H, bias=False)
        self.gate_up = nn.Linear(H, 2 * INTER, bias=False)
        self.down = nn.Linear(INTER, H, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = self.wqkv(self.n1(x)).view(b, s, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        half = q.shape[-1] // 2
        rot = lambda t: t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin
        a = F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, H))
        g, u = self.gate_up(self.n2(x)).chunk(2, -1)
        return x + self.down(F.silu(g) * u)


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, H)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.norm = RMSNorm(H)
        self.head = nn.Linear(H, VOCAB, bias=False)
        d = H // HEADS
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.outer(torch.arange(SEQ, dtype=torch.float64), inv)
        full = torch.cat([ang, ang], -1)
        self.register_buffer("cos", full.cos().float(), persistent=False)
        self.register_buffer("sin", full.sin().float(), persistent=False)

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


class HFDecoder(nn.Module):
    """transformers' Llama of the same shape, called as Decoder is (tokens, targets) -> loss."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=INTER, num_hidden_layers=L,
                             num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ,
                             rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="sdpa")
        self.llama = LlamaForCausalLM(config)

    def forward(self, tokens, targets):
        logits = self.llama(input_ids=tokens).logits
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--profile", default="", help="write a torch.profiler kernel table here (rank 0)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--hf", action="store_true", help="Hugging Face transformers' LlamaForCausalLM")
    args = ap.parse_args()
    global SEQ
    SEQ = args.seq
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    if world > 1:
        dist.init_process_group("nccl")
    torch.manual_seed(1)
    model = (HFDecoder() if args.hf else Decoder()).cuda().to(torch.bfloat16)
    params = list(model.parameters())
    if args.compile:
        model = torch.compile(model)
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(master, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[local], gradient_as_bucket_view=True)
    times = []
    prof = None
    if args.profile and rank == 0:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA],
                                      schedule=torch.profiler.schedule(wait=args.warmup, warmup=1, active=3))
        prof.start()
    for step in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens = torch.randint(VOCAB, (args.micro, SEQ), device="cuda")
        loss = model(tokens, torch.roll(tokens, -1, 1))
        loss.backward()
        for p, m in zip(params, master):
            m.grad = p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(master, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if prof:
            prof.step()
    if prof:
        prof.stop()
        with open(args.profile, "w") as f:
            try:
                f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=40))
            except Exception:  # older PyTorch names it after CUDA
                f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40))
    if rank == 0:
        n = sum(p.numel() for p in params) - VOCAB * H
        flops_per_token = 6 * n + 12 * L * H * SEQ
        dt = sum(times[args.warmup:]) / len(times[args.warmup:])
        tokens_per_s = args.micro * SEQ * world / dt
        mfu = tokens_per_s * flops_per_token / (989.4e12 * world)
        name = ("transformers llama" if args.hf else "pytorch") + (" + torch.compile" if args.compile else " eager")
        print(f"{name} ranks={world} micro={args.micro} seq={SEQ}: {dt:.4f} s/step, {tokens_per_s:.0f} tokens/s, MFU {100 * mfu:.1f}%, "
              f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
