"""Regenerate the Python stubs of proto/ into distserve/ (run after editing a .proto file).

    python scripts/generate_protos.py            # rewrite the committed stubs
    python scripts/generate_protos.py --out DIR  # write them under DIR instead

``proto/distserve/v1/x.proto`` becomes ``distserve/v1/x_pb2.py`` (+ ``_pb2_grpc.py``, ``.pyi``),
so the proto package ``distserve.v1`` is the Python package ``distserve.v1``.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.rglob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Run protoc (grpcio-tools) on every .proto file; the written files, relative to ``out``."""
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    files = [p.relative_to(PROTO_DIR) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *map(str, files),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {files}")
    stems = [f.with_suffix("") for f in files]
    return [stem.with_name(stem.name + suffix) for stem in stems for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write the stubs under (default: the repo)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(args.out / path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
