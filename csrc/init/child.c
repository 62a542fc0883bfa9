/*
 * child.c - what every request child of the init does first: read and
 * check the request's payload, take the requested credentials, put its
 * descriptors in place, and report a failure before it exits.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "init/init.h"

/* The payload's uint32 group ids go to setgroups as they are. */
_Static_assert(sizeof(gid_t) == sizeof(uint32_t), "gid_t is 32 bits");

/* In a request child: where a failure goes (the start pipe of an EXEC, the
 * channel of an OPEN) before the child exits. */
int child_report_fd = -1;
bool child_report_is_pipe;
struct start_failure *child_report_mem;

void __attribute__((noreturn)) child_fail(int stage, int err)
{
    if (child_report_mem) {
        *child_report_mem = (struct start_failure){.stage = stage, .err = err};
    } else if (child_report_is_pipe) {
        struct start_failure f = {.stage = stage, .err = err};
        ssize_t w = write(child_report_fd, &f, sizeof f); /* an empty pipe takes 8 bytes at once */
        (void)w;
    } else {
        send_reply(child_report_fd, NSBOX_REPLY_FAIL, 0, err, stage, -1);
    }
    _exit(127);
}

/* Parses the payload into `rq`, with everything an EXEC child needs laid
 * out in one allocation: a child that shares our memory (CLONE_VM) must
 * not allocate, so this runs before it starts (or in a forked child). */
bool parse_payload(struct request *rq, char *payload, size_t len)
{
    size_t glen = (size_t)rq->h.ngroups * sizeof(uint32_t);
    if (rq->h.ngroups > NGROUPS_MAX || glen > len)
        return false;
    rq->groups = (const uint32_t *)payload;
    size_t argc = rq->h.argc, envc = rq->h.envc, want = 1 + argc + envc;
    if (argc > len || envc > len || want > len - glen) /* each string takes a byte at least */
        return false;
    /* cwd, argv[argc], NULL, env[envc], NULL, then the sh fallback's argc + 2 */
    char **v = calloc(want + 2 + argc + 2, sizeof *v);
    if (!v)
        return false;
    char *p = payload + glen, *end = payload + len;
    for (size_t i = 0; i < want; i++) {
        char *z = memchr(p, 0, (size_t)(end - p));
        if (!z) {
            free(v);
            return false;
        }
        v[i <= argc ? i : i + 1] = p; /* i + 1: past the NULL that ends argv */
        p = z + 1;
    }
    rq->strings = v;
    rq->argv = v + 1;
    rq->env = v + 2 + argc;
    rq->sh = v + 3 + argc + envc;
    return true;
}

/* Reads a payload that came in a memfd. */
char *read_payload_fd(int fd, size_t len)
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
int apply_creds(const struct request *rq)
{
    if (rq->h.flags & NSBOX_F_SETGROUPS) {
        /* With a single mapped id, setgroups is denied by the kernel; only
         * root runs then, and keeping root's groups is what it would get. */
        if (setgroups(rq->h.ngroups, (const gid_t *)rq->groups) < 0 && !(errno == EPERM && rq->h.uid == 0))
            return errno;
    }
    if (setresgid(rq->h.gid, rq->h.gid, rq->h.gid) < 0)
        return errno;
    if (setresuid(rq->h.uid, rq->h.uid, rq->h.uid) < 0)
        return errno;
    return 0;
}

/* Moves the child's descriptors into place: `map[i]` becomes fd i for
 * i < nmap; `*keep`, unless it is -1, is moved above them and stays
 * close-on-exec; every other descriptor is closed. */
bool arrange_fds(const int *map, int nmap, int *keep)
{
    int high[NSBOX_MAX_FDS];
    for (int i = 0; i < nmap; i++) {
        if ((high[i] = fcntl(map[i], F_DUPFD_CLOEXEC, 64)) < 0)
            return false;
    }
    int k = *keep < 0 ? -1 : fcntl(*keep, F_DUPFD_CLOEXEC, 64);
    if (*keep >= 0 && k < 0)
        return false;
    for (int i = 0; i < nmap; i++) {
        if (dup2(high[i], i) < 0) /* dup2 clears close-on-exec on the copy */
            return false;
    }
    int first_closed = nmap;
    if (k >= 0) {
        if (dup2(k, nmap) < 0 || fcntl(nmap, F_SETFD, FD_CLOEXEC) < 0)
            return false;
        *keep = nmap;
        first_closed = nmap + 1;
    }
    /* Nothing of the init's (its connections, the namespace fds) may
     * reach the command. */
    return syscall(SYS_close_range, first_closed, ~0U, 0) == 0;
}

/* Gives the command the signal state of a fresh process: nothing blocked,
 * and SIGPIPE, the one disposition the init changes, back to default
 * (handlers are reset by execve itself). */
void reset_signals(void)
{
    sigset_t all;
    sigemptyset(&all);
    sigprocmask(SIG_SETMASK, &all, NULL);
    signal(SIGPIPE, SIG_DFL);
}

/* The init's resource limits as it started (after the host's, from the
 * sandbox's settings, and its own lifted descriptor limit): what every
 * command gets, whatever was set on the init since. */
static struct rlimit startup_limits[RLIM_NLIMITS];
static bool startup_known[RLIM_NLIMITS];

void record_limits(void)
{
    for (int r = 0; r < RLIM_NLIMITS; r++)
        startup_known[r] = getrlimit(r, &startup_limits[r]) == 0;
}

/* Best effort, and allocation-free (the child may share the init's
 * memory): a hard limit lowered since cannot be raised back without
 * CAP_SYS_RESOURCE over the host, and the command then inherits the lower
 * one, as it would have anyway. */
void restore_limits(void)
{
    for (int r = 0; r < RLIM_NLIMITS; r++) {
        if (startup_known[r])
            setrlimit(r, &startup_limits[r]);
    }
}
