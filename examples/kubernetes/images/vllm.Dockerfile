# syntax=docker/dockerfile:1
# The prefill and decode image: vLLM's official OpenAI server image, unchanged, plus kvdisagg
# with its GPU extras (Mooncake's CUDA wheel, LMCache, OpenTelemetry) and the `kvdisagg admin`
# client the preStop hooks call. Build from the repository root (bash images/build.sh):
#
#   docker build -f examples/kubernetes/images/vllm.Dockerfile \
#                -t kvdisagg-vllm:0.1.0-vllm0.32.0 .
#
# The tag says both versions: kvdisagg's (pyproject.toml) and vLLM's (the base image, which
# must match kvdisagg's `gpu` extra, vllm==0.32.0). For a reproducible build, pin the base
# images by digest too (`docker buildx imagetools inspect vllm/vllm-openai:v0.32.0`).

# 1. kvdisagg as a wheel, built from this source tree (pure Python: no compiler downstream).
FROM python:3.11.13-slim-bookworm AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src/ src/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# 2. vLLM's image with the wheel installed.
FROM vllm/vllm-openai:v0.32.0
ARG KVDISAGG_EXTRAS=mooncake-gpu,lmcache,tracing
LABEL org.opencontainers.image.title="kvdisagg-vllm" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.description="vLLM 0.32.0 with the kvdisagg KV connector"
# Mooncake's transfer engine needs the RDMA verbs library at run time (also over TCP).
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=wheel /wheels/ /tmp/wheels/
# vLLM and torch stay exactly as the base image ships them: the constraints make pip fail
# rather than replace them with what an extra asks for.
RUN python3 -c "import importlib.metadata as m; print('\n'.join(f'{p}=={m.version(p)}' for p in ('vllm', 'torch')))" > /tmp/keep.txt \
 && python3 -m pip install --no-cache-dir --constraint /tmp/keep.txt \
      "$(ls /tmp/wheels/kvdisagg-*.whl)[${KVDISAGG_EXTRAS}]" \
 && rm -rf /tmp/wheels /tmp/keep.txt \
 && kvdisagg admin drain --help > /dev/null
# The base image's entrypoint (vllm serve) and user are kept; the manifests name the command.
