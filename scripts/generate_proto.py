"""Generate the Python code of proto/ (messages, gRPC stubs and their typed .pyi) into a folder.

``make proto`` writes into libs/common/src, where the code is checked in; tests/test_grpc_api.py
writes into a temporary folder and compares, so checked-in code that is stale fails the suite.
The plugins (mypy-protobuf) are looked up beside this interpreter, i.e. in the virtualenv.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

__all__ = ["PROTOS", "PROTO_ROOT", "generate"]

PROTO_ROOT = Path(__file__).resolve().parents[1] / "proto"
PROTOS = sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out: Path) -> None:
    """Write ``*_pb2.py``, ``*_pb2.pyi``, ``*_pb2_grpc.py`` and ``*_pb2_grpc.pyi`` under ``out``."""
    bin_dir = Path(sys.executable).parent
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
        f"--mypy_out={out}",
        f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
        f"--mypy_grpc_out={out}",
        *(str(proto) for proto in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed: {' '.join(args)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="Folder the packages are written under, e.g. libs/common/src")
    generate(parser.parse_args().out)
