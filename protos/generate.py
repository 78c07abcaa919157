"""Regenerates the *_pb2 modules from the .proto sources.

    python -m protos.generate            # rewrite protos/*_pb2*.py
    python -m protos.generate --out DIR  # write them elsewhere (the up-to-date test)

Run from the repository root so generated imports read `from protos import ...`.
Needs grpcio-tools (the `test` extra pins the version the checked-in files came from).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "protos").glob("*.proto"))


def generate(out: pathlib.Path) -> None:
    from grpc_tools import protoc  # imported here: only generation needs grpcio-tools

    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{ROOT}", f"--python_out={out}", f"--grpc_python_out={out}", *SOURCES]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {SOURCES}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT)
    generate(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
