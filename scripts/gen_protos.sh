#!/usr/bin/env bash
# Regenerates the Python gRPC stubs in ravnest/v1/ from protos/. tests/test_protos.py fails when
# the committed stubs differ from what this script produces.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
python -m grpc_tools.protoc -Iprotos --python_out="$out" --grpc_python_out="$out" protos/ravnest/v1/*.proto
