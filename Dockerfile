# sanmai: the OpenAI-compatible server in a container for a GPU host.
#
#   podman build -t sanmai .                     # compiles with --features cuda --locked
#   podman build -t sanmai --build-arg SANMAI_BINARY=target/release/sanmai .
#                                                # copies a binary built outside (cargo build --release
#                                                # [--features cuda]) in place of compiling it
#
# The GPU driver (libcuda) comes from the host through the NVIDIA container toolkit (CDI). What the
# binary loads at run time comes from the runtime image: NVRTC (cuda-nvrtc-13-0), cuBLAS
# (libcublas-13-0) and NCCL (libnccl2), all in NVIDIA's CUDA runtime image, and the CUDA headers NVRTC
# compiles the kernels against (cuda_bf16.h and what it includes: cuda-cudart-dev-13-0, installed
# here). The kernels are built for CUDA 13.0.

# Base images. Any Rust image of Rust 1.85 or later builds; any glibc image of the binary's glibc or
# later runs it (a CPU-only image serves on the CPU).
ARG BUILD_IMAGE=docker.io/library/rust:1.95-bookworm
ARG RUNTIME_IMAGE=nvcr.io/nvidia/cuda:13.0.2-runtime-ubuntu24.04

FROM ${BUILD_IMAGE} AS build
# A path inside the build context to a `sanmai` binary built outside; empty: compile it here.
ARG SANMAI_BINARY=
ARG CARGO_FEATURES=cuda
WORKDIR /src
COPY . .
RUN set -eu; mkdir -p /out; \
    if [ -n "$SANMAI_BINARY" ]; then \
        echo "using the prebuilt binary $SANMAI_BINARY (no compile in this stage)"; \
        install -m 0755 "$SANMAI_BINARY" /out/sanmai; \
    else \
        cargo build --release --locked --features "$CARGO_FEATURES"; \
        install -m 0755 target/release/sanmai /out/sanmai; \
    fi; \
    /out/sanmai --version

FROM ${RUNTIME_IMAGE} AS runtime
# Packages installed with apt-get on top of the runtime image (empty: none). The default adds the CUDA
# headers to NVIDIA's runtime image. cudarc opens NCCL by the unversioned name libnccl.so, which
# libnccl2 does not ship: the link to libnccl.so.2 is made here.
ARG RUNTIME_PACKAGES=cuda-cudart-dev-13-0
RUN set -eu; \
    if [ -n "$RUNTIME_PACKAGES" ]; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $RUNTIME_PACKAGES; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    for lib in /usr/lib/*-linux-gnu/libnccl.so.2; do \
        if [ -e "$lib" ] && [ ! -e "${lib%.2}" ]; then ln -s libnccl.so.2 "${lib%.2}"; fi; \
    done; \
    useradd --system --uid 10001 --user-group --home-dir /var/lib/sanmai --create-home \
        --shell /usr/sbin/nologin sanmai; \
    mkdir -p /model /ple /var/cache/sanmai; \
    chown sanmai:sanmai /var/cache/sanmai
COPY --from=build /out/sanmai /usr/local/bin/sanmai
COPY configs/deploy/ /etc/sanmai/deploy/
COPY configs/models/ /etc/sanmai/models/

# The kernel disk cache: a volume, so that a restarted container skips NVRTC. CUDA_HOME is where the
# CUDA headers are (NVIDIA's images keep them under /usr/local/cuda).
ENV SANMAI_CACHE_DIR=/var/cache/sanmai \
    CUDA_HOME=/usr/local/cuda \
    RUST_LOG=info \
    NO_COLOR=1
# /model: the checkpoint (read-only); /ple: the PLE table of a model that has one (read-only).
VOLUME ["/var/cache/sanmai"]
USER sanmai:sanmai
WORKDIR /var/lib/sanmai
EXPOSE 8000
# /health answers 200 once the model is loaded and the engine runs (503 while it loads); bash's /dev/tcp
# asks it, so the image needs no HTTP client.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/8000 && printf 'GET /health HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n' >&3 && head -n 1 <&3 | grep -q ' 200 '"]
# SIGTERM drains in-flight responses for up to 30 s, then exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/sanmai"]
# Inside the container the server listens on every address; compose publishes it on 127.0.0.1.
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
