#!/usr/bin/env bash
# Install what c_generate builds against, offline-cacheable and without touching the system's
# apt sources: cJSON from the machine's Debian release, and the ONNX Runtime C headers from
# Debian trixie's libonnxruntime-dev (tools/release/fetch_ort_headers.sh unpacks them into .cdeps/).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
if [ ! -f /usr/include/cjson/cJSON.h ]; then
    apt-get update -qq && apt-get install -y -qq libcjson-dev >/dev/null
fi
headers="$("$root/tools/release/fetch_ort_headers.sh")"
echo "headers: $headers; cJSON: /usr/include/cjson"
