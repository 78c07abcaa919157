"""The checked-in *_pb2 modules and their type stubs are exactly what protoc makes from the .proto sources."""

from __future__ import annotations

import pathlib

from interleaf.protos.generate import ROOT, generate


def test_generated_modules_are_up_to_date(tmp_path):
    generate(tmp_path)
    made = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert made == [pathlib.Path("protos/interleaf_pb2.py"), pathlib.Path("protos/interleaf_pb2.pyi"),
                    pathlib.Path("protos/interleaf_pb2_grpc.py")]
    for relative in made:
        assert (tmp_path / relative).read_text() == (ROOT / relative).read_text(), (
            f"{relative} is stale: run `python -m interleaf.protos.generate`"
        )
