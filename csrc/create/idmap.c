/*
 * idmap.c - writing the uid/gid maps of a child's user namespace: directly
 * (as real root, or a single mapped id), or through the setuid
 * newuidmap/newgidmap for a subordinate range.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
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
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

/* glibc 2.34 added posix_spawn_file_actions_addclosefrom_np. */
#if defined(__GLIBC__) && __GLIBC_PREREQ(2, 34)
#define HAVE_ADDCLOSEFROM 1
#endif

#include "create/zygote.h"
#include "common/fdpass.h"

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
    /* The helpers are setuid root: they get /dev/null, the pipe for their
     * complaint as stderr, an empty environment and none of our descriptors.
     * Ours are close-on-exec (our socket since main() began; what a request
     * brings, by MSG_CMSG_CLOEXEC), but one that slipped through would be
     * handed to a privileged program, so where the C library can, the
     * spawned process closes them all. */
    posix_spawn_file_actions_t fa;
    char *envp[] = {NULL};
    pid_t hp;
    int err = posix_spawn_file_actions_init(&fa);
    if (err) {
        close(out[0]);
        close(out[1]);
        return err;
    }
    err = posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    if (!err)
        err = posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    if (!err)
        err = posix_spawn_file_actions_adddup2(&fa, out[1], 2);
#ifdef HAVE_ADDCLOSEFROM
    if (!err)
        err = posix_spawn_file_actions_addclosefrom_np(&fa, 3);
#endif
    if (!err)
        err = posix_spawn(&hp, helper, &fa, NULL, argv, envp);
    posix_spawn_file_actions_destroy(&fa);
    close(out[1]);
    if (err) {
        close(out[0]);
        return err;
    }
    /* Read to EOF (a helper blocked on a full pipe would never exit), keeping
     * what fits in msg. */
    int got = 0;
    for (;;) {
        char scratch[256];
        int room = NSBOX_ZYGOTE_MSG_MAX - *msglen - got;
        ssize_t n = room > 0 ? read(out[0], msg + *msglen + got, (size_t)room) : read(out[0], scratch, sizeof scratch);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        if (room > 0)
            got += (int)n;
    }
    close(out[0]);
    int status, r;
    while ((r = waitpid(hp, &status, 0)) < 0 && errno == EINTR)
        ;
    /* Without its status (ECHILD, should SIGCHLD be ignored) we cannot tell
     * whether it wrote the map: a failure. */
    err = r < 0 ? errno : (WIFEXITED(status) && WEXITSTATUS(status) == 0) ? 0 : EPERM;
    if (err)
        *msglen += got;
    return err;
}

/* Writes the id maps of the user namespace of `pid`; 0 or an errno. */
int write_id_maps(const struct nsbox_clone_request *req, pid_t pid, char *msg, int *msglen)
{
    if (req->newuidmap) {
        int err = run_map_helper(req->newuidmap, pid, req->uid_map, msg, msglen);
        return err ? err : run_map_helper(req->newgidmap, pid, req->gid_map, msg, msglen);
    }
    /* An unprivileged gid_map requires setgroups to be denied first. */
    if (req->deny_setgroups && write_proc(pid, "setgroups", "deny") < 0)
        return errno;
    if (write_proc(pid, "uid_map", req->uid_map) < 0 || write_proc(pid, "gid_map", req->gid_map) < 0)
        return errno;
    return 0;
}
