/*
 * init.h - the parts of nsbox-init, PID 1 of every nsbox sandbox:
 *
 *   main.c   the server: connections, requests, jobs, reaping, the lifeline
 *   child.c  what every request child does first: payload, credentials, fds
 *   spawn.c  an EXEC child: working directory, PATH resolution, execve
 *   open.c   an OPEN child: a path opened inside the sandbox, fd sent back
 *   kill.c   signalling a command's whole process tree
 *   reply.c  a reply on a channel, a growing array: used by all of the above
 *
 * The init holds no privileges beyond those of the sandbox itself. It never
 * blocks on a request body: payloads arrive inline or in a memfd, and the
 * work that may block happens in a child (see main.c).
 */
#ifndef NSBOX_INIT_H
#define NSBOX_INIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/protocol.h"

struct request {
    struct nsbox_request h;
    const uint32_t *groups;
    char **strings; /* cwd or path, then argv, NULL, env, NULL (one allocation) */
    char **argv;    /* NULL-terminated, for execve */
    char **env;     /* NULL-terminated, for execve */
    char **sh;      /* argc + 2 free slots: the /bin/sh fallback's argv */
};

/* What a request child writes on the start pipe when it cannot go on. */
struct start_failure {
    int32_t stage;
    int32_t err;
};
/* The report of a helper that died before its exec: a sandbox process
 * stopped or killed it. */
#define HELPER_KILLED ((struct start_failure){.stage = NSBOX_STAGE_HELPER, .err = EINTR})

/* reply.c */
void *grow(void *p, size_t *cap, size_t need, size_t elem);
void send_reply(int chan, int32_t kind, int32_t code, int32_t err, int32_t stage, int fd);

/* child.c: the request child reports failures on child_report_fd (the
 * start pipe of an EXEC, the channel of an OPEN) and exits. */
extern int child_report_fd;
extern bool child_report_is_pipe;
extern struct start_failure *child_report_mem; /* a child sharing our memory: here */
void __attribute__((noreturn)) child_fail(int stage, int err);
bool parse_payload(struct request *rq, char *payload, size_t len);
char *read_payload_fd(int fd, size_t len);
int apply_creds(const struct request *rq);
bool arrange_fds(const int *map, int nmap, int *keep);
void reset_signals(void);
void record_limits(void);
void restore_limits(void);

/* spawn.c */
void __attribute__((noreturn)) child_exec(struct request *rq, int fds[4]);

/* open.c */
void __attribute__((noreturn)) child_open(struct request *rq);

/* kill.c */
void kill_tree(pid_t leader, int sig);
void kill_leftovers(pid_t leader); /* SIGKILL to what a reaped leader's session and group kept */

#endif
