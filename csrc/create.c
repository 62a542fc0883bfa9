/*
 * create.c - nsbox-create: clone a child into new namespaces, set up its root.
 *
 * A small static program that the Python process starts once and asks to
 * create each sandbox (the zygote, see create.h). It clones a child
 * straight into the new user, mount, PID, IPC, UTS, cgroup and network
 * namespaces, so the child is PID 1 of its namespace and, with
 * CLONE_PARENT, a child of the Python process.
 *
 * The child:
 *   1. moves the descriptors the program keeps to 3, 4, ... and closes every
 *      other one, so nothing of the host leaks in;
 *   2. waits for one byte on sync_fd: the zygote writes it once the child's
 *      uid/gid maps are in place (it may need newuidmap to write them);
 *   3. runs the steps Python composed (mounts, pivot_root, hostname, ...),
 *      reporting the index of a failed step and its errno on error_fd;
 *   4. execs the init from a descriptor opened before the pivot, so the
 *      binary does not need to exist inside the root filesystem.
 * error_fd is close-on-exec: the host reading EOF on it means the exec
 * succeeded.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <net/if.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "create.h"
#include "fdpass.h"

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
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
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

static int run_step(const struct nsbox_step *s, int *slots)
{
    switch (s->kind) {
    case NSBOX_STEP_MOUNT:
        return mount(s->a, s->b, s->c, s->flags, s->d);

    case NSBOX_STEP_TREE_CLONE: {
        if (s->slot < 0 || s->slot >= NSBOX_SLOTS) {
            errno = EINVAL;
            return -1;
        }
        unsigned int rec = (s->flags & AT_RECURSIVE) ? AT_RECURSIVE : 0;
        int fd = (int)syscall(SYS_open_tree, AT_FDCWD, s->a, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | rec);
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
        if (syscall(SYS_move_mount, slots[s->slot], "", AT_FDCWD, s->b, MOVE_MOUNT_F_EMPTY_PATH) < 0)
            return -1;
        close(slots[s->slot]);
        slots[s->slot] = -1;
        return 0;

    case NSBOX_STEP_MKDIR: {
        if (mkdir(s->b, s->mode) < 0 && errno != EEXIST)
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
        return 0;
    }

    case NSBOX_STEP_MKFILE: {
        int fd = open(s->b, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, s->mode);
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
        return chdir("/");

    case NSBOX_STEP_HOSTNAME:
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
        return r;
    }

    case NSBOX_STEP_REMOUNT:
        return mount(NULL, s->b, NULL, MS_REMOUNT | s->flags, NULL);
    }
    errno = EINVAL;
    return -1;
}

/*
 * Puts keep_fds at 3, 4, ... (a -1 entry leaves that number closed), then
 * the error pipe, the program and the sync pipe just above them (all three
 * close-on-exec), points stdin/out/err at /dev/null unless told otherwise,
 * and closes every other descriptor inherited from the host. Updates the
 * three pointers to the new numbers.
 */
static int arrange_fds(const struct nsbox_spec *spec, int *error_fd, int *exec_fd, int *sync_fd)
{
    /* First copy everything we keep above any number we are about to assign. */
    int high[4];
    for (int i = 0; i < spec->nkeep; i++) {
        high[i] = -1;
        if (spec->keep_fds[i] >= 0 && (high[i] = fcntl(spec->keep_fds[i], F_DUPFD_CLOEXEC, 100)) < 0)
            return -1;
    }
    int err_hi = fcntl(*error_fd, F_DUPFD_CLOEXEC, 100);
    int sync_hi = fcntl(*sync_fd, F_DUPFD_CLOEXEC, 100);
    int exe_hi = *exec_fd >= 0 ? fcntl(*exec_fd, F_DUPFD_CLOEXEC, 100) : -1;
    if (err_hi < 0 || sync_hi < 0 || (*exec_fd >= 0 && exe_hi < 0))
        return -1;
    for (int i = 0; i < spec->nkeep; i++) {
        if (high[i] >= 0 && dup2(high[i], 3 + i) < 0) /* the copy loses O_CLOEXEC */
            return -1;
        if (high[i] < 0)
            close(3 + i);
    }
    int base = 3 + spec->nkeep;
    if (dup3(err_hi, base, O_CLOEXEC) < 0 || dup3(sync_hi, base + 2, O_CLOEXEC) < 0)
        return -1;
    *error_fd = base;
    *sync_fd = base + 2;
    if (exe_hi >= 0) {
        if (dup3(exe_hi, base + 1, O_CLOEXEC) < 0)
            return -1;
        *exec_fd = base + 1;
    }
    if (!spec->keep_stdio) {
        int null = open("/dev/null", O_RDWR | O_CLOEXEC);
        if (null < 0)
            return -1;
        for (int i = 0; i < 3; i++) {
            if (dup2(null, i) < 0)
                return -1;
        }
    }
    return (int)syscall(SYS_close_range, base + 3, ~0U, 0);
}

