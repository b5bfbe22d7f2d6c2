"""The PyTorch peer of recipes/rtx4090x3_resnet50_cifar10.toml: torchvision's ResNet-50 with
DistributedDataParallel, as a careful user writes it, trained on the same files with the same recipe.

    torchrun --nproc_per_node 3 bench/resnet_peer_gpu.py --data DIR --steps 1300 [--out result.json]

Same as dsrun's run: the CIFAR stem (3x3 convolution, stride 1, no max-pool) on torchvision's
bottleneck blocks (stride on the 3x3, as dsrun's), Kaiming-normal convolutions; 128 images per GPU;
random crop with 4 black pixels of padding and a horizontal flip; per-channel normalisation with
CIFAR-10's means; SGD with Nesterov momentum 0.9, weight decay 5e-4 on the weights of two or more
dimensions only, one-cycle rate (linear rise over the first 25% from peak/25, cosine down to
peak/25/1e4, momentum not cycled); fp16 autocast with a dynamic loss scale; every image of the
epoch once, the epoch's order one permutation shared by the ranks.
What a careful user adds and dsrun does too: channels-last memory, the images and their augmentation
on the GPU (no DataLoader workers to starve), the foreach SGD step (see below why not fused), bucket views for the gradients.
Images per second are timed over the steps after the first tenth (cuDNN autotuning, NCCL set-up);
accuracy is on the whole test batch after the last step, in eval mode, on rank 0.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision

MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)


def load(path, names, device):
    raw = torch.cat([torch.from_numpy(__import__("numpy").fromfile(os.path.join(path, n), dtype="uint8")) for n in names])
    records = raw.view(-1, 3073)
    return records[:, 1:].reshape(-1, 3, 32, 32).to(device), records[:, 0].long().to(device)


def normalise(images_u8):
    return ((images_u8.float() / 255) - MEAN.to(images_u8.device)) / STD.to(images_u8.device)


def crop_flip(images_u8, generator):
    n = images_u8.size(0)
    padded = F.pad(images_u8, (4, 4, 4, 4))  # black, as dsrun pads
    dy = torch.randint(0, 9, (n,), device=images_u8.device, generator=generator)
    dx = torch.randint(0, 9, (n,), device=images_u8.device, generator=generator)
    flip = torch.rand(n, device=images_u8.device, generator=generator) < 0.5
    rows = dy[:, None] + torch.arange(32, device=images_u8.device)[None]
    across = torch.arange(32, device=images_u8.device)[None]
    cols = dx[:, None] + torch.where(flip[:, None], 31 - across, across)
    flat = (rows[:, :, None] * 40 + cols[:, None, :]).view(n, 1, 1024).expand(n, 3, 1024)
    return padded.view(n, 3, 1600).gather(2, flat).view(n, 3, 32, 32)


def model():
    net = torchvision.models.resnet50(num_classes=10)
    net.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    net.maxpool = nn.Identity()
    return net


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=1300)
    ap.add_argument("--per-gpu", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="")
    a = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    torch.manual_seed(a.seed)
    torch.backends.cudnn.benchmark = True

    train_x, train_y = load(a.data, [f"data_batch_{i}.bin" for i in range(1, 6)], device)
    test_x, test_y = load(a.data, ["test_batch.bin"], device)
    net = model().to(device, memory_format=torch.channels_last)
    ddp = nn.parallel.DistributedDataParallel(net, device_ids=[device.index], gradient_as_bucket_view=True)
    decay = [p for p in net.parameters() if p.ndim >= 2]
    no_decay = [p for p in net.parameters() if p.ndim < 2]
    # foreach, not fused: torch 2.11's fused SGD lets GradScaler hand it the overflow check, and on a
    # skipped (overflowed) step it still advances the momentum buffer, so the early fp16 overflows write
    # inf into the momentum and the weights turn NaN (seen here by step 100; LibreYOLO/libreyolo#771).
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": no_decay, "weight_decay": 0}],
                          lr=a.lr, momentum=0.9, nesterov=True, foreach=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=a.steps, pct_start=0.25, anneal_strategy="cos",
                                                div_factor=25, final_div_factor=1e4, cycle_momentum=False)
    scaler = torch.amp.GradScaler("cuda")
    order_gen = torch.Generator(device=device)
    order_gen.manual_seed(a.seed)  # the same permutation on every rank
    aug_gen = torch.Generator(device=device)
    aug_gen.manual_seed(a.seed * 1000 + rank)

    n_train, global_batch = train_x.size(0), a.per_gpu * world
    order, cursor = torch.randperm(n_train, device=device, generator=order_gen), 0
    timed_from = a.steps // 10
    losses = []
    for step in range(a.steps):
        if step == timed_from:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        if cursor + global_batch > n_train:  # a new epoch: a new order (the last partial batch dropped)
            order, cursor = torch.randperm(n_train, device=device, generator=order_gen), 0
        idx = order[cursor + rank * a.per_gpu: cursor + (rank + 1) * a.per_gpu]
        cursor += global_batch
        x = normalise(crop_flip(train_x[idx], aug_gen)).contiguous(memory_format=torch.channels_last)
        y = train_y[idx]
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        if step % 100 == 0 or step == a.steps - 1 or (step < 300 and step % 10 == 0):
            losses.append((step, loss.item()))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    images_per_second = (a.steps - timed_from) * global_batch / seconds

    correct = 0
    if rank == 0:
        net.eval()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            for i in range(0, test_x.size(0), 1000):
                xb = normalise(test_x[i:i + 1000]).contiguous(memory_format=torch.channels_last)
                correct += (net(xb).argmax(1) == test_y[i:i + 1000]).sum().item()
        result = {"images_per_second": images_per_second, "step_seconds": seconds / (a.steps - timed_from),
                  "accuracy": correct / test_x.size(0), "steps": a.steps, "gpus": world, "final_loss": losses[-1][1],
                  "losses": losses, "torch": torch.__version__, "torchvision": torchvision.__version__}
        print(json.dumps(result))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
