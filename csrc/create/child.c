/*
 * child.c - the child the zygote clones: it arranges its descriptors,
 * waits for the host's go byte, runs the setup steps, locks the mounts and
 * execs the init (see main.c for the order).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <linux/sched.h>
#include <net/if.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <linux/magic.h>
#include <stdbool.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "create/zygote.h"
#include "common/fdpass.h"

/* Older C libraries lack the new mount API; the kernel has had it since 5.2
 * (mount_setattr since 5.12). */
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef OPEN_TREE_CLOEXEC
#define OPEN_TREE_CLOEXEC O_CLOEXEC
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif
#ifndef MOVE_MOUNT_T_EMPTY_PATH
#define MOVE_MOUNT_T_EMPTY_PATH 0x00000040
#endif

struct nsbox_mount_attr {
    uint64_t attr_set;
    uint64_t attr_clr;
    uint64_t propagation;
    uint64_t userns_fd;
};

static void report(int fd, int step, int err)
{
    struct nsbox_setup_error e = {.step = step, .err = err};
    /* Best effort: the host treats a short report like a crash. */
    ssize_t r = write(fd, &e, sizeof e);
    (void)r;
}

/* Writes a sysctl of the sandbox's own namespaces. With `read_only_ok`, a
 * /proc/sys made read-only outside (a procfs bound from a container's)
 * leaves the kernel's default. */
static int write_sysctl(const char *path, const char *value, bool read_only_ok)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0)
        return read_only_ok && errno == EROFS ? 0 : -1;
    size_t len = strlen(value);
    int r = write(fd, value, len) == (ssize_t)len ? 0 : -1;
    int err = errno;
    close(fd);
    errno = err;
    return r;
}

/*
 * NSBOX_IN_ROOT: `path` (absolute, normal) resolved inside the root we
 * pivoted into, as an O_PATH descriptor (with `flags`: O_DIRECTORY, or
 * O_CREAT for a file). Symlinks resolve there (RESOLVE_IN_ROOT), /proc's
 * magic links are not followed (they lead to our descriptors, the host's
 * directories among them), and /proc and /sys are no place for a mount.
 */
static int in_root(const char *path, int flags, unsigned int mode)
{
    int root = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (root < 0)
        return -1;
    struct open_how how = {
        /* O_NONBLOCK: a FIFO there must not hold us (O_CREAT opens for reading). */
        .flags = (unsigned long long)(flags | O_CLOEXEC | ((flags & O_CREAT) ? O_RDONLY | O_NONBLOCK : O_PATH)),
        .mode = (flags & O_CREAT) ? mode : 0,
        .resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS,
    };
    int fd = (int)syscall(SYS_openat2, root, path, &how, sizeof how);
    int err = errno;
    close(root);
    struct statfs sf;
    if (fd >= 0 && fstatfs(fd, &sf) == 0 && (sf.f_type == PROC_SUPER_MAGIC || sf.f_type == SYSFS_MAGIC)) {
        close(fd);
        fd = -1;
        err = EACCES;
    }
    errno = err;
    return fd;
}

/* The target of an NSBOX_IN_ROOT mount: refused if it is the root itself
 * (a link to "/"), which a mount would cover, the rest of the setup with it. */
static int mount_target(const char *path, int flags)
{
    int fd = in_root(path, flags, 0);
    struct stat st, root;
    if (fd >= 0 && fstat(fd, &st) == 0 && stat("/", &root) == 0 && st.st_dev == root.st_dev &&
        st.st_ino == root.st_ino) {
        close(fd);
        errno = EBUSY;
        return -1;
    }
    return fd;
}

/* mount(2) on the target an NSBOX_IN_ROOT step resolved. */
static int mount_in_root(const struct nsbox_step *s)
{
    int fd = mount_target(s->b, O_DIRECTORY);
    if (fd < 0)
        return -1;
    char target[64];
    snprintf(target, sizeof target, "/proc/self/fd/%d", fd);
    int r = mount(s->a, target, s->c, s->flags & ~(unsigned long)NSBOX_IN_ROOT, s->d);
    int err = errno;
    close(fd);
    errno = err;
    return r;
}

