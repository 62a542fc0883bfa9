/*
 * main.c - nsbox-init, PID 1 of every nsbox sandbox: its server loop.
 *
 * A small static program with four jobs:
 *   1. spawn server: on an EXEC request it starts a child that shares its
 *      memory until it execs (spawn_shared), which applies cwd and
 *      credentials and execs the command with cmd[0] resolved through PATH;
 *      on an OPEN request a forked child opens a file as the requesting user
 *      and passes the descriptor back;
 *   2. reaper: it reaps every process that ends up as its child and reports
 *      the exit status of commands (128+N for signal N), or starts a
 *      command with a restart policy again;
 *   3. killer: on request (or when the host drops a command's channel) it
 *      kills the command's whole process tree;
 *   4. lifeline: when the owning process is gone (POLLHUP on the lifeline
 *      pipe, NSBOX_FD_LIFELINE) it kills everything and exits, which makes
 *      the kernel tear down the sandbox. Connections come and go: the
 *      owner closes its own while the sandbox is idle.
 *
 * The init holds no privileges beyond those of the sandbox itself. It never
 * blocks on a request body: payloads arrive inline or in a memfd. The work
 * that may block happens in a child: an open in a forked one; an exec in
 * one the init waits for only until its execve, and never while a sandbox
 * process holds it stopped (wait_for_exec).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/ioctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/fdpass.h"
#include "init/init.h"
#include "init/rawsys.h"
#include "init/seccomp.h"

/* A forked child we answer for: a command started by EXEC whose exit has
 * not been reported yet, or the helper serving an OPEN. */
struct job {
    pid_t pid;     /* 0 while a restart waits (restart->due) */
    int chan;      /* -1 once the host has let go of the channel */
    int start;     /* EXEC: the start pipe until the command runs or failed, else -1 */
    bool detached; /* losing the channel does not kill it */
    bool open;     /* an OPEN helper: it answers on its own copy of chan */
    bool stopped;  /* we killed it because a sandbox process stopped it */
    bool no_started; /* EXEC: the host asked for no STARTED reply */
    bool rerun;    /* started again by its restart policy: no replies but EXIT */
    int code;      /* while a restart waits: the last run's exit status */
    struct restart *restart; /* EXEC with F_RESTART: how to start it again */
};

/* A command with a restart policy: its request as it came, and our copies
 * of its descriptors, to start it again as often as it exits. */
struct restart {
    struct nsbox_request h;
    char *payload; /* inline; NULL where it came in a memfd, fds[3] */
    int fds[4];    /* stdin, stdout, stderr [, the payload's memfd] */
    int nfds;
    uint32_t restarts; /* so far */
    long delay_ms;     /* the next wait */
    struct timespec started, due;
};
/* Docker's backoff: 100 ms, doubled at each restart up to 1 min, and back
 * to 100 ms after a run of 10 s. A command that exits at once costs the
 * init a fork every minute at most, once the waits have grown. */
#define RESTART_FIRST_MS 100
#define RESTART_MAX_MS 60000
#define RESTART_RESET_MS 10000


static struct job *jobs;
static size_t njobs, jobs_cap;
static int *conns; /* accepted client connections */
static size_t nconns, conns_cap;
static int sig_fd = -1, listen_fd = -1;
/* Out of descriptors (our RLIMIT_NOFILE, or the system's), accept4 fails
 * and leaves the client in the backlog, where poll keeps reporting it: we
 * would spin. spare_fd, a copy of sig_fd, is closed then to make room to
 * accept that client and close it, so the host hears an error at once
 * (see turn_away). Where even that fails, the listener leaves the poll set
 * (listen_paused) for LISTEN_RETRY_MS, or until something else wakes us. */
static int spare_fd = -1;
static bool listen_paused;
#define LISTEN_RETRY_MS 100
static int userns_fd = -1, mntns_fd = -1; /* where sandbox processes run */
static bool detached;
static uint64_t exec_count;
/* argv "--nested-userns": commands may create namespaces (see seccomp.c). */
static bool allow_nested_userns;
static bool unfiltered; /* privileged: no seccomp filter at all */
/* Why the kernel refused our seccomp filter (an errno), or 0: with no
 * filter, no command runs. */
static int filter_err;
/* Whether a child may share our memory until its exec (spawn_shared):
 * not if fs.suid_dumpable is 1, which would let the sandbox user ptrace
 * that child between its credential change and its exec, and so reach our
 * memory. Read once at start (check_shared_spawn); when unsure, we fork. */
static bool shared_spawn_safe;

