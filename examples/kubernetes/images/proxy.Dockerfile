# syntax=docker/dockerfile:1
# The proxy image: Python 3.11 and kvdisagg, no vLLM, no GPU, a non-root user. Build from the
# repository root (bash images/build.sh):
#
#   docker build -f examples/kubernetes/images/proxy.Dockerfile -t kvdisagg-proxy:0.1.0 .
#
# For a reproducible build, pin the base image by digest too.

# 1. A virtual environment with kvdisagg and its dependencies at pinned versions
#    (proxy-constraints.txt), from wheels only: nothing compiles.
FROM python:3.11.13-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src/ src/
COPY examples/kubernetes/images/proxy-constraints.txt /tmp/constraints.txt
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && python -m venv /opt/kvdisagg \
 && /opt/kvdisagg/bin/pip install --no-cache-dir --only-binary=:all: \
      --constraint /tmp/constraints.txt /wheels/kvdisagg-*.whl \
 && /opt/kvdisagg/bin/kvdisagg proxy --help > /dev/null

# 2. The same base with the environment alone: no build tools, no source tree.
FROM python:3.11.13-slim-bookworm
LABEL org.opencontainers.image.title="kvdisagg-proxy" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.description="kvdisagg proxy: OpenAI-compatible P/D front door"
COPY --from=build /opt/kvdisagg /opt/kvdisagg
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin kvdisagg
ENV PATH=/opt/kvdisagg/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Numeric, so that runAsNonRoot can verify it.
USER 10001:10001
EXPOSE 8000 8001
ENTRYPOINT ["kvdisagg"]
CMD ["proxy", "--help"]
