"""transformers' DeepseekV3ForCausalLM + torch.compile training on one GPU: the peer of
recipes/gpu/deepseek_v2_lite_h100.toml (issue 63). DeepSeek-V2-Lite's shape cut to --layers layers
(hidden 2048, MLA without a query latent, kv_lora_rank 512, 16 heads of 128 + 64 rotary, values 128,
64 routed experts of 1408 top-6 + 2 shared, the first layer dense of 10944, vocab 102400) with V3's
router (sigmoid, the selection bias, one group), as transformers builds it. bf16 weights with fp32
master weights in fused AdamW (as bench/python_reference_gpu.py), SDPA attention, its own loss.

    python3 bench/hf_deepseek_v3_speed.py --steps 20 --micro 4 [--accumulation 4] --seq 2048 [--no-compile] [--experts grouped_mm]
Prints s/step, tokens/s and MFU on two bases: 6 x active parameters (the head included, the
embedding not), and that plus causal attention's products.
"""
import argparse
import time

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--experts", default="", help="transformers' experts implementation (eager, grouped_mm, batched_mm); default: its own")
    args = ap.parse_args()
    H, HEADS, NOPE, ROPE, V, VOCAB = 2048, 16, 128, 64, 128, 102400
    kwargs = dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=args.layers,
                  num_attention_heads=HEADS, num_key_value_heads=HEADS, n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
                  routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE,
                  v_head_dim=V, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=args.seq,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, rope_interleave=True)
    try:
        cfg = DeepseekV3Config(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **kwargs)
    except TypeError:
        cfg = DeepseekV3Config(rope_theta=10000.0, **kwargs)
    cfg._attn_implementation = "sdpa"
    if args.experts:
        cfg._experts_implementation = args.experts
    torch.manual_seed(1)
    model = DeepseekV3ForCausalLM(cfg).cuda().to(torch.bfloat16).train()
    experts_impl = getattr(model.config, "_experts_implementation", None)
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n or n.endswith("mlp.experts.gate_up_proj") or n.endswith("mlp.experts.down_proj"))
    embedding = model.model.embed_tokens.weight.numel()
    active = total - embedding - routed + routed * cfg.num_experts_per_tok // cfg.n_routed_experts
    step_model = model if args.no_compile else torch.compile(model)
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(master, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    times = []
    for step in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.accumulation):
            tokens = torch.randint(VOCAB, (args.micro, args.seq), device="cuda")
            loss = step_model(input_ids=tokens, labels=tokens).loss / args.accumulation
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
    dt = sum(times[args.warmup:]) / len(times[args.warmup:])
    tokens_per_s = args.micro * args.accumulation * args.seq / dt
    attention = 3 * HEADS * (NOPE + ROPE + V) * args.seq * args.layers  # causal QK^T and PV, forward and backward
    peak = 989.4e12
    name = "transformers DeepseekV3" + (" eager" if args.no_compile else " + torch.compile")
    print(f"{name} (experts {experts_impl}) layers={args.layers} micro={args.micro} x {args.accumulation} seq={args.seq}: {dt:.4f} s/step, {tokens_per_s:.0f} tokens/s, "
          f"MFU {100 * tokens_per_s * 6 * active / peak:.1f}% (6 x {active / 1e9:.3f} B active), "
          f"{100 * tokens_per_s * (6 * active + attention) / peak:.1f}% with attention; loss {loss.item() * args.accumulation:.4f}; "
          f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB; parameters {total / 1e9:.3f} B", flush=True)


if __name__ == "__main__":
    main()
