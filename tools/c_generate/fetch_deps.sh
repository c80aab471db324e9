#!/usr/bin/env bash
# Install what c_generate builds against: cJSON from the machine's configured apt sources
# (installing a package needs root: without it this says which command to run), and the ONNX
# Runtime C headers (custom_ops/fetch_ort_headers.sh unpacks them into .cdeps/, no root needed).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cjson="${LOOPCAST_CJSON_HEADER:-/usr/include/cjson/cJSON.h}"
if [ ! -f "$cjson" ]; then
    if [ "$(id -u)" -eq 0 ]; then
        apt-get update -qq && apt-get install -y -qq libcjson-dev >/dev/null
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        sudo apt-get update -qq && sudo apt-get install -y -qq libcjson-dev >/dev/null
    else
        echo "error: the C example needs cJSON, and installing it needs root:" \
             "run 'sudo apt-get install libcjson-dev' (the op library's headers need no root:" \
             "custom_ops/fetch_ort_headers.sh)" >&2
        exit 2
    fi
fi
headers="$("$root/custom_ops/fetch_ort_headers.sh")"
echo "headers: $headers; cJSON: $(dirname "$cjson")"
