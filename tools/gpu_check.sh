#!/usr/bin/env bash
# Builds and runs the CUDA kernels' tests and benchmark on a machine that has nvcc, g++
# and a GPU but none of the project's other dependencies (no CMake configure): only
# kernels/, checkpoint/parallel.cc, the two kernels test files and
# bench/cuda_kernels_bench.cc, with GoogleTest
# and xxhash.h taken from a dependency folder.
#
#   tools/gpu_check.sh            # from the repository root
#
# Environment:
#   GPU_DEPS   dependency folder (default .gpu-deps): googletest/{include,src} copied
#              from /usr/src/googletest/googletest, include/xxhash.h from /usr/include.
#              Make it with `tools/gpu_check.sh --deps` on a machine that has both.
#   OUT        where the logs go (default .gpu-out)
#   BUILD      build folder (default /tmp/flywheel-gpu-check)
#   ARCH       nvcc -arch (default sm_90: Hopper, H100/H200)
#   BENCH_ARGS extra arguments for cuda_kernels_bench
#
# Exit status: 0 tests and benchmark passed; 1 a test failed; otherwise the benchmark's
# (1 wrong result, 2 error, 77 no usable CUDA device: the tests then skip, and this is
# what a machine without a GPU gives).
set -euo pipefail

cd "$(dirname "$0")/.."
GPU_DEPS=${GPU_DEPS:-.gpu-deps}
OUT=${OUT:-.gpu-out}
BUILD=${BUILD:-/tmp/flywheel-gpu-check}
ARCH=${ARCH:-sm_90}

if [[ "${1:-}" == "--deps" ]]; then
  mkdir -p "$GPU_DEPS/googletest" "$GPU_DEPS/include"
  cp -r /usr/src/googletest/googletest/include /usr/src/googletest/googletest/src \
    "$GPU_DEPS/googletest/"
  cp /usr/include/xxhash.h "$GPU_DEPS/include/"
  echo "dependencies copied into $GPU_DEPS (keep it out of git: .git/info/exclude)"
  exit 0
fi

NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
mkdir -p "$OUT" "$BUILD"
OUT=$(readlink -f "$OUT")
JOBS=$(nproc)

