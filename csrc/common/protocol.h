/*
 * protocol.h - the wire format between the host process and the sandbox init.
 *
 * nsbox/init/protocol.py mirrors every definition here; keep the two in step and
 * bump NSBOX_PROTOCOL_VERSION when either changes.
 *
 * Transport:
 *   - The control connection is a SOCK_SEQPACKET socket. The host sends one
 *     struct nsbox_request per message, followed inline by its payload, with
 *     the request's file descriptors attached as SCM_RIGHTS.
 *   - Every EXEC or OPEN request carries a "channel": one end of a fresh
 *     SOCK_STREAM socketpair. Results come back on it as struct nsbox_reply
 *     records: for EXEC, STARTED (unless NSBOX_F_NO_STARTED) or FAIL, then
 *     EXIT; for OPEN, FD or FAIL.
 *     The host may write a 4-byte signal number on it to signal the
 *     command's process tree. Closing it early kills that tree (or the
 *     helper serving an OPEN).
 *   - The init inherits its listening socket and its lifeline as fixed fds
 *     (NSBOX_FD_*). Every client, the owner included, connects to the
 *     listening socket, and may close its connection while idle: a
 *     sandbox's lifetime does not hang on any connection.
 */
#ifndef NSBOX_PROTOCOL_H
#define NSBOX_PROTOCOL_H

#include <stdint.h>

#define NSBOX_PROTOCOL_VERSION 6

/* PATH of a command whose environment has none (the host sends the same
 * default; it reads this one through nsbox_default_path()). */
#define NSBOX_DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

/* Descriptors the init finds open when it starts. */
/* The lifeline: the read end of a pipe whose write end only the owning
 * process holds (one pipe for all of its sandboxes). POLLHUP on it means
 * the owner is gone: the init kills everything and exits. */
#define NSBOX_FD_LIFELINE 3
#define NSBOX_FD_LISTEN 4    /* the listening socket every client connects to */
#define NSBOX_FD_USERNS 5    /* the nested user namespace sandbox processes run in */
#define NSBOX_FD_MNTNS 6     /* and its mount namespace, where every mount is locked */

/* Largest control message: header plus inline payload. Larger payloads
 * travel in a memfd attached as the last descriptor (NSBOX_F_PAYLOAD_FD). */
#define NSBOX_MSG_MAX 65536
#define NSBOX_MAX_FDS 8

enum nsbox_op {
    NSBOX_OP_EXEC = 1,     /* fds: channel, stdin, stdout, stderr [, payload] */
    NSBOX_OP_OPEN = 2,     /* fds: channel [, payload] */
    NSBOX_OP_DETACH = 3,   /* the lifeline no longer holds: the sandbox outlives its owner */
    NSBOX_OP_STATUS = 4,   /* reply: struct nsbox_status on the same connection */
    NSBOX_OP_SHUTDOWN = 5, /* kill everything and exit */
};

/* Request flags. */
#define NSBOX_F_PAYLOAD_FD 0x1 /* payload is in a memfd, not inline */
#define NSBOX_F_MKDIRS 0x2     /* OPEN: create missing parent directories */
#define NSBOX_F_SETGROUPS 0x4  /* apply the supplementary group list */
#define NSBOX_F_SETCTTY 0x8    /* EXEC: stdin is a terminal; make it the controlling one */
#define NSBOX_F_DETACHED 0x10  /* EXEC: closing the channel does not kill the command */
#define NSBOX_F_REGULAR 0x20   /* OPEN: only a regular file or a directory will do */
#define NSBOX_F_NO_STARTED 0x40 /* EXEC: no STARTED reply (a caller that waits for EXIT) */
/* EXEC: a restart policy (compose's `restart`). The init starts the command
 * again when it exits, after a wait that doubles from 100 ms to 1 min (back
 * to 100 ms after a run of 10 s), as Docker does. No reply is sent for a
 * run that is followed by another; EXIT reports the last one's status.
 * With F_RESTART_ON_FAILURE, only after a non-zero status. `mode` holds the
 * most restarts, 0 for no limit. A command that fails to start on its
 * first run is not restarted, nor one the host signals with SIGKILL or
 * SIGTERM, nor one whose channel the host closes (unless F_DETACHED). */
#define NSBOX_F_RESTART 0x80
#define NSBOX_F_RESTART_ON_FAILURE 0x100

/*
 * Payload layout: ngroups uint32 gids, then NUL-terminated strings:
 *   EXEC: cwd ("" keeps the init's), argv[0..argc), env[0..envc)
 *   OPEN: the absolute path inside the sandbox
 */
struct nsbox_request {
    uint32_t op;
    uint32_t flags;
    uint32_t uid;
    uint32_t gid;
    uint32_t ngroups;
    uint32_t argc;
    uint32_t envc;
    uint32_t open_flags;  /* OPEN: O_* flags (access mode, O_CREAT, O_TRUNC) */
    uint32_t mode;        /* OPEN: creation mode; EXEC with F_RESTART: most restarts (0: any) */
    uint32_t payload_len; /* bytes of payload, inline or in the memfd */
};

enum nsbox_reply_kind {
    NSBOX_REPLY_EXIT = 1, /* code: exit status, or 128+N for signal N */
    NSBOX_REPLY_FAIL = 2, /* stage and err (an errno) say what failed */
    NSBOX_REPLY_FD = 3,   /* a descriptor is attached; code: 1 if a directory */
    NSBOX_REPLY_STARTED = 4, /* EXEC: the command is running (its execve succeeded) */
};

enum nsbox_stage {
    NSBOX_STAGE_REQUEST = 1, /* malformed request */
    NSBOX_STAGE_SPAWN = 2,   /* fork failed */
    NSBOX_STAGE_CWD = 3,     /* chdir to the working directory */
    NSBOX_STAGE_CREDS = 4,   /* setgroups / setgid / setuid */
    NSBOX_STAGE_EXEC = 5,    /* execve of the command */
    NSBOX_STAGE_MKDIRS = 6,  /* creating parent directories */
    NSBOX_STAGE_OPEN = 7,    /* opening the file */
    NSBOX_STAGE_HELPER = 8,  /* a process inside stopped or killed nsbox's helper */
    NSBOX_STAGE_KERNEL_FS = 9, /* OPEN with F_REGULAR: a file of a kernel file system (proc, sysfs...) or FUSE */
};

struct nsbox_reply {
    int32_t kind;
    int32_t code;
    int32_t err;
    int32_t stage;
};

struct nsbox_status {
    uint32_t version;
    uint32_t running; /* exec requests whose command has not exited */
    uint64_t execs;   /* exec requests served since start */
    uint32_t detached;
    uint32_t flags; /* NSBOX_STATUS_* */
};

/* Status flags. */
#define NSBOX_STATUS_SHARED_SPAWN 0x1 /* commands start in a child sharing the init's memory */

#endif
