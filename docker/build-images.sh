#!/usr/bin/env bash
# Builds Interleaf's images with no registry: a Debian base made by mmdebstrap, the
# Interleaf image (docker/Dockerfile) on it, and Prometheus (docker/prometheus.Dockerfile).
#
#   docker/build-images.sh            # from anywhere; needs a running dockerd, mmdebstrap, pip
#
# Python packages come from this machine's pip, with its own configuration (indexes,
# find-links, constraints, certificates, proxies): it downloads the wheels the image needs,
# for the image's Python and platform, into docker/wheels, and the build installs from
# there with no index at all. So the image gets exactly what `pip install` resolves here
# (torch==2.13.0 is the CPU build where the configured indexes offer it, as on CI).
#
# Environment (all optional):
#   INTERLEAF_BASE    the base image (default: interleaf-base:bookworm, made here when missing;
#                     a CUDA base, e.g. nvidia/cuda:12.8.1-runtime-ubuntu24.04, is used as is)
#   INTERLEAF_TORCH   the torch requirement (default torch==2.13.0)
#   INTERLEAF_EXTRAS  the package's extras (e.g. gpu: CuPy for the NCCL transport)
#   INTERLEAF_TAG     the Interleaf image's tag (default: the project's version)
#   REBUILD_BASE=1    makes the Debian base again (e.g. for Debian's security updates)
# Prints the images it built, one name a line, last.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

SUITE=bookworm
DEFAULT_BASE="interleaf-base:$SUITE"
BASE="${INTERLEAF_BASE:-$DEFAULT_BASE}"
TORCH="${INTERLEAF_TORCH:-torch==2.13.0}"
EXTRAS="${INTERLEAF_EXTRAS:-}"
VERSION="$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
TAG="${INTERLEAF_TAG:-$VERSION}"
IMAGE="interleaf:$TAG"
PROMETHEUS_IMAGE="interleaf-prometheus:$SUITE"
WHEELS="$ROOT/docker/wheels"
# The legacy builder: it needs no buildx plugin and runs the same with Debian's docker.io
# and a newer CLI (which would otherwise want buildx).
export DOCKER_BUILDKIT=0

die() { echo "build-images.sh: $*" >&2; exit 1; }
step() { echo "== $*" >&2; }

docker info >/dev/null 2>&1 || die "no Docker engine answers ('docker info' fails): start dockerd first"

# -- the Debian base: minbase + Python and its venv module, no docs, no apt lists --------
if [[ "$BASE" == "$DEFAULT_BASE" ]] && { [[ "${REBUILD_BASE:-}" == 1 ]] || ! docker image inspect "$BASE" >/dev/null 2>&1; }; then
    command -v mmdebstrap >/dev/null || die "mmdebstrap is missing (apt-get install mmdebstrap)"
    step "making $BASE with mmdebstrap"
    mirror=http://deb.debian.org/debian
    # Into a file first: a pipe would have `docker import` tag whatever part of the tar
    # arrived before a failed mmdebstrap ended; then the base must run its python3.
    tarball="$(mktemp --suffix=.tar)"
    trap 'rm -f "$tarball"' EXIT
    mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
        "$SUITE" "$tarball" "deb $mirror $SUITE main" "deb $mirror $SUITE-updates main" \
        "deb http://deb.debian.org/debian-security $SUITE-security main" \
        || die "making $BASE failed: mmdebstrap $SUITE"
    docker import --change 'CMD ["/bin/bash"]' --message "mmdebstrap $SUITE minbase + python3" "$tarball" "$BASE.partial" >/dev/null \
        || die "making $BASE failed: docker import"
    docker run --rm "$BASE.partial" python3 -c 'import venv' >/dev/null \
        || { docker rmi "$BASE.partial" >/dev/null; die "the base made for $BASE has no working python3"; }
    docker tag "$BASE.partial" "$BASE" && docker rmi "$BASE.partial" >/dev/null
    rm -f "$tarball"