static void shutdown_sandbox(void)
{
    /* As PID 1, kill(-1) reaches every other process of the namespace; our
     * exit then makes the kernel kill anything that slipped through. */
    kill(-1, SIGKILL);
    _exit(0);
}

/* ---- the server side ------------------------------------------------- */

static void drop_conn(size_t i)
{
    close(conns[i]);
    conns[i] = conns[--nconns];
}

static void close_fds(const int *fds, int n)
{
    for (int i = 0; i < n; i++)
        close(fds[i]);
}

/* Refuses a request: FAIL on its channel (fds[0], if it came with any
 * descriptor), and every descriptor it brought closed. */
static void refuse(const int *fds, int nfds, int32_t err, int32_t stage)
{
    if (nfds > 0)
        send_reply(fds[0], NSBOX_REPLY_FAIL, 0, err, stage, -1);
    close_fds(fds, nfds);
}

static void serve_status(int fd)
{
    struct nsbox_status st = {
        .version = NSBOX_PROTOCOL_VERSION,
        .running = (uint32_t)njobs,
        .execs = exec_count,
        .detached = detached,
        .flags = shared_spawn_safe ? NSBOX_STATUS_SHARED_SPAWN : 0,
    };
    send(fd, &st, sizeof st, MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* Moves a freshly forked child into the namespaces sandbox processes live
 * in (see csrc/create/lock.c); returns 0 or an errno. */
static int enter_sandbox(void)
{
    if (userns_fd < 0)
        return 0;
    if (setns(userns_fd, CLONE_NEWUSER) < 0 || setns(mntns_fd, CLONE_NEWNS) < 0)
        return errno;
    return 0;
}

static void add_job(struct job j)
{
    jobs = grow(jobs, &jobs_cap, njobs + 1, sizeof *jobs);
    jobs[njobs++] = j;
}

/* Keeps what a command with a restart policy needs to start again: its
 * request, and `fds` (stdin, stdout, stderr [, payload memfd]), which are
 * then the restart's. NULL where there is no memory: it runs once. */
static struct restart *new_restart(const struct request *rq, const char *payload, const int *fds, int nfds)
{
    struct restart *r = calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->h = rq->h;
    if (!(rq->h.flags & NSBOX_F_PAYLOAD_FD)) {
        r->payload = malloc(rq->h.payload_len ? rq->h.payload_len : 1);
        if (!r->payload) {
            free(r);
            return NULL;
        }
        memcpy(r->payload, payload, rq->h.payload_len);
    }
    memcpy(r->fds, fds, (size_t)nfds * sizeof *fds);
    r->nfds = nfds;
    clock_gettime(CLOCK_MONOTONIC, &r->started);
    return r;
}

static void drop_restart(struct job *j)
{
    struct restart *r = j->restart;
    if (!r)
        return;
    close_fds(r->fds, r->nfds);
    free(r->payload);
    free(r);
    j->restart = NULL;
}

/* Records a started EXEC command; the descriptors it was given are its own
 * now (the command's stdout and stderr must reach EOF when it exits), or
 * its restart policy's. `failed`: the host heard it did not start, and it
 * will not be restarted. */
static void add_exec_job(pid_t pid, int start, const struct request *rq, const char *payload, int *fds, int nfds,
                         bool failed)
{
    struct restart *r = NULL;
    if ((rq->h.flags & NSBOX_F_RESTART) && !failed)
        r = new_restart(rq, payload, fds + 1, nfds - 1);
    add_job((struct job){.pid = pid, .chan = fds[0], .start = start, .detached = rq->h.flags & NSBOX_F_DETACHED,
                         .no_started = rq->h.flags & NSBOX_F_NO_STARTED, .restart = r});
    if (!r)
        close_fds(fds + 1, nfds - 1);
}

/* ---- starting a command without copying ourselves --------------------- */

/* How long a child sharing our memory may take to exec before we kill it:
 * we serve nothing while it runs on our memory. */
#define SHARED_EXEC_LIMIT_MS 10000
/* How often we look for a stopped child, or a lost lifeline, meanwhile. */
#define SHARED_CHECK_MS 5
/* How long we wait for a killed child to leave our memory. One stuck in an
 * uninterruptible wait (on a FUSE file system a sandbox process serves, or
 * a hung NFS mount) may never: we stop waiting and leave it its slot. */
#define SHARED_KILL_WAIT_MS 1000

/* The stack of the child of spawn_shared (one at a time), with a guard page
 * below it; mapped on first use. */
#define SHARED_STACK_SIZE (256 * 1024)
static char *shared_stack;

/* The child of spawn_shared, in static memory: the kernel writes tid when
 * the child leaves our memory, which may be after we stopped waiting. */
struct shared_child {
    struct request *rq;
    int *fds;
    struct start_failure failure; /* the child's report; see shared_child_main */
    pid_t tid; /* the kernel zeroes it, and wakes us, at its exec or exit */
};
static struct shared_child shared;

static void check_shared_spawn(void)
{
    char c = 0;
    int fd = open("/proc/sys/fs/suid_dumpable", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        shared_spawn_safe = read(fd, &c, 1) == 1 && c == '0';
        close(fd);
    }
}

static int shared_child_main(void *arg)
{
    struct shared_child *c = arg;
    child_report_fd = -1;
    child_report_mem = &c->failure;
    reset_signals();
    /* The kernel lets a process that shares its memory, but not its
     * thread group, join a user namespace (userns_install). */
    int err = enter_sandbox();
    if (err)
        child_fail(NSBOX_STAGE_SPAWN, err);
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0); /* see child_exec */
    if (setsid() < 0)
        child_fail(NSBOX_STAGE_SPAWN, errno);
    child_exec(c->rq, c->fds);
}

static long elapsed_ms(const struct timespec *since)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - since->tv_sec) * 1000 + (now.tv_nsec - since->tv_nsec) / 1000000;
}

