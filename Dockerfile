# syntax=docker/dockerfile:1
# embed-service images (docs/deployment.md). Two targets:
#   docker build -t embed-service:0.1.0 .                          CPU (the default target)
#   docker build --target cuda -t embed-service:0.1.0-cuda .       CUDA: the CUDA build of torch, flash-attn
# Build arguments:
#   MODEL, MODEL_REVISION   a Hugging Face repo id (and revision) baked into the image; empty: the packaged
#                           all-MiniLM-L6-v2, or whatever EMBED_MODEL names at run time (a mounted volume)
#   TORCH_SPEC              the CPU target's torch (default: scripts/install.sh's CPU wheel)
#   CUDA_TORCH_SPEC, TORCH_INDEX_URL   the CUDA target's torch and the index it comes from
# Both targets install with scripts/install.sh, the script `make` runs, so its steps are tested in CI.

ARG PYTHON_VERSION=3.11
ARG DEBIAN=bookworm
ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu24.04

# ---- CPU: build the virtual environment (pip and its caches stay in this stage) --------------------------
FROM python:${PYTHON_VERSION}-slim-${DEBIAN} AS cpu-build
ENV PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY scripts/install.sh scripts/install.sh
COPY pyproject.toml README.md LICENSE ./
COPY src src
# src/embed_service/kernels links to kernels/ (the Triton kernels, installed as embed_service.kernels).
COPY kernels kernels
ARG TORCH_SPEC=""
# The pip cache is a build cache mount: rebuilds after a source change reuse the torch wheel, and it never
# lands in a layer.
RUN --mount=type=cache,target=/root/.cache/pip \
    TORCH_SPEC="${TORCH_SPEC}" scripts/install.sh /opt/venv runtime

# ---- a model baked in (optional), fetched with the server's own resolver (embed_service/model_source.py)
FROM cpu-build AS model
ARG MODEL=""
ARG MODEL_REVISION=""
ENV HF_HUB_CACHE=/models/hub
RUN mkdir -p /models/hub \
    && if [ -n "${MODEL}" ]; then \
         /opt/venv/bin/python -m embed_service.model_source "${MODEL}" ${MODEL_REVISION:+"${MODEL_REVISION}"}; \
       fi

# ---- CPU: the image ------------------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim-${DEBIAN} AS cpu
# A C compiler stays in this image (about 190 MiB installed of gcc-12, binutils and libc6-dev, beside
# the 1.3 GiB virtual environment): the CPU attention kernel (embed_service/ops/csrc) is compiled on first use with
# -march=native for the CPU the pod lands on (AVX-512, AMX tiles), 2 s once per pod into EMBED_KERNEL_CACHE;
# it gives 1.5-2.3x the query throughput of torch's attention (docs/performance.md). A kernel prebuilt at image build
# must guess the CPU: x86-64-v4 matches native speed on AVX-512, x86-64-v3 is 2-6x slower, neither has AMX,
# and the loader has no run-time dispatch (docs/deployment.md has the figures). EMBED_CPU_KERNELS=0 (or an
# image without gcc) serves on torch's attention instead, with the same results.
# DL3008 (pin apt versions): bookworm's point releases replace the pinned versions and the build breaks;
# the base image tag is the pin.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --home-dir /home/embed --shell /usr/sbin/nologin embed \
    && install -d -o embed -g embed /var/cache/embed-service /home/embed/.cache
COPY --from=cpu-build /opt/venv /opt/venv
COPY --from=model --chown=embed:embed /models /models
ARG MODEL=""
ARG MODEL_REVISION=""
# The writable places the server uses: the kernel cache, HOME/.cache and /tmp; /models (HF_HUB_CACHE) only
# to download a repo id at start-up. Everything else may be read-only (docker run --read-only, Kubernetes
# readOnlyRootFilesystem).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/embed \
    HF_HUB_CACHE=/models/hub \
    EMBED_KERNEL_CACHE=/var/cache/embed-service/kernels \
    EMBED_HOST=0.0.0.0 \
    EMBED_PORT=8000 \
    EMBED_MODEL=${MODEL} \
    EMBED_REVISION=${MODEL_REVISION}
USER 10001:10001
WORKDIR /home/embed
EXPOSE 8000
# /health: 200 once the model is loaded, 503 while loading or draining. Python, not curl: one less package.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('EMBED_PORT', '8000')}/health\", timeout=4)"]
# SIGTERM drains (--drain-timeout, 30 s): give `docker stop` a longer timeout (-t 35); compose does.
STOPSIGNAL SIGTERM
ENTRYPOINT ["embed-service", "serve"]

# ---- CUDA: build (the devel image has nvcc, for a flash-attn without a prebuilt wheel) --------------------
FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS cuda-build
# DL3008: as above; the CUDA image tag is the pin.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
    && rm -rf /var/lib/apt/lists/*
ENV PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 MAX_JOBS=4
WORKDIR /src
COPY scripts/install.sh scripts/install.sh
COPY pyproject.toml README.md LICENSE ./
COPY src src
# src/embed_service/kernels links to kernels/ (the Triton kernels, installed as embed_service.kernels).
COPY kernels kernels
ARG CUDA_TORCH_SPEC=torch
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
RUN --mount=type=cache,target=/root/.cache/pip \
    TORCH_SPEC="${CUDA_TORCH_SPEC}" TORCH_INDEX_URL="${TORCH_INDEX_URL}" scripts/install.sh /opt/venv runtime \
    && scripts/install.sh /opt/venv gpu

FROM cuda-build AS cuda-model
ARG MODEL=""
ARG MODEL_REVISION=""
ENV HF_HUB_CACHE=/models/hub
RUN mkdir -p /models/hub \
    && if [ -n "${MODEL}" ]; then \
         /opt/venv/bin/python -m embed_service.model_source "${MODEL}" ${MODEL_REVISION:+"${MODEL_REVISION}"}; \
       fi

# ---- CUDA: the image. The base image (CUDA runtime, libcudart): torch's CUDA wheels bring cuBLAS and cuDNN
# as nvidia-* wheels, so the larger -runtime image would carry them twice. No compiler: on a GPU the CPU
# kernel is not used.
FROM nvidia/cuda:${CUDA_VERSION}-base-${UBUNTU} AS cuda
# DL3008: as above.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --home-dir /home/embed --shell /usr/sbin/nologin embed \
    && install -d -o embed -g embed /var/cache/embed-service /home/embed/.cache
COPY --from=cuda-build /opt/venv /opt/venv
COPY --from=cuda-model --chown=embed:embed /models /models
ARG MODEL=""
ARG MODEL_REVISION=""
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/embed \
    HF_HUB_CACHE=/models/hub \
    EMBED_KERNEL_CACHE=/var/cache/embed-service/kernels \
    EMBED_HOST=0.0.0.0 \
    EMBED_PORT=8000 \
    EMBED_DEVICE=cuda \
    EMBED_MODEL=${MODEL} \
    EMBED_REVISION=${MODEL_REVISION}
USER 10001:10001
WORKDIR /home/embed
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('EMBED_PORT', '8000')}/health\", timeout=4)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["embed-service", "serve"]

# The default target: the last stage is what a plain `docker build .` builds.
FROM cpu AS default
