"""The committed gRPC stubs are what the .proto files generate."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).parent.parent
spec = importlib.util.spec_from_file_location("generate_protos", ROOT / "scripts" / "generate_protos.py")
generate_protos = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generate_protos)


def test_committed_stubs_are_current(tmp_path):
    written = generate_protos.generate(tmp_path)
    assert written, "no .proto file was found"
    for path in written:
        committed = ROOT / path
        assert committed.exists(), f"{path} is not committed: run python scripts/generate_protos.py"
        assert committed.read_text() == (tmp_path / path).read_text(), (
            f"{path} is stale: run python scripts/generate_protos.py"
        )


def test_stubs_describe_the_service():
    from distserve.v1 import distserve_pb2

    service = distserve_pb2.DESCRIPTOR.services_by_name["DistServe"]
    assert {m.name for m in service.methods} == {"Generate", "GetClusterInfo", "Tokenize", "Detokenize", "SetRoles"}
    assert service.methods_by_name["Generate"].server_streaming
