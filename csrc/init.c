/*
 * init.c - PID 1 of every nsbox sandbox.
 *
 * A small static program with four jobs:
 *   1. spawn server: on an EXEC request it forks, the child applies cwd and
 *      credentials and execs the command with cmd[0] resolved through PATH;
 *      on an OPEN request the child opens a file as the requesting user and
 *      passes the descriptor back;
 *   2. reaper: it reaps every process that ends up as its child and reports
 *      the exit status of commands (128+N for signal N);
 *   3. killer: on request (or when the host drops a command's channel) it
 *      kills the command's whole process tree;
 *   4. lifeline: when the owner's control connection closes it kills
 *      everything and exits, which makes the kernel tear down the sandbox.
 *
 * The init holds no privileges beyond those of the sandbox itself. It never
 * blocks on a request body: payloads arrive inline or in a memfd, and the
 * work that may block (exec, open) happens in a forked child.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/openat2.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fdpass.h"
#include "protocol.h"

#define DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

/* A command started by EXEC whose exit has not been reported yet. */
struct job {
    pid_t pid;
    int chan;      /* -1 once the host has let go of the channel */
    bool detached; /* losing the channel does not kill it */
};

/* A client connection: the owner's (fd 3) or one accepted later. */
struct conn {
    int fd;
    bool lifeline;
};

static struct job *jobs;
static size_t njobs, jobs_cap;
static struct conn *conns;
static size_t nconns, conns_cap;
static int sig_fd = -1, listen_fd = -1;
static int userns_fd = -1, mntns_fd = -1; /* where sandbox processes run */
static bool detached;
static uint64_t exec_count;

static void *grow(void *p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return p;
    size_t n = *cap ? *cap * 2 : 16;
    while (n < need)
        n *= 2;
    void *q = realloc(p, n * elem);
    if (!q) /* out of memory in PID 1: nothing sensible is left to do */
        _exit(70);
    *cap = n;
    return q;
}

static void shutdown_sandbox(void)
{
    /* As PID 1, kill(-1) reaches every other process of the namespace; our
     * exit then makes the kernel kill anything that slipped through. */
    kill(-1, SIGKILL);
    _exit(0);
}

/* ---- replies --------------------------------------------------------- */

static void send_reply(int chan, int32_t kind, int32_t code, int32_t err, int32_t stage, int fd)
{
    struct nsbox_reply r = {.kind = kind, .code = code, .err = err, .stage = stage};
    struct iovec iov = {.iov_base = &r, .iov_len = sizeof r};
    /* A host that went away makes this fail with EPIPE; nothing to do then. */
    send_with_fd(chan, &iov, 1, fd);
}

static void fail_and_exit(int chan, int stage, int err)
{
    send_reply(chan, NSBOX_REPLY_FAIL, 0, err, stage, -1);
    _exit(127);
}

/* ---- killing a command's process tree -------------------------------- */

struct procinfo {
    pid_t pid, ppid, pgid, sid;
};

/* Reads pid, ppid, process group and session from /proc/PID/stat. */
static bool read_stat(pid_t pid, struct procinfo *pi)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return false;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return false;
    buf[n] = 0;
    /* The command name may contain anything, even ')': skip to the last one. */
    char *p = strrchr(buf, ')');
    if (!p)
        return false;
    char state;
    if (sscanf(p + 1, " %c %d %d %d", &state, &pi->ppid, &pi->pgid, &pi->sid) != 4)
        return false;
    pi->pid = pid;
    return state != 'Z';
}

/*
 * Signals every process belonging to the command led by `leader`: its
 * session and process group (the leader called setsid), and, through the
 * parent links, descendants that moved to a session of their own. Returns
 * how many processes were signalled.
 */