/* Appends the decimal digits of v at p; returns the end. (No snprintf: this
 * runs in a copy of a multi-threaded process, where only system calls and
 * plain code are safe.) */
static char *put_uint(char *p, unsigned long v)
{
    char digits[24];
    int n = 0;
    do {
        digits[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n)
        *p++ = digits[--n];
    return p;
}

static char *put_str(char *p, const char *s)
{
    while (*s)
        *p++ = *s++;
    return p;
}

/* /proc/PID/NAME, into buf (at least 64 bytes). */
static const char *proc_path(char *buf, pid_t pid, const char *name)
{
    char *p = put_str(buf, "/proc/");
    p = put_uint(p, (unsigned long)pid);
    *p++ = '/';
    *put_str(p, name) = 0;
    return buf;
}

static int write_proc(pid_t pid, const char *name, const char *text)
{
    char path[64];
    int fd = open(proc_path(path, pid, name), O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = write(fd, text, strlen(text));
    int err = errno;
    close(fd);
    errno = err;
    return n == (ssize_t)strlen(text) ? 0 : -1;
}

/*
 * Why: the user namespace that set up the mounts owns them, so its root
 * could remount a read-only bind read-write or unmount what covers a
 * path. Mounts copied into a mount namespace owned by a *less* privileged
 * user namespace are locked by the kernel: their flags cannot be changed
 * and they cannot be detached from what they cover. So a child holds a
 * nested user + mount namespace pair open while we map its ids and take
 * descriptors of both; the init later puts every sandbox process in it.
 * It also keeps the init out of reach: nothing in the nested namespace
 * has capabilities over the init's (ptrace, stealing its descriptors).
 */
static int make_locked_namespaces(const char *uid_map, const char *gid_map, int *userns, int *mntns)
{
    int hold[2];
    if (pipe2(hold, O_CLOEXEC) < 0)
        return -1;
    /* A raw clone, not fork(): no atfork handlers of the host's C library. */
    long pid = syscall(SYS_clone, CLONE_NEWUSER | CLONE_NEWNS | SIGCHLD, 0, 0, 0, 0);
    if (pid < 0)
        return -1;
    if (pid == 0) {
        char c;
        close(hold[1]);
        ssize_t r = read(hold[0], &c, 1); /* returns when the parent closes its end */
        (void)r;
        _exit(0);
    }
    close(hold[0]);
    char path[64];
    int rc = -1;
    if (write_proc((pid_t)pid, "uid_map", uid_map) == 0 && write_proc((pid_t)pid, "gid_map", gid_map) == 0) {
        *userns = open(proc_path(path, (pid_t)pid, "ns/user"), O_RDONLY | O_CLOEXEC);
        *mntns = open(proc_path(path, (pid_t)pid, "ns/mnt"), O_RDONLY | O_CLOEXEC);
        rc = (*userns >= 0 && *mntns >= 0) ? 0 : -1;
    }
    int err = errno;
    close(hold[1]);
    while (waitpid((pid_t)pid, NULL, 0) < 0 && errno == EINTR)
        ;
    errno = err;
    return rc;
}

static void __attribute__((noreturn)) child(const struct nsbox_spec *spec)
{
    /* Nothing may interrupt the setup; the mask is cleared before exec. */
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, NULL);

    /* Drop every host descriptor we were not given before anything else:
     * a stray copy of the sync pipe's write end would keep us waiting
     * forever if the host died. */
    int error_fd = spec->error_fd, exec_fd = spec->exec_fd, sync_fd = spec->sync_fd;
    if (arrange_fds(spec, &error_fd, &exec_fd, &sync_fd) < 0) {
        report(error_fd, NSBOX_SETUP_FDS, errno);
        _exit(1);
    }
    char go;
    if (read(sync_fd, &go, 1) != 1) {
        report(error_fd, NSBOX_SETUP_SYNC, errno ? errno : EPIPE);
        _exit(1);
    }
    close(sync_fd);
    if (spec->new_session)
        setsid();
    /* The maps are written: take uid/gid 0 explicitly, so every id (saved,
     * filesystem) is the namespace's root. */
    if (setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0) {
        report(error_fd, NSBOX_SETUP_IDS, errno);
        _exit(1);
    }

    int slots[NSBOX_SLOTS];
    for (int i = 0; i < NSBOX_SLOTS; i++)
        slots[i] = -1;
    for (int i = 0; i < spec->nsteps; i++) {
        if (run_step(&spec->steps[i], slots) < 0) {
            report(error_fd, i, errno);
            _exit(1);
        }
    }
    for (int i = 0; i < NSBOX_SLOTS; i++) {
        if (slots[i] >= 0)
            close(slots[i]);
    }
    if (spec->lock_uid_map) {
        int userns, mntns, at = 3 + spec->lock_slot;
        /* open() may have handed out the very numbers we are to fill: move
         * both out of the way before placing them. */
        if (make_locked_namespaces(spec->lock_uid_map, spec->lock_gid_map, &userns, &mntns) < 0 ||
            (userns = fcntl(userns, F_DUPFD_CLOEXEC, 100)) < 0 || (mntns = fcntl(mntns, F_DUPFD_CLOEXEC, 100)) < 0 ||
            dup2(userns, at) < 0 || dup2(mntns, at + 1) < 0) {
            report(error_fd, NSBOX_SETUP_LOCK, errno);
            _exit(1);
        }
        close(userns);
        close(mntns);
    }

    sigemptyset(&all);
    sigprocmask(SIG_SETMASK, &all, NULL);
    if (exec_fd >= 0)
        syscall(SYS_execveat, exec_fd, "", spec->argv, spec->envp, AT_EMPTY_PATH);
    else
        execvpe(spec->argv[0], spec->argv, spec->envp);
    report(error_fd, NSBOX_SETUP_EXEC, errno);
    _exit(127);
}

static void reply(int sock, int pid, int err, int stage, int pidfd, const char *msg, int msglen)
{
    struct nsbox_zygote_reply r = {.pid = pid, .err = err, .stage = stage, .msglen = msglen};
    struct iovec iov[2] = {{.iov_base = &r, .iov_len = sizeof r}, {.iov_base = (void *)msg, .iov_len = (size_t)msglen}};
    send_with_fd(sock, iov, msglen > 0 ? 2 : 1, pidfd);
}

/*
 * Runs newuidmap or newgidmap: `helper PID inside outside count ...`, the
 * numbers taken from `map`. Returns 0, or an errno with the helper's
 * complaint (its stderr) in msg.
 */
static int run_map_helper(const char *helper, pid_t pid, const char *map, char *msg, int *msglen)
{
    char buf[512], pidstr[24];
    char *argv[64];
    int argc = 0;
    *put_uint(pidstr, (unsigned long)pid) = 0;
    argv[argc++] = (char *)helper;
    argv[argc++] = pidstr;
    size_t len = strlen(map);
    if (len >= sizeof buf)
        return E2BIG;
    memcpy(buf, map, len + 1);
    for (char *tok = strtok(buf, " \n"); tok && argc < 63; tok = strtok(NULL, " \n"))
        argv[argc++] = tok;
    argv[argc] = NULL;

    int out[2];
    if (pipe2(out, O_CLOEXEC) < 0)
        return errno;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, out[1], 2);
    char *envp[] = {NULL};
    pid_t hp;
    int err = posix_spawn(&hp, helper, &fa, NULL, argv, envp);
    posix_spawn_file_actions_destroy(&fa);
    close(out[1]);
    if (err) {
        close(out[0]);
        return err;
    }
    ssize_t n = read(out[0], msg + *msglen, (size_t)(NSBOX_ZYGOTE_MSG_MAX - *msglen));
    close(out[0]);
    int status;
    while (waitpid(hp, &status, 0) < 0 && errno == EINTR)
        ;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
        return 0;
    if (n > 0)
        *msglen += (int)n;
    return EPERM;
}

