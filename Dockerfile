# stepserve's image, for KubeRay (k8s/) or any Ray cluster: Python 3.11, stepserve and its pinned
# dependencies installed by the same script as ./dev and CI (scripts/install.sh), a non-root user,
# and bash and wget, which KubeRay's probes run.
#
#   docker build -t REGISTRY/stepserve:TAG .                          # GPU nodes (CUDA torch)
#   docker build --build-arg TORCH_INDEX=cpu -t REGISTRY/stepserve:TAG-cpu .   # the tiny default on CPUs
#
# The GPU image needs no CUDA base: PyPI's Linux torch wheels carry their CUDA runtime libraries
# (nvidia-* wheels), and the node's driver comes in through the NVIDIA container runtime.
# Weights are never baked in: mount them (k8s/rayservice.yaml mounts /models and /loras).
FROM python:3.11-slim-bookworm

ARG TORCH_INDEX=pip
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 RAY_USAGE_STATS_ENABLED=0

RUN apt-get update \
 && apt-get install -y --no-install-recommends bash wget ca-certificates libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 1000 --user-group ray

WORKDIR /opt/stepserve
COPY pyproject.toml README.md ./
COPY .ci/constraints.txt .ci/constraints.txt
COPY requirements.lock requirements.lock
COPY scripts/install.sh scripts/install.sh
COPY stepserve stepserve
COPY engine engine
COPY policies policies
COPY actors actors
COPY deployments deployments
COPY kernels kernels
COPY load_tests load_tests
COPY configs configs
RUN STEPSERVE_TORCH_INDEX=$TORCH_INDEX scripts/install.sh /usr/local/bin/python app \
 && python -c "import stepserve.deployments.app"

USER 1000:1000
WORKDIR /home/ray
# KubeRay starts Ray itself (ray start ...); run alone, the image serves the tiny default.
CMD ["stepserve", "serve", "--host", "0.0.0.0"]
