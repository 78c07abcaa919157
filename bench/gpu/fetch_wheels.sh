#!/usr/bin/env bash
# The wheels a GPU machine lacks, fetched here (where PyPI is reachable) into
# bench/gpu/wheels/ for bench/gpu/session.sh to install there: the GPU image has torch,
# CuPy, numpy, prometheus-client, safetensors, matplotlib, tokenizers, pyarrow, tqdm and
# tensorboard, but not the grpcio and protobuf the generated code demands
# (pyproject.toml's floors), tomli-w or torchao (train.precision=fp8, and the float8
# peer). Each at the version this machine's tests run with, for the image's CPython
# (3.12, x86_64 Linux).
#
#     bash bench/gpu/fetch_wheels.sh      # then carry bench/gpu/wheels (it is git-ignored)
set -euo pipefail
cd "$(dirname "$0")"
PYTHON_VERSION=${PYTHON_VERSION:-3.12}

version_here() {  # the installed version of $1 in this machine's python3, else the pin $2
    python3 -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print(sys.argv[2])" "$1" "$2"
}

rm -rf wheels && mkdir wheels
python3 -m pip download --quiet --dest wheels --no-deps --only-binary=:all: \
    --python-version "$PYTHON_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform linux_x86_64 --platform any \
    "grpcio==$(version_here grpcio 1.85.3)" \
    "grpcio-health-checking==$(version_here grpcio-health-checking 1.85.1)" \
    "protobuf==$(version_here protobuf 7.36.2)" \
    "tomli-w==$(version_here tomli-w 1.2.0)" \
    "torchao==$(version_here torchao 0.18.0)"
ls -1 wheels
du -sh wheels