/* MKDIR with NSBOX_IN_ROOT: made in its parent as resolved in the root; what
 * the whole path leads to there must be a directory. */
static int mkdir_in_root(const struct nsbox_step *s)
{
    if (strcmp(s->b, "/") == 0)
        return 0; /* the root: there */
    const char *slash = strrchr(s->b, '/');
    if (!slash || !slash[1]) {
        errno = EINVAL;
        return -1;
    }
    char parent[4096];
    size_t len = slash == s->b ? 1 : (size_t)(slash - s->b);
    if (len >= sizeof parent) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(parent, s->b, len);
    parent[len] = 0;
    int dir = in_root(parent, O_DIRECTORY, 0);
    if (dir < 0)
        return -1;
    int r = 0;
    if (mkdirat(dir, slash + 1, s->mode) == 0) {
        /* One made here gets its mode whatever the umask, as below; through
         * a descriptor, not its name, which a sandbox sharing a volume could
         * have swapped for a link since. */
        int fd = openat(dir, slash + 1, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        r = fd < 0 || fchmod(fd, s->mode) < 0 ? -1 : 0;
        if (fd >= 0) {
            int err = errno;
            close(fd);
            errno = err;
        }
    } else if (errno != EEXIST) {
        r = -1;
    }
    int err = errno;
    close(dir);
    if (r < 0) {
        errno = err;
        return -1;
    }
    int fd = in_root(s->b, O_DIRECTORY, 0);
    if (fd < 0)
        return -1;
    close(fd);
    return 0;
}

static int run_step(const struct nsbox_step *s, int *slots)
{
    switch (s->kind) {
    case NSBOX_STEP_MOUNT:
        if (s->flags & NSBOX_IN_ROOT)
            return mount_in_root(s);
        return mount(s->a, s->b, s->c, s->flags, s->d);

    case NSBOX_STEP_TREE_CLONE: {
        if (s->slot < 0 || s->slot >= NSBOX_SLOTS) {
            errno = EINVAL;
            return -1;
        }
        unsigned int rec = (s->flags & AT_RECURSIVE) ? AT_RECURSIVE : 0;
        int fd;
        if (s->flags & NSBOX_TREE_NO_SYMLINKS) {
            struct open_how how = {.flags = O_PATH | O_CLOEXEC, .resolve = RESOLVE_NO_SYMLINKS};
            int src = (int)syscall(SYS_openat2, AT_FDCWD, s->a, &how, sizeof how);
            if (src < 0)
                return -1;
            fd = (int)syscall(SYS_open_tree, src, "", OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_EMPTY_PATH | rec);
            int err = errno;
            close(src);
            errno = err;
        } else {
            fd = (int)syscall(SYS_open_tree, AT_FDCWD, s->a, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | rec);
        }
        if (fd < 0)
            return -1;
        if (s->attr_set || s->attr_clr) {
            struct nsbox_mount_attr attr = {.attr_set = s->attr_set, .attr_clr = s->attr_clr};
            if (syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH | rec, &attr, sizeof attr) < 0)
                return -1;
        }
        slots[s->slot] = fd;
        return 0;
    }

    case NSBOX_STEP_TREE_ATTACH:
        if (s->slot < 0 || s->slot >= NSBOX_SLOTS || slots[s->slot] < 0) {
            errno = EBADF;
            return -1;
        }
        if (s->flags & NSBOX_IN_ROOT) {
            int fd = mount_target(s->b, 0);
            if (fd < 0)
                return -1;
            long r = syscall(SYS_move_mount, slots[s->slot], "", fd, "",
                             MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH);
            int err = errno;
            close(fd);
            errno = err;
            if (r < 0)
                return -1;
        } else if (syscall(SYS_move_mount, slots[s->slot], "", AT_FDCWD, s->b, MOVE_MOUNT_F_EMPTY_PATH) < 0) {
            return -1;
        }
        close(slots[s->slot]);
        slots[s->slot] = -1;
        return 0;

    case NSBOX_STEP_MKDIR: {
        if (s->flags & NSBOX_IN_ROOT)
            return mkdir_in_root(s);
        int made = mkdir(s->b, s->mode) == 0;
        if (!made && errno != EEXIST)
            return -1;
        /* It must be a directory and not a symlink: a mount on it would
         * follow the link, and before the pivot that leads to the host. */
        struct stat st;
        if (lstat(s->b, &st) < 0)
            return -1;
        if (!S_ISDIR(st.st_mode)) {
            errno = ENOTDIR;
            return -1;
        }
        /* One made here gets its mode whatever the umask (a shared /tmp
         * must be 1777); one that was there keeps its own. */
        if (made && (st.st_mode & 07777) != s->mode && chmod(s->b, s->mode) < 0)
            return -1;
        return 0;
    }

    case NSBOX_STEP_MKFILE: {
        /* Read-only: a file that exists is only a mount point, so neither
         * copied up from an overlay's lower layer nor needs to be ours to
         * write (the host's /etc/resolv.conf, under a read-only root). */
        int fd = (s->flags & NSBOX_IN_ROOT)
                     ? in_root(s->b, O_CREAT, s->mode)
                     : open(s->b, O_RDONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, s->mode);
        if (fd < 0)
            return -1;
        close(fd);
        return 0;
    }

    case NSBOX_STEP_SYMLINK:
        if (symlink(s->a, s->b) == 0)
            return 0;
        if (errno != EEXIST || unlink(s->b) < 0)
            return -1;
        return symlink(s->a, s->b);

    case NSBOX_STEP_PIVOT:
        /* pivot_root(".", ".") stacks the old root under the new one; the
         * detach then leaves no path back to the host's filesystem. */
        if (chdir(s->b) < 0 || syscall(SYS_pivot_root, ".", ".") < 0)
            return -1;
        if (umount2(".", MNT_DETACH) < 0)
            return -1;
        /* The host directories of PATH_FD steps are named by host-side
         * steps only (the new root among them, above): from here on a path
         * is the sandbox's, and /proc/self/fd/N through a symlink swapped
         * into a bound host directory would reach a host directory (a
         * shared image layer) from an INSIDE step. None stays open. */
        if (syscall(SYS_close_range, NSBOX_PATH_FD_BASE, NSBOX_PATH_FD_BASE + NSBOX_PATH_FDS - 1, 0) < 0)
            return -1;
        return chdir("/");

    case NSBOX_STEP_HOSTNAME:
        if (!s->a) {
            errno = EINVAL;
            return -1;
        }
        return sethostname(s->a, strlen(s->a));

    case NSBOX_STEP_LOOPBACK_UP: {
        int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        if (fd < 0)
            return -1;
        struct ifreq ifr;
        memset(&ifr, 0, sizeof ifr);
        strcpy(ifr.ifr_name, "lo");
        int r = ioctl(fd, SIOCGIFFLAGS, &ifr);
        if (r == 0) {
            ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
            r = ioctl(fd, SIOCSIFFLAGS, &ifr);
        }
        int err = errno;
        close(fd);
        errno = err;
        if (r < 0 || !s->a)
            return r;
        /* Every user may bind any port, as in Docker: the namespace is the
         * sandbox's alone. Only its owner (us, root of the user namespace
         * that owns it) may say so; sandbox processes live in a nested
         * user namespace. */
        r = write_sysctl(s->a, "0", true);
        /* And, as Docker sets it, every group may send ICMP echo without a
         * raw socket (ping): net.ipv4.ping_group_range, b, set to c. */
        if (r == 0 && s->b && s->c)
            r = write_sysctl(s->b, s->c, true);
        return r;
    }

    case NSBOX_STEP_REMOUNT:
        return mount(NULL, s->b, NULL, MS_REMOUNT | s->flags, NULL);

    case NSBOX_STEP_PATH_FD: {
        if (s->slot < 0 || s->slot >= NSBOX_PATH_FDS) {
            errno = EINVAL;
            return -1;
        }
        int fd = open(s->a, O_PATH | O_CLOEXEC);
        if (fd < 0)
            return -1;
        int r = dup3(fd, NSBOX_PATH_FD_BASE + s->slot, O_CLOEXEC);
        int err = errno;
        close(fd);
        errno = err;
        return r < 0 ? -1 : 0;
    }

    case NSBOX_STEP_SYSCTL:
        /* A limit of this user namespace (/proc/sys/user/ names the
         * writer's own): the commands, in a nested one, cannot raise it. */
        return write_sysctl(s->a, s->b, false);

    case NSBOX_STEP_BECOME_ROOT:
        /* Until now the child kept its creator's credentials (see
         * Plan.host_dir in nsbox/plan/plan.py): host paths were looked up
         * as the invoking user. From here on every id (real, saved, filesystem) is the
         * namespace's root, so what we create belongs to sandbox root. */
        if (setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0)
            return -1;
        /* Changing ids made us non-dumpable, which hands our /proc files
         * (the id maps of the namespaces we create next among them) to host
         * root. We run no other program yet: nothing to protect. */
        return prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);
    }
    errno = EINVAL;
    return -1;
}

