#!/usr/bin/env bash
# Installs stepserve into the environment of a Python interpreter: the one install that ./dev
# (and so CI) and the Dockerfile share, so the image is what CI tests. Every dependency comes from
# a lock file, one version each, with its files' hashes checked (scripts/lock.sh makes them from
# the top-level pins in .ci/constraints.txt); then stepserve itself, with no dependency resolved.
#
#   scripts/install.sh PYTHON [dev|app]
#
#   dev  (default)  editable, with the test extras: ./dev and CI (requirements-dev.lock)
#   app             the package itself and its Redis client, no test extras: the container
#                   image (requirements.lock)
#
# torch goes first and alone: anything that resolves an unpinned torch pulls the multi-GB CUDA
# build. Where it comes from is STEPSERVE_TORCH_INDEX:
#   auto (default)  PyTorch's CPU index (https://download.pytorch.org/whl/cpu) on a machine with
#                   no NVIDIA GPU, if that index answers; else pip's own configured index (on
#                   Linux, PyPI's torch is the CUDA build, which bundles its CUDA libraries)
#   pip             pip's own configured index, whatever the machine
#   cpu             PyTorch's CPU index, or fail
#   <URL>           that index
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${1:?usage: scripts/install.sh PYTHON [dev|app]}
TARGET=${2:-dev}
CONSTRAINTS=.ci/constraints.txt
CPU_INDEX=https://download.pytorch.org/whl/cpu

say() { echo "install: $*" >&2; }
die() { say "$*"; exit 1; }

torch_index() {
    local choice=${STEPSERVE_TORCH_INDEX:-auto}
    case $choice in
        pip) ;;
        cpu) echo "$CPU_INDEX" ;;
        auto)
            if command -v nvidia-smi >/dev/null 2>&1; then
                return  # a GPU machine: PyPI's CUDA build
            fi
            if "$PY" -c "import urllib.request as u; u.urlopen('$CPU_INDEX/torch/', timeout=5)" >/dev/null 2>&1; then
                echo "$CPU_INDEX"
            else
                say "no NVIDIA GPU, but $CPU_INDEX does not answer: torch comes from pip's own index"
            fi
            ;;
        http://* | https://* | file://*) echo "$choice" ;;
        *) die "STEPSERVE_TORCH_INDEX must be auto, pip, cpu or an index URL, not '$choice'" ;;
    esac
}

torch=$(sed -n 's/^torch==\([^[:space:]#]*\).*/\1/p' "$CONSTRAINTS")
[[ -n $torch ]] || die "$CONSTRAINTS pins no torch==VERSION"
case $TARGET in
    dev) package=(-e .) lock=requirements-dev.lock ;;
    app) package=(.) lock=requirements.lock ;;
    *) die "the target is dev or app, not '$TARGET'" ;;
esac

say "upgrading pip"
"$PY" -m pip install -q --upgrade pip
index=$(torch_index)
if [[ -n $index ]]; then
    say "installing torch==$torch from $index"
    # PyPI stays reachable for torch's own dependencies, which not every index mirrors.
    "$PY" -m pip install -q --index-url "$index" --extra-index-url https://pypi.org/simple "torch==$torch"
else
    say "installing torch==$torch"
    "$PY" -m pip install -q "torch==$torch"
fi
# torch is in no lock (its CPU and CUDA builds hash differently); it satisfies what needs it.
say "installing the dependencies locked in $lock (hashes checked)"
"$PY" -m pip install -q --require-hashes -r "$lock"
say "installing stepserve (${package[*]})"
"$PY" -m pip install -q --no-deps "${package[@]}"
