/*
 * spawn.c - an EXEC request's child: it enters the working directory,
 * takes the terminal if asked, becomes the requested user and execs the
 * command with cmd[0] resolved through the command's own PATH.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "init/init.h"

static char *getenv_from(char **env, size_t envc, const char *name)
{
    size_t n = strlen(name);
    for (size_t i = 0; i < envc; i++) {
        if (strncmp(env[i], name, n) == 0 && env[i][n] == '=')
            return env[i] + n + 1;
    }
    return NULL;
}

/* execve. A child sharing the init's memory clears its report (see
 * spawn_shared) only while the execve runs: if it dies meanwhile, the
 * command did start. */
static void execve_reported(const char *path, char **argv, char **env)
{
    struct start_failure *report = child_report_mem;
    if (report)
        *report = (struct start_failure){0};
    execve(path, argv, env);
    if (report)
        *report = HELPER_KILLED;
}

/* execve, falling back to /bin/sh for files without a #! line (as execvp).
 * Allocates nothing: the child may share the init's memory. */
static void try_exec(const char *path, struct request *rq)
{
    execve_reported(path, rq->argv, rq->env);
    if (errno != ENOEXEC)
        return;
    char **sh = rq->sh;
    sh[0] = "sh";
    sh[1] = (char *)path;
    for (size_t i = 1; i < rq->h.argc; i++)
        sh[i + 1] = rq->argv[i];
    sh[rq->h.argc + 1] = NULL;
    execve_reported("/bin/sh", sh, rq->env);
    errno = ENOEXEC;
}

/* Resolves argv[0] through the command's own PATH and execs it. Returns the
 * errno an execvp would report. */
static int exec_command(struct request *rq)
{
    const char *cmd = rq->argv[0];
    if (!*cmd)
        return ENOENT;
    if (strchr(cmd, '/')) {
        try_exec(cmd, rq);
        return errno;
    }
    const char *path = getenv_from(rq->env, rq->h.envc, "PATH");
    if (!path)
        path = NSBOX_DEFAULT_PATH;
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
            /* Look before calling execve on a path that is not there: while
             * an execve runs, a helper that dies reads as the command, so
             * that window stays as short as the one execve that counts. */
            if (faccessat(AT_FDCWD, buf, F_OK, 0) == 0 || (errno != ENOENT && errno != ENOTDIR))
                try_exec(buf, rq);
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

void __attribute__((noreturn)) child_exec(struct request *rq, int fds[4])
{
    int stdio[3] = {fds[1], fds[2], fds[3]};
    /* First: a descriptor limit lowered since would fail arrange_fds. */
    restore_limits();
    /* The channel stays with the init; we report on the start pipe (or,
     * sharing the init's memory, in it). */
    if (!arrange_fds(stdio, 3, &child_report_fd))
        child_fail(NSBOX_STAGE_SPAWN, errno);
    char *cwd = rq->strings[0];

    /* Like runc: enter the working directory while still root, so a user
     * may start in a directory it cannot search (root's home, say); if root
     * cannot (root-squashed NFS), try again as the user. */
    int cwd_err = (*cwd && chdir(cwd) < 0) ? errno : 0;
    /* We lead a new session (setsid in spawn_request), so this terminal
     * becomes ours: job control works in an interactive shell. */
    if ((rq->h.flags & NSBOX_F_SETCTTY) && ioctl(0, TIOCSCTTY, 0) < 0)
        child_fail(NSBOX_STAGE_SPAWN, errno);
    int err = apply_creds(rq);
    if (err)
        child_fail(NSBOX_STAGE_CREDS, err);
    /* Changing credentials resets the dumpable flag of our memory, which a
     * child started by spawn_shared shares with the init: clear it again. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    if (cwd_err && chdir(cwd) < 0)
        child_fail(NSBOX_STAGE_CWD, errno);
    err = exec_command(rq);
    child_fail(NSBOX_STAGE_EXEC, err);
}