static pid_t shared_tid(void)
{
    return __atomic_load_n(&shared.tid, __ATOMIC_ACQUIRE);
}

/* Waits until the child of spawn_shared has exec'd or died, that is, has
 * left our memory: CLONE_CHILD_CLEARTID makes the kernel zero shared.tid
 * and wake a futex on it then. A futex, not a close-on-exec pipe: a pipe's
 * wakeup would queue us behind the exec'd command on its CPU. A sandbox
 * process may stop the child (it runs as a sandbox user), so every few
 * milliseconds we look, and kill a stopped child rather than wait on it.
 * The child shares our errno: only errno-free calls here (rawsys.h).
 * Returns false if a killed child still holds our memory after
 * SHARED_KILL_WAIT_MS; it will never run its own code again. */
static bool wait_for_exec(pid_t pid)
{
    struct timespec start, checked, killed_at;
    clock_gettime(CLOCK_MONOTONIC, &start);
    checked = start;
    bool killed = false;
    pid_t t;
    while ((t = shared_tid()) != 0) {
        struct timespec ts = {.tv_nsec = SHARED_CHECK_MS * 1000000L};
        raw_syscall5(SYS_futex, (long)&shared.tid, FUTEX_WAIT, t, (long)&ts, 0);
        if (elapsed_ms(&checked) < SHARED_CHECK_MS)
            continue;
        clock_gettime(CLOCK_MONOTONIC, &checked);
        /* The lifeline holds while we wait: POLLHUP needs no events. */
        struct pollfd p = {.fd = detached ? -1 : NSBOX_FD_LIFELINE};
        struct timespec now = {0};
        if (raw_syscall5(SYS_ppoll, (long)&p, 1, (long)&now, 0, 0) > 0 && p.revents)
            shutdown_sandbox();
        if (killed) {
            if (elapsed_ms(&killed_at) >= SHARED_KILL_WAIT_MS)
                return false;
            continue;
        }
        siginfo_t st = {0};
        bool stopped = raw_syscall5(SYS_waitid, P_PID, pid, (long)&st, WSTOPPED | WNOHANG | WNOWAIT, 0) == 0 &&
                       st.si_pid == pid;
        bool late = elapsed_ms(&start) >= SHARED_EXEC_LIMIT_MS;
        /* A child that has exec'd meanwhile is the command: not ours to kill. */
        if ((stopped || late) && shared_tid() != 0) {
            raw_syscall5(SYS_kill, pid, SIGKILL, 0, 0, 0); /* our unreaped child: its pid cannot be reused */
            killed = true;
            clock_gettime(CLOCK_MONOTONIC, &killed_at);
            shared.failure = (struct start_failure){.stage = NSBOX_STAGE_HELPER, .err = stopped ? EINTR : ETIMEDOUT};
        }
    }
    return true;
}

/* Starts an EXEC command in a child that shares our memory (CLONE_VM, as
 * posix_spawn does) until its execve: no page tables to copy, no
 * copy-on-write faults, no copy to tear down at the exec. Unlike vfork, we
 * wait for the exec ourselves (see wait_for_exec), so a stopped child
 * cannot stop PID 1. The child allocates nothing (parse_payload laid out
 * what it needs), runs on its own stack, and writes no memory we use but
 * its failure report. */
