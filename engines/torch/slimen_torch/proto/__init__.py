"""Generated gRPC stubs of engines/proto/engine.proto (regenerate with gen_proto.sh)."""