/* Writes the id maps of the user namespace of `pid`; 0 or an errno. */
static int write_id_maps(const struct nsbox_spec *spec, pid_t pid, char *msg, int *msglen)
{
    if (spec->newuidmap) {
        int err = run_map_helper(spec->newuidmap, pid, spec->uid_map, msg, msglen);
        return err ? err : run_map_helper(spec->newgidmap, pid, spec->gid_map, msg, msglen);
    }
    /* An unprivileged gid_map requires setgroups to be denied first. */
    if (spec->deny_setgroups && write_proc(pid, "setgroups", "deny") < 0)
        return errno;
    if (write_proc(pid, "uid_map", spec->uid_map) < 0 || write_proc(pid, "gid_map", spec->gid_map) < 0)
        return errno;
    return 0;
}

#define MAX_FDS 12

/* Serves one creation request; fds[0] is the reply socket, fds[1] the spec. */
static void serve(int *fds, int nfds)
{
    struct stat st;
    char *buf = NULL;
    struct nsbox_spec spec;
    memset(&spec, 0, sizeof spec);
    int sync[2] = {-1, -1};
    if (nfds < 2 || fstat(fds[1], &st) < 0 || st.st_size <= 0 || !(buf = malloc((size_t)st.st_size)) ||
        pread(fds[1], buf, (size_t)st.st_size, 0) != st.st_size ||
        nsbox_spec_unpack(buf, (unsigned long)st.st_size, &spec) || nfds != 2 + nsbox_spec_fds(&spec) ||
        pipe2(sync, O_CLOEXEC) < 0) {
        reply(fds[0], -1, EINVAL, NSBOX_ZYGOTE_REQUEST, -1, NULL, 0);
        goto out;
    }
    /* The descriptors, in the order create.h gives. */
    int next = 2;
    spec.sync_fd = sync[0];
    spec.error_fd = fds[next++];
    if (spec.exec_fd >= 0)
        spec.exec_fd = fds[next++];
    for (int i = 0; i < spec.nkeep; i++) {
        if (spec.keep_fds[i] >= 0)
            spec.keep_fds[i] = fds[next++];
    }

    int pidfd = -1;
    struct clone_args args;
    memset(&args, 0, sizeof args);
    /* With CLONE_PARENT the child's exit signal is ours (SIGCHLD); clone3
     * requires exit_signal to be 0 then. */
    args.flags = spec.clone_flags | CLONE_PARENT | CLONE_PIDFD;
    args.pidfd = (uint64_t)(uintptr_t)&pidfd;
    long pid = syscall(SYS_clone3, &args, sizeof args);
    if (pid == 0)
        child(&spec); /* it closes every descriptor it does not need first */
    if (pid < 0) {
        reply(fds[0], -1, errno, NSBOX_ZYGOTE_CLONE, -1, NULL, 0);
        goto out;
    }
    char msg[NSBOX_ZYGOTE_MSG_MAX];
    int msglen = 0;
    int err = write_id_maps(&spec, (pid_t)pid, msg, &msglen);
    if (err) {
        /* The child never started: it is ours to stop (our parent reaps it). */
        syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, NULL, 0);
        reply(fds[0], (int)pid, err, NSBOX_ZYGOTE_IDMAP, pidfd, msg, msglen);
    } else {
        ssize_t w = write(sync[1], "g", 1); /* go on */
        (void)w;
        reply(fds[0], (int)pid, 0, 0, pidfd, NULL, 0);
    }
    close(pidfd);
