#!/usr/bin/env bash
# Installs the Debian packages mokd builds and tests against (with --fuzz, also
# what make fuzz needs). Idempotent: it asks dpkg first and only calls apt-get
# for what is missing (through sudo when not root).
# libopenblas0-pthread gives numpy (the CPU benchmark baseline) a real BLAS.
# curl scrapes the metrics listener in the tests; python3-yaml and shellcheck
# check deploy/k8s and deploy/slurm.
set -euo pipefail

pkgs=(libuv1-dev libprotobuf-c-dev protobuf-c-compiler check pkg-config
      libsystemd-dev libinih-dev python3-numpy libopenblas0-pthread
      curl python3-yaml shellcheck)
# --fuzz: also clang and its runtimes (libFuzzer, ASan, UBSan) for make fuzz
if [ "${1:-}" = "--fuzz" ]; then
  pkgs+=(clang libclang-rt-dev)
elif [ $# -gt 0 ]; then
  echo "usage: install-deps.sh [--fuzz]" >&2
  exit 2
fi

missing=()
for p in "${pkgs[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all packages present"
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-deps: missing ${missing[*]} and no apt-get here; install them by hand" >&2
  exit 1
fi

sudo=()
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "install-deps: missing ${missing[*]}; run as root or install sudo" >&2
    exit 1
  fi
  sudo=(sudo)
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