static int signal_tree(pid_t leader, int sig)
{
    DIR *d = opendir("/proc");
    if (!d)
        return 0;
    struct procinfo *ps = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (*end || pid <= 1)
            continue;
        ps = grow(ps, &cap, n + 1, sizeof *ps);
        if (read_stat((pid_t)pid, &ps[n]))
            n++;
    }
    closedir(d);

    bool *mark = calloc(n ? n : 1, sizeof *mark);
    if (!mark)
        _exit(70);
    for (size_t i = 0; i < n; i++)
        mark[i] = ps[i].pid == leader || ps[i].sid == leader || ps[i].pgid == leader;
    for (bool changed = true; changed;) {
        changed = false;
        for (size_t i = 0; i < n; i++) {
            if (mark[i])
                continue;
            for (size_t j = 0; j < n; j++) {
                if (mark[j] && ps[j].pid == ps[i].ppid) {
                    mark[i] = changed = true;
                    break;
                }
            }
        }
    }
    int count = 0;
    for (size_t i = 0; i < n; i++) {
        if (mark[i] && kill(ps[i].pid, sig) == 0)
            count++;
    }
    free(mark);
    free(ps);
    return count;
}

static void kill_tree(pid_t leader, int sig)
{
    if (sig != SIGKILL) {
        signal_tree(leader, sig);
        return;
    }
    /* A process may fork between our scan and its death; its orphans keep
     * the session id, so rescan until a pass finds nobody. */
    for (int round = 0; round < 50 && signal_tree(leader, SIGKILL) > 0; round++)
        ;
}

/* ---- the child side of a request ------------------------------------- */

struct request {
    struct nsbox_request h;
    const uint32_t *groups;
    char **strings; /* cwd or path, then argv, then env */
    size_t nstrings;
};

/* Parses the payload into `rq`. Runs in the forked child, so it may allocate. */
static bool parse_payload(struct request *rq, char *payload, size_t len)
{
    size_t glen = (size_t)rq->h.ngroups * sizeof(uint32_t);
    if (rq->h.ngroups > NGROUPS_MAX || glen > len)
        return false;
    rq->groups = (const uint32_t *)payload;
    size_t want = 1 + (size_t)rq->h.argc + rq->h.envc;
    rq->strings = calloc(want + 1, sizeof(char *));
    if (!rq->strings)
        return false;
    char *p = payload + glen, *end = payload + len;
    for (size_t i = 0; i < want; i++) {
        char *z = memchr(p, 0, (size_t)(end - p));
        if (!z)
            return false;
        rq->strings[i] = p;
        p = z + 1;
    }
    rq->nstrings = want;
    return true;
}

/* Reads a payload that came in a memfd. */
static char *read_payload_fd(int fd, size_t len)
{
    char *buf = malloc(len ? len : 1);
    if (!buf)
        return NULL;
    size_t off = 0;
    while (off < len) {
        ssize_t n = pread(fd, buf + off, len - off, (off_t)off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0) {
            free(buf);
            return NULL;
        }
        off += (size_t)n;
    }
    return buf;
}

/* Switches to the requested user; returns 0 or an errno. */
static int apply_creds(const struct request *rq)
{
    if (rq->h.flags & NSBOX_F_SETGROUPS) {
        gid_t gs[NGROUPS_MAX];
        for (uint32_t i = 0; i < rq->h.ngroups; i++)
            gs[i] = rq->groups[i];
        /* With a single mapped id, setgroups is denied by the kernel; only
         * root runs then, and keeping root's groups is what it would get. */
        if (setgroups(rq->h.ngroups, gs) < 0 && !(errno == EPERM && rq->h.uid == 0))
            return errno;
    }
    if (setresgid(rq->h.gid, rq->h.gid, rq->h.gid) < 0)
        return errno;
    if (setresuid(rq->h.uid, rq->h.uid, rq->h.uid) < 0)
        return errno;
    return 0;
}

/* Moves the child's descriptors into place: `map[i]` becomes fd i for
 * i < nmap; `*keep` is moved above them and stays close-on-exec; every
 * other descriptor is closed. */
static bool arrange_fds(const int *map, int nmap, int *keep)
{
    int high[NSBOX_MAX_FDS];
    for (int i = 0; i < nmap; i++) {
        if ((high[i] = fcntl(map[i], F_DUPFD_CLOEXEC, 64)) < 0)
            return false;
    }
    int k = fcntl(*keep, F_DUPFD_CLOEXEC, 64);
    if (k < 0)
        return false;
    for (int i = 0; i < nmap; i++) {
        if (dup2(high[i], i) < 0) /* dup2 clears close-on-exec on the copy */
            return false;
    }
    if (dup2(k, nmap) < 0 || fcntl(nmap, F_SETFD, FD_CLOEXEC) < 0)
        return false;
    *keep = nmap;
    syscall(SYS_close_range, nmap + 1, ~0U, 0);
    return true;
}

