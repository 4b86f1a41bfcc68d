#!/usr/bin/env bash
# Installs JAX's CUDA 12 plugin at the installed jaxlib's exact version: what `python -m ember.tools.compile`
# needs to compile the train step for described GPUs (--target=h100x8) on a machine without one. No GPU,
# CUDA toolkit or cuDNN is needed for compiling (about 180 MB to download).
set -euo pipefail
version=$(python -c "import jaxlib; print(jaxlib.__version__)")
pip install "jax-cuda12-plugin==${version}" "jax-cuda12-pjrt==${version}"
