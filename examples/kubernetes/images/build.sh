#!/usr/bin/env bash
# Build the Kubernetes example's two images from this checkout, and push them if a registry
# prefix is given. Run from anywhere:
#
#   bash examples/kubernetes/images/build.sh                          # local tags only
#   bash examples/kubernetes/images/build.sh registry.example.com/ml/ # build and push there
#
# Then point the kustomization at them (README.md, "Images").
set -euo pipefail
cd "$(dirname "$0")/../../.."   # the build context: the repository root
prefix="${1:-}"
docker build -f examples/kubernetes/images/vllm.Dockerfile -t "${prefix}kvdisagg-vllm:0.1.0-vllm0.32.0" .
docker build -f examples/kubernetes/images/proxy.Dockerfile -t "${prefix}kvdisagg-proxy:0.1.0" .
if [ -n "$prefix" ]; then
  docker push "${prefix}kvdisagg-vllm:0.1.0-vllm0.32.0"
  docker push "${prefix}kvdisagg-proxy:0.1.0"
fi