static void spawn_shared(struct request *rq, char *payload, int *fds, int nfds)
{
    int chan = fds[0];
    if (!shared_stack) {
        char *m = mmap(NULL, SHARED_STACK_SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK,
                       -1, 0);
        if (m == MAP_FAILED) {
            refuse(fds, nfds, errno, NSBOX_STAGE_SPAWN);
            return;
        }
        mprotect(m, 4096, PROT_NONE); /* the guard page: best effort */
        shared_stack = m;
    }
    if (!parse_payload(rq, payload, rq->h.payload_len) || rq->h.argc == 0) {
        free(rq->strings);
        refuse(fds, nfds, EINVAL, NSBOX_STAGE_REQUEST);
        return;
    }
    /* Until the child clears it at its execve, the report says a sandbox
     * process killed the child: dying without a word is that. */
    shared = (struct shared_child){.rq = rq, .fds = fds, .failure = HELPER_KILLED};
    pid_t pid = clone(shared_child_main, shared_stack + SHARED_STACK_SIZE,
                      CLONE_VM | CLONE_PARENT_SETTID | CLONE_CHILD_CLEARTID | SIGCHLD, &shared, &shared.tid, NULL,
                      &shared.tid);
    int clone_err = errno; /* only read if there is no child to change it */
    bool left = pid < 0 || wait_for_exec(pid);
    free(rq->strings);
    /* The child's credential changes reset the dumpable flag we share. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    if (pid < 0) {
        refuse(fds, nfds, clone_err, NSBOX_STAGE_SPAWN);
        return;
    }
    exec_count++;
    if (!left) {
        /* Stuck, killed: it keeps its slot (we fork meanwhile), is reaped
         * silently whenever it dies, and the host hears why now. */
        refuse(fds, nfds, shared.failure.err, shared.failure.stage);
        add_job((struct job){.pid = pid, .chan = -1, .start = -1});
        return;
    }
    if (shared.failure.stage)
        send_reply(chan, NSBOX_REPLY_FAIL, 0, shared.failure.err, shared.failure.stage, -1);
    else if (!(rq->h.flags & NSBOX_F_NO_STARTED))
        send_reply(chan, NSBOX_REPLY_STARTED, 0, 0, 0, -1);
    add_exec_job(pid, -1, rq, payload, fds, nfds, shared.failure.stage != 0);
}

/* The forked child of a request: an OPEN reports a failure on its
 * channel, an EXEC on its start pipe, `start_w` (-1 for a restart's run,
 * which no one waits for). */
static void __attribute__((noreturn)) request_child(struct request *rq, char *payload, int *fds, int nfds, int start_w)
{
    bool exec = rq->h.op == NSBOX_OP_EXEC;
    child_report_is_pipe = exec;
    child_report_fd = exec ? start_w : fds[0];
    child_report_mem = NULL; /* a child of spawn_shared set it in our memory */
    reset_signals();
    /* We carry the init's seccomp filter, which allows exactly these two
     * setns calls (see seccomp.c). */
    int err = enter_sandbox();
    if (err)
        child_fail(NSBOX_STAGE_SPAWN, err);
    if (rq->h.flags & NSBOX_F_PAYLOAD_FD) {
        payload = read_payload_fd(fds[nfds - 1], rq->h.payload_len);
        if (!payload)
            child_fail(NSBOX_STAGE_REQUEST, EIO);
    }
    if (!parse_payload(rq, payload, rq->h.payload_len) || (exec && rq->h.argc == 0))
        child_fail(NSBOX_STAGE_REQUEST, EINVAL);
    if (!exec)
        child_open(rq);
    /* Each command leads its own session, so kill_tree can find it. */
    if (setsid() < 0)
        child_fail(NSBOX_STAGE_SPAWN, errno);
    child_exec(rq, fds);
}

/* Forks the child that serves an EXEC or OPEN request.
 *
 * Until it has exec'd, an EXEC child is nsbox's helper, not the command: it
 * reports a failure on a close-on-exec start pipe, whose EOF without a
 * report means the command runs (STARTED). A helper runs as a sandbox user
 * so a sandbox process may signal it; reap() kills one that gets stopped,
 * and the host hears STAGE_HELPER instead of waiting forever. */
