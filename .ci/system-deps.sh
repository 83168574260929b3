#!/usr/bin/env bash
# System packages the test tiers use. Installs only what is missing, so it is quick to rerun.
# Exits non-zero when something is still missing afterwards: as root when apt cannot install it,
# and in CI (CI=true) also when not root. On a laptop without root it only warns (the tests that
# need a missing tool then skip with its name; in CI such a skip is a failure, see tests/conftest.py).
set -euo pipefail

missing() {
  local out=()
  command -v tmux >/dev/null || out+=(tmux)
  command -v chromium >/dev/null || out+=(chromium)  # web/browser-v0 tests (Playwright drives the system Chromium)
  command -v bwrap >/dev/null || out+=(bubblewrap)  # sandboxes: the local backend's namespaces
  ldconfig -p 2>/dev/null | grep -q "libseccomp\.so\.2" || out+=(libseccomp2)  # sandboxes: the local seccomp filter (pyseccomp loads it)
  command -v dockerd >/dev/null || [ -x /usr/sbin/dockerd ] || out+=(docker.io)  # sandboxes: docker tests start their own dockerd
  echo "${out[@]}"
}

case "${CI:-}" in 1|true|TRUE|True|yes) ci=1 ;; *) ci=0 ;; esac
read -r -a need <<< "$(missing)"
[ ${#need[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  echo "missing system packages: ${need[*]} (install them, e.g. sudo apt-get install -y ${need[*]})" >&2
  if [ "$ci" -eq 1 ]; then
    echo "CI=true: cannot install them without root, and CI needs every one of them: failing" >&2
    exit 1
  fi
  exit 0  # a laptop: the tests that need them skip and say so
fi

if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null; }; then
  echo "apt-get could not install: ${need[*]} (see apt's messages above; is the Debian mirror reachable?)" >&2
  exit 1
fi
ldconfig  # refresh the linker cache the libseccomp2 check reads (seen stale right after apt-get)
read -r -a still <<< "$(missing)"
if [ ${#still[@]} -gt 0 ]; then
  echo "still missing after apt-get install: ${still[*]} (is the package available in this distribution?)" >&2
  exit 1
fi
