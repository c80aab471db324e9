#!/usr/bin/env bash
# The ONNX Runtime C/C++ headers, from a package registry: Debian trixie's libonnxruntime-dev,
# downloaded and unpacked (headers only) into DEST (default: the repository's .cdeps/) without
# touching the system's apt sources. The onnxruntime wheels carry no headers; the C API is
# forward compatible, so code built against these (1.21) loads in the wheel's newer runtime.
# Prints the include directory.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
deps="${1:-$root/.cdeps}"
if [ ! -f "$deps/usr/include/onnxruntime/onnxruntime_c_api.h" ]; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/lists/partial"
    echo "deb http://deb.debian.org/debian trixie main" > "$work/sources.list"
    opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o "Dir::State::Lists=$work/lists" -o APT::Sandbox::User=root)
    apt-get "${opts[@]}" update -qq
    (cd "$work" && apt-get "${opts[@]}" download libonnxruntime-dev >/dev/null)
    mkdir -p "$deps"
    dpkg -x "$work"/libonnxruntime-dev_*.deb "$deps"
fi
echo "$deps/usr/include/onnxruntime"