fi

# -- the wheels, downloaded by this machine's pip for the image's Python -----------------
# The Dockerfile's first stage (the base with python3) says which Python and C
# library the wheels must suit; a CUDA base gets its Python there too.
step "reading the image's Python from the Dockerfile's base stage"
mkdir -p "$WHEELS"
docker build --force-rm --target base --build-arg BASE="$BASE" -f docker/Dockerfile --iidfile "$WHEELS/.base-stage" . >&2 \
    || die "building the base stage of docker/Dockerfile on $BASE failed"
base_stage="$(cat "$WHEELS/.base-stage")"
facts="$(docker run --rm "$base_stage" python3 -c \
    'import platform, sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}", platform.libc_ver()[1], platform.machine())')" \
    || die "running python3 in the base stage of docker/Dockerfile on $BASE failed"
read -r py glibc machine <<< "$facts"
[[ -n "$glibc" ]] || die "the base's Python reports no glibc version: only glibc bases are supported"
# Every manylinux tag the image's C library runs (pip takes --platform literally).
platforms=()
for ((minor = ${glibc#*.}; minor >= 17; minor--)); do platforms+=(--platform "manylinux_2_${minor}_$machine"); done
platforms+=(--platform "manylinux2014_$machine" --platform "manylinux2010_$machine" --platform "manylinux1_$machine")

# The requirements: torch, the project's dependencies with the extras asked for, and what
# building the project's own wheel needs (its build-system).
python3 - "$TORCH" "$EXTRAS" > "$WHEELS/requirements.new" <<'EOF'
import sys, tomllib
torch, extras = sys.argv[1], [e for e in sys.argv[2].split(",") if e]
project = tomllib.load(open("pyproject.toml", "rb"))
print(torch)
for requirement in project["project"]["dependencies"]:
    if not requirement.replace(" ", "").startswith("torch"):
        print(requirement)
for extra in extras:
    for requirement in project["project"]["optional-dependencies"][extra]:
        print(requirement)
for requirement in project["build-system"]["requires"] + ["wheel"]:
    print(requirement)
EOF
download=(python3 -m pip download --quiet --dest "$WHEELS" --only-binary=:all: --python-version "$py"
          --implementation cp "${platforms[@]}" -r "$WHEELS/requirements.new")
# A download is skipped when the same request (requirements, target, pip's configuration)
# already filled the folder: the warm build then asks no index at all.
request="$(printf '%s\n' "${download[*]}"; cat "$WHEELS/requirements.new"; python3 -m pip config list)"
if [[ "$request" != "$(cat "$WHEELS/.request" 2>/dev/null)" ]]; then
    step "downloading wheels for Python $py, glibc $glibc, $machine (this machine's pip)"
    rm -f "$WHEELS"/*.whl "$WHEELS/.request"
    "${download[@]}" || die "pip could not download the image's wheels (see above): ${download[*]}"
    printf '%s' "$request" > "$WHEELS/.request"
fi
mv "$WHEELS/requirements.new" "$WHEELS/requirements.txt"

# -- the images -------------------------------------------------------------------------
step "building $IMAGE"
docker build --force-rm --build-arg BASE="$BASE" -f docker/Dockerfile -t "$IMAGE" . >&2 \
    || die "building $IMAGE from docker/Dockerfile failed"
if [[ "$BASE" == "$DEFAULT_BASE" ]]; then
    step "building $PROMETHEUS_IMAGE"
    # No context: the Dockerfile copies nothing.
    docker build --force-rm --build-arg BASE="$BASE" -t "$PROMETHEUS_IMAGE" - < docker/prometheus.Dockerfile >&2 \
        || die "building $PROMETHEUS_IMAGE from docker/prometheus.Dockerfile failed"
    echo "$PROMETHEUS_IMAGE"
fi
echo "$IMAGE"
