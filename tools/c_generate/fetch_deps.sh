#!/usr/bin/env bash
# Install what c_generate builds against, offline-cacheable and without touching the system's
# apt sources: cJSON from the machine's Debian release, and the ONNX Runtime C headers from
# Debian trixie's libonnxruntime-dev (headers only, unpacked into .cdeps/; the C API is
# forward compatible with the newer libonnxruntime.so of the Python wheel we link against).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
deps="$root/.cdeps"
if [ ! -f /usr/include/cjson/cJSON.h ]; then
    apt-get update -qq && apt-get install -y -qq libcjson-dev >/dev/null
fi
if [ ! -f "$deps/usr/include/onnxruntime/onnxruntime_c_api.h" ]; then
    work="$(mktemp -d)"
    mkdir -p "$work/lists/partial"
    echo "deb http://deb.debian.org/debian trixie main" > "$work/sources.list"
    opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o "Dir::State::Lists=$work/lists" -o APT::Sandbox::User=root)
    apt-get "${opts[@]}" update -qq
    (cd "$work" && apt-get "${opts[@]}" download libonnxruntime-dev >/dev/null)
    mkdir -p "$deps"
    dpkg -x "$work"/libonnxruntime-dev_*.deb "$deps"
    rm -rf "$work"
fi
echo "headers: $deps/usr/include/onnxruntime; cJSON: /usr/include/cjson"
