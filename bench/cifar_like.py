"""A CIFAR-10-shaped data set in CIFAR-10's binary format, for machines that cannot fetch the real one.

    python3 bench/cifar_like.py OUT_DIR [--seed N]

Writes data_batch_1.bin ... data_batch_5.bin (10,000 images each) and test_batch.bin (10,000), each
record one label byte and 3072 pixel bytes (red, green, blue planes of 32 x 32), as cifar-10-batches-bin
holds them; dsrun's data.kind = "cifar10" and bench/resnet_peer_gpu.py read them alike.

Why not random pixels: accuracy has to mean something. Each class is a grating, vertical or horizontal
stripes at one of five frequencies (1.5 to 7.5 cycles across the image, 1.5x apart); every image draws
its frequency around its class's (log-normal, sigma 0.13, so neighbouring classes overlap and the best
possible accuracy is about 90%), its orientation within 12 degrees, its phase and contrast, a smooth
coloured background, a colour cast and pixel noise. A network has to learn oriented filters, as on
real images. Crops and horizontal flips keep every label (neither changes a grating's frequency, and a
flip mirrors its orientation about the vertical, which both classes' orientations are symmetric under).
"""
import argparse
import os

import numpy as np

SIZE = 32
CYCLES = np.array([1.5, 2.25, 3.4, 5.0, 7.5])  # labels 2i and 2i + 1: vertical and horizontal stripes
SIGMA = np.deg2rad(12.0)


def smooth_field(rng, n, cells=4):
    """n smooth RGB fields [n, 3, 32, 32] in [-1, 1]: a coarse random grid, bilinearly upsampled."""
    coarse = rng.uniform(-1, 1, size=(n, 3, cells + 1, cells + 1))
    t = np.linspace(0, cells, SIZE)
    i0 = np.minimum(t.astype(int), cells - 1)
    f = t - i0
    rows = coarse[:, :, i0, :] * (1 - f)[None, None, :, None] + coarse[:, :, i0 + 1, :] * f[None, None, :, None]
    return rows[:, :, :, i0] * (1 - f) + rows[:, :, :, i0 + 1] * f


def images(rng, labels):
    n = len(labels)
    orientation = (labels % 2) * np.pi / 2 + rng.normal(0, SIGMA, n)
    cycles = CYCLES[labels // 2] * np.exp(rng.normal(0, 0.13, n))
    phase = rng.uniform(0, 2 * np.pi, n)
    y, x = np.mgrid[0:SIZE, 0:SIZE] / SIZE
    along = np.cos(orientation)[:, None, None] * x + np.sin(orientation)[:, None, None] * y
    grating = np.sin(2 * np.pi * cycles[:, None, None] * along + phase[:, None, None])  # [n, 32, 32]
    contrast = rng.uniform(0.25, 0.7, n)[:, None, None, None]
    tint = rng.uniform(0.3, 1.0, (n, 3, 1, 1))
    img = 0.5 + contrast * tint * grating[:, None] + 0.3 * smooth_field(rng, n) + rng.normal(0, 0.12, (n, 3, SIZE, SIZE))
    return np.clip(img * 255, 0, 255).astype(np.uint8)


def write_batch(path, rng, n):
    labels = rng.integers(0, 10, n)
    pixels = images(rng, labels).reshape(n, 3 * SIZE * SIZE)
    records = np.concatenate([labels.astype(np.uint8)[:, None], pixels], axis=1)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(records.tobytes())
    os.replace(tmp, path)  # a half-written batch never carries the final name


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=10)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        write_batch(os.path.join(a.out, name), rng, 10000)
    with open(os.path.join(a.out, "batches.meta.txt"), "w") as f:
        f.write("".join(f"grating-{k}\n" for k in range(10)))
    print(f"wrote 60,000 CIFAR-shaped images to {a.out} (seed {a.seed})")


if __name__ == "__main__":
    main()
