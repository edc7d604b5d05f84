#!/bin/sh
# Build llama.cpp (the peer for `python -m bench.decode --peer llama.cpp`) from the source vendored
# in the llama-cpp-python sdist on PyPI, pinned by version and SHA-256. Nothing else is downloaded:
# the web UI, TLS and tests are switched off. The build lives in the user cache, next to the model
# cache (see engine/user_cache.py: cache_dir), and a stamp makes a second run instant.
#
#   sh bench/peer/build.sh            # PEER_PYTHON=python3 by default (only used for `pip download`)
#   PEER_ISA=avx2 sh bench/peer/build.sh   # an AVX2-only build in build-avx2/ (no AVX-512), to compare
#                                           # with the kernels' AVX2 path on an AVX-512 machine
#
# Environment: SEQUOIA_CACHE / XDG_CACHE_HOME (where), PEER_PYTHON (which pip), PEER_JOBS (2),
# PEER_ISA (native, or avx2).
set -eu

VERSION=0.3.36
SDIST=llama_cpp_python-$VERSION.tar.gz
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
TARGETS="llama-server llama-speculative llama-bench llama-quantize"
# GGML_NATIVE=ON, but without Intel AMX: this version's AMX matmul (ggml_backend_amx_mul_mat) dies with
# SIGILL at its first tile instruction in a server's worker threads on a Sapphire Rapids VM (tile data
# permission is requested on the main thread only; ggml-org/llama.cpp pull request 26954). GCC's
# explicit -mno-* flags win over -march=native whatever their order. Part of the stamp, so changing
# the recipe rebuilds.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
ISA=${PEER_ISA:-native}
case "$ISA" in
    native) BUILD=build; STAMP_NAME=.built
            ISA_FLAGS="-DGGML_NATIVE=ON" ;;
    avx2)   BUILD=build-avx2; STAMP_NAME=.built-avx2
            ISA_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF" ;;
    *) echo "peer: PEER_ISA must be native or avx2, not $ISA" >&2; exit 2 ;;
esac
RECIPE="$SHA256 $ISA-no-amx"

if [ -n "${SEQUOIA_CACHE:-}" ]; then ROOT=$SEQUOIA_CACHE; else ROOT=${XDG_CACHE_HOME:-$HOME/.cache}/sequoia-chat; fi
DIR=$ROOT/peer/llama.cpp-$VERSION
STAMP=$DIR/$STAMP_NAME
PY=${PEER_PYTHON:-python3}
JOBS=${PEER_JOBS:-2}

all_built() {
    for t in $TARGETS; do [ -x "$DIR/$BUILD/bin/$t" ] || return 1; done
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$RECIPE" ] && all_built; then
    echo "llama.cpp peer already built: $DIR/$BUILD/bin"
    exit 0
fi

command -v cmake >/dev/null 2>&1 || {
    echo "peer: cmake is missing (apt-get install cmake, or pip install cmake)" >&2; exit 2; }

sha_of() { "$PY" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$1"; }

mkdir -p "$DIR/dl"
if [ ! -f "$DIR/dl/$SDIST" ] || [ "$(sha_of "$DIR/dl/$SDIST")" != "$SHA256" ]; then
    rm -f "$DIR/dl/$SDIST"
    echo "peer: downloading the llama-cpp-python $VERSION sdist from PyPI"
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR/dl"
fi
got=$(sha_of "$DIR/dl/$SDIST")
if [ "$got" != "$SHA256" ]; then
    echo "peer: $SDIST has SHA-256 $got, expected $SHA256; refusing to build it" >&2
    rm -f "$DIR/dl/$SDIST"
    exit 2
fi

if [ ! -f "$DIR/src/CMakeLists.txt" ]; then
    rm -rf "$DIR/src" "$DIR/src.tmp"
    mkdir -p "$DIR/src.tmp"
    tar xzf "$DIR/dl/$SDIST" -C "$DIR/src.tmp" --strip-components=3 "llama_cpp_python-$VERSION/vendor/llama.cpp"
    mv "$DIR/src.tmp" "$DIR/src"
fi

rm -f "$STAMP"
echo "peer: building $TARGETS with $JOBS jobs (15 to 25 minutes on 2 cores); log: $DIR/$BUILD.log"
# shellcheck disable=SC2086
nice -n 19 cmake -S "$DIR/src" -B "$DIR/$BUILD" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    $ISA_FLAGS \
    -DCMAKE_C_FLAGS="$NO_AMX" \
    -DCMAKE_CXX_FLAGS="$NO_AMX" \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_EXAMPLES=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_OPENSSL=OFF \
    >"$DIR/$BUILD.log" 2>&1 || { tail -n 30 "$DIR/$BUILD.log" >&2; exit 1; }
# shellcheck disable=SC2086
nice -n 19 cmake --build "$DIR/$BUILD" --config Release -j "$JOBS" --target $TARGETS \
    >>"$DIR/$BUILD.log" 2>&1 || { tail -n 30 "$DIR/$BUILD.log" >&2; exit 1; }

all_built || { echo "peer: build finished but binaries are missing in $DIR/$BUILD/bin" >&2; exit 1; }
echo "$RECIPE" >"$STAMP"
echo "llama.cpp peer built: $DIR/$BUILD/bin"
