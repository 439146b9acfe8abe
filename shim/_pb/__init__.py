"""Generated gRPC code for weft's own protocols (see proto/generate.py)."""
