# Sourced by the bench/gpu_*.sh scripts: the repository root as working directory, $out for logs
# ($OUT on the device machine), NVLink multicast off in NCCL, PyTorch and NVSHMEM (a program using
# it can put a shared host's GPUs out of service), $gpus, and build_and_test.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-/tmp/out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(nvidia-smi -L | wc -l)

# build_and_test REGEX: scripts/gpu_build.sh, then the ctest tests matching REGEX; log in
# $out/build_and_tests.log, a summary printed; exits when no dsrun was built.
build_and_test() {
  local t0
  t0=$(date +%s)
  scripts/gpu_build.sh -j 8 -R "$1" > "$out/build_and_tests.log" 2>&1
  echo "build+tests exit $? in $(( $(date +%s) - t0 )) s"
  grep -E "tests passed|tests failed|Failed|SKIPPED" "$out/build_and_tests.log" | head -20
  [ -x build-gpu/dsrun ] || { tail -80 "$out/build_and_tests.log"; exit 1; }
}