/*
 * Puts keep_fds at 3, 4, ... (a -1 entry leaves that number closed), then
 * the error pipe, the program and the sync pipe just above them (all three
 * close-on-exec), points stdin/out/err at /dev/null unless told otherwise,
 * and closes every other descriptor inherited from the host. Updates the
 * three pointers to the new numbers; *error_fd is valid even on failure.
 */
static int arrange_fds(const struct nsbox_clone_request *req, int *error_fd, int *exec_fd, int *sync_fd)
{
    if (req->nkeep < 0 || req->nkeep > 4) {
        errno = EINVAL;
        return -1;
    }
    /* First copy everything we keep above any number we are about to
     * assign; the error pipe first, so that a failure can still be
     * reported once its old number has been reused. */
    int err_hi = fcntl(*error_fd, F_DUPFD_CLOEXEC, 100);
    if (err_hi < 0)
        return -1;
    *error_fd = err_hi;
    int high[4];
    for (int i = 0; i < req->nkeep; i++) {
        high[i] = -1;
        if (req->keep_fds[i] >= 0 && (high[i] = fcntl(req->keep_fds[i], F_DUPFD_CLOEXEC, 100)) < 0)
            return -1;
    }
    int sync_hi = fcntl(*sync_fd, F_DUPFD_CLOEXEC, 100);
    int exe_hi = *exec_fd >= 0 ? fcntl(*exec_fd, F_DUPFD_CLOEXEC, 100) : -1;
    if (sync_hi < 0 || (*exec_fd >= 0 && exe_hi < 0))
        return -1;
    for (int i = 0; i < req->nkeep; i++) {
        if (high[i] >= 0 && dup2(high[i], 3 + i) < 0) /* the copy loses O_CLOEXEC */
            return -1;
        if (high[i] < 0)
            close(3 + i);
    }
    int base = 3 + req->nkeep;
    if (dup3(err_hi, base, O_CLOEXEC) < 0)
        return -1;
    *error_fd = base;
    if (dup3(sync_hi, base + 2, O_CLOEXEC) < 0)
        return -1;
    *sync_fd = base + 2;
    if (exe_hi >= 0) {
        if (dup3(exe_hi, base + 1, O_CLOEXEC) < 0)
            return -1;
        *exec_fd = base + 1;
    } else {
        close(base + 1); /* whatever it was (close_range below starts above it) */
    }
    if (!req->keep_stdio) {
        /* Not close-on-exec: should it land on one of 0-2, it stays there. */
        int null = open("/dev/null", O_RDWR);
        if (null < 0)
            return -1;
        for (int i = 0; i < 3; i++) {
            if (null != i && dup2(null, i) < 0)
                return -1;
        }
        /* It may have taken a keep position left empty: that one stays closed. */
        if (null > 2)
            close(null);
    }
    return (int)syscall(SYS_close_range, base + 3, ~0U, 0);
}