static char *getenv_from(char **env, size_t envc, const char *name)
{
    size_t n = strlen(name);
    for (size_t i = 0; i < envc; i++) {
        if (strncmp(env[i], name, n) == 0 && env[i][n] == '=')
            return env[i] + n + 1;
    }
    return NULL;
}

/* execve, falling back to /bin/sh for files without a #! line (as execvp). */
static void try_exec(const char *path, char **argv, size_t argc, char **env)
{
    execve(path, argv, env);
    if (errno != ENOEXEC)
        return;
    char **sh = calloc(argc + 2, sizeof(char *));
    if (!sh)
        return;
    sh[0] = "sh";
    sh[1] = (char *)path;
    for (size_t i = 1; i < argc; i++)
        sh[i + 1] = argv[i];
    execve("/bin/sh", sh, env);
    errno = ENOEXEC;
}

/* Resolves argv[0] through the command's own PATH and execs it. Returns the
 * errno an execvp would report. */
static int exec_command(char **argv, size_t argc, char **env, size_t envc)
{
    const char *cmd = argv[0];
    if (!*cmd)
        return ENOENT;
    if (strchr(cmd, '/')) {
        try_exec(cmd, argv, argc, env);
        return errno;
    }
    const char *path = getenv_from(env, envc, "PATH");
    if (!path)
        path = DEFAULT_PATH;
    bool denied = false;
    int last = ENOENT;
    size_t clen = strlen(cmd);
    for (const char *p = path;; p++) {
        const char *colon = strchrnul(p, ':');
        size_t dlen = (size_t)(colon - p);
        char buf[PATH_MAX];
        if (dlen + clen + 2 <= sizeof buf) {
            /* An empty PATH element means the current directory. */
            if (dlen == 0)
                buf[0] = '.', dlen = 1;
            else
                memcpy(buf, p, dlen);
            buf[dlen] = '/';
            memcpy(buf + dlen + 1, cmd, clen + 1);
            try_exec(buf, argv, argc, env);
            switch (errno) {
            case EACCES:
                denied = true;
                /* fall through */
            case ENOENT:
            case ENOTDIR:
            case ESTALE:
            case ENODEV:
            case ETIMEDOUT:
                break;
            default:
                return errno; /* found, but unusable (ENOEXEC, E2BIG, ...) */
            }
            last = errno;
        }
        if (!*colon)
            break;
        p = colon;
    }
    return denied ? EACCES : last;
}

/* Gives the command the signal state of a fresh process: nothing blocked,
 * and SIGPIPE, the one disposition the init changes, back to default
 * (handlers are reset by execve itself). */
static void reset_signals(void)
{
    sigset_t all;
    sigemptyset(&all);
    sigprocmask(SIG_SETMASK, &all, NULL);
    signal(SIGPIPE, SIG_DFL);
}

static void child_exec(struct request *rq, int fds[4])
{
    int chan = fds[0];
    int stdio[3] = {fds[1], fds[2], fds[3]};
    if (!arrange_fds(stdio, 3, &chan))
        _exit(127);
    char *cwd = rq->strings[0];
    char **argv = rq->strings + 1;
    char **env = rq->strings + 1 + rq->h.argc;
    /* The argv and env arrays must be NULL-terminated for execve. */
    char **argv_z = calloc(rq->h.argc + 1, sizeof(char *));
    char **env_z = calloc(rq->h.envc + 1, sizeof(char *));
    if (!argv_z || !env_z)
        fail_and_exit(chan, NSBOX_STAGE_SPAWN, ENOMEM);
    memcpy(argv_z, argv, rq->h.argc * sizeof(char *));
    memcpy(env_z, env, rq->h.envc * sizeof(char *));

    /* Like runc: enter the working directory while still root, so a user
     * may start in a directory it cannot search (root's home, say); if root
     * cannot (root-squashed NFS), try again as the user. */
    int cwd_err = (*cwd && chdir(cwd) < 0) ? errno : 0;
    /* We lead a new session (setsid in spawn_request), so this terminal
     * becomes ours: job control works in an interactive shell. */
    if ((rq->h.flags & NSBOX_F_SETCTTY) && ioctl(0, TIOCSCTTY, 0) < 0)
        fail_and_exit(chan, NSBOX_STAGE_SPAWN, errno);
    int err = apply_creds(rq);
    if (err)
        fail_and_exit(chan, NSBOX_STAGE_CREDS, err);
    if (cwd_err && chdir(cwd) < 0)
        fail_and_exit(chan, NSBOX_STAGE_CWD, errno);
    err = exec_command(argv_z, rq->h.argc, env_z, rq->h.envc);
    fail_and_exit(chan, NSBOX_STAGE_EXEC, err);
}

