#!/usr/bin/env bash
# The images, from the repository alone: `build` them with whichever builder is installed,
# `load` them into a local cluster (kind or k3d) or `push` them to a registry the nodes pull
# from. `make images`, `make load-images CLUSTER=kind|k3d` and `make push-images REGISTRY=...`
# run it.
#
# The names are the chart's and the examples' defaults (REGISTRY/NAME:TAG, the tag the
# chart's appVersion), so on a local cluster nothing else needs setting; none of them is
# published, they exist only where they were built or loaded. With another REGISTRY the
# values to give the chart are printed.
#
#   REGISTRY  default ghcr.io/kernelcache
#   TAG       default the chart's appVersion
#   IMAGES    default "operator init examples"; add serving (serving/Dockerfile: kernelcache
#             added to a vLLM image, VLLM_IMAGE, several GB) for a real engine
#   BUILDER   default the first of docker, podman, nerdctl, buildah on PATH
#   CLUSTER   load: kind or k3d; CLUSTER_NAME its name (default kind, k3s-default)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEFAULT_REGISTRY=ghcr.io/kernelcache
REGISTRY="${REGISTRY:-$DEFAULT_REGISTRY}"
TAG="${TAG:-$(sed -n 's/^appVersion: *"*\([^"]*\)"*$/\1/p' "$REPO/charts/kernelcache/Chart.yaml")}"
IMAGES="${IMAGES:-operator init examples}"

die() { echo "images: $*" >&2; exit 1; }

# image -> "repository-name Dockerfile"
describe() {
    case "$1" in
        operator) echo "kernelcache-operator operator/Dockerfile" ;;
        init) echo "kernelcache-init initcontainer/Dockerfile" ;;
        examples) echo "examples examples/Dockerfile" ;;
        serving) echo "kernelcache-serving serving/Dockerfile" ;;
        *) die "unknown image '$1' in IMAGES (known: operator init examples serving)" ;;
    esac
}

reference() { local d; d=($(describe "$1")); echo "$REGISTRY/${d[0]}:$TAG"; }

builder() {
    if [ -n "${BUILDER:-}" ]; then
        command -v "$BUILDER" >/dev/null || die "BUILDER=$BUILDER is not on PATH"
        echo "$BUILDER"
        return
    fi
    for candidate in docker podman nerdctl buildah; do
        if command -v "$candidate" >/dev/null; then echo "$candidate"; return; fi
    done
    die "no image builder on PATH: install docker, podman, nerdctl or buildah (or name one with BUILDER=)"
}

build() {
    local tool image d args
    tool="$(builder)"
    for image in $IMAGES; do
        d=($(describe "$image"))
        args=(build -f "${d[1]}" -t "$(reference "$image")")
        if [ "$image" = serving ] && [ -n "${VLLM_IMAGE:-}" ]; then
            args+=(--build-arg "VLLM_IMAGE=$VLLM_IMAGE")
        fi
        echo "+ $tool ${args[*]} ." >&2
        (cd "$REPO" && "$tool" "${args[@]}" .) || die "$tool could not build $(reference "$image") from ${d[1]}"
    done
    if [ "$REGISTRY" != "$DEFAULT_REGISTRY" ]; then
        echo "Install the chart with these images:"
        echo "  --set image.repository=$REGISTRY/kernelcache-operator --set image.tag=$TAG \\"
        echo "  --set operator.initImage=$(reference init)"
    fi
}

# Each image into a docker-archive file, which kind and k3d both import, whatever built it.
save() {
    local tool="$1" ref="$2" file="$3"
    if [ "$tool" = buildah ]; then
        buildah push "$ref" "docker-archive:$file:$ref"
    else
        "$tool" save -o "$file" "$ref"
    fi
}

load() {
    local tool cluster name work image ref file
    cluster="${CLUSTER:-}"
    case "$cluster" in
        kind) name="${CLUSTER_NAME:-kind}" ;;
        k3d) name="${CLUSTER_NAME:-k3s-default}" ;;
        *) die "CLUSTER=kind or CLUSTER=k3d: the local cluster to load the images into (got '${cluster}')" ;;
    esac
    command -v "$cluster" >/dev/null || die "$cluster is not on PATH"
    tool="$(builder)"
    work="$(mktemp -d)"
    trap "rm -rf '$work'" EXIT  # expanded now: work is local to this function
    for image in $IMAGES; do
        ref="$(reference "$image")"
        file="$work/$image.tar"
        save "$tool" "$ref" "$file" || die "$tool has no image $ref: run make images first"
        if [ "$cluster" = kind ]; then
            kind load image-archive "$file" --name "$name"
        else
            k3d image import "$file" --cluster "$name"
        fi
        echo "loaded $ref into $cluster cluster $name"
    done
}

push() {
    local tool image
    [ "$REGISTRY" != "$DEFAULT_REGISTRY" ] \
        || die "set REGISTRY to a registry your nodes pull from ($DEFAULT_REGISTRY is not published)"
    tool="$(builder)"
    for image in $IMAGES; do
        "$tool" push "$(reference "$image")" || die "$tool could not push $(reference "$image")"
    done
}

case "${1:-}" in
    build | load | push) "$1" ;;
    *) die "usage: images.sh build|load|push" ;;
esac
