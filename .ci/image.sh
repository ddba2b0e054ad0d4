#!/usr/bin/env bash
# CI: builds the container image and runs it, without a container registry.
#
#   bash .ci/image.sh BINARY WORK_DIR
#
# BINARY: a `sanmai` built by this CI run, inside the repository (e.g. target/release/sanmai). The
# image is built from it through the Dockerfile's build argument SANMAI_BINARY: the build stage copies
# it in instead of compiling (compiling it again would take most of CI's time on 2 cores).
# WORK_DIR: where the base image's root file system, the podman-compose venv and the logs go.
#
# 1. Base image: mmdebstrap a Debian bookworm minbase root file system and `podman import` it; it is
#    both BUILD_IMAGE and RUNTIME_IMAGE (the binary needs glibc only to serve on the CPU).
# 2. `podman build --isolation chroot` of the Dockerfile with those build arguments.
# 3. compose.yaml validated for every profile with podman-compose 1.6 (`config`), and each service's
#    command line through `sanmai plan` (.ci/compose_check.py).
# 4. The image serves the built-in model on the CPU: by `podman run` (runc, the port published on
#    127.0.0.1) where that works; otherwise from the image's own file system (`podman image mount`,
#    then chroot as the image's user). The output says which ran. /health, one chat completion,
#    the server's user is not root, SIGTERM stops it with exit status 0.
set -euo pipefail
cd "$(dirname "$0")/.."
binary="$1"
work="$2"
mkdir -p "$work"
work="$(cd "$work" && pwd)"

base=localhost/sanmai-ci-base:bookworm
image=localhost/sanmai:ci
container=sanmai-ci
say() { echo "[image] $*"; }

t0=$(date +%s)
lap() { say "$1 ($(($(date +%s) - t0)) s so far)"; }

if ! command -v podman >/dev/null || ! command -v mmdebstrap >/dev/null || ! command -v runc >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        podman buildah mmdebstrap runc uidmap containernetworking-plugins iptables \
        python3-venv >"$work/apt.log" 2>&1 || { tail -n 40 "$work/apt.log"; exit 1; }
fi
podman --version
lap "tools installed"

# 1. The base image.
if ! podman image exists "$base"; then
    mmdebstrap --quiet --variant=minbase bookworm "$work/rootfs.tar"
    podman import "$work/rootfs.tar" "$base" >/dev/null
    rm -f "$work/rootfs.tar"
fi
lap "base image $base (Debian bookworm minbase, mmdebstrap + podman import)"

# 2. The image, from the binary this CI run built (the build stage copies it; it does not compile).
"$binary" --version
podman build --quiet --format docker --isolation chroot \
    --build-arg BUILD_IMAGE="$base" --build-arg RUNTIME_IMAGE="$base" \
    --build-arg RUNTIME_PACKAGES= --build-arg SANMAI_BINARY="$binary" \
    -t "$image" . >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
user="$(podman image inspect "$image" --format '{{.Config.User}}')"
say "built $image from the prebuilt binary $binary (build argument SANMAI_BINARY); image user: $user"
case "$user" in "" | root | root:* | 0 | 0:*) say "FAIL: the image runs as root"; exit 1 ;; esac
lap "image built"

# 3. compose.yaml: every profile through podman-compose 1.6's `config`, every service through plan.
if [ ! -x "$work/venv/bin/podman-compose" ]; then
    python3 -m venv "$work/venv"
    "$work/venv/bin/pip" install --quiet --disable-pip-version-check "podman-compose==1.6.0"
fi
configs=()
for profile in 3x3090 3x3090-mtp 1xh200 demo; do
    SANMAI_MODEL=/nonexistent/model SANMAI_PLE_TABLE=/nonexistent/ple \
        "$work/venv/bin/podman-compose" -f compose.yaml --profile "$profile" config \
        >"$work/compose-$profile.yaml"
    grep -q "^  sanmai-$profile:" "$work/compose-$profile.yaml" \
        || { say "FAIL: profile $profile has no service sanmai-$profile"; exit 1; }
    configs+=("$work/compose-$profile.yaml")
done
say "compose.yaml: podman-compose config passed for every profile"
"$work/venv/bin/python" .ci/compose_check.py "$binary" . "${configs[@]}"
lap "compose.yaml checked"

