#!/usr/bin/env bash
# Builds lopd-platform:cpu on a machine where container registries cannot be reached (`make image`):
#   1. starts a private Docker engine (unless LOPD_DOCKER_HOST names a running one);
#   2. makes the Debian 12 base image from a debootstrap root file system (once; kept in the engine);
#   3. serves the host's CA bundle and local wheels (the CPU torch wheel) on loopback for the build;
#   4. builds docker/Dockerfile.cpu with host networking (the engine runs without a bridge);
#   5. runs the image: the entrypoint's smoke check, then a component's --help.
# Needs root, dockerd and debootstrap (Debian packages docker.io and debootstrap). Engine state stays in
# $LOPD_IMAGE_WORK so that a second build reuses the base image and the layer cache; delete it to free space.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
work=${LOPD_IMAGE_WORK:-/var/tmp/lopd-image}
image=${LOPD_IMAGE:-lopd-platform:cpu}
base=lopd-base:bookworm
wheels=${LOPD_WHEELS:-/opt/wheels}
ca_bundle=${LOPD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
docker_bin=${DOCKER:-docker}

log() { printf '[image %4ds] %s\n' "$SECONDS" "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "run as root (dockerd and debootstrap need it)"
command -v "$docker_bin" >/dev/null || die "no docker client: apt-get install docker.io"
mkdir -p "$work"

pids=()
cleanup() {
    local pid
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    # dockerd leaves its network namespace mounted; unmount it so that the work folder can be deleted.
    if [ -z "${LOPD_DOCKER_HOST:-}" ] && mountpoint -q "$work/exec/netns/default" 2>/dev/null; then
        umount "$work/exec/netns/default" || true
    fi
}
trap cleanup EXIT
trap "exit 130" INT TERM

# 1. The engine: a private one on its own socket and data root, no bridge, no iptables.
if [ -n "${LOPD_DOCKER_HOST:-}" ]; then
    export DOCKER_HOST=$LOPD_DOCKER_HOST
else
    command -v dockerd >/dev/null || die "no dockerd: apt-get install docker.io"
    export DOCKER_HOST=unix://$work/docker.sock
    log "starting dockerd (log: $work/dockerd.log)"
    dockerd --iptables=false --ip-forward=false --bridge=none \
        --data-root "$work/data" --exec-root "$work/exec" --pidfile "$work/dockerd.pid" \
        --host "$DOCKER_HOST" >"$work/dockerd.log" 2>&1 &
    pids+=("$!")
    for _ in $(seq 60); do
        "$docker_bin" version >/dev/null 2>&1 && break
        kill -0 "${pids[0]}" 2>/dev/null || { tail -20 "$work/dockerd.log" >&2; die "dockerd exited"; }
        sleep 1
    done
    "$docker_bin" version >/dev/null 2>&1 || die "dockerd did not answer in 60 s (see $work/dockerd.log)"
fi
log "engine: $("$docker_bin" version --format '{{.Server.Version}}') ($("$docker_bin" info --format '{{.Driver}}'))"

# 2. The base image: Debian 12 minbase, the same release the Dockerfile's default base pins.
if ! "$docker_bin" image inspect "$base" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || die "no debootstrap: apt-get install debootstrap"
    rootfs=$work/rootfs
    rm -rf "$rootfs"
    log "debootstrap bookworm (minbase) into $rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" >"$work/debootstrap.log" 2>&1 ||
        { tail -20 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
    # Like Debian's own images: updates and security updates too, from the mirror debootstrap used.
    mirror=$(awk '$1 == "deb" { print $2; exit }' "$rootfs/etc/apt/sources.list")
    printf 'deb %s bookworm-updates main\ndeb %s-security bookworm-security main\n' "$mirror" "$mirror" \
        >>"$rootfs/etc/apt/sources.list"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    log "importing the root file system as $base"
    tar -C "$rootfs" --numeric-owner -c . | "$docker_bin" import --change 'CMD ["bash"]' - "$base" >/dev/null
    rm -rf "$rootfs"
fi
log "base image: $base"

# 3. Build files on loopback: the CA bundle (pip inside the build trusts the same CAs as this host) and the
# local wheels (torch 2.13.0+cpu lies on disk here; the registry's torch is the CUDA build).
files=$work/files
rm -rf "$files"
mkdir -p "$files/wheels"
cp "$ca_bundle" "$files/ca-certificates.crt"
if compgen -G "$wheels/torch-*.whl" >/dev/null; then
    ln -s "$wheels"/torch-*.whl "$files/wheels/"
fi
# A fixed port: the URL is a build argument, and a new value would invalidate the layer cache.
port=${LOPD_FILES_PORT:-38765}
python3 -m http.server --bind 127.0.0.1 --directory "$files" "$port" >"$work/files.log" 2>&1 &
pids+=("$!")
for _ in $(seq 20); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/ca-certificates.crt')" \
        2>/dev/null && break
    kill -0 "${pids[-1]}" 2>/dev/null || die "cannot serve build files on 127.0.0.1:$port (set LOPD_FILES_PORT)"
    sleep 0.5
done

# 4. The build. The engine has no bridge, so build steps use the host's network (registries + loopback).
log "building $image from docker/Dockerfile.cpu (log: $work/build.log)"
build_start=$SECONDS
: >"$work/build.log"
# The dependency stage is tagged too ($image-deps), so that `docker image prune` keeps its layer cache.
for target in deps final; do
    tag=$image
    target_args=()
    if [ "$target" = deps ]; then
        tag=$image-deps
        target_args=(--target deps)
    fi
    DOCKER_BUILDKIT=0 "$docker_bin" build --network host "${target_args[@]}" \
        --build-arg BASE_IMAGE="$base" \
        --build-arg BUILD_FILES_URL="http://127.0.0.1:$port" \
        -f "$root/docker/Dockerfile.cpu" -t "$tag" "$root" >>"$work/build.log" 2>&1 ||
        { tail -30 "$work/build.log" >&2; die "docker build ($target) failed"; }
done
log "built $image in $((SECONDS - build_start)) s, size $("$docker_bin" image inspect "$image" --format '{{.Size}}' |
    awk '{printf "%.2f GB", $1 / 1e9}')"

# 5. Smoke checks, without network: the default command, the import, and a component's CLI.
"$docker_bin" run --rm --network none "$image" >/dev/null
"$docker_bin" run --rm --network none --entrypoint python "$image" -c 'import lopd_core, components, flows'
log "image runs as user $("$docker_bin" run --rm --network none --entrypoint id "$image" -u)"
# A stage's CLI (components.<stage>), else any component module with a command line.
stage=""
for name in collect bank cold_start train evaluate report; do
    if [ -f "$root/components/$name.py" ] || [ -f "$root/components/$name/__main__.py" ]; then
        stage=$name
        break
    fi
done
if [ -z "$stage" ]; then
    module=$(grep -l '__name__ == "__main__"' "$root"/components/*.py 2>/dev/null | head -1 || true)
    [ -n "$module" ] && stage=$(basename "$module" .py)
fi
if [ -n "$stage" ]; then
    log "docker run $image components.$stage --help"
    "$docker_bin" run --rm --network none "$image" "components.$stage" --help
else
    log "no component has a command line yet: checked 'import lopd_core, components, flows' instead"
fi
log "done in $SECONDS s"
