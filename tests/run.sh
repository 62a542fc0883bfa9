#!/bin/bash
# Runs the test suite in every identity mode this machine offers.
#
# nsbox has three identity modes (see nsbox/idmap.py): real root, an
# unprivileged user with a subordinate id range, and an unprivileged user
# with only its own uid. As root, this script tests all three, each with a
# real user of that kind:
#   root          this process
#   nsbox-sub     created here, with an /etc/subuid and /etc/subgid range
#   nsbox-single  created here, with no range
# The unprivileged users cannot use a Python that lives under /root (pyenv),
# nor read a checkout there, so everything they run is staged in
# $NSBOX_TEST_STAGE (default /var/tmp/nsbox-test): a venv built from the
# system Python with nsbox installed, a copy of tests/, and the fixture
# tarballs. Not as root, the suite runs once, as the current user.
#
# Arguments are passed to pytest.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
python=${PYTHON:-python3}
say() { printf '\n== %s\n' "$*"; }

say "fixture root filesystems"
rootfs/busybox.sh
rootfs/debian.sh

if [[ $(id -u) -ne 0 ]]; then
    say "running as $(id -un), not root: testing this user's identity mode only"
    "$python" -m pip install -q -e ".[inspect,test]"
    NSBOX_TEST_FIXTURES="$repo/rootfs/build" exec "$python" -m pytest "$@"
fi

stage=${NSBOX_TEST_STAGE:-/var/tmp/nsbox-test}
syspy=${NSBOX_TEST_PYTHON:-/usr/bin/python3}
say "staging the suite in $stage (python: $syspy)"
mkdir -p "$stage"
chmod 755 "$stage"
if [[ ! -x $stage/venv/bin/python ]]; then
    "$syspy" -m venv "$stage/venv"
fi
"$stage/venv/bin/python" -m pip install -q --upgrade pip
"$stage/venv/bin/python" -m pip install -q "$repo[inspect,test]"
# Always rebuild nsbox itself: the checkout may have changed since.
"$stage/venv/bin/python" -m pip install -q --force-reinstall --no-deps "$repo"
rm -rf "$stage/src" "$stage/fixtures"
mkdir -p "$stage/src" "$stage/fixtures"
cp -r tests pyproject.toml csrc "$stage/src/"  # csrc: the spec parser is fuzzed under sanitizers
cp rootfs/build/*.tar "$stage/fixtures/"
chmod -R a+rX "$stage"

say "test users"
ensure_user() { id "$1" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$1"; }
ensure_user nsbox-sub
ensure_user nsbox-single
for f in /etc/subuid /etc/subgid; do
    touch "$f"
    sed -i '/^nsbox-single:/d' "$f"  # useradd may have given it one
    grep -q '^nsbox-sub:' "$f" || echo "nsbox-sub:200000:65536" >>"$f"
done
command -v newuidmap >/dev/null || { echo "newuidmap is missing: apt-get install uidmap" >&2; exit 1; }

declare -A result
run_mode() {
    local mode=$1 user=$2
    shift 2
    say "identity mode '$mode' (user $user)"
    local env=(NSBOX_TEST_FIXTURES="$stage/fixtures" NSBOX_TEST_EXPECT_MODE="$mode" LANG=C.UTF-8
               PATH=/usr/local/bin:/usr/bin:/bin)
    local cmd=(env -i "${env[@]}" HOME="$(getent passwd "$user" | cut -d: -f6)"
               "$stage/venv/bin/python" -m pytest -p no:cacheprovider "$@")
    if [[ $user != root ]]; then
        cmd=(runuser -u "$user" -- "${cmd[@]}")
    fi
    if (cd "$stage/src" && "${cmd[@]}"); then result[$mode]=passed; else result[$mode]=FAILED; fi
}
run_mode root root "$@"
run_mode subuid nsbox-sub "$@"
run_mode single nsbox-single "$@"

say "summary"
status=0
for mode in root subuid single; do
    printf '  %-7s %s\n' "$mode" "${result[$mode]}"
    [[ ${result[$mode]} == passed ]] || status=1
done
exit $status
