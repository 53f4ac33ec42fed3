#!/usr/bin/env bash
# A CUDA 13.0 toolkit for building the `cuda` feature on a machine without a GPU or a CUDA
# install, assembled from NVIDIA's wheels on PyPI (about 1 GB, downloaded once). Prints the
# `export` lines that point the build at it:
#   eval "$(scripts/cuda-toolkit.sh [DIR])"      (DIR default: ~/.cache/cuda13)
# Needs python3 with pip, unzip, gcc, and cudarc's source in the cargo registry (`cargo fetch`).
#
# 13.0 exactly: a newer nvcc may emit PTX that a CUDA 13.0 driver cannot load. No wheel ships the
# driver library (libcuda.so, which the binary links through cudarc): the linker gets a stub with
# every driver entry point cudarc declares, each returning CUDA_ERROR_NO_DEVICE, under the soname
# libcuda.so.1; at run time the GPU machine's driver provides the real one.
set -euo pipefail
DIR=${1:-$HOME/.cache/cuda13}
CUDA=$DIR/cuda13
if [ ! -e "$CUDA/lib/stubs/libcuda.so" ]; then
  mkdir -p "$DIR/wheels"
  WHEELS="nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
          nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88
          nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35"
  ( cd "$DIR/wheels" && python3 -m pip download -q --no-deps --only-binary=:all: \
      --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --python-version 3.11 $WHEELS ) >&2
  # Every CUDA 13 wheel unpacks into nvidia/cu13/{bin,include,lib,nvvm}.
  rm -rf "$DIR/unpacked" "$CUDA"
  for wheel in "$DIR"/wheels/*.whl; do unzip -qo "$wheel" -d "$DIR/unpacked"; done
  mv "$DIR/unpacked/nvidia/cu13" "$CUDA"
  rm -rf "$DIR/unpacked"
  ln -s lib "$CUDA/lib64"
  # The wheels carry versioned sonames only; the linker looks for lib<name>.so.
  for lib in libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnvrtc.so.13 libcudart.so.13; do
    ln -sf "$lib" "$CUDA/lib/${lib%.so.*}.so"
  done
  CUDARC=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* 2>/dev/null | sort -V | tail -1)
  [ -n "$CUDARC" ] || { echo "cudarc 0.19 is not in the cargo registry: run 'cargo fetch' first" >&2; exit 1; }
  mkdir -p "$CUDA/lib/stubs"
  grep -A1 'extern "C" {' "$CUDARC/src/driver/sys/mod.rs" | grep -oE '^\s+(pub )?fn [A-Za-z0-9_]+' \
    | awk '{print $NF}' | sort -u | sed 's/.*/int &(void) { return 100; }/' > "$DIR/libcuda-stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$CUDA/lib/stubs/libcuda.so" "$DIR/libcuda-stub.c"
fi
cat <<ENV
export CUDA_HOME=$CUDA CUDA_PATH=$CUDA PATH=$CUDA/bin:\$PATH
export CUDA_COMPUTE_CAP=\${CUDA_COMPUTE_CAP:-90}
export CUDAFORGE_THREADS=\${CUDAFORGE_THREADS:-2}
export NVCC_APPEND_FLAGS="-Xfatbin -compress-all"
ENV
