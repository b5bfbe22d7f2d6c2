#!/usr/bin/env bash
# Run ON the GPU machine, from anywhere: builds dsrun into build-gpu/ against the PyTorch (CUDA, NCCL)
# that the machine's python3 holds and the Debian libraries that scripts/gpu_kit.sh unpacked into
# .device/sysroot here, then runs the tests. Needs no network. Extra arguments go to ctest (e.g. -j 8).
# Env: PYTHON (default python3), BUILD_TYPE (default RelWithDebInfo), TORCH_CUDA_ARCH_LIST (default 9.0),
#      GPU_CMAKE_ARGS (more cmake arguments, split on spaces).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
sys=$root/.device/sysroot
build=$root/build-gpu
say() { echo "gpu_build: $*"; }
die() { echo "gpu_build: error: $*" >&2; exit 1; }

[ -f "$sys/.stamp" ] || die "$sys is missing: run scripts/gpu_kit.sh on the Debian machine and carry .device"
py=${PYTHON:-python3}
command -v "$py" >/dev/null || die "no $py"

# --- PyTorch: where it is, its ABI, CUDA, and the NVIDIA wheels' headers and libraries -------------
torch_env=$("$py" - <<'EOF'
import glob, os, site, shlex, torch
d = os.path.dirname(torch.__file__)
roots = [p for p in site.getsitepackages() + [site.getusersitepackages(), os.path.dirname(d)] if os.path.isdir(p)]
nv = sorted({os.path.dirname(p) for r in roots for p in glob.glob(os.path.join(r, "nvidia", "**", "lib", "*.so*"), recursive=True)})
nccl_h = [p for r in roots for p in glob.glob(os.path.join(r, "nvidia", "**", "nccl.h"), recursive=True)]
v = {
  "torch_version": torch.__version__,
  "torch_cuda": torch.version.cuda or "",
  "torch_abi": int(torch._C._GLIBCXX_USE_CXX11_ABI),
  "torch_cmake": torch.utils.cmake_prefix_path,
  "torch_dir": d,
  "nvidia_libs": ":".join(nv),
  "nccl_inc": os.path.dirname(nccl_h[0]) if nccl_h else "",
}
for k, x in v.items(): print(f"{k}={shlex.quote(str(x))}")
EOF
) || die "$py cannot import torch"
eval "$torch_env"
say "torch $torch_version (CUDA ${torch_cuda:-none}), _GLIBCXX_USE_CXX11_ABI=$torch_abi, at $torch_dir"
# The carried .so files (toml++, spdlog, fmt) were built by Debian's GCC with the C++11 ABI (=1).
[ "$torch_abi" = 1 ] || die "this torch uses the old C++ ABI (=0); the Debian libraries in .device use the new one:
  use a torch >= 2.7 (CXX11 ABI wheels), or build dsrun header-only for toml++/spdlog/fmt"

# The carried libraries need glibc >= 2.34 and a libstdc++ with GLIBCXX_3.4.30 (GCC 12), as on Debian 12.
glibc=$(getconf GNU_LIBC_VERSION | awk '{print $2}')
[ "$(printf '%s\n2.34\n' "$glibc" | sort -V | head -1)" = 2.34 ] || die "glibc $glibc < 2.34: the Debian bookworm .so files in .device cannot load here"
libstdcxx=$(${CXX:-c++} -print-file-name=libstdc++.so.6 2>/dev/null || true)
if [ -f "$libstdcxx" ] && ! grep -qa 'GLIBCXX_3\.4\.30' "$libstdcxx"; then
  die "$libstdcxx lacks GLIBCXX_3.4.30 (GCC 12): libspdlog.so.1.10 from .device cannot load here"
fi

# --- CUDA toolkit (Caffe2's cuda.cmake, which find_package(Torch) runs, needs nvcc and its headers) -
nvcc=$(command -v nvcc || true)
[ -n "$nvcc" ] || for c in /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do [ -x "$c" ] && { nvcc=$c; break; }; done
[ -n "$nvcc" ] || die "no nvcc found (PATH, /usr/local/cuda): find_package(Torch) of a CUDA torch needs the toolkit"
cuda_home=$(cd "$(dirname "$nvcc")/.." && pwd)
export CUDA_HOME=$cuda_home CUDA_PATH=$cuda_home CUDACXX=$nvcc PATH=$cuda_home/bin:$PATH
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
say "nvcc $("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p') at $nvcc; $(${CXX:-c++} --version | head -1); glibc $glibc"

