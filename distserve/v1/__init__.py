"""Generated stubs of the ``distserve.v1`` gRPC API (proto/distserve/v1); regenerate them with
``python scripts/generate_protos.py``."""
