"""harness.py — what the integration tests share: the Python classes generated from the
repository's protos (at test time, into a temporary folder) and the ok/FAIL checker."""
import os
import sys
import tempfile


def load_protos(proto_dir):
    """(kvlingo_pb2, kvlingo_pb2_grpc, health_pb2, health_pb2_grpc) generated from proto_dir."""
    from grpc_tools import protoc

    gen = tempfile.mkdtemp(prefix="kvl-proto-")
    for inc, f in ((proto_dir, "kvlingo/v1/kvlingo.proto"), (os.path.join(proto_dir, "grpc/health/v1"), "health.proto")):
        if protoc.main(["protoc", f"-I{inc}", f"--python_out={gen}", f"--grpc_python_out={gen}", f]) != 0:
            raise RuntimeError(f"protoc failed on {f}")
    sys.path.insert(0, gen)
    from kvlingo.v1 import kvlingo_pb2, kvlingo_pb2_grpc
    import health_pb2
    import health_pb2_grpc
    return kvlingo_pb2, kvlingo_pb2_grpc, health_pb2, health_pb2_grpc


class Checks:
    """check(cond, what) prints 'ok  what' or 'FAIL what' and counts the failures."""

    def __init__(self):
        self.failed = 0

    def __call__(self, cond, what):
        print(f"{'ok  ' if cond else 'FAIL'} {what}", flush=True)
        self.failed += not cond
        return cond
