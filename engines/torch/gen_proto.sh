#!/usr/bin/env bash
# Regenerates the Python gRPC stubs in slimen_torch/proto/ from engines/proto/engine.proto.
# Generation needs grpcio-tools, which the worker does not need at run time, so it lives in a
# throwaway virtual environment. The version pins keep the generated code loadable by the pinned
# runtime (grpcio 1.84, protobuf 7.36: generated code refuses an older runtime than its generator).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=${PROTOGEN_VENV:-/tmp/slimen-protogen}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q grpcio-tools==1.84.0 protobuf==7.36.2 >&2
fi
out="$here/slimen_torch/proto"
mkdir -p "$out"
"$venv/bin/python" -m grpc_tools.protoc -I "$root/engines/proto" \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" "$root/engines/proto/engine.proto"
# protoc writes an absolute import of the sibling module; the stubs live inside a package.
sed -i 's/^import engine_pb2 as engine__pb2$/from . import engine_pb2 as engine__pb2/' "$out/engine_pb2_grpc.py"
