#!/usr/bin/env bash
# The code sandbox's system tool (reflow/envs/isolation.py): bubblewrap. Installs it where this machine allows
# (root with apt-get or dnf); elsewhere says how, and exits 0 either way: only tasks that run model-written code
# need it, and they refuse to start without it, naming what is missing.
set -u
if command -v bwrap >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  { apt-get install -y -q bubblewrap || { apt-get update -q && apt-get install -y -q bubblewrap; }; } >/dev/null 2>&1
elif [ "$(id -u)" = 0 ] && command -v dnf >/dev/null 2>&1; then
  dnf install -y -q bubblewrap >/dev/null 2>&1
fi
if command -v bwrap >/dev/null 2>&1; then
  echo "installed bubblewrap $(bwrap --version 2>/dev/null) for the code sandbox"
else
  echo "note: bubblewrap is not installed (the code sandbox needs it for the retool and coding_agent tasks):" \
       "apt-get install bubblewrap (Debian/Ubuntu) or dnf install bubblewrap (Fedora/RHEL)" >&2
fi
exit 0
