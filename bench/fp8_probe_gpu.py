"""What this GPU's torch offers for FP8 products, and what each costs (issue 49's first question).

    python3 bench/fp8_probe_gpu.py

Prints the torch version, the C++ declarations of the scaled products, which scaling layouts
at::_scaled_mm accepts (tensorwise, rowwise, 1x128 x 128x128 blocks; e4m3 and e5m2 operands), their
error against a bf16 product, and TFLOP/s for the ~1B's and DeepSeek-LLM-7B's linear shapes.
"""
import glob
import os
import re
import time

import torch

print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())
inc = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "ops")
for name in ["_scaled_mm.h", "_scaled_mm_v2.h", "_scaled_grouped_mm.h", "_scaled_grouped_mm_v2.h"]:
    p = os.path.join(inc, name)
    if os.path.exists(p):
        text = open(p).read()
        decl = re.findall(r"inline at::Tensor " + name[:-2] + r"\([^)]*\)", text)
        print(name, "->", decl[:1])
    else:
        print(name, "absent")
for enum in glob.glob(os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "native", "cuda", "ScaledBlas*.h")) + \
            glob.glob(os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "BlasBackend.h")):
    print("header", enum)
    print("".join(l for l in open(enum) if "Scal" in l or "BlockWise" in l or "RowWise" in l)[:1500])

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
dev = "cuda"


def q_tensor(x, dt):
    amax = x.abs().amax().float().clamp(min=1e-12)
    s = torch.finfo(dt).max / amax
    return (x.float() * s).to(dt), (1 / s).reshape(())


def q_rows(x, dt, dim):
    amax = x.abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    s = torch.finfo(dt).max / amax
    return (x.float() * s).to(dt), (1 / s)


def q_blocks(x, dt, br, bc):
    m, k = x.shape
    xb = x.float().reshape(m // br, br, k // bc, bc)
    amax = xb.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12)
    s = torch.finfo(dt).max / amax
    return (xb * s).to(dt).reshape(m, k), (1 / s).reshape(m // br, k // bc)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


M, K, N = 4096, 2048, 5504
x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
ref = x @ w.t()
tries = {}
xa, sa = q_tensor(x, E4)
wb, sb = q_tensor(w, E4)
tries["tensorwise e4m3 x e4m3"] = lambda: torch._scaled_mm(xa, wb.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
xa5, sa5 = q_tensor(x, E5)
tries["tensorwise e5m2 x e4m3"] = lambda: torch._scaled_mm(xa5, wb.t(), scale_a=sa5, scale_b=sb, out_dtype=torch.bfloat16)
xr, sr = q_rows(x, E4, 1)
wr, swr = q_rows(w, E4, 1)
tries["rowwise e4m3 x e4m3"] = lambda: torch._scaled_mm(xr, wr.t(), scale_a=sr, scale_b=swr.t(), out_dtype=torch.bfloat16)
xr5, sr5 = q_rows(x, E5, 1)
tries["rowwise e5m2 x e4m3"] = lambda: torch._scaled_mm(xr5, wr.t(), scale_a=sr5, scale_b=swr.t(), out_dtype=torch.bfloat16)
xk, sk = q_blocks(x, E4, 1, 128)
wk, swk = q_blocks(w, E4, 128, 128)
tries["blockwise 1x128 x 128x128 (scales as made)"] = lambda: torch._scaled_mm(xk, wk.t(), scale_a=sk, scale_b=swk, out_dtype=torch.bfloat16)
tries["blockwise 1x128 x 128x128 (a's scales outer-dim-major, b's transposed)"] = lambda: torch._scaled_mm(
    xk, wk.t(), scale_a=sk.t().contiguous().t(), scale_b=swk.t(), out_dtype=torch.bfloat16)
tries["blockwise 1x128 x 128x128 (a's scales outer-dim-major, b's as made)"] = lambda: torch._scaled_mm(
    xk, wk.t(), scale_a=sk.t().contiguous().t(), scale_b=swk, out_dtype=torch.bfloat16)
works = {}
for name, f in tries.items():
    try:
        out = f()
        print(f"{name}: OK, relative error {rel(out, ref):.4f}")
        works[name] = f
    except Exception as e:  # report what this torch refuses, and why
        print(f"{name}: refused: {str(e).splitlines()[0][:300]}")
print("_scaled_grouped_mm:", hasattr(torch, "_scaled_grouped_mm"), (torch._scaled_grouped_mm.__doc__ or "")[:200] if hasattr(torch, "_scaled_grouped_mm") else "")


def bench(f, flops, n=30):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / n
    return flops / dt / 1e12, dt * 1e3


for (M, K, N, what) in [(16384, 2048, 5504, "1B MLP up"), (16384, 5504, 2048, "1B MLP down"), (16384, 2048, 2048, "1B attention"),
                        (16384, 4096, 11008, "7B MLP up"), (16384, 11008, 4096, "7B MLP down"), (16384, 4096, 4096, "7B attention")]:
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
    fl = 2 * M * K * N
    line = [f"{what} [{M}x{K}]x[{K}x{N}]: bf16 {bench(lambda: x @ w.t(), fl)[0]:.0f}"]
    xa, sa = q_tensor(x, E4)
    wb, sb = q_tensor(w, E4)
    line.append(f"tensorwise {bench(lambda: torch._scaled_mm(xa, wb.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), fl)[0]:.0f}")
    line.append(f"tensorwise fast-accum {bench(lambda: torch._scaled_mm(xa, wb.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True), fl)[0]:.0f}")
    xr, sr = q_rows(x, E4, 1)
    wr, swr = q_rows(w, E4, 1)
    line.append(f"rowwise {bench(lambda: torch._scaled_mm(xr, wr.t(), scale_a=sr, scale_b=swr.t(), out_dtype=torch.bfloat16), fl)[0]:.0f}")
    for name, f in works.items():
        if name.startswith("blockwise"):
            xk, sk = q_blocks(x, E4, 1, 128)
            wk, swk = q_blocks(w, E4, 128, 128)
            g = {"blockwise 1x128 x 128x128 (scales as made)": lambda: torch._scaled_mm(xk, wk.t(), scale_a=sk, scale_b=swk, out_dtype=torch.bfloat16),
                 "blockwise 1x128 x 128x128 (a's scales outer-dim-major, b's transposed)": lambda: torch._scaled_mm(xk, wk.t(), scale_a=sk.t().contiguous().t(), scale_b=swk.t(), out_dtype=torch.bfloat16),
                 "blockwise 1x128 x 128x128 (a's scales outer-dim-major, b's as made)": lambda: torch._scaled_mm(xk, wk.t(), scale_a=sk.t().contiguous().t(), scale_b=swk, out_dtype=torch.bfloat16)}[name]
            line.append(f"blockwise {bench(g, fl)[0]:.0f}")
            break
    qt = bench(lambda: q_tensor(x, E4), 0)[1]
    line.append(f"(TFLOP/s; quantising x tensorwise in eager {qt:.3f} ms)")
    print(", ".join(line))
