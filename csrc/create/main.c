/*
 * main.c - nsbox-create, the zygote: clone a child into new namespaces.
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
 *   2. waits for one byte on sync_fd: the host writes it once the child's
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
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "create/zygote.h"
#include "common/fdpass.h"

/* Best effort, and without waiting: the reply socket is fresh and the reply
 * small, so a socket with no room (or no socket at all) means the owner
 * does not want it, and waiting would stall every later request. */
static void reply(int sock, int pid, int err, int stage, int pidfd, const char *msg, int msglen)
{
    struct nsbox_zygote_reply r = {.pid = pid, .err = err, .stage = stage, .msglen = msglen};
    struct iovec iov[2] = {{.iov_base = &r, .iov_len = sizeof r}, {.iov_base = (void *)msg, .iov_len = (size_t)msglen}};
    send_with_fd_flags(sock, iov, msglen > 0 ? 2 : 1, pidfd, MSG_DONTWAIT);
}

#define MAX_FDS 12

/* What this process is. A sub-zygote (see enter() and hold() below) lives
 * in a user namespace other than the zygote's:
 *   POD     another sandbox's user and network namespaces: the children it
 *           clones share both (no id maps to write);
 *   HOLDER  a user namespace of the owner's, with no sandbox in it: the
 *           children it clones get user namespaces of their own, nested in
 *           it, whose maps it writes directly (no setuid helper). */
enum role { ZYGOTE, POD, HOLDER };
static enum role role = ZYGOTE;

/* Makes `sock` our socket (fd NSBOX_ZYGOTE_SOCKET, close-on-exec) and
 * closes every descriptor above it: a zygote keeps nothing else (0-2 are
 * /dev/null), a sub-zygote nothing of the request it came from. */
static int take_socket(int sock)
{
    if (sock != NSBOX_ZYGOTE_SOCKET && dup2(sock, NSBOX_ZYGOTE_SOCKET) < 0)
        return -1;
    if (fcntl(NSBOX_ZYGOTE_SOCKET, F_SETFD, FD_CLOEXEC) < 0)
        return -1;
    return (int)syscall(SYS_close_range, NSBOX_ZYGOTE_SOCKET + 1, ~0U, 0);
}

/* Whether the process of `pidfd` has exited, waiting a moment for one
 * that is on its way out. */
static bool exited(int pidfd)
{
    struct pollfd p = {.fd = pidfd, .events = POLLIN};
    return poll(&p, 1, 100) == 1;
}

/* Reads and unpacks the request memfd `fd`; 0, or -1 with nothing allocated
 * (*buf is freed by the caller either way). Its size bounds what we read. */
static int read_request(int fd, char **buf, struct nsbox_clone_request *req)
{
    struct stat st;
    memset(req, 0, sizeof *req);
    *buf = NULL;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_size <= 0 || st.st_size > NSBOX_CLONE_REQUEST_MAX ||
        !(*buf = malloc((size_t)st.st_size)) || pread(fd, *buf, (size_t)st.st_size, 0) != st.st_size ||
        nsbox_clone_request_unpack(*buf, (unsigned long)st.st_size, req))
        return -1;
    return 0;
}

