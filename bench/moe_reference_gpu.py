"""PyTorch eager reference for the single-GPU MoE benchmark (bench/gpu_moe.sh): the DeepSeek-MoE decoder of
recipes/gpu/deepseek_moe_h100.toml with dsrun's semantics (engine/model/deepseek.cpp, MoEImpl and BlockImpl):
RMSNorm, RoPE, SDPA (causal), grouped-query attention; the first --first-dense blocks keep a dense SwiGLU,
the others a DeepSeek-MoE layer: router softmax in fp32, top-k routed experts weighted by their scores (not
renormalised), shared experts as one SwiGLU of shared x moe-intermediate, and the expert-level balance loss
added to the LM loss. Dispatch is the usual eager one: (token, choice) pairs sorted by expert, each expert run
on its contiguous slice, weighted and summed back (no grouped GEMM). bf16 weights with fp32 master weights in
fused AdamW, as bench/python_reference_gpu.py and DeepSpeed's bf16 mode keep them. One GPU.

    python3 bench/moe_reference_gpu.py --steps 20 --micro 4 --seq 2048
Prints tokens/s and MFU (mean over the steps after warm-up), on the basis of dsrun's plan: active parameters.
"""
import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up in one projection of 2 x inner rows (as dsrun's)."""

    def __init__(self, hidden, inner):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(g) * u)


class MoE(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.e, self.k, self.aux_weight = a.experts, a.top_k, a.aux_weight
        self.router = nn.Linear(a.hidden, a.experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(a.hidden, a.moe_intermediate) for _ in range(a.experts))
        # S shared experts of size fe act like one SwiGLU of size S * fe
        self.shared = SwiGLU(a.hidden, a.shared * a.moe_intermediate) if a.shared > 0 else None

    def forward(self, x):
        shape = x.shape
        t = x.reshape(-1, shape[-1])
        n = t.shape[0]
        scores = torch.softmax(self.router(t).float(), -1)           # [T, E] fp32
        weights, chosen = scores.topk(self.k, -1)                    # [T, k], not renormalised
        flat = chosen.reshape(-1)                                    # (token, choice) pairs
        order = torch.argsort(flat, stable=True)                     # grouped by expert
        token_of = order // self.k
        counts = torch.bincount(flat, minlength=self.e)
        xs = t.index_select(0, token_of)                             # [T*k, H], expert-contiguous
        w = weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(x.dtype)
        outs = []
        for expert, part in zip(self.experts, xs.split(counts.tolist())):  # one host sync per layer
            if part.shape[0]:
                outs.append(expert(part))
        out = torch.zeros_like(t).index_add(0, token_of, torch.cat(outs) * w)
        if self.shared is not None:
            out = out + self.shared(t)
        # Expert-level balance loss (DeepSeek-MoE eq. 12): a * sum_i f_i P_i, f_i = E/(kT) * count_i
        # (no gradient through it), P_i = mean score of expert i.
        f = counts.float() * (self.e / (self.k * n))
        aux = self.aux_weight * (f * scores.mean(0)).sum()
        return out.reshape(shape), aux


class Block(nn.Module):
    def __init__(self, a, moe):
        super().__init__()
        self.h, self.heads, self.kv_heads, self.d = a.hidden, a.heads, a.kv_heads, a.hidden // a.heads
        self.n1, self.n2 = RMSNorm(a.hidden), RMSNorm(a.hidden)
        self.wqkv = nn.Linear(a.hidden, (a.heads + 2 * a.kv_heads) * self.d, bias=False)  # q, k, v rows stacked
        self.wo = nn.Linear(a.hidden, a.hidden, bias=False)
        self.moe = MoE(a) if moe else None
        self.mlp = None if moe else SwiGLU(a.hidden, a.intermediate)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        d, kvd = self.d, self.kv_heads * self.d
        q, k, v = self.wqkv(self.n1(x)).split([self.heads * d, kvd, kvd], -1)
        q = q.view(b, s, self.heads, d).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, d).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, d).transpose(1, 2)
        half = d // 2
        rot = lambda t: t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin
        q, k = rot(q), rot(k)
        if self.heads != self.kv_heads:  # grouped-query attention: each KV head serves heads/kv_heads query heads
            g = self.heads // self.kv_heads
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(b, s, self.h))
        if self.moe is not None:
            y, aux = self.moe(self.n2(x))
            return x + y, aux
        return x + self.mlp(self.n2(x)), None


