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
# What they run is staged in $NSBOX_TEST_STAGE (default /var/tmp/nsbox-test;
# see tests/stage.sh): a venv with nsbox installed, a copy of tests/, and
# the fixture tarballs. Not as root, the suite runs once, as the current user.
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
source tests/stage.sh
say "staging the suite in $stage (python: $syspy)"
# csrc: the spec parser is fuzzed under sanitizers
stage_nsbox "$repo" "$stage" "$syspy" tests pyproject.toml csrc
rm -rf "$stage/fixtures"
mkdir -p "$stage/fixtures"
cp rootfs/build/*.tar "$stage/fixtures/"
chmod -R a+rX "$stage/fixtures"

say "test users"
ensure_test_users

declare -A result
run_mode() {
    local mode=$1 user=$2
    shift 2
    say "identity mode '$mode' (user $user)"
    if (cd "$stage/src" && as_user "$user" NSBOX_TEST_FIXTURES="$stage/fixtures" NSBOX_TEST_EXPECT_MODE="$mode" \
            "$stage/venv/bin/python" -m pytest -p no:cacheprovider "$@"); then
        result[$mode]=passed
    else
        result[$mode]=FAILED
    fi
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