out:
    for (int i = 0; i < 2; i++) {
        if (sync[i] >= 0)
            close(sync[i]);
    }
    free((void *)spec.steps);
    free((void *)spec.argv);
    free((void *)spec.envp);
    free(buf);
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
}

/*
 * nsbox-create: the zygote (see create.h). Reads creation requests from
 * its socket until the Python process that started it goes away.
 */
/* Sets every signal's disposition to the default. posix_spawn leaves
 * glibc's two internal signals (32, 33) ignored, and an ignored signal
 * stays ignored across exec, in every process of every sandbox; sigaction()
 * refuses those two, so this uses the system call. An all-zero kernel
 * sigaction is SIG_DFL with no flags and an empty mask. */
static void default_signal_dispositions(void)
{
    static const char dfl[64];
    for (int s = 1; s <= 64; s++) {
        if (s != SIGKILL && s != SIGSTOP)
            syscall(SYS_rt_sigaction, s, dfl, NULL, 8);
    }
}

int main(void)
{
    default_signal_dispositions();
    for (;;) {
        char byte;
        struct iovec iov = {.iov_base = &byte, .iov_len = 1};
        union {
            char buf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
            struct cmsghdr align;
        } u;
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
        ssize_t n = recvmsg(NSBOX_ZYGOTE_SOCKET, &msg, MSG_CMSG_CLOEXEC);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return 0;
        int fds[MAX_FDS], nfds = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                continue;
            int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < k && nfds < MAX_FDS; i++)
                memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
        }
        if (msg.msg_flags & MSG_CTRUNC) {
            for (int i = 0; i < nfds; i++)
                close(fds[i]);
            continue;
        }
        serve(fds, nfds);
    }
}
