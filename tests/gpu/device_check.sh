#!/usr/bin/env bash
# One GPU check of stepserve on a bare lent machine (no network; Python 3.12 with torch, triton,
# transformers already there), run from the repository root with the wheels of what the image
# lacks carried in .whl/ (diffusers, pydantic and its parts; no Ray), fetched here with
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl diffusers==0.42.1 pydantic==2.13.4 pydantic-core==2.46.4 \
#       annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
# (.whl/ is not committed: list it in .git/info/exclude) and carried with the run:
#
#   bash tests/gpu/device_check.sh          (results under $OUT, at most 8 files)
#
# 1. installs the wheels into $SITE_DIR (on PYTHONPATH) and the repository as `stepserve`
#    (editable, so every top-level folder maps to its subpackage as pyproject.toml says);
# 2. prints the GPU and the versions, and checks that the engine imports without Ray;
# 3. python -m pytest tests/gpu -m gpu (every GPU test; tests/cpu/kernels only runs the kernels'
#    torch references on CPU tensors, so it is not run here: tests/gpu/test_cuda_patch_stitch.py
#    runs the Triton kernels on CUDA);
# 4. stepserve profile-concurrency on full-size SD1.5 in float16 (configs/profiles/
#    sd15-h200-profile.yaml) at 512 px into $OUT/profile/ (concurrency.csv/json/png), the decode
#    chunks on a CUDA stream of their own as engine/decode_lane.py runs them;
# 5. only when STEPS names `profiles`: `stepserve profile` (no Ray: no live rows) of
#    configs/cluster.yaml's models at full size (configs/profiles/h200-cluster-profile.yaml) into
#    $OUT/profiles/: SDXL (512/768/1024 px, packed mixes), SD3.5-Medium (the same, and masked
#    template edits) and Wan 2.2 TI2V-5B (256/480/768 px, 17/49/81 frames, SP degree 1), each
#    bounded by $MODEL_LIMIT_S; PROFILE_MODELS (default "sd3 sdxl wan") picks them and SD3_ARGS,
#    SDXL_ARGS, WAN_ARGS their grids.
#
# STEPS (default "pytest concurrency") picks steps 3-5; the installs and imports always run.
# Each step is bounded by `timeout` (550 s of limits in all; 3 to 5 minutes expected on an H200);
# a failing step is reported and the later steps still run; the script exits non-zero if any
# step failed. Files under $OUT:
# env.log, pytest_gpu.log, profile.log, summary.txt, profile/concurrency.{csv,json,png},
# profiles/<name>-h200.{csv,log} (the device tool returns at most 8 files: pick steps to fit).
# Overridable for a dry run elsewhere: PYTHON, WHL_DIR, SITE_DIR, DEVICE, PROFILE_CONFIG,
# PROFILE_ARGS, PYTEST_LIMIT_S, PROFILE_LIMIT_S, MODEL_LIMIT_S, CLUSTER_PROFILE, PROFILE_MODELS and the
# *_ARGS above.
set -uo pipefail
export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 MPLBACKEND=Agg
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore

OUT=${OUT:?OUT must name the results folder}
PY=${PYTHON:-python3}
WHL=${WHL_DIR:-.whl}
SITE=${SITE_DIR:-/tmp/site}
DEVICE=${DEVICE:-cuda}
PROFILE_CONFIG=${PROFILE_CONFIG:-configs/profiles/sd15-h200-profile.yaml}
PROFILE_ARGS=${PROFILE_ARGS:---size 512 --max-batch 6 --most-chunks 6 --repeats 3}
PYTEST_LIMIT_S=${PYTEST_LIMIT_S:-200}
PROFILE_LIMIT_S=${PROFILE_LIMIT_S:-200}
MODEL_LIMIT_S=${MODEL_LIMIT_S:-170}
STEPS=" ${STEPS:-pytest concurrency} "
PROFILE_MODELS=${PROFILE_MODELS:-sd3 sdxl wan}
SD3_ARGS=${SD3_ARGS:---sizes 512 768 1024 --batches 1 2 4 8 --repeats 5}
SDXL_ARGS=${SDXL_ARGS:---sizes 512 768 1024 --batches 1 2 4 8 --repeats 5}
WAN_ARGS=${WAN_ARGS:---sizes 256 480 768 --repeats 3}
REPO=$(pwd)
mkdir -p "$OUT/profile" "$OUT/profiles"
ENV_LOG=$OUT/env.log
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
FAILED=()
T0=$(date +%s)

# step NAME LIMIT_S LOG CMD...: run CMD under timeout, its output into LOG (and stdout), its
# status into summary.txt; a failure is recorded and the script goes on.
step() {
    local name=$1 limit=$2 log=$3
    shift 3
    echo "=== $name (limit ${limit} s): $*" | tee -a "$log"
    local start rc
    start=$(date +%s)
    timeout -k 15 "$limit" "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    local line="$name: rc=$rc, $(( $(date +%s) - start )) s"
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && line="$line (TIMED OUT after ${limit} s)"
    echo "=== $line" | tee -a "$log"
    echo "$line" >> "$SUMMARY"
    if [ "$rc" -ne 0 ]; then
        FAILED+=("$name")
    fi
    return "$rc"
}

# ---- 1. the GPU, the versions, the installs ----------------------------------------------------
{
    echo "date: $(date -u +%FT%TZ)"
    echo "repo: $REPO"
    nvidia-smi || echo "nvidia-smi failed"
    echo "python: $(command -v "$PY") $("$PY" --version 2>&1)"
    "$PY" -m pip --version
    "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|triton|transformers|huggingface|safetensors|numpy|pillow|matplotlib|setuptools|typing|pytest|accelerate|peft|tokenizers) ' || true
    echo "wheels carried:"
    ls -l "$WHL"
} 2>&1 | tee "$ENV_LOG"