void __attribute__((noreturn)) child(const struct nsbox_clone_request *req)
{
    /* Nothing may interrupt the setup; the mask is cleared before exec. */
    sigset_t all;
    sigfillset(&all);
    if (sigprocmask(SIG_SETMASK, &all, NULL) < 0) {
        report(req->error_fd, NSBOX_SETUP_SIGNALS, errno);
        _exit(1);
    }

    /* Drop every host descriptor we were not given before anything else:
     * a stray copy of the sync pipe's write end would keep us waiting
     * forever if the host died. */
    int error_fd = req->error_fd, exec_fd = req->exec_fd, sync_fd = req->sync_fd;
    if (arrange_fds(req, &error_fd, &exec_fd, &sync_fd) < 0) {
        report(error_fd, NSBOX_SETUP_FDS, errno);
        _exit(1);
    }
    /* One go, or two: the zygote's and the host's (host_go). */
    for (int gos = 1 + (req->go_fd >= 0 && req->host_go); gos > 0; gos--) {
        char go;
        if (read(sync_fd, &go, 1) != 1) {
            report(error_fd, NSBOX_SETUP_SYNC, errno ? errno : EPIPE);
            _exit(1);
        }
    }
    close(sync_fd);
    /* The program leads a session and process group of its own. */
    if (req->new_session && setsid() < 0) {
        report(error_fd, NSBOX_SETUP_SESSION, errno);
        _exit(1);
    }

    int slots[NSBOX_SLOTS];
    for (int i = 0; i < NSBOX_SLOTS; i++)
        slots[i] = -1;
    for (int i = 0; i < req->nsteps; i++) {
        if (run_step(&req->steps[i], slots) < 0) {
            report(error_fd, i, errno);
            _exit(1);
        }
    }
    for (int i = 0; i < NSBOX_SLOTS; i++) {
        if (slots[i] >= 0)
            close(slots[i]);
    }
    /* The host directories the steps used: nothing of the host stays open. */
    if (syscall(SYS_close_range, NSBOX_PATH_FD_BASE, NSBOX_PATH_FD_BASE + NSBOX_PATH_FDS - 1, 0) < 0) {
        report(error_fd, NSBOX_SETUP_FDS, errno);
        _exit(1);
    }
    if (req->lock_uid_map) {
        /* nsbox_clone_request_unpack checked this; the dup2s below must not land
         * anywhere else (nor on our error pipe just above the keeps). */
        if (!req->lock_gid_map || req->lock_slot < 0 || req->lock_slot + 1 >= req->nkeep) {
            report(error_fd, NSBOX_SETUP_LOCK, EINVAL);
            _exit(1);
        }
        int userns, mntns, at = 3 + req->lock_slot;
        /* open() may have handed out the very numbers we are to fill: move
         * both out of the way before placing them. */
        if (make_locked_namespaces(req->lock_uid_map, req->lock_gid_map, &userns, &mntns) < 0 ||
            (userns = fcntl(userns, F_DUPFD_CLOEXEC, 100)) < 0 || (mntns = fcntl(mntns, F_DUPFD_CLOEXEC, 100)) < 0 ||
            dup2(userns, at) < 0 || dup2(mntns, at + 1) < 0) {
            report(error_fd, NSBOX_SETUP_LOCK, errno);
            _exit(1);
        }
        close(userns);
        close(mntns);
    }

    sigemptyset(&all);
    if (sigprocmask(SIG_SETMASK, &all, NULL) < 0) {
        report(error_fd, NSBOX_SETUP_SIGNALS, errno);
        _exit(1);
    }
    if (exec_fd >= 0)
        syscall(SYS_execveat, exec_fd, "", req->argv, req->envp, AT_EMPTY_PATH);
    else
        execvpe(req->argv[0], req->argv, req->envp);
    report(error_fd, NSBOX_SETUP_EXEC, errno);
    _exit(127);
}