/* mkdir -p of every parent of `path`, resolved inside our root. */
static int make_parents(const char *path)
{
    char buf[PATH_MAX];
    size_t len = strlen(path);
    if (len >= sizeof buf)
        return ENAMETOOLONG;
    memcpy(buf, path, len + 1);
    for (char *p = buf + 1; (p = strchr(p, '/')); p++) {
        *p = 0;
        if (mkdir(buf, 0777) < 0 && errno != EEXIST) {
            int err = errno;
            *p = '/';
            return err;
        }
        *p = '/';
    }
    return 0;
}

static void child_open(struct request *rq, int chan)
{
    int none[1] = {-1};
    if (!arrange_fds(none, 0, &chan))
        _exit(127);
    const char *path = rq->strings[0];
    int err = apply_creds(rq);
    if (err)
        fail_and_exit(chan, NSBOX_STAGE_CREDS, err);
    if ((rq->h.flags & NSBOX_F_MKDIRS) && (err = make_parents(path)))
        fail_and_exit(chan, NSBOX_STAGE_MKDIRS, err);

    /* Our root is the sandbox root, so ordinary resolution cannot leave it;
     * RESOLVE_IN_ROOT and RESOLVE_NO_MAGICLINKS also keep /proc magic links
     * from pointing anywhere else. O_NONBLOCK keeps a FIFO from hanging us. */
    struct open_how how = {
        .flags = (rq->h.open_flags & (O_ACCMODE | O_CREAT | O_TRUNC | O_EXCL)) | O_CLOEXEC |
                 O_NOCTTY | O_NONBLOCK,
        .mode = (rq->h.open_flags & O_CREAT) ? rq->h.mode & 07777 : 0,
        .resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS,
    };
    int root = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    int fd = (int)syscall(SYS_openat2, root, path, &how, sizeof how);
    if (fd < 0 && errno == ENOSYS)
        fd = open(path, (int)how.flags, (mode_t)how.mode);
    if (fd < 0)
        fail_and_exit(chan, NSBOX_STAGE_OPEN, errno);
    struct stat st;
    if (fstat(fd, &st) < 0)
        fail_and_exit(chan, NSBOX_STAGE_OPEN, errno);
    send_reply(chan, NSBOX_REPLY_FD, S_ISDIR(st.st_mode) ? 1 : 0, 0, 0, fd);
    _exit(0);
}

/* ---- the server side ------------------------------------------------- */

static void add_conn(int fd, bool lifeline)
{
    conns = grow(conns, &conns_cap, nconns + 1, sizeof *conns);
    conns[nconns++] = (struct conn){.fd = fd, .lifeline = lifeline};
}

static void drop_conn(size_t i)
{
    if (conns[i].lifeline && !detached)
        shutdown_sandbox();
    close(conns[i].fd);
    conns[i] = conns[--nconns];
}

static void close_fds(const int *fds, int n)
{
    for (int i = 0; i < n; i++)
        close(fds[i]);
}