/* Serves one creation request; fds[0] is the reply socket, fds[1] the request. */
static void serve(int *fds, int nfds)
{
    if (nfds < 1)
        return; /* no descriptor came: nothing to answer on, nothing to close */
    char *buf = NULL;
    struct nsbox_clone_request req;
    memset(&req, 0, sizeof req);
    /* In a holder, only maps we can write ourselves: a setuid helper run
     * from inside a user namespace is nothing we want. */
    if (nfds < 2 || read_request(fds[1], &buf, &req) || nfds != 2 + nsbox_clone_request_fds(&req) ||
        (role == HOLDER && req.newuidmap)) {
        reply(fds[0], -1, EINVAL, NSBOX_ZYGOTE_REQUEST, -1, NULL, 0);
        goto out;
    }
    /* The descriptors, in the order create.h gives. */
    int next = 2;
    req.error_fd = fds[next++];
    req.sync_fd = fds[next++];
    if (req.go_fd >= 0)
        req.go_fd = fds[next++];
    if (req.exec_fd >= 0)
        req.exec_fd = fds[next++];
    for (int i = 0; i < req.nkeep; i++) {
        if (req.keep_fds[i] >= 0)
            req.keep_fds[i] = fds[next++];
    }

    int pidfd = -1;
    struct clone_args args;
    memset(&args, 0, sizeof args);
    /* With CLONE_PARENT the child's exit signal is ours (SIGCHLD); clone3
     * requires exit_signal to be 0 then. */
    /* In a pod the user and network namespaces are ours already; their id
     * maps were written when they were made. */
    unsigned long ns = req.clone_flags;
    if (role == POD)
        ns &= ~(unsigned long)(CLONE_NEWUSER | CLONE_NEWNET);
    args.flags = ns | CLONE_PARENT | CLONE_PIDFD;
    args.pidfd = (uint64_t)(uintptr_t)&pidfd;
    long pid = syscall(SYS_clone3, &args, sizeof args);
    if (pid == 0)
        child(&req); /* it closes every descriptor it does not need first */
    if (pid < 0) {
        reply(fds[0], -1, errno, NSBOX_ZYGOTE_CLONE, -1, NULL, 0);
        goto out;
    }
    char msg[NSBOX_ZYGOTE_MSG_MAX];
    int msglen = 0;
    int err = role == POD ? 0 : write_id_maps(&req, (pid_t)pid, msg, &msglen);
    if (err && exited(pidfd)) {
        /* The child failed before we could write its maps (its first steps
         * failed): its own report on the error pipe says why, not the maps. */
        err = 0;
        msglen = 0;
    }
    if (err) {
        /* The child never started: it is ours to stop (our parent reaps it). */
        syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, NULL, 0);
        reply(fds[0], (int)pid, err, NSBOX_ZYGOTE_IDMAP, pidfd, msg, msglen);
    } else {
        /* The child waits on the sync pipe. Given its write end, we send
         * the go ourselves, so that its setup overlaps our reply's way to
         * the host; else the host does, once its own hooks (cgroup) are
         * done. One byte into a fresh pipe whose read end we hold ourselves
         * (sync_fd) neither blocks nor fails (no SIGPIPE); were it to fail,
         * the child would read EOF and report that. */
        if (req.go_fd >= 0)
            (void)!write(req.go_fd, "g", 1);
        reply(fds[0], (int)pid, 0, 0, pidfd, NULL, 0);
    }
    close(pidfd);
out:
    nsbox_clone_request_free(&req); /* unpack left it zeroed if it refused it */
    free(buf);
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
}

/*
 * Serves a join request: fds are the reply socket, the sub-zygote's socket,
 * and descriptors of a user namespace and a network namespace (another
 * sandbox's, as its init sees them). Clones a sub-zygote (CLONE_PARENT: a
 * child of the Python process, which reaps it) that enters both and then
 * serves creation requests on its socket like this zygote, until EOF. Its
 * children are cloned inside that user namespace, so they need no id maps,
 * and share that network namespace: services of one sample reach each
 * other on its loopback, as the containers of a pod do.
 *
 * With no network namespace given (3 descriptors), it enters only the user
 * namespace, which must be a holder's (one with the owner's maps, such as a
 * named service network's), and serves as a holder does: its children get
 * nested user namespaces and network namespaces of their own.
 *
 * Entering needs CAP_SYS_ADMIN over the user namespace: we have it as its
 * owner (our uid created it, from our namespace); a user namespace owned
 * by anyone else is refused by the kernel (EPERM).
 */
static void enter(int *fds, int nfds)
{
    if (nfds < 1)
        return;
    if ((nfds != 4 && nfds != 3) || role != ZYGOTE) {
        reply(fds[0], -1, EINVAL, NSBOX_ZYGOTE_REQUEST, -1, NULL, 0);
        goto out;
    }
    int pidfd = -1;
    struct clone_args args;
    memset(&args, 0, sizeof args);
    args.flags = CLONE_PARENT | CLONE_PIDFD;
    args.pidfd = (uint64_t)(uintptr_t)&pidfd;
    /* The sub-zygote reports a failure to enter by exiting before it
     * answers anything: report it here instead, from a pipe it writes the
     * errno to. */
    int status[2];
    if (pipe2(status, O_CLOEXEC) < 0) {
        reply(fds[0], -1, errno, NSBOX_ZYGOTE_CLONE, -1, NULL, 0);
        goto out;
    }
    long pid = syscall(SYS_clone3, &args, sizeof args);
    if (pid == 0) {
        close(status[0]);
        int err = 0;
        if (setns(fds[2], CLONE_NEWUSER) < 0 || (nfds == 4 && setns(fds[3], CLONE_NEWNET) < 0))
            err = errno;
        ssize_t w = write(status[1], &err, sizeof err);
        (void)w;
        if (err || take_socket(fds[1]) < 0) /* the latter: the owner's first request finds us gone */
            _exit(1);
        role = nfds == 4 ? POD : HOLDER;
        return; /* back to the serving loop, on the new socket */
    }
    close(status[1]);
    int err = pid < 0 ? errno : 0;
    if (pid > 0 && read(status[0], &err, sizeof err) != (ssize_t)sizeof err)
        err = ECHILD;
    close(status[0]);
    if (pid > 0 && err)
        syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, NULL, 0); /* exiting already; the owner reaps it */
    reply(fds[0], pid > 0 ? (int)pid : -1, err, err ? NSBOX_ZYGOTE_JOIN : 0, pidfd, NULL, 0);
    if (pidfd >= 0)
        close(pidfd);
