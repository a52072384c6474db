#!/usr/bin/env bash
# Install the system tools the test suite and benchmarks need for a local Apache Kafka
# (libs/common/src/ragstream/local_kafka.py): a Java >= 17 runtime and Maven, on Debian 12.
# Idempotent: installs only what is missing and says what it did.
set -euo pipefail

java_major() {  # 0 when java is missing; "1" for a 1.8-style version string
  if ! command -v java >/dev/null 2>&1; then echo 0; return; fi
  java -version 2>&1 | sed -n 's/.* version "\([0-9]*\).*/\1/p' | head -n 1
}

packages=()
major="$(java_major)"
if [ "${major:-0}" -ge 17 ]; then
  echo "java: found $(command -v java) (major version ${major})"
else
  if [ "${major:-0}" -eq 0 ]; then echo "java: missing"; else echo "java: version ${major} < 17"; fi
  echo "  -> installing openjdk-17-jre-headless"
  packages+=(openjdk-17-jre-headless)
fi
if command -v mvn >/dev/null 2>&1; then
  echo "mvn: found $(command -v mvn)"
else
  echo "mvn: missing"
  echo "  -> installing maven"
  packages+=(maven)
fi

if [ "${#packages[@]}" -eq 0 ]; then
  echo "nothing to install"
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
# The JRE's postinst links its man page there; slim Debian images lack the folder.
$sudo mkdir -p /usr/share/man/man1
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update
$sudo apt-get install -y --no-install-recommends "${packages[@]}"
echo "installed: ${packages[*]}"

if [ "$(java_major)" -lt 17 ]; then
  echo "error: 'java' on PATH is still not >= 17 (see: update-alternatives --config java)" >&2
  exit 1
fi