static void spawn_request(struct request *rq, char *payload, int *fds, int nfds)
{
    bool exec = rq->h.op == NSBOX_OP_EXEC;
    int need = exec ? 4 : 1;
    bool in_fd = rq->h.flags & NSBOX_F_PAYLOAD_FD;
    if (nfds != need + (in_fd ? 1 : 0)) {
        refuse(fds, nfds, EINVAL, NSBOX_STAGE_REQUEST);
        return;
    }
    int chan = fds[0];
    if (exec && filter_err) {
        refuse(fds, nfds, filter_err, NSBOX_STAGE_SPAWN);
        return;
    }
    /* One child at a time shares our memory: while a stuck one holds it,
     * we fork. */
    if (exec && !in_fd && shared_spawn_safe && shared_tid() == 0) {
        spawn_shared(rq, payload, fds, nfds);
        return;
    }
    int start[2] = {-1, -1};
    if (exec && pipe2(start, O_CLOEXEC | O_NONBLOCK) < 0) {
        refuse(fds, nfds, errno, NSBOX_STAGE_SPAWN);
        return;
    }
    pid_t pid = fork();
    if (pid < 0) {
        refuse(fds, nfds, errno, NSBOX_STAGE_SPAWN);
        close_fds(start, exec ? 2 : 0);
        return;
    }
    if (pid == 0)
        request_child(rq, payload, fds, nfds, start[1]);
    if (exec) {
        exec_count++;
        close(start[1]);
        add_exec_job(pid, start[0], rq, payload, fds, nfds, false);
    } else {
        /* The helper answers on its own copy of chan; ours tells us when
         * the host gives up, and is closed when the helper is reaped. */
        add_job((struct job){.pid = pid, .chan = chan, .start = -1, .open = true});
        close_fds(fds + 1, nfds - 1);
    }
}

