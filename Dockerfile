# ember for NVIDIA GPUs (H100 / H200): the project with its [gpu] extra (JAX with CUDA 12 from pip,
# which brings its own CUDA, cuDNN and NCCL libraries; the host provides only the driver).
#
#   docker build -t ember .
#   docker run --gpus all -v $PWD/runs:/workdir ember --config=configs/default.py --config.workdir=/workdir/default
#
# The entry point is train.py (arguments are its flags); /workdir is the volume for runs
# (metrics, TensorBoard, checkpoints). Multi-node: launch/jobset.yaml, docs/multihost.md.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/ember

# Dependencies first (a layer that survives source edits), then the source.
COPY pyproject.toml README.md ./
COPY ember ./ember
RUN pip install ".[gpu]"

COPY configs ./configs
COPY launch ./launch
COPY train.py ./

VOLUME /workdir
ENTRYPOINT ["python", "train.py"]
CMD ["--config=configs/default.py", "--config.workdir=/workdir/default"]