out:
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
}

/*
 * Serves a holder request: fds are the reply socket, the holder's socket
 * and a request memfd, of which only the id maps count. Clones the holder into
 * a new user namespace (CLONE_PARENT: a child of the Python process), writes
 * its maps as for a sandbox (newuidmap for a subordinate range: once, here,
 * instead of once per sandbox), and lets it serve creation requests on its
 * socket until EOF (role HOLDER).
 *
 * What a sandbox made by the holder can do to it: nothing. The sandbox's
 * user namespace is a child of the holder's, so its root has no capability
 * in the holder's namespace or a sibling's; the holder's pid is outside
 * every sandbox's PID namespace.
 */
static void hold(int *fds, int nfds)
{
    if (nfds < 1)
        return;
    char *buf = NULL;
    struct nsbox_clone_request req;
    memset(&req, 0, sizeof req);
    int ready[2] = {-1, -1}, pidfd = -1;
    if (nfds != 3 || role != ZYGOTE || read_request(fds[2], &buf, &req)) {
        reply(fds[0], -1, EINVAL, NSBOX_ZYGOTE_REQUEST, -1, NULL, 0);
        goto out;
    }
    if (pipe2(ready, O_CLOEXEC) < 0) {
        reply(fds[0], -1, errno, NSBOX_ZYGOTE_CLONE, -1, NULL, 0);
        goto out;
    }
    struct clone_args args;
    memset(&args, 0, sizeof args);
    args.flags = CLONE_NEWUSER | CLONE_PARENT | CLONE_PIDFD;
    args.pidfd = (uint64_t)(uintptr_t)&pidfd;
    long pid = syscall(SYS_clone3, &args, sizeof args);
    if (pid == 0) {
        /* Wait until our maps are written; EOF means they were not. */
        char go;
        close(ready[1]);
        /* Then become the namespace's root, so that our ids are mapped in
         * it (a new user namespace needs its creator's ids mapped in the
         * parent). Python uses a holder only where root is the owner's own
         * uid and gid, so nothing changes for host file access; changing
         * ids made us non-dumpable, which would hand the /proc files of the
         * children we clone (their id maps among them) to host root. */
        if (read(ready[0], &go, 1) != 1 || setresgid(0, 0, 0) < 0 || setresuid(0, 0, 0) < 0 ||
            prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) < 0 || take_socket(fds[1]) < 0)
            _exit(1);
        nsbox_clone_request_free(&req);
        free(buf);
        role = HOLDER;
        return; /* back to the serving loop, on the new socket */
    }
    if (pid < 0) {
        reply(fds[0], -1, errno, NSBOX_ZYGOTE_CLONE, -1, NULL, 0);
        goto out;
    }
    char msg[NSBOX_ZYGOTE_MSG_MAX];
    int msglen = 0;
    int err = write_id_maps(&req, (pid_t)pid, msg, &msglen);
    if (err)
        syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, NULL, 0); /* the owner reaps it */
    else if (write(ready[1], "g", 1) != 1)
        err = errno;
    reply(fds[0], (int)pid, err, err ? NSBOX_ZYGOTE_IDMAP : 0, pidfd, msg, msglen);
out:
    if (pidfd >= 0)
        close(pidfd);
    for (int i = 0; i < 2; i++) {
        if (ready[i] >= 0)
            close(ready[i]);
    }
    nsbox_clone_request_free(&req);
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
    /* We hold our socket and /dev/null at 0-2, nothing else: close what the
     * owner's process may have let through (see spawn.c). posix_spawn's dup2
     * left the socket inheritable; nothing we run (the setuid id-map
     * helpers) may have it. The children we clone put their own descriptors
     * over fd 3 before they exec. */
    if (take_socket(NSBOX_ZYGOTE_SOCKET) < 0)
        return 1;
    for (;;) {
        char byte;
        int fds[MAX_FDS], nfds;
        bool truncated;
        ssize_t n = recv_with_fds(NSBOX_ZYGOTE_SOCKET, &byte, 1, fds, MAX_FDS, &nfds, &truncated, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return 0;
        if (truncated) {
            for (int i = 0; i < nfds; i++)
                close(fds[i]);
            continue;
        }
        if (byte == 'j')
            enter(fds, nfds);
        else if (byte == 'h')
            hold(fds, nfds);
        else
            serve(fds, nfds);
    }
}