/* Handles one message on a connection; returns false if it closed. */
static bool serve_conn(int fd)
{
    /* Aligned: the payload after the header starts with uint32 group ids. */
    static char buf[NSBOX_MSG_MAX] __attribute__((aligned(8)));
    int fds[NSBOX_MAX_FDS], nfds;
    bool truncated;
    ssize_t n = recv_with_fds(fd, buf, sizeof buf, fds, NSBOX_MAX_FDS, &nfds, &truncated, MSG_DONTWAIT);
    if (n < 0)
        return errno == EINTR || errno == EAGAIN;
    if (n == 0)
        return false;
    struct request rq = {0};
    if (truncated) {
        /* Longer than any request (it fills buf), or with more descriptors
         * than any request has, or with its descriptors cut off: the kernel
         * installs none past our RLIMIT_NOFILE (MSG_CTRUNC), and drops the
         * rest. The host hears why on the channel, fds[0], if that came;
         * else it sees the channel closed. Either way it does not wait, and
         * the connection stays usable. */
        refuse(fds, nfds, (size_t)n < sizeof buf && nfds < NSBOX_MAX_FDS ? EMFILE : EINVAL, NSBOX_STAGE_REQUEST);
        return true;
    }
    if ((size_t)n < sizeof rq.h) {
        close_fds(fds, nfds);
        return true;
    }
    memcpy(&rq.h, buf, sizeof rq.h);
    size_t inline_len = (size_t)n - sizeof rq.h;
    if (!(rq.h.flags & NSBOX_F_PAYLOAD_FD) && rq.h.payload_len != inline_len) {
        refuse(fds, nfds, EINVAL, NSBOX_STAGE_REQUEST);
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
    if (jobs[i].start >= 0)
        close(jobs[i].start);
    drop_restart(&jobs[i]);
    jobs[i] = jobs[--njobs];
}

/* ---- restart policies ------------------------------------------------ */

/* Whether a command that exited with `code` runs again; if so, when. */
static bool will_restart(struct job *j, int code)
{
    struct restart *r = j->restart;
    if (!r || ((r->h.flags & NSBOX_F_RESTART_ON_FAILURE) && code == 0) || (r->h.mode && r->restarts >= r->h.mode))
        return false;
    if (elapsed_ms(&r->started) >= RESTART_RESET_MS || !r->delay_ms)
        r->delay_ms = RESTART_FIRST_MS;
    clock_gettime(CLOCK_MONOTONIC, &r->due);
    r->due.tv_sec += r->delay_ms / 1000;
    r->due.tv_nsec += (r->delay_ms % 1000) * 1000000L;
    if (r->due.tv_nsec >= 1000000000L) {
        r->due.tv_sec++;
        r->due.tv_nsec -= 1000000000L;
    }
    r->delay_ms = r->delay_ms * 2 > RESTART_MAX_MS ? RESTART_MAX_MS : r->delay_ms * 2;
    /* As a restarted container starts with no process of its last run, the
     * run's leftovers (a server it put in the background) go with it: they
     * would hold its ports and pile up. Its session id outlives it while
     * they keep it, so it cannot name anyone else. */
    if (j->pid > 0)
        kill_leftovers(j->pid);
    j->pid = 0;
    j->code = code;
    return true;
}

/* Starts a waiting command again, in a forked child. Its run reports to no
 * one: the host heard it start the first time, and hears its last exit.
 * It has a start pipe, as a first run has, so that a helper a sandbox
 * process stops before its exec is killed (reap), not left holding copies
 * of our descriptors. */
static void start_again(struct job *j)
{
    struct restart *r = j->restart;
    struct request rq = {.h = r->h};
    int fds[1 + 4] = {-1};
    memcpy(fds + 1, r->fds, (size_t)r->nfds * sizeof *fds);
    int start[2] = {-1, -1};
    pid_t pid = pipe2(start, O_CLOEXEC | O_NONBLOCK) < 0 ? -1 : fork();
    if (pid == 0)
        request_child(&rq, r->payload, fds, 1 + r->nfds, start[1]);
    if (start[1] >= 0)
        close(start[1]);
    if (pid < 0) { /* no process or pipe to be had now (a pids limit): as a run that failed at once */
        if (start[0] >= 0)
            close(start[0]);
        clock_gettime(CLOCK_MONOTONIC, &r->started);
        will_restart(j, j->code);
        return;
    }
    r->restarts++;
    clock_gettime(CLOCK_MONOTONIC, &r->started);
    j->pid = pid;
    j->start = start[0];
    j->stopped = false;
    j->rerun = true;
}

/* Milliseconds until the next restart is due: the poll's timeout (-1: none). */
static int next_restart_ms(void)
{
    long next = -1;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    for (size_t i = 0; i < njobs; i++) {
        const struct restart *r = jobs[i].restart;
        if (jobs[i].pid || !r)
            continue;
        long ms = (r->due.tv_sec - now.tv_sec) * 1000 + (r->due.tv_nsec - now.tv_nsec) / 1000000 + 1;
        if (ms < 0)
            ms = 0;
        if (next < 0 || ms < next)
            next = ms;
    }
    return (int)next;
}

/* Starts the waiting commands that are due. A waiting command whose policy
 * the host ended (serve_channel) is done: its last status is its EXIT. */
static void restart_due(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    for (size_t i = njobs; i-- > 0;) {
        struct job *j = &jobs[i];
        if (j->pid)
            continue;
        if (!j->restart) {
            if (j->chan >= 0)
                send_reply(j->chan, NSBOX_REPLY_EXIT, j->code, 0, 0, -1);
            remove_job(i);
        } else if (now.tv_sec > j->restart->due.tv_sec ||
                   (now.tv_sec == j->restart->due.tv_sec && now.tv_nsec >= j->restart->due.tv_nsec)) {
            start_again(j);
        }
    }
}

/* The start pipe of an EXEC is readable (or its helper is gone): tells the
 * host whether the command runs. */
static void settle_start(struct job *j)
{
    struct start_failure f;
    ssize_t n = read(j->start, &f, sizeof f);
    if (n < 0 && errno == EAGAIN && !j->stopped)
        return;
    close(j->start);
    j->start = -1;
    if (j->rerun)
        return; /* a restart's run: its exit is what counts (will_restart) */
    if (j->stopped || n == (ssize_t)sizeof f)
        drop_restart(j); /* it did not start: nothing to run again */
    if (j->chan < 0)
        return;
    if (j->stopped)
        send_reply(j->chan, NSBOX_REPLY_FAIL, 0, EINTR, NSBOX_STAGE_HELPER, -1);
    else if (n == (ssize_t)sizeof f)
        send_reply(j->chan, NSBOX_REPLY_FAIL, 0, f.err, f.stage, -1);
    else if (!j->no_started)
        send_reply(j->chan, NSBOX_REPLY_STARTED, 0, 0, 0, -1);
}

/* Whether a job's helper has become its command: its exec closed the start
 * pipe's write end, and no failure was written first. */
static bool exec_done(int start)
{
    struct pollfd p = {.fd = start, .events = POLLIN};
    int avail = 0;
    return poll(&p, 1, 0) == 1 && (p.revents & POLLHUP) && ioctl(start, FIONREAD, &avail) == 0 && avail == 0;
}

static struct job *find_job(pid_t pid)
{
    for (size_t i = 0; i < njobs; i++) {
        if (jobs[i].pid == pid)
            return &jobs[i];
    }
    return NULL;
}

static void reap(void)
{
    struct signalfd_siginfo si;
    while (read(sig_fd, &si, sizeof si) > 0)
        ;
    int status;
    pid_t pid;
    /* WUNTRACED: a helper that is not yet the command (or serves an OPEN)
     * is ours, and a sandbox process that stops it would stall the host. */
    while ((pid = waitpid(-1, &status, WNOHANG | WUNTRACED)) > 0) {
        struct job *j = find_job(pid);
        if (!j)
            continue;
        if (WIFSTOPPED(status)) {
            /* The command may have started since the poll and stopped
             * itself (a shell's `suspend`): not a helper to kill. */
            if (!j->open && j->start >= 0 && exec_done(j->start))
                settle_start(j);
            if (j->open || j->start >= 0) {
                j->stopped = true;
                kill(pid, SIGKILL); /* our unreaped child: its pid cannot be reused */
            }
            continue;
        }
        if (j->start >= 0)
            settle_start(j); /* before EXIT: the host hears why first */
        int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (!j->open && will_restart(j, code))
            continue; /* no reply: it runs again (restart_due) */
        if (j->chan >= 0) {
            if (j->open) {
                if (j->stopped || WIFSIGNALED(status))
                    send_reply(j->chan, NSBOX_REPLY_FAIL, 0, EINTR, NSBOX_STAGE_HELPER, -1);
            } else {
                send_reply(j->chan, NSBOX_REPLY_EXIT, code, 0, 0, -1);
            }
        }
        remove_job((size_t)(j - jobs));
    }
}

/* The host wrote a signal number on a command's channel, or closed it. */
static void serve_channel(size_t i)
{
    int32_t sig;
    ssize_t n = read(jobs[i].chan, &sig, sizeof sig);
    if (n < 0 && (errno == EINTR || errno == EAGAIN))
        return;
    if (!jobs[i].open && n == (ssize_t)sizeof sig && sig > 0 && sig < NSIG) {
        /* As with `docker kill`, SIGKILL or SIGTERM (the stop signal)
         * from the host ends a restart policy, and a command waiting to
         * restart is then done (restart_due); other signals leave it. */
        if ((sig == SIGKILL || sig == SIGTERM) && jobs[i].restart) {
            drop_restart(&jobs[i]);
            if (!jobs[i].pid)
                jobs[i].code = 128 + sig; /* killed while waiting: as if killed running */
        }
        if (jobs[i].pid)
            kill_tree(jobs[i].pid, sig);
        return;
    }
    /* EOF or garbage: the host no longer wants this command (or, for a
     * detached one, no longer wants to hear about it). */
    if (jobs[i].open) {
        kill(jobs[i].pid, SIGKILL);
    } else if (!jobs[i].detached) {
        drop_restart(&jobs[i]);
        if (jobs[i].pid)
            kill_tree(jobs[i].pid, SIGKILL);
    }
    close(jobs[i].chan);
    jobs[i].chan = -1; /* still reaped, silently */
}

/* accept4 failed for want of descriptors: accepts the waiting client in
 * the room spare_fd leaves and closes it (its request unread, so the host
 * sees its connection and channel closed). Returns true if it did; else
 * there is no client, or no room even so, and the listener is paused. */
static bool turn_away(void)
{
    int fd = -1, err = EMFILE;
    if (spare_fd >= 0) {
        close(spare_fd);
        fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC);
        err = errno;
        if (fd >= 0)
            close(fd);
        /* Back into the number just freed, below the limit as before. */
        spare_fd = fcntl(sig_fd, F_DUPFD_CLOEXEC, 0);
    }
    if (fd >= 0)
        return true;
    if (err == EMFILE || err == ENFILE)
        listen_paused = true;
    return false;
}

