"""Regenerates the *_pb2 modules from the .proto sources.

    python -m interleaf.protos.generate            # rewrite protos/*_pb2*.py and *_pb2.pyi
    python -m interleaf.protos.generate --out DIR  # write them into DIR/protos (the up-to-date test)

protoc names a generated module's imports after the .proto's path under its include root,
so the sources are compiled from a staging folder where they sit at `interleaf/protos/`:
the generated code then reads `from interleaf.protos import ...`, the installed namespace.
Needs grpcio-tools (the `test` extra pins the version the checked-in files came from).
The generated modules refuse to import under a grpcio older than that grpcio-tools, or a
protobuf runtime older than its protoc: regenerating with a newer one raises those floors,
and pyproject's dependencies must follow (tests/test_dependency_floors.py fails until they do).
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"


def generate(out: pathlib.Path) -> None:
    from grpc_tools import protoc  # imported here: only generation needs grpcio-tools

    with tempfile.TemporaryDirectory() as staging:
        staged = pathlib.Path(staging) / "interleaf" / "protos"
        staged.mkdir(parents=True)
        sources = []
        for proto in sorted(PROTOS.glob("*.proto")):
            shutil.copy(proto, staged / proto.name)
            sources.append(f"interleaf/protos/{proto.name}")
        # --pyi_out: the messages' type stubs, so type checkers see their classes and fields.
        args = ["protoc", f"-I{staging}", f"--python_out={staging}", f"--pyi_out={staging}",
                f"--grpc_python_out={staging}", *sources]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {sources}")
        (out / "protos").mkdir(parents=True, exist_ok=True)
        for made in [*staged.glob("*_pb2*.py"), *staged.glob("*_pb2.pyi")]:
            shutil.copy(made, out / "protos" / made.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT)
    generate(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
