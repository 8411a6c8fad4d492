# embed-service images (docs/deployment.md). Two targets:
#   docker build -t embed-service:0.1.0 .                          CPU (the default target)
#   docker build --target cuda -t embed-service:0.1.0-cuda .       CUDA: the CUDA build of torch, flash-attn
# No `# syntax=` line: BuildKit's built-in Dockerfile frontend has all this file uses (RUN --mount), and
# such a line makes every build pull a frontend image from Docker Hub, which fails air-gapped.
# Build arguments:
#   MODEL, MODEL_REVISION   a Hugging Face repo id (and revision) baked into the image; empty: the packaged
#                           all-MiniLM-L6-v2, or whatever EMBED_MODEL names at run time (a mounted volume)
#   TORCH_SPEC, TORCH_INDEX_URL   the CPU target's torch (default torch==2.13.0) and where it comes from
#                           (default: scripts/install.sh's choice, PyTorch's CPU index in a build, which has
#                           no GPU; `none`: pip's own configuration)
#   CUDA_TORCH_SPEC, CUDA_TORCH_INDEX_URL   the CUDA target's torch and its index (cu128)
#   PIP_FIND_LINKS          a wheelhouse for pip (a URL or a path), e.g. for a build without PyPI
# Both targets install with scripts/install.sh, the script `make` runs, so its steps are tested in CI.
# Layers: torch and the other dependencies are installed in a layer keyed by pyproject.toml and the
# install script alone; the package after it, so a source change rebuilds in seconds.

ARG PYTHON_VERSION=3.11
ARG DEBIAN=bookworm
ARG CUDA_VERSION=12.8.1
ARG UBUNTU=ubuntu24.04

# ---- CPU: the dependencies (pip and its caches stay in the build stages) ---------------------------------
FROM python:${PYTHON_VERSION}-slim-${DEBIAN} AS cpu-deps
ENV PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY scripts/install.sh scripts/install.sh
COPY pyproject.toml ./
ARG TORCH_SPEC=""
ARG TORCH_INDEX_URL=""
ARG PIP_FIND_LINKS
# The pip cache is a build cache mount: it never lands in a layer.
RUN --mount=type=cache,target=/root/.cache/pip \
    TORCH_SPEC="${TORCH_SPEC}" TORCH_INDEX_URL="${TORCH_INDEX_URL}" scripts/install.sh /opt/venv deps

# ---- CPU: the package, and the CPU attention kernel prebuilt per x86-64 level (ops/cpu_kernels.py) --------
FROM cpu-deps AS cpu-build
# The compiler stays in this stage: the image loads the prebuilt kernel for its CPU's level at run time.
# DL3008 (pin apt versions): bookworm's point releases replace the pinned versions and the build breaks;
# the base image tag is the pin.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY README.md LICENSE ./
COPY src src
# src/embed_service/kernels links to the modules in kernels/ (the Triton kernels, embed_service.kernels).
COPY kernels kernels
# /stage holds only the package's files, at their paths: the image copies it over the dependencies' venv,
# so that a source change makes a layer of a few MB, not one of the whole venv.
RUN --mount=type=cache,target=/root/.cache/pip \
    scripts/install.sh /opt/venv package \
    && /opt/venv/bin/python -m embed_service.ops.cpu_kernels prebuild \
    && site=$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
    && mkdir -p "/stage$site" /stage/opt/venv/bin \
    && cp -a "$site/embed_service" "$site"/embed_service-*.dist-info "/stage$site/" \
    && cp -a /opt/venv/bin/embed-service /stage/opt/venv/bin/

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
# No compiler: the CPU attention kernel (ops/csrc) comes prebuilt for x86-64-v3, -v4, -v4 with AVX512-BF16
# and -v4 with AMX, and the loader picks the best level the CPU's flags allow (-v4 runs as fast as
# -march=native on AVX-512); it needs only libgomp (OpenMP), and neither gcc (about 190 MiB) nor an exec
# mount for a kernel cache.
# DL3008: as above.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && useradd --uid 10001 --user-group --create-home --home-dir /home/embed --shell /usr/sbin/nologin embed \
    && install -d -o embed -g embed /var/cache/embed-service /home/embed/.cache
COPY --from=cpu-deps /opt/venv /opt/venv
COPY --from=cpu-build /stage/ /
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
# SIGTERM drains: /health turns 503, admitted requests finish for up to EMBED_DRAIN_TIMEOUT (30 s), then the
# workers stop (up to 10 s) and the process exits 0. Docker's default 10 s before SIGKILL cuts that short:
# stop with `docker stop -t 45` (30 + 10 + 5 to exit), as compose's stop_grace_period and Kubernetes'
# terminationGracePeriodSeconds do.
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
COPY pyproject.toml ./
# Pinned as the CPU target's torch is; match the index to your driver (cu126, cu128, ...).
ARG CUDA_TORCH_SPEC=torch==2.13.0
ARG CUDA_TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG PIP_FIND_LINKS
RUN --mount=type=cache,target=/root/.cache/pip \
    TORCH_SPEC="${CUDA_TORCH_SPEC}" TORCH_INDEX_URL="${CUDA_TORCH_INDEX_URL}" scripts/install.sh /opt/venv deps \
    && scripts/install.sh /opt/venv gpu
COPY README.md LICENSE ./
COPY src src
# src/embed_service/kernels links to the modules in kernels/ (the Triton kernels, embed_service.kernels).
COPY kernels kernels
RUN --mount=type=cache,target=/root/.cache/pip \
    scripts/install.sh /opt/venv package

FROM cuda-build AS cuda-model
ARG MODEL=""
ARG MODEL_REVISION=""
ENV HF_HUB_CACHE=/models/hub
RUN mkdir -p /models/hub \
    && if [ -n "${MODEL}" ]; then \
         /opt/venv/bin/python -m embed_service.model_source "${MODEL}" ${MODEL_REVISION:+"${MODEL_REVISION}"}; \
       fi

# ---- CUDA: the image. The base image (CUDA runtime, libcudart): torch's CUDA wheels bring cuBLAS and cuDNN
# as nvidia-* wheels, so the larger -runtime image would carry them twice.
FROM nvidia/cuda:${CUDA_VERSION}-base-${UBUNTU} AS cuda
# gcc, libc6-dev and python3-dev: Triton compiles a C helper (its CUDA launcher, against Python.h) the first
# time a kernel launches, and JIT-compiles the kernels into TRITON_CACHE_DIR, which, as everything it loads
# from there, must be writable and executable: the kernel cache's mount (an emptyDir; with docker run,
# --tmpfs /var/cache/embed-service:exec). Without a compiler the first Triton launch fails.
# DL3008: as above.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
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
    TRITON_HOME=/var/cache/embed-service \
    TRITON_CACHE_DIR=/var/cache/embed-service/triton \
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
