#!/usr/bin/env bash
# Build and run the Docker images without a Docker daemon or a registry (`make image`), with buildah.
#   scripts/build_image.sh [cpu]      docker/Dockerfile.cpu -> localhost/dist-trainer:cpu, then prints its size
#   scripts/build_image.sh cuda       docker/Dockerfile with CUDA_OPS=0 on the same base -> dist-trainer:cuda-check:
#                                     every step of the CUDA file but its NVIDIA base, CUDA torch and op builds
#   scripts/build_image.sh run [-v HOST:CTR]... [-e VAR=VALUE]... [-u USER] [--entrypoint CMD] IMAGE [ARGS...]
#                                     `docker run --rm` with those options: the image's ENTRYPOINT with ARGS (or
#                                     its CMD), as its USER (or -u), in its WORKDIR, with its ENV
#   scripts/build_image.sh buildah ARGS...   buildah itself on this store (images, rmi, inspect, ...)
# Environment:
#   IMAGE_BASE   base image (default: a Debian bookworm root filesystem made here with debootstrap, holding
#                python3 and python3-venv, cached in IMAGE_STORE; where a registry is reachable, e.g. the
#                Dockerfile's own python:3.11.11-slim-bookworm)
#   TORCH_INDEX_URL  where torch comes from (default: with a local pip mirror, the mirror, as `make venv` here;
#                else the Dockerfile's index, the CPU wheel index for the cuda check)
#   IMAGE_STORE  buildah's storage and the cached base (default: .image/ in this checkout, ignored by git and
#                kept out of the build context; a clean clone builds everything from scratch)
#   IMAGE_TAG    the image's name (defaults above)
# pip in the build uses the host's sources (PIP_* variables, else `pip config list`: index, extra indexes,
# find-links, CA bundle), written to a pip.conf (IMAGE_STORE/pip/, mode 0600) that is mounted read-only with the
# local folders it names under /tmp/build-pip for the RUN steps only: the image holds none of them (their empty
# mount points stay), and its history records only PIP_CONFIG_FILE's path, never an index URL or its token.
# TORCH_INDEX_URL is a build argument (recorded in the history): give it a public index only.
# Needs root (buildah, debootstrap, apt-get).
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(local_base) stops the script too
# buildah keeps its temporary files in TMPDIR (the Makefile's .tmp/, absent in a clean clone)
[ -z "${TMPDIR:-}" ] || mkdir -p "$TMPDIR"
here="$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
store="${IMAGE_STORE:-$here/.image}"
mkdir -p "$store"
store="$(cd -P "$store" && pwd)"
python="${PYTHON:-python3}"
B=(buildah --root "$store/storage" --runroot "$store/run" --storage-driver overlay)
die() { echo "build_image.sh: $*" >&2; exit 2; }