/* A client usually sends its request right after connecting: serve it
 * now rather than after another poll. */
static void accept_clients(void)
{
    for (;;) {
        int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            if ((errno == EMFILE || errno == ENFILE) && turn_away())
                continue;
            return;
        }
        if (!serve_conn(fd)) {
            close(fd);
            continue;
        }
        conns = grow(conns, &conns_cap, nconns + 1, sizeof *conns);
        conns[nconns++] = fd;
    }
}

int main(int argc, char **argv)
{
    for (int i = 2; i < argc; i++) { /* argv[1] is the sandbox's id */
        allow_nested_userns |= strcmp(argv[i], "--nested-userns") == 0;
        unfiltered |= strcmp(argv[i], "--no-seccomp") == 0;
    }
    umask(022);
    /* Lift the descriptor soft limit: each running command holds a channel. */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    record_limits(); /* restored for each command (see child_exec) */

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
    spare_fd = fcntl(sig_fd, F_DUPFD_CLOEXEC, 0); /* best effort: see turn_away */

    /* Nothing in the sandbox may ptrace us or take our descriptors (the
     * lifeline among them); the sandbox's processes hold no capabilities in
     * our user namespace, so this suffices for ptrace. It does not for what
     * the kernel allows a process's owner, which sandbox root is to the
     * kernel (same ids): setting our resource limits and scheduling. The
     * seccomp filter refuses those on process 1 (see seccomp.c). Our
     * exec'd children are dumpable again. */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0)
        return 70;
    check_shared_spawn();
    if (fcntl(NSBOX_FD_USERNS, F_GETFD) >= 0 && fcntl(NSBOX_FD_MNTNS, F_GETFD) >= 0) {
        userns_fd = NSBOX_FD_USERNS;
        mntns_fd = NSBOX_FD_MNTNS;
        fcntl(userns_fd, F_SETFD, FD_CLOEXEC);
        fcntl(mntns_fd, F_SETFD, FD_CLOEXEC);
    }

    /* The filter goes on us, once: every process of the sandbox is forked
     * from us and inherits it. We hold CAP_SYS_ADMIN in our user namespace,
     * so no no_new_privs is needed. Nothing we do from here on is denied:
     * forks without namespace flags, and the two setns calls of
     * enter_sandbox(). */
    int err = unfiltered ? 0 : nsbox_seccomp_install(allow_nested_userns, userns_fd >= 0);
    filter_err = err < 0 ? -err : 0;

    fcntl(NSBOX_FD_LIFELINE, F_SETFD, FD_CLOEXEC);
    listen_fd = NSBOX_FD_LISTEN;
    if (fcntl(listen_fd, F_SETFD, FD_CLOEXEC) < 0 || fcntl(listen_fd, F_SETFL, O_NONBLOCK) < 0)
        return 70;

    /* Our only child yet is the setup's helper (csrc/create/lock.c), on
     * its way out, if not gone: reap it before any command can see it. It
     * exited while we started, so this rarely waits. */
    for (;;) {
        if (waitpid(-1, NULL, 0) > 0 || errno == EINTR)
            continue;
        break;
    }
    reap(); /* the SIGCHLD it left on the signalfd */

    struct pollfd *pfds = NULL;
    size_t pcap = 0;
    for (;;) {
        size_t n = 0, need = 3 + nconns + 2 * njobs;
        pfds = grow(pfds, &pcap, need, sizeof *pfds);
        pfds[n++] = (struct pollfd){.fd = sig_fd, .events = POLLIN};
        pfds[n++] = (struct pollfd){.fd = listen_paused ? -1 : listen_fd, .events = POLLIN};
        /* POLLHUP needs no events; a detached sandbox has no lifeline. */
        pfds[n++] = (struct pollfd){.fd = detached ? -1 : NSBOX_FD_LIFELINE};
        size_t conn_base = n;
        for (size_t i = 0; i < nconns; i++)
            pfds[n++] = (struct pollfd){.fd = conns[i], .events = POLLIN};
        /* A closed channel or start pipe is -1, which poll skips. */
        size_t job_base = n;
        for (size_t i = 0; i < njobs; i++)
            pfds[n++] = (struct pollfd){.fd = jobs[i].chan, .events = POLLIN};
        size_t start_base = n;
        for (size_t i = 0; i < njobs; i++)
            pfds[n++] = (struct pollfd){.fd = jobs[i].start, .events = POLLIN};

        int timeout = next_restart_ms();
        if (listen_paused && (timeout < 0 || timeout > LISTEN_RETRY_MS))
            timeout = LISTEN_RETRY_MS;
        int r = poll(pfds, n, timeout);
        listen_paused = false; /* try again: a descriptor may be free now */
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return 70;
        }
        /* Walk connections backwards: dropping swaps in the last. Jobs are
         * only removed by reap(), last. */
        for (size_t i = njobs; i-- > 0;) {
            if (jobs[i].chan >= 0 && pfds[job_base + i].revents)
                serve_channel(i);
            if (jobs[i].start >= 0 && pfds[start_base + i].revents)
                settle_start(&jobs[i]);
        }
        for (size_t i = nconns; i-- > 0;) {
            short ev = pfds[conn_base + i].revents;
            if (ev & POLLIN) {
                if (!serve_conn(conns[i]))
                    drop_conn(i);
            } else if (ev & (POLLHUP | POLLERR | POLLNVAL)) {
                drop_conn(i);
            }
        }
        if (pfds[2].revents)
            shutdown_sandbox();
        if (pfds[1].revents)
            accept_clients();
        if (pfds[0].revents)
            reap();
        restart_due();
    }
}