# --- The carried Debian prefixes --------------------------------------------------------------------
prefixes=
ld_path=
pc_path=
for p in "$sys"/*/usr; do
  name=$(basename "$(dirname "$p")")
  case $name in gloo|fortunes) continue ;; esac  # headers only / data: both handled below
  [ -d "$p/lib/x86_64-linux-gnu" ] && ld_path=$ld_path:$p/lib/x86_64-linux-gnu
  [ "$name" = pkgconf ] && continue              # a tool, used below only if the machine has none
  prefixes="$prefixes$p;"
  for d in "$p/lib/x86_64-linux-gnu/pkgconfig" "$p/share/pkgconfig"; do [ -d "$d" ] && pc_path=$pc_path:$d; done
done
export PKG_CONFIG_PATH=${pc_path#:}${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
# Run time (tests run dsrun and dsrun-rank), and link time: ld resolves libtorch_cuda's own needs
# (libcudart, libnccl, ...) through LD_LIBRARY_PATH when it cannot through their $ORIGIN run paths.
export LD_LIBRARY_PATH=${ld_path#:}:$torch_dir/lib${nvidia_libs:+:$nvidia_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

cmake_args=()
if ! command -v pkg-config >/dev/null; then
  say "no pkg-config here: using the carried pkgconf"
  cmake_args+=(-DPKG_CONFIG_EXECUTABLE="$sys/pkgconf/usr/bin/pkgconf")
fi

cxx_flags=
ld_flags=
# ProcessGroupGloo.hpp includes <gloo/...>: prefer torch's own copy; Debian's (older) only if it ships none.
if [ -f "$torch_dir/include/gloo/algorithm.h" ]; then
  say "gloo headers: torch's own"
else
  say "gloo headers: torch ships none; using Debian's libgloo-dev (2022-05) headers from .device"
  cxx_flags="$cxx_flags -isystem $sys/gloo/usr/include"
fi
# ProcessGroupNCCL.hpp includes <nccl.h>: torch, the toolkit, the system, or the nvidia-nccl wheel.
if [ -f "$torch_dir/include/nccl.h" ] || [ -f "$cuda_home/include/nccl.h" ] || [ -f /usr/include/nccl.h ]; then
  say "nccl.h: found beside torch, CUDA or /usr/include"
elif [ -n "$nccl_inc" ]; then
  say "nccl.h: $nccl_inc"
  cxx_flags="$cxx_flags -isystem $nccl_inc"
  nccl_so=$(ls "$nccl_inc"/../lib/libnccl.so* 2>/dev/null | head -1 || true)
  if [ -n "$nccl_so" ]; then   # linked only if dsrun's code calls NCCL itself (inline header code)
    nccl_lib=$(cd "$(dirname "$nccl_so")" && pwd)
    ld_flags="$ld_flags -Wl,-rpath,$nccl_lib"
    cmake_args+=(-DCMAKE_CXX_STANDARD_LIBRARIES="-Wl,--push-state,--as-needed $nccl_lib/$(basename "$nccl_so") -Wl,--pop-state")
  fi
else
  say "nccl.h: not found; the build fails if DSRUN_WITH_NCCL is set"
fi

# --- Configure, build, test ----------------------------------------------------------------------
cmake -S "$root" -B "$build" -G Ninja \
  -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" -DDSRUN_UNITY_BUILD=OFF \
  -DCMAKE_PREFIX_PATH="$prefixes$torch_cmake" \
  -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES=90 -DCUDAToolkit_ROOT="$cuda_home" \
  -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
  -DCMAKE_CXX_FLAGS="${cxx_flags# }" -DCMAKE_EXE_LINKER_FLAGS="${ld_flags# }" \
  "${cmake_args[@]}" ${GPU_CMAKE_ARGS:-}

if grep -q 'DSRUN_WITH_NCCL' "$build/compile_commands.json" 2>/dev/null; then
  say "CUDA torch detected: dsrun_engine built with DSRUN_WITH_NCCL"
else
  say "warning: DSRUN_WITH_NCCL is not set: CMake did not see a CUDA torch (TORCH_CUDA_LIBRARIES empty)"
fi

cmake --build "$build" -j "$(nproc)"

# recipes/quickstart.toml, and the CLI tests that run it, train on /usr/share/games/fortunes.
if [ ! -e /usr/share/games/fortunes ]; then
  if mkdir -p /usr/share/games 2>/dev/null && cp -r "$sys/fortunes/usr/share/games/fortunes" /usr/share/games/; then
    say "copied the fortunes text to /usr/share/games/fortunes"
  else
    say "warning: no /usr/share/games/fortunes and cannot create it: the quickstart's training tests will fail"
  fi
fi
ctest --test-dir "$build" --output-on-failure "$@"