need_tools() {
    local missing=()
    command -v buildah >/dev/null || missing+=(buildah)
    command -v debootstrap >/dev/null || missing+=(debootstrap)
    [ ${#missing[@]} -eq 0 ] && return
    [ "$(id -u)" = 0 ] || die "missing ${missing[*]}: install them (apt-get install ${missing[*]}) or run as root"
    echo "installing ${missing[*]} (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# The local base: Debian's own python3 (the public python:slim base needs a registry). Its tag names the recipe,
# so a changed package list makes a new base instead of reusing a stale one.
SUITE=bookworm
BASE_PACKAGES=python3,python3-venv
local_base() {
    local key tag tarball rootfs ctr
    key="$(printf '%s %s minbase' "$SUITE" "$BASE_PACKAGES" | sha256sum | cut -c1-12)"
    tag="localhost/dist-trainer-base:$SUITE-$key"
    tarball="$store/base-$SUITE-$key.tar"
    if "${B[@]}" inspect --type image "$tag" >/dev/null 2>&1; then
        echo "$tag"; return
    fi
    if [ ! -s "$tarball" ]; then
        rootfs="$store/base-$SUITE-$key.rootfs"
        rm -rf "$rootfs"
        echo "debootstrap $SUITE ($BASE_PACKAGES) into $rootfs" >&2
        debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$rootfs" >"$store/debootstrap.log" 2>&1 \
            || die "debootstrap failed; see $store/debootstrap.log"
        # as Debian's own images: no package cache or lists (a RUN that installs runs apt-get update)
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        tar -C "$rootfs" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
        rm -rf "$rootfs"
    fi
    ctr="$("${B[@]}" from scratch)"
    "${B[@]}" add "$ctr" "$tarball" / >/dev/null
    "${B[@]}" config --cmd /bin/bash "$ctr"
    "${B[@]}" commit -q "$ctr" "$tag" >/dev/null
    "${B[@]}" rm "$ctr" >/dev/null
    echo "$tag"
}

# The host pip's value of one setting: its PIP_* variable, else the last config file that sets it.
pip_setting() {
    local var
    var="PIP_$(tr 'a-z-' 'A-Z_' <<<"$1")"
    if [ -n "${!var:-}" ]; then printf '%s\n' "${!var}"; return; fi
    "$python" -m pip config list 2>/dev/null | sed -n "s/^[a-z]*\.$1='\(.*\)'$/\1/p" | tail -n1
}

# Local pip sources become read-only mounts under /tmp/build-pip; URLs pass unchanged.
build_args=()
mounts=()
localized=""
localize() {  # $1: a path or URL the host's pip reads; $2: index|links|cert -> $localized: what the build reads
    local loc="$1" path dir rest
    case "$loc" in
        file://*) path="${loc#file://}" ;;
        /*) path="$loc" ;;
        *) localized="$loc"; return ;;
    esac
    # an index's pages link to files beside it (../../files) and a CA bundle is a file: mount the folder above
    case "$2" in
        links) dir="${path%/}"; rest="" ;;
        *) dir="$(dirname "$path")"; rest="/$(basename "$path")" ;;
    esac
    [ -e "$path" ] || die "pip's $2 $loc (host pip configuration) does not exist"
    local target="/tmp/build-pip/$((${#mounts[@]} / 2))"
    mounts+=(--volume "$dir:$target:ro")
    case "$loc" in file://*) localized="file://$target$rest" ;; *) localized="$target$rest" ;; esac
}

PIP_CONF_DIR=/tmp/build-pip/conf
pip_sources() {  # $1: the torch index without a mirror ("" = the Dockerfile's)
    # The sources go into a pip.conf mounted for the RUN steps, not into build arguments: a build argument's value
    # is recorded in the image's history (`docker history`), and an index URL may carry a token (user:token@host).
    local value item out kind mirror=0 conf="$store/pip"
    rm -rf "$conf" && mkdir -m 700 "$conf"
    (umask 077; printf '[global]\n' >"$conf/pip.conf")
    for setting in index-url extra-index-url find-links cert; do
        value="$(pip_setting "$setting")"
        [ -n "$value" ] || continue
        case "$setting" in find-links) kind=links ;; cert) kind=cert ;; *) kind=index ;; esac
        out=""
        for item in $value; do
            localize "$item" "$kind"
            out="${out:+$out }$localized"
            case "$item" in file://*|/*) [ "$kind" = cert ] || mirror=1 ;; esac
        done
        printf '%s = %s\n' "$setting" "$out" >>"$conf/pip.conf"
    done
    mounts+=(--volume "$conf:$PIP_CONF_DIR:ro")
    build_args+=(--build-arg "PIP_CONFIG_FILE=$PIP_CONF_DIR/pip.conf")
    # torch: TORCH_INDEX_URL when given; with a local mirror, from the same sources as `make venv` on this host
    # (the mirror holds the CPU wheel); else $1 or the Dockerfile's default index.
    if [ -n "${TORCH_INDEX_URL+set}" ]; then
        build_args+=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
    elif [ "$mirror" = 1 ]; then
        build_args+=(--build-arg "TORCH_INDEX_URL=")
    elif [ -n "$1" ]; then
        build_args+=(--build-arg "TORCH_INDEX_URL=$1")
    fi
}

RUN_HOSTNAME=dist-trainer-run
run_image() {  # run [-v HOST:CTR]... [-e VAR=VALUE]... [-u USER] [--entrypoint CMD] IMAGE [ARGS...]
    local image status=0 options=() entry=() cmd=() custom_entry=0
    while [ $# -gt 0 ]; do
        case "$1" in
            -v|--volume|-e|--env|-u|--user) [ $# -ge 2 ] || die "run: $1 needs a value"; options+=("$1" "$2"); shift 2 ;;
            --entrypoint) [ $# -ge 2 ] || die "run: $1 needs a command"; entry=("$2"); custom_entry=1; shift 2 ;;
            -*) die "run: unknown option $1 (-v, -e, -u, --entrypoint)" ;;
            *) break ;;
        esac
    done
    [ $# -ge 1 ] || die "usage: scripts/build_image.sh run [-v HOST:CTR]... [-e VAR=VALUE]... [-u USER] [--entrypoint CMD] IMAGE [ARGS...]"
    image="$1"
    shift
    config() { "${B[@]}" inspect --type image --format "{{range .OCIv1.Config.$1}}{{println .}}{{end}}" "$image"; }
    [ "$custom_entry" = 1 ] || mapfile -t entry < <(config Entrypoint)
    if [ $# -eq 0 ] && [ "$custom_entry" = 0 ]; then
        mapfile -t cmd < <(config Cmd)
        set -- "${cmd[@]}"
    fi
    [ ${#entry[@]} -gt 0 ] || [ $# -gt 0 ] || die "run: $image has no ENTRYPOINT and no command was given"
    # As docker does, the container's hostname resolves (torchrun's rendezvous looks itself up; unresolved, it hangs).
    run_ctr="$("${B[@]}" from --pull=never -q --add-host "$RUN_HOSTNAME:127.0.0.1" "$image")"
    trap '"${B[@]}" rm "$run_ctr" >/dev/null' EXIT
    # buildah run applies the image's USER, WORKDIR and ENV, not its ENTRYPOINT: prepend it as `docker run` does.
    "${B[@]}" run --isolation chroot --hostname "$RUN_HOSTNAME" "${options[@]}" "$run_ctr" -- "${entry[@]}" "$@" \
        || status=$?
    return "$status"
}

target="${1:-cpu}"
case "$target" in
    cpu) dockerfile=docker/Dockerfile.cpu; tag="${IMAGE_TAG:-localhost/dist-trainer:cpu}"; extra=(); torch_index="" ;;
    cuda) dockerfile=docker/Dockerfile; tag="${IMAGE_TAG:-localhost/dist-trainer:cuda-check}"
          extra=(--build-arg CUDA_OPS=0); torch_index=https://download.pytorch.org/whl/cpu ;;
    run) shift; run_image "$@"; exit ;;
    buildah) shift; exec "${B[@]}" "$@" ;;
    *) die "unknown target $target (cpu, cuda, run, buildah)" ;;
esac

need_tools
start=$SECONDS
if [ -n "${IMAGE_BASE:-}" ]; then
    base="$IMAGE_BASE"; pull=(--pull=true)
else
    base="$(local_base)"; pull=(--pull=never)
fi
pip_sources "$torch_index"
echo "building $tag from $dockerfile on $base"
# --force-rm: a failed build (a broken COPY) leaves no working container, nor its mount, in the store
cd "$here"
"${B[@]}" bud --isolation chroot --format docker --layers --force-rm "${pull[@]}" -f "$dockerfile" --build-arg "BASE=$base" \
    "${extra[@]}" "${build_args[@]}" "${mounts[@]}" -t "$tag" .
size="$("${B[@]}" images --format '{{.Size}}' "$tag" | head -n1)"
echo "image $tag: $size ($((SECONDS - start)) s)"
