#!/usr/bin/env bash
# System packages the test tiers use. Installs only what is missing, so it is quick to rerun.
set -euo pipefail
need=()
command -v tmux >/dev/null || need+=(tmux)
command -v chromium >/dev/null || need+=(chromium)  # web/browser-v0 tests (Playwright drives the system Chromium)
command -v bwrap >/dev/null || need+=(bubblewrap)  # sandboxes: the local backend's namespaces
ldconfig -p 2>/dev/null | grep -q "libseccomp\.so\.2" || need+=(libseccomp2)  # sandboxes: the local seccomp filter (pyseccomp loads it)
command -v dockerd >/dev/null || [ -x /usr/sbin/dockerd ] || need+=(docker.io)  # sandboxes: docker tests start their own dockerd
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing system packages: ${need[*]} (install them, e.g. sudo apt-get install -y ${need[*]})" >&2
    exit 0
  fi
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