# 4. Serve from the image.
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
log="$work/serve.log"
mode=""
pid=""
mnt=""
# runc with cgroupfs: crun refuses CI's hybrid cgroups.
podman_ci() { podman --runtime runc --cgroup-manager cgroupfs "$@"; }
cleanup() {
    if [ "$mode" = podman ]; then podman_ci rm -f "$container" >/dev/null 2>&1 || true; fi
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
    if [ -n "$mnt" ]; then podman image unmount "$image" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
podman_ci rm -f "$container" >/dev/null 2>&1 || true
# Limits below CI's own (podman's defaults, and even CI's own NPROC, are refused by setrlimit here).
nofile="$(ulimit -Hn)"
if [ "$nofile" = unlimited ] || [ "$nofile" -gt 65536 ]; then nofile=65536; fi
nproc=4096
if podman_ci run -d --name "$container" --ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc" \
    -p "127.0.0.1:$port:8000" "$image" >"$work/run.log" 2>&1; then
    mode=podman
    say "RAN: podman run (runc), port 8000 published on 127.0.0.1:$port"
else
    say "podman run failed here:"
    cat "$work/run.log"
    mnt="$(podman image mount "$image")"
    # The image's own command, environment and user, on the host's network.
    mapfile -t argv < <(podman image inspect "$image" --format '{{range .Config.Entrypoint}}{{println .}}{{end}}{{range .Config.Cmd}}{{println .}}{{end}}' | sed '/^$/d')
    mapfile -t envs < <(podman image inspect "$image" --format '{{range .Config.Env}}{{println .}}{{end}}' | sed '/^$/d')
    argv=("${argv[@]/#8000/$port}")
    env -i "${envs[@]}" HOME=/var/lib/sanmai chroot --userspec="$user" "$mnt" "${argv[@]}" >"$log" 2>&1 &
    pid=$!
    mode=chroot
    say "RAN: chroot into the image's file system ($mnt) as $user: ${argv[*]} (no podman run; listening on 0.0.0.0:$port)"
fi

logs() { if [ "$mode" = podman ]; then podman_ci logs "$container" >"$log" 2>&1 || true; fi; tail -n 60 "$log"; }
fail() { say "FAIL: $*"; logs; exit 1; }
ready=0
for _ in $(seq 240); do
    if curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1; then ready=1; break; fi
    if [ "$mode" = podman ]; then
        [ "$(podman_ci inspect "$container" --format '{{.State.Running}}')" = true ] || break
    else
        kill -0 "$pid" 2>/dev/null || break
    fi
    sleep 0.5
done
[ "$ready" = 1 ] || fail "/health did not answer 200"
say "/health: 200"
lap "server healthy"

if [ "$mode" = podman ]; then
    podman_ci healthcheck run "$container" || fail "the image's HEALTHCHECK failed"
    say "the image's HEALTHCHECK passed"
    server_pid="$(podman_ci inspect "$container" --format '{{.State.Pid}}')"
else
    server_pid="$pid"
fi
uid="$(awk '/^Uid:/ {print $2}' "/proc/$server_pid/status")"
[ "$uid" != 0 ] || fail "the server runs as root"
say "the server runs as uid $uid (image user $user)"

reply="$(curl -fsS -m 120 "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
    -d '{"model": "sanmai-demo", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8}')" \
    || fail "the chat completion failed"
echo "$reply"
python3 -c 'import json, sys; r = json.loads(sys.argv[1]); assert r["object"] == "chat.completion" and r["usage"]["completion_tokens"] > 0, r' "$reply" \
    || fail "the chat completion is not one"
say "chat completion answered through 127.0.0.1:$port"

if [ "$mode" = podman ]; then
    podman_ci stop -t 45 "$container" >/dev/null
    status="$(podman_ci inspect "$container" --format '{{.State.ExitCode}}')"
    stop_how="podman stop (SIGTERM)"
else
    kill -TERM "$pid"
    status=0
    wait "$pid" || status=$?
    pid=""
    stop_how="SIGTERM to the chrooted server"
fi
logs >/dev/null
[ "$status" = 0 ] || fail "$stop_how: exit status $status"
grep -q "panicked" "$log" && fail "a panic in the server log"
say "$stop_how: exit status 0"
lap "done: ran by $mode"
