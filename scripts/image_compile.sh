#!/usr/bin/env bash
# Builds the Dockerfile's build stage as `podman build -t sanmai .` does (`cargo build --release
# --locked --features cuda` inside the image), without a container registry: the Rust base image is
# made here by mmdebstrap-ing a Debian bookworm root file system with Debian's Rust 1.96 (rustc-web
# and cargo-web from bookworm-security) and `podman import`-ing it, then passed as BUILD_IMAGE. The
# stage ends by running the compiled `sanmai --version`. A full release build: slow on few cores,
# which is why CI builds its image from the binary it already built (.ci/image.sh).
#
#   scripts/image_compile.sh WORK_DIR
#
# WORK_DIR: where the root file system and the build log go. Needs podman, mmdebstrap and network
# access to the Debian mirrors and crates.io. The compile trusts the build host's CA bundle
# (SANMAI_BUILD_CA_BUNDLE, default /etc/ssl/certs/ca-certificates.crt, mounted read-only over the
# image's for the build only), so it also works behind a proxy that re-signs TLS with its own CA.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:?usage: image_compile.sh WORK_DIR}
mkdir -p "$work"
work="$(cd "$work" && pwd)"
base=localhost/sanmai-rust-base:bookworm
image=localhost/sanmai:build-stage

if ! podman image exists "$base"; then
    mmdebstrap --quiet --variant=minbase \
        --include=ca-certificates,rustc-web,cargo-web,gcc,g++,libc6-dev,pkg-config \
        bookworm "$work/rust-rootfs.tar" \
        "deb http://deb.debian.org/debian bookworm main" \
        "deb http://deb.debian.org/debian-security bookworm-security main"
    podman import "$work/rust-rootfs.tar" "$base" >/dev/null
    rm -f "$work/rust-rootfs.tar"
fi

ca=${SANMAI_BUILD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
mounts=()
[ -f "$ca" ] && mounts=(--volume "$ca:/etc/ssl/certs/ca-certificates.crt:ro")
t0=$(date +%s)
podman build --format docker --isolation chroot --target build "${mounts[@]}" \
    --build-arg BUILD_IMAGE="$base" -t "$image" . 2>&1 | tee "$work/build-stage.log"
echo "build stage compiled in $(($(date +%s) - t0)) s: $image"
