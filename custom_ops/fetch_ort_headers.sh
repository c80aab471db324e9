#!/usr/bin/env bash
# The ONNX Runtime C/C++ headers, from a package registry: the libonnxruntime-dev package of
# the machine's own configured apt sources where they carry it, else of Debian trixie from the
# mirror those sources already use; downloaded and unpacked (headers only) into DEST (default:
# the repository's .cdeps/), without installing anything or touching the system's apt state.
# The onnxruntime wheels carry no headers; the C API is forward compatible, so code built against
# these (1.21 or newer) loads in the wheel's newer runtime. Prints the include directory.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
deps="${1:-$root/.cdeps}"
if [ -f "$deps/usr/include/onnxruntime/onnxruntime_c_api.h" ]; then
    echo "$deps/usr/include/onnxruntime"; exit 0
fi
command -v apt-get >/dev/null && command -v dpkg >/dev/null || {
    echo "error: fetching the ONNX Runtime headers needs apt-get and dpkg (a Debian or Ubuntu machine);" \
         "elsewhere set LOOPCAST_ORT_INCLUDE to a folder holding onnxruntime_cxx_api.h" >&2
    exit 2
}
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "fetching libonnxruntime-dev (the ONNX Runtime headers) ..." >&2
if (cd "$work" && apt-get download -qq libonnxruntime-dev >/dev/null 2>&1); then
    :  # the machine's configured sources have it (their package lists are already current)
else
    # A private source list and private package lists: the system's apt state stays as it is.
    # The mirror is the one the machine's sources use (a Debian machine's own), else Debian's.
    mirror="$(grep -rhoE '^(deb|URIs:) +(\[[^]]*\] +)?https?://[^ ]+/debian/?' /etc/apt/sources.list \
              /etc/apt/sources.list.d 2>/dev/null | grep -oE 'https?://[^ ]+' | head -n1 || true)"
    mirror="${mirror:-http://deb.debian.org/debian}"
    echo "  not in this machine's apt sources: taking Debian trixie's from ${mirror%/}" >&2
    mkdir -p "$work/lists/partial"
    echo "deb ${mirror%/} trixie main" > "$work/sources.list"
    opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
          -o "Dir::State::Lists=$work/lists" -o APT::Sandbox::User="$(id -un)")
    apt-get "${opts[@]}" update -qq
    (cd "$work" && apt-get "${opts[@]}" download libonnxruntime-dev >/dev/null)
fi
mkdir -p "$deps"
dpkg -x "$work"/libonnxruntime-dev_*.deb "$deps"
echo "$deps/usr/include/onnxruntime"