{
  echo "== $(date -u +%FT%TZ) $(uname -n)"
  "$NVCC" --version | tail -2
  g++ --version | head -1
  nvidia-smi 2>&1 || echo "nvidia-smi: not available"
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

CXXFLAGS=(-std=c++20 -O2 -g -Wall -Wextra -Wno-unused-parameter -fno-strict-aliasing
          -I. -I"$GPU_DEPS/include" -I"$GPU_DEPS/googletest/include" -DFLYWHEEL_HAVE_CUDA=1)
GTEST_FLAGS=(-std=c++20 -O1 -I"$GPU_DEPS/googletest/include" -I"$GPU_DEPS/googletest" -pthread)

# name, then the command; its output goes to $BUILD/name.log.
declare -a PIDS=() NAMES=()
compile() {
  local name=$1
  shift
  "$@" >"$BUILD/$name.log" 2>&1 &
  PIDS+=($!)
  NAMES+=("$name")
}

echo "== build (every file at once, on $JOBS cores)"
start=$(date +%s)
compile gtest-all g++ "${GTEST_FLAGS[@]}" -c "$GPU_DEPS/googletest/src/gtest-all.cc" -o "$BUILD/gtest-all.o"
compile gtest_main g++ "${GTEST_FLAGS[@]}" -c "$GPU_DEPS/googletest/src/gtest_main.cc" -o "$BUILD/gtest_main.o"
compile cuda_kernels "$NVCC" -std=c++20 -O3 -arch="$ARCH" -Xptxas -v -I. -DFLYWHEEL_HAVE_CUDA=1 \
  -c kernels/cuda/cuda_kernels.cu -o "$BUILD/cuda_kernels.o"
compile kernels g++ "${CXXFLAGS[@]}" -c kernels/kernels.cc -o "$BUILD/kernels.o"
compile kernels_avx2 g++ "${CXXFLAGS[@]}" -mavx2 -mbmi -mbmi2 -mpopcnt -c kernels/kernels_avx2.cc \
  -o "$BUILD/kernels_avx2.o"
compile checksum g++ "${CXXFLAGS[@]}" -mavx2 -c kernels/checksum.cc -o "$BUILD/checksum.o"
compile checksum_scalar g++ "${CXXFLAGS[@]}" -c kernels/checksum_scalar.cc -o "$BUILD/checksum_scalar.o"
# The benchmark's parallel loop (checkpoint/parallel.h) for generating its checkpoints.
compile parallel g++ "${CXXFLAGS[@]}" -c checkpoint/parallel.cc -o "$BUILD/parallel.o"
# kernels_test.cc calls libxxhash's XXH3 as a reference; the header alone provides it inline.
compile kernels_test g++ "${CXXFLAGS[@]}" -DXXH_INLINE_ALL -c tests/kernels/kernels_test.cc \
  -o "$BUILD/kernels_test.o"
compile cuda_kernels_test g++ "${CXXFLAGS[@]}" -c tests/kernels/cuda_kernels_test.cc \
  -o "$BUILD/cuda_kernels_test.o"
# nvcc compiles the benchmark (host code only) so that it finds cuda_runtime.h wherever
# this machine's CUDA lives, and links both programs with its static runtime.
compile cuda_kernels_bench "$NVCC" -std=c++20 -O3 -Xcompiler -Wall,-Wextra,-Wno-unused-parameter \
  -I. -I"$GPU_DEPS/include" -DFLYWHEEL_HAVE_CUDA=1 -c bench/cuda_kernels_bench.cc \
  -o "$BUILD/cuda_kernels_bench.o"
failed=0
for i in "${!PIDS[@]}"; do
  if ! wait "${PIDS[$i]}"; then
    echo "-- ${NAMES[$i]} failed:"
    cat "$BUILD/${NAMES[$i]}.log"
    failed=1
  fi
done
grep -h 'error\|warning' "$BUILD"/*.log | grep -v 'ptxas info' || true
cp "$BUILD/cuda_kernels.log" "$OUT/ptxas.txt"  # registers, shared memory and spills per kernel
[[ $failed == 0 ]] || exit 2

KERNEL_OBJS=("$BUILD"/kernels.o "$BUILD"/kernels_avx2.o "$BUILD"/checksum.o
             "$BUILD"/checksum_scalar.o "$BUILD"/cuda_kernels.o)
LINK=(-cudart static -Xcompiler -pthread)
"$NVCC" -o "$BUILD/kernels_test" "$BUILD"/kernels_test.o "$BUILD"/cuda_kernels_test.o \
  "${KERNEL_OBJS[@]}" "$BUILD"/gtest-all.o "$BUILD"/gtest_main.o "${LINK[@]}"
"$NVCC" -o "$BUILD/cuda_kernels_bench" "$BUILD"/cuda_kernels_bench.o "$BUILD"/parallel.o \
  "${KERNEL_OBJS[@]}" "${LINK[@]}"
echo "built in $(($(date +%s) - start)) s"

echo "== tests"
test_status=0
"$BUILD/kernels_test" --gtest_brief=0 >"$OUT/test.log" 2>&1 || test_status=$?
grep -E '^\[ *(OK|FAILED|SKIPPED|PASSED) *\]|^\[==========\]|Failure|Expected|Which is|Value of' \
  "$OUT/test.log" | head -80
grep -A2 'SKIPPED \]' "$OUT/test.log" | grep -m1 'Skipped' || true

echo "== benchmark"
bench_status=0
# shellcheck disable=SC2086
"$BUILD/cuda_kernels_bench" ${BENCH_ARGS:-} >"$OUT/bench.log" 2>&1 || bench_status=$?
cat "$OUT/bench.log"

echo "== summary: tests exit $test_status, benchmark exit $bench_status"
[[ $test_status == 0 ]] || exit 1
exit "$bench_status"