step install-wheels 45 "$ENV_LOG" \
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}

# The repository as `stepserve`: an editable install (package-dir mapping, pyproject.toml) into
# this Python's own site-packages. If that fails (no writable site-packages, an old setuptools),
# a sitecustomize on PYTHONPATH maps the same names onto the repository's folders.
if ! step install-stepserve 45 "$ENV_LOG" \
        "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e "$REPO"; then
    echo "editable install failed: mapping stepserve.* onto $REPO with a sitecustomize instead" | tee -a "$ENV_LOG"
    "$PY" - "$REPO" "$SITE" >> "$ENV_LOG" 2>&1 <<'EOF'
import pathlib, sys, tomllib
repo, site = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
dirs = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
(site / "sitecustomize.py").write_text(f'''"""device_check.sh: stepserve.* from the repository's folders (pyproject's package-dir)."""
import importlib.abc, importlib.util, os, sys
_ROOT = {str(repo)!r}
_DIRS = {dict(dirs)!r}
class _StepserveFolders(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in _DIRS:
            return None
        folder = os.path.join(_ROOT, _DIRS[name])
        return importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])
sys.meta_path.insert(0, _StepserveFolders())
''')
print("wrote", site / "sitecustomize.py")
EOF
fi

# ---- 2. imports (from outside the repository, so only the installed names count) ----------------
step imports 60 "$ENV_LOG" bash -c "cd /tmp && \"$PY\" - <<'EOF'
import sys
import torch, transformers, huggingface_hub, diffusers, pydantic, pydantic_core
try:
    import triton
except ImportError:
    print('no triton')
import stepserve.cli, stepserve.deployments.config, stepserve.profiling.synerdiff, stepserve.load_tests.plots
import stepserve.engine.step_runner, stepserve.engine.decode_lane, stepserve.engine.vae_chunking
import stepserve.engine.forward_modes.skip_cfg, stepserve.engine.families.sd15, stepserve.engine.families.sd3
import stepserve.kernels.patch_stitch
for name in ('torch', 'triton', 'transformers', 'huggingface_hub', 'diffusers', 'pydantic', 'pydantic_core'):
    module = sys.modules.get(name)
    if module is None:
        continue
    print(f'{name} {module.__version__} {module.__file__}')
print('stepserve.engine from', sys.modules['stepserve.engine'].__file__)
print('cuda:', torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else '-')
leaked = [m for m in ('ray', 'fastapi', 'starlette', 'av', 'openai') if m in sys.modules]
assert not leaked, f'the engine path imported {leaked}'
print('no ray, fastapi, starlette, av or openai imported')
EOF"

# ---- 3. the GPU tests -----------------------------------------------------------------------------
[[ $STEPS == *" pytest "* ]] && step pytest-gpu "$PYTEST_LIMIT_S" "$OUT/pytest_gpu.log" \
    "$PY" -m pytest tests/gpu -m gpu -q -p no:cacheprovider -rfEs --durations=25

# ---- 4. SynerDiff's concurrency profile -------------------------------------------------------------
# shellcheck disable=SC2086  # PROFILE_ARGS is a list of arguments
[[ $STEPS == *" concurrency "* ]] && step profile-concurrency "$PROFILE_LIMIT_S" "$OUT/profile.log" \
    "$PY" -m stepserve.cli profile-concurrency --config "$PROFILE_CONFIG" --device "$DEVICE" $PROFILE_ARGS \
    --out "$OUT/profile"

# ---- 5. the cluster's profiles ------------------------------------------------------------------
CLUSTER_PROFILE=${CLUSTER_PROFILE:-configs/profiles/h200-cluster-profile.yaml}
profile_model() {  # profile_model NAME CSV ARGS...: one model of the cluster's profile config
    local name=$1 csv=$2
    shift 2
    step "profile-$csv" "$MODEL_LIMIT_S" "$OUT/profiles/$csv.log" "$PY" -m stepserve.cli profile \
        --config "$CLUSTER_PROFILE" --model "$name" --device "$DEVICE" --no-live "$@" --out "$OUT/profiles/$csv.csv"
}
# shellcheck disable=SC2086  # the *_ARGS are lists of arguments
if [[ $STEPS == *" profiles "* ]]; then
    for model in $PROFILE_MODELS; do
        case $model in
            sd3) profile_model stable-diffusion-3.5-medium sd3-h200 $SD3_ARGS ;;
            sdxl) profile_model stable-diffusion-xl-base-1.0 sdxl-h200 $SDXL_ARGS ;;
            wan) profile_model wan2.2-ti2v-5b wan22-ti2v-h200 $WAN_ARGS ;;
            *) echo "unknown model in PROFILE_MODELS: $model" | tee -a "$SUMMARY"; FAILED+=("profile-$model") ;;
        esac
    done
fi

# ---- the verdict --------------------------------------------------------------------------------------
echo "total: $(( $(date +%s) - T0 )) s" >> "$SUMMARY"
if [ "${#FAILED[@]}" -ne 0 ]; then
    echo "FAILED steps: ${FAILED[*]}" | tee -a "$SUMMARY"
    echo "--- summary"; cat "$SUMMARY"
    exit 1
fi
echo "all steps passed" | tee -a "$SUMMARY"
echo "--- summary"; cat "$SUMMARY"
exit 0
