#!/usr/bin/env bash
# install_consumer_test.sh CMAKE BUILD_DIR SOURCE_DIR GENERATOR CXX [LAUNCHER]
#
# Installs BUILD_DIR's Development component (client library, headers, CMake package; no
# binaries, so that only the libraries need to be built) into a fresh prefix, then configures,
# builds and runs tests/install/consumer against it with find_package(kvpool CONFIG REQUIRED).
# Work happens in BUILD_DIR/install-test (a fixed path: ccache hits on the next run).
set -euo pipefail
cmake=$1 build=$2 src=$3 generator=$4 cxx=$5 launcher=${6:-}
work=$build/install-test
rm -rf "$work"
mkdir -p "$work"
prefix=$work/prefix

"$cmake" --install "$build" --prefix "$prefix" --component Development >"$work/install.log"
for f in lib/cmake/kvpool/kvpoolConfig.cmake lib/cmake/kvpool/kvpoolConfigVersion.cmake \
         lib/cmake/kvpool/kvpoolTargets.cmake lib/libkvpool_client.a \
         include/kvpool/client/client.h include/kvpool/common/keys.h \
         include/kvpool/transport/transport.h include/kvpool/kernels/block_format.h \
         share/kvpool/proto/kvpool/v1/pool.proto; do
  [[ -f $prefix/$f ]] || { echo "install_consumer_test: $prefix/$f was not installed" >&2; exit 1; }
done
# Nothing of the build or source tree may leak into the installed package.
if grep -rlF -e "$build" -e "$src/" "$prefix/lib/cmake/kvpool"; then
  echo "install_consumer_test: the package files above name the build or source tree" >&2
  exit 1
fi

args=(-S "$src/tests/install/consumer" -B "$work/build" -G "$generator"
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CXX_COMPILER="$cxx")
[[ -n $launcher ]] && args+=(-DCMAKE_CXX_COMPILER_LAUNCHER="$launcher")
"$cmake" "${args[@]}" >"$work/configure.log" || { cat "$work/configure.log" >&2; exit 1; }
"$cmake" --build "$work/build" >"$work/build.log" || { cat "$work/build.log" >&2; exit 1; }
"$work/build/kvpool_consumer"
