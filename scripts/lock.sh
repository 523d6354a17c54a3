#!/usr/bin/env bash
# Regenerates the lock files every install uses (scripts/install.sh): every dependency of
# stepserve pinned to one version with the hashes of its files, from the top-level pins in
# .ci/constraints.txt:
#   requirements.lock      the package and its Redis client: the container image
#   requirements-dev.lock  that and the test extras: ./dev and CI
# torch is left out of both: install.sh installs it first, alone, from the index that fits the
# machine (the CPU build or PyPI's CUDA build, which hash differently); its own dependencies
# are locked. The locks are for CPython 3.11 on Linux x86_64 (the image's and CI's).
#
#   scripts/lock.sh [PYTHON]     (needs pip-tools in that Python: pip install pip-tools)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${1:-python3}

compile() {  # OUT EXTRAS
    "$PY" -m piptools compile --quiet --generate-hashes --strip-extras --no-emit-index-url --no-emit-find-links \
        --unsafe-package torch --resolver=backtracking -c .ci/constraints.txt $2 -o "$1" pyproject.toml
}
compile requirements.lock "--extra redis"
compile requirements-dev.lock "--extra redis --extra test"