class Decoder(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.vocab = a.vocab
        self.emb = nn.Embedding(a.vocab, a.hidden)
        self.blocks = nn.ModuleList(Block(a, i >= a.first_dense and a.experts > 0) for i in range(a.layers))
        self.norm = RMSNorm(a.hidden)
        self.head = nn.Linear(a.hidden, a.vocab, bias=False)
        d = a.hidden // a.heads
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.outer(torch.arange(a.seq, dtype=torch.float64), inv)
        full = torch.cat([ang, ang], -1)
        self.register_buffer("cos", full.cos().float(), persistent=False)
        self.register_buffer("sin", full.sin().float(), persistent=False)

    def forward(self, tokens, targets):
        x = self.emb(tokens)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        aux = torch.zeros((), device=x.device)
        for blk in self.blocks:
            x, a = blk(x, cos, sin)
            if a is not None:
                aux = aux + a
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, self.vocab), targets.view(-1)) + aux


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=102400)
    ap.add_argument("--intermediate", type=int, default=10944, help="dense SwiGLU inner size (the first dense layers)")
    ap.add_argument("--experts", type=int, default=64, help="routed experts per MoE layer")
    ap.add_argument("--shared", type=int, default=2, help="shared experts per MoE layer")
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--moe-intermediate", type=int, default=1408)
    ap.add_argument("--first-dense", type=int, default=1)
    ap.add_argument("--aux-weight", type=float, default=0.001)
    ap.add_argument("--profile", default="", help="write a torch.profiler kernel table here")
    a = ap.parse_args()
    assert a.hidden % a.heads == 0 and a.heads % a.kv_heads == 0 and (a.hidden // a.heads) % 2 == 0, "bad head shape"
    assert a.experts == 0 or 1 <= a.top_k <= a.experts, "top-k must be between 1 and experts"
    assert int(os.environ.get("WORLD_SIZE", "1")) == 1, "one GPU only"
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.manual_seed(1)
    with torch.device("cuda"):  # built on the GPU: initialising billions of weights on the CPU takes long
        model = Decoder(a)
    with torch.no_grad():  # dsrun's initialisation: N(0, 0.02) weights, norms 1 (routing as balanced as dsrun's)
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
    model = model.to(torch.bfloat16)
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(master, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    times = []
    prof = None
    if a.profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA],
                                      schedule=torch.profiler.schedule(wait=a.warmup, warmup=1, active=3))
        prof.start()
    for step in range(a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens = torch.randint(a.vocab, (a.micro, a.seq), device="cuda")
        loss = model(tokens, torch.roll(tokens, -1, 1))
        loss.backward()
        for p, m in zip(params, master):
            m.grad = None if p.grad is None else p.grad.float()  # an expert no token chose has no gradient
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
        with open(a.profile, "w") as f:
            try:
                f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=40))
            except Exception:  # older PyTorch names it after CUDA
                f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40))
    # FLOPs per token (PaLM appendix B; the same basis as python_reference_gpu.py and dsrun's plan,
    # engine/plan/cost.cpp):  6 * N_active + 12 * L * H * SEQ, where N_active counts every parameter a token
    # passes through except the embedding lookup (attention, norms, routers, dense MLPs, shared experts, the
    # final norm and the head) and, of the routed experts, only its top-k: each MoE layer's E - k unchosen
    # experts (3 * H * moe_intermediate parameters each) are left out.
    total = sum(p.numel() for p in params)
    moe_layers = sum(1 for blk in model.blocks if blk.moe is not None)
    n_active = total - a.vocab * a.hidden - moe_layers * (a.experts - a.top_k) * 3 * a.hidden * a.moe_intermediate
    flops_per_token = 6 * n_active + 12 * a.layers * a.hidden * a.seq
    dt = sum(times[a.warmup:]) / len(times[a.warmup:])
    tokens_per_s = a.micro * a.seq / dt
    mfu = tokens_per_s * flops_per_token / 989.4e12
    print(f"pytorch eager moe ranks=1 params={total / 1e9:.3f}B active={(n_active + a.vocab * a.hidden) / 1e9:.3f}B: "
          f"{dt:.4f} s/step, {tokens_per_s:.0f} tokens/s, MFU {100 * mfu:.1f}%, "
          f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
