# Sourced by tests/run.sh and bench/run.sh (as root): what running nsbox as
# the unprivileged test users needs.
#
# The test users cannot use a Python that lives under /root (pyenv), nor
# read a checkout there, so what they run is staged in $stage: a venv built
# from the system Python with nsbox installed, and copies of what they run.
#   stage_nsbox REPO STAGE PYTHON PATHS...  venv + nsbox, PATHS copied to STAGE/src
#   ensure_test_users                       nsbox-sub (a subuid range), nsbox-single (none)
#   as_user USER CMD...                     CMD as USER, in a clean environment

stage_nsbox() {
    local repo=$1 stage=$2 syspy=$3
    shift 3
    mkdir -p "$stage"
    chmod 755 "$stage"
    if [[ ! -x $stage/venv/bin/python ]]; then
        "$syspy" -m venv "$stage/venv"
    fi
    # nsbox is built from a copy of the checkout without its build outputs:
    # setuptools reuses a build/ that an earlier `pip install .` left, so
    # modules since moved or deleted would be installed again beside the new.
    rm -rf "$stage/pkg"
    mkdir -p "$stage/pkg"
    tar -C "$repo" --exclude=./build --exclude=./dist --exclude=./.git --exclude='./*.egg-info' \
        --exclude=./rootfs/build --exclude=./.venv --exclude='__pycache__' -cf - . | tar -C "$stage/pkg" -xf -
    "$stage/venv/bin/python" -m pip install -q --upgrade pip
    "$stage/venv/bin/python" -m pip install -q "$stage/pkg[inspect,test]"
    # Always rebuild nsbox itself: the checkout may have changed since.
    "$stage/venv/bin/python" -m pip install -q --force-reinstall --no-deps "$stage/pkg"
    rm -rf "$stage/src"
    mkdir -p "$stage/src"
    (cd "$repo" && cp -r --parents "$@" "$stage/src/")
    chmod -R a+rX "$stage"
}

ensure_test_users() {
    local u f
    for u in nsbox-sub nsbox-single; do
        id "$u" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$u"
    done
    for f in /etc/subuid /etc/subgid; do
        touch "$f"
        sed -i '/^nsbox-single:/d' "$f"  # useradd may have given it one
        grep -q '^nsbox-sub:' "$f" || echo "nsbox-sub:200000:65536" >>"$f"
    done
    command -v newuidmap >/dev/null || { echo "newuidmap is missing: apt-get install uidmap" >&2; return 1; }
}

# Extra environment variables may come first, as NAME=VALUE words.
as_user() {
    local user=$1
    shift
    local cmd=(env -i LANG=C.UTF-8 PATH=/usr/local/bin:/usr/bin:/bin HOME="$(getent passwd "$user" | cut -d: -f6)" "$@")
    if [[ $user != root ]]; then
        cmd=(runuser -u "$user" -- "${cmd[@]}")
    fi
    "${cmd[@]}"
}
