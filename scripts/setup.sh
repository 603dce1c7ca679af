#!/usr/bin/env bash
# Idempotent set-up for a Debian 12 machine: installs only the Debian packages that are
# missing, then creates the Python tooling environment inside the build tree.
# Usage: scripts/setup.sh [BUILD_DIR]
set -euo pipefail
build_dir="${1:-build}"

packages=(
  build-essential cmake ninja-build ccache pkg-config git python3 python3-venv python3-yaml
  libabsl-dev libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libucx-dev ucx-utils libssl-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libspdlog-dev libyaml-cpp-dev nlohmann-json3-dev libxxhash-dev libcpp-httplib-dev
  libeigen3-dev libcli11-dev prometheus
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "setup: installing missing Debian packages: ${missing[*]}" >&2
  sudo_cmd=()
  if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
  "${sudo_cmd[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends \
    "${missing[@]}"
  # The `prometheus` package is here for its promtool (the metrics tests); Debian also enables
  # and starts its server, which listens on 0.0.0.0:9090, kvpool-server's documented metrics
  # port (newcomer report 13). Stop and disable the server we installed; nothing else uses it.
  if [[ " ${missing[*]} " == *" prometheus "* && -d /run/systemd/system ]]; then
    echo "setup: disabling the prometheus server the package started (only promtool is used)" >&2
    "${sudo_cmd[@]}" systemctl disable --now prometheus.service >/dev/null 2>&1 || true
  fi
fi

# Python tooling (tests of the Python tools, the rotation-file converter): a venv in the
# build tree, with packages from PyPI only.
venv="${build_dir}/venv"
stamp="${venv}/.kvpool-requirements"
req="$(dirname "$0")/../python/requirements.txt"
if [[ ! -f "$stamp" ]] || ! cmp -s "$req" "$stamp"; then
  echo "setup: creating Python environment in ${venv}" >&2
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -r "$req"
  cp "$req" "$stamp"
fi
