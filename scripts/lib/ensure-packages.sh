# shellcheck shell=bash
# Sourced by the scripts in scripts/ and by .ci/run; not meant to be executed.
#
#   source scripts/lib/ensure-packages.sh
#   attn_ensure_packages cmake g++ make libeigen3-dev
#
# Installs the Debian packages that are not installed yet. As root it runs
# apt-get itself; otherwise it prints the exact command to run and exits 1.
# On a system without dpkg it only warns and lets the build report what is
# missing.

attn_missing_packages() {
  local pkg status
  for pkg in "$@"; do
    status="$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)"
    if [[ "$status" != "install ok installed" ]]; then
      printf '%s\n' "$pkg"
    fi
  done
}

attn_ensure_packages() {
  if (($# == 0)); then
    return 0
  fi
  if ! command -v dpkg-query >/dev/null 2>&1; then
    echo "attn: dpkg-query not found: not a Debian system, cannot check for: $*" >&2
    echo "attn: install the equivalents of these packages yourself if the build fails." >&2
    return 0
  fi

  local missing=()
  mapfile -t missing < <(attn_missing_packages "$@")
  if ((${#missing[@]} == 0)); then
    return 0
  fi

  if [[ "$(id -u)" -ne 0 ]]; then
    echo "attn: missing Debian packages: ${missing[*]}" >&2
    echo "attn: install them with:" >&2
    echo "  sudo apt-get update && sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
    exit 1
  fi

  echo "attn: installing missing Debian packages: ${missing[*]}"
  local attempt
  for attempt in 1 2 3; do
    if apt-get update -q &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"; then
      return 0
    fi
    echo "attn: apt-get failed (attempt ${attempt}/3)" >&2
    sleep $((attempt * 5))
  done
  echo "attn: could not install: ${missing[*]}" >&2
  exit 1
}