static void serve_status(int fd)
{
    struct nsbox_status st = {
        .version = NSBOX_PROTOCOL_VERSION,
        .running = (uint32_t)njobs,
        .execs = exec_count,
        .detached = detached,
    };
    send(fd, &st, sizeof st, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* Moves a freshly forked child into the namespaces sandbox processes live
 * in (see make_locked_namespaces in create.c); returns 0 or an errno. */
static int enter_sandbox(void)
{
    if (userns_fd < 0)
        return 0;
    if (setns(userns_fd, CLONE_NEWUSER) < 0 || setns(mntns_fd, CLONE_NEWNS) < 0)
        return errno;
    return 0;
}

/* Forks the child that serves an EXEC or OPEN request. */
static void spawn_request(struct request *rq, char *payload, int *fds, int nfds)
{
    int need = rq->h.op == NSBOX_OP_EXEC ? 4 : 1;
    bool in_fd = rq->h.flags & NSBOX_F_PAYLOAD_FD;
    if (nfds != need + (in_fd ? 1 : 0)) {
        if (nfds > 0)
            send_reply(fds[0], NSBOX_REPLY_FAIL, 0, EINVAL, NSBOX_STAGE_REQUEST, -1);
        close_fds(fds, nfds);
        return;
    }
    int chan = fds[0];
    pid_t pid = fork();
    if (pid < 0) {
        send_reply(chan, NSBOX_REPLY_FAIL, 0, errno, NSBOX_STAGE_SPAWN, -1);
        close_fds(fds, nfds);
        return;
    }
    if (pid == 0) {
        reset_signals();
        int err = enter_sandbox();
        if (err)
            fail_and_exit(chan, NSBOX_STAGE_SPAWN, err);
        if (in_fd) {
            payload = read_payload_fd(fds[nfds - 1], rq->h.payload_len);
            if (!payload)
                fail_and_exit(chan, NSBOX_STAGE_REQUEST, EIO);
        }
        if (!parse_payload(rq, payload, rq->h.payload_len) ||
            (rq->h.op == NSBOX_OP_EXEC && rq->h.argc == 0))
            fail_and_exit(chan, NSBOX_STAGE_REQUEST, EINVAL);
        if (rq->h.op == NSBOX_OP_EXEC) {
            /* Each command leads its own session, so kill_tree can find it. */
            setsid();
            child_exec(rq, fds);
        }
        child_open(rq, chan);
    }
    if (rq->h.op == NSBOX_OP_EXEC) {
        exec_count++;
        jobs = grow(jobs, &jobs_cap, njobs + 1, sizeof *jobs);
        jobs[njobs++] = (struct job){.pid = pid, .chan = chan, .detached = rq->h.flags & NSBOX_F_DETACHED};
        close_fds(fds + 1, nfds - 1);
    } else {
        close_fds(fds, nfds); /* the OPEN child answers on its own copy */
    }
}

/* Handles one message on a connection; returns false if it closed. */
static bool serve_conn(int fd)
{
    static char buf[NSBOX_MSG_MAX];
    union {
        char buf[CMSG_SPACE(sizeof(int) * NSBOX_MAX_FDS)];
        struct cmsghdr align;
    } u;
    struct iovec iov = {.iov_base = buf, .iov_len = sizeof buf};
    struct msghdr msg = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    ssize_t n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0)
        return errno == EINTR || errno == EAGAIN;
    if (n == 0)
        return false;

    int fds[NSBOX_MAX_FDS];
    int nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int i = 0; i < k && nfds < NSBOX_MAX_FDS; i++)
            memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
    }
    struct request rq = {0};
    if ((size_t)n < sizeof rq.h || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
        close_fds(fds, nfds);
        return true;
    }
    memcpy(&rq.h, buf, sizeof rq.h);
    size_t inline_len = (size_t)n - sizeof rq.h;
    if (!(rq.h.flags & NSBOX_F_PAYLOAD_FD) && rq.h.payload_len != inline_len) {
        if (nfds > 0)
            send_reply(fds[0], NSBOX_REPLY_FAIL, 0, EINVAL, NSBOX_STAGE_REQUEST, -1);
        close_fds(fds, nfds);
        return true;
    }

    switch (rq.h.op) {
    case NSBOX_OP_EXEC:
    case NSBOX_OP_OPEN:
        spawn_request(&rq, buf + sizeof rq.h, fds, nfds);
        return true;
    case NSBOX_OP_DETACH:
        detached = true;
        serve_status(fd);
        break;
    case NSBOX_OP_STATUS:
        serve_status(fd);
        break;
    case NSBOX_OP_SHUTDOWN:
        shutdown_sandbox();
    }
    close_fds(fds, nfds);
    return true;
}

static void remove_job(size_t i)
{
    if (jobs[i].chan >= 0)
        close(jobs[i].chan);
    jobs[i] = jobs[--njobs];
}

static void reap(void)
{
    struct signalfd_siginfo si;
    while (read(sig_fd, &si, sizeof si) > 0)
        ;
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        for (size_t i = 0; i < njobs; i++) {
            if (jobs[i].pid != pid)
                continue;
            int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
            if (jobs[i].chan >= 0)
                send_reply(jobs[i].chan, NSBOX_REPLY_EXIT, code, 0, 0, -1);
            remove_job(i);
            break;
        }
    }
}

