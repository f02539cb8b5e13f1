#!/usr/bin/env bash
# Installs the system programs the tests drive, from Debian packages, when they are missing:
# promtool and the prometheus server (the alert-rule tests and the end-to-end Prometheus
# test), g++ (inductor's C++ backend for the torch.compile tests), unshare (the read-only
# worlds of the key-matrix and least-privilege tests), docker-registry, skopeo and htpasswd
# (the OCI push and pull tests: a real registry with TLS and basic auth, and an independent
# client reading what was pushed).
#
# Missing ones are installed with apt-get when this runs as root. Otherwise, under CI (CI set)
# it fails naming what is missing; elsewhere it says which tests will skip and how to
# install what they need. Idempotent: does nothing when every program is there.
set -euo pipefail

# program:Debian package
TOOLS=(promtool:prometheus prometheus:prometheus g++:g++ unshare:util-linux
    docker-registry:docker-registry skopeo:skopeo htpasswd:apache2-utils)

missing() {
    for entry in "${TOOLS[@]}"; do
        command -v "${entry%%:*}" >/dev/null || echo "$entry"
    done
}

packages() {
    for entry in "$@"; do echo "${entry#*:}"; done | sort -u | tr '\n' ' '
}

describe() {
    for entry in "$@"; do printf '%s (Debian package %s), ' "${entry%%:*}" "${entry#*:}"; done |
        sed 's/, $//'
}

mapfile -t absent < <(missing)
if [ "${#absent[@]}" -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "install-system-tools: installing $(packages "${absent[@]}")" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # shellcheck disable=SC2046  # one word per package
    apt-get install -y -qq --no-install-recommends $(packages "${absent[@]}") >/dev/null
    mapfile -t absent < <(missing)
fi
[ "${#absent[@]}" -eq 0 ] && exit 0

if [ -n "${CI:-}" ]; then
    echo "install-system-tools: missing $(describe "${absent[@]}"); run as root with apt-get," \
        "or install them first" >&2
    exit 1
fi
echo "install-system-tools: missing $(describe "${absent[@]}"): the tests that need them" \
    "will skip (as root: apt-get install $(packages "${absent[@]}"))" >&2
