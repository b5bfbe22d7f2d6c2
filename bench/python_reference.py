"""The quickstart's tiny DeepSeek-style decoder written in Python PyTorch, for bench/train_speed.sh.

Same shapes as templates/models/deepseek-tiny.toml, same batch, AdamW, clipping, fp32, one thread
per rank when two ranks share the cores. Two ranks use DistributedDataParallel over Gloo.
Prints the mean seconds per optimizer step after warm-up.

    python3 bench/python_reference.py --ranks 1 --steps 30
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

HIDDEN, LAYERS, HEADS, INTER, VOCAB = 128, 4, 4, 344, 256


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(HIDDEN), RMSNorm(HIDDEN)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(HIDDEN, INTER, bias=False), nn.Linear(HIDDEN, INTER, bias=False)
        self.down = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).view(b, s, HEADS, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        att = torch.softmax(scores.masked_fill(mask, float("-inf")).float(), -1).to(q.dtype) @ v
        x = x + self.wo(att.transpose(1, 2).reshape(b, s, HIDDEN))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(nn.Module):
    def __init__(self, seq):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        d = HIDDEN // HEADS
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
        full = torch.cat([ang, ang], -1)
        self.register_buffer("cos", full.cos().float(), persistent=False)
        self.register_buffer("sin", full.sin().float(), persistent=False)
        self.mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)  # not a buffer: DDP cannot broadcast bool
        for name, p in self.named_parameters():
            if "norm" not in name:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, tokens, targets):
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin, self.mask)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def train(rank, world, args, port):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(1234)
    model = Decoder(args.seq)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=2e-3, betas=(0.9, 0.95), eps=1e-8)
    per_rank = args.global_batch // world
    accumulation = per_rank // args.micro
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        for m in range(accumulation):
            tokens = torch.randint(VOCAB, (args.micro, args.seq))
            targets = torch.randint(VOCAB, (args.micro, args.seq))
            loss = model(tokens, targets) / accumulation
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        steady = times[args.warmup:]
        print(f"ranks {world}: {sum(steady) / len(steady):.4f} s/step (mean of steps {args.warmup + 1}-{args.steps})")
    if world > 1:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    if args.ranks == 1:
        train(0, 1, args, 0)
    else:
        mp.spawn(train, args=(args.ranks, args, 29651), nprocs=args.ranks)


if __name__ == "__main__":
    main()