/* The host wrote a signal number on a command's channel, or closed it. */
static void serve_channel(size_t i)
{
    int32_t sig;
    ssize_t n = read(jobs[i].chan, &sig, sizeof sig);
    if (n < 0 && (errno == EINTR || errno == EAGAIN))
        return;
    if (n == (ssize_t)sizeof sig && sig > 0 && sig < NSIG) {
        kill_tree(jobs[i].pid, sig);
        return;
    }
    /* EOF or garbage: the host no longer wants this command (or, for a
     * detached one, no longer wants to hear about it). */
    if (!jobs[i].detached)
        kill_tree(jobs[i].pid, SIGKILL);
    close(jobs[i].chan);
    jobs[i].chan = -1; /* still reaped, silently */
}

static void accept_clients(void)
{
    int fd;
    while ((fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK)) >= 0)
        add_conn(fd, false);
}

int main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    umask(022);
    /* Lift the descriptor soft limit: each running command holds a channel. */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }

    /* SIGCHLD arrives through a signalfd; the signals that would kill an
     * ordinary process do not reach PID 1 from inside its namespace anyway,
     * and SIGPIPE must not kill us when a host drops a channel. */
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    signal(SIGPIPE, SIG_IGN);
    sig_fd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sig_fd < 0)
        return 70;

    /* Nothing in the sandbox may ptrace us or take our descriptors (the
     * lifeline among them); the sandbox's processes hold no capabilities in
     * our user namespace, so this suffices. Our exec'd children are
     * dumpable again. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    if (fcntl(NSBOX_FD_USERNS, F_GETFD) >= 0 && fcntl(NSBOX_FD_MNTNS, F_GETFD) >= 0) {
        userns_fd = NSBOX_FD_USERNS;
        mntns_fd = NSBOX_FD_MNTNS;
        fcntl(userns_fd, F_SETFD, FD_CLOEXEC);
        fcntl(mntns_fd, F_SETFD, FD_CLOEXEC);
    }

    fcntl(NSBOX_FD_CONTROL, F_SETFD, FD_CLOEXEC);
    fcntl(NSBOX_FD_CONTROL, F_SETFL, O_NONBLOCK);
    add_conn(NSBOX_FD_CONTROL, true);
    if (fcntl(NSBOX_FD_LISTEN, F_GETFD) >= 0) {
        listen_fd = NSBOX_FD_LISTEN;
        fcntl(listen_fd, F_SETFD, FD_CLOEXEC);
        fcntl(listen_fd, F_SETFL, O_NONBLOCK);
    }

    struct pollfd *pfds = NULL;
    size_t pcap = 0;
    for (;;) {
        size_t n = 0, need = 2 + nconns + njobs;
        pfds = grow(pfds, &pcap, need, sizeof *pfds);
        pfds[n++] = (struct pollfd){.fd = sig_fd, .events = POLLIN};
        pfds[n++] = (struct pollfd){.fd = listen_fd, .events = POLLIN};
        size_t conn_base = n;
        for (size_t i = 0; i < nconns; i++)
            pfds[n++] = (struct pollfd){.fd = conns[i].fd, .events = POLLIN};
        size_t job_base = n;
        for (size_t i = 0; i < njobs; i++)
            pfds[n++] = (struct pollfd){.fd = jobs[i].chan, .events = POLLIN};

        if (poll(pfds, n, -1) < 0) {
            if (errno == EINTR)
                continue;
            return 70;
        }
        /* Walk connections and jobs backwards: dropping swaps in the last. */
        for (size_t i = njobs; i-- > 0;) {
            if (pfds[job_base + i].revents)
                serve_channel(i);
        }
        for (size_t i = nconns; i-- > 0;) {
            short ev = pfds[conn_base + i].revents;
            if (ev & POLLIN) {
                if (!serve_conn(conns[i].fd))
                    drop_conn(i);
            } else if (ev & (POLLHUP | POLLERR | POLLNVAL)) {
                drop_conn(i);
            }
        }
        if (listen_fd >= 0 && pfds[1].revents)
            accept_clients();
        if (pfds[0].revents)
            reap();
    }
}
