#!/bin/sh
# The Debian packages the tests need, installed when missing: the MQTT broker (mosquitto) and its
# password tool (mosquitto_passwd, in the same package), the headless browser the web console's
# tests drive (chromium, through Playwright's Python package: no browser is downloaded), and
# PostgreSQL's server binaries (initdb, postgres: the store's tests start a throwaway cluster). Idempotent: nothing runs when all are there.
# Uses apt-get where this machine has it and we may use it (root, or sudo without a password);
# otherwise stops with the exact command to run.
set -eu

missing=""
# Debian keeps PostgreSQL's server binaries off PATH, under /usr/lib/postgresql/VERSION/bin.
have() {
  command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/usr/local/sbin/$1" ] ||
    ls /usr/lib/postgresql/*/bin/"$1" >/dev/null 2>&1
}
# binary:package
PAIRS="mosquitto:mosquitto mosquitto_passwd:mosquitto chromium:chromium initdb:postgresql"
for pair in $PAIRS; do
  bin=${pair%%:*}; pkg=${pair#*:}
  if ! have "$bin"; then
    case " $missing " in *" $pkg "*) ;; *) missing="$missing $pkg" ;; esac
  fi
done
[ -z "$missing" ] && exit 0

cmd="apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq$missing"
if ! command -v apt-get >/dev/null 2>&1; then
  echo "make install: the tests need these system packages:$missing; this machine has no apt-get:" >&2
  echo "install them with its package manager, then run make again." >&2
  exit 1
fi
if [ "$(id -u)" = 0 ]; then
  sudo=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  sudo="sudo"
else
  echo "make install: the tests need system packages:$missing. Run, as root:" >&2
  echo "  $cmd" >&2
  exit 1
fi
echo "installing system packages:$missing (apt-get)"
$sudo sh -c "$cmd" >/dev/null
for pair in $PAIRS; do
  bin=${pair%%:*}
  have "$bin" || { echo "make install: apt-get ran but '$bin' is still missing" >&2; exit 1; }
done
