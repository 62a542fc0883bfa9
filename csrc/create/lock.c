/*
 * lock.c - the nested user and mount namespaces that lock the mounts.
 *
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

#include "create/zygote.h"
#include "common/fdpass.h"

/* The pid of the process `pidfd` refers to, as the /proc we see numbers it:
 * where the host's /proc is masked, the sandbox's /proc is a bind of it
 * (nsbox/plan/procmask.py), which numbers processes in an outer PID namespace.
 * A pidfd's fdinfo gives the pid in the namespace of that procfs. */
static pid_t proc_pid(int pidfd, pid_t pid)
{
    char path[64], buf[512];
    *put_uint(put_str(path, "/proc/self/fdinfo/"), (unsigned long)pidfd) = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return pid;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return pid;
    buf[n] = 0;
    char *line = strstr(buf, "\nPid:");
    if (!line)
        return pid;
    long v = strtol(line + 5, NULL, 10);
    return v > 0 ? (pid_t)v : pid;
}

int make_locked_namespaces(const char *uid_map, const char *gid_map, int *userns, int *mntns)
{
    int hold[2];
    if (pipe2(hold, O_CLOEXEC) < 0)
        return -1;
    /* clone() with the namespace flags rather than fork() + unshare(): the
     * child starts out in the new namespaces, so we can write its maps at
     * once, with no handshake. The raw system call, because glibc's clone()
     * insists on a new stack; without CLONE_VM the child runs on a copy of
     * ours, as after fork(), and it only calls read() and _exit(). */
    int pidfd = -1;
    long pid = syscall(SYS_clone, CLONE_NEWUSER | CLONE_NEWNS | CLONE_PIDFD | SIGCHLD, 0, &pidfd, 0, 0);
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
    pid_t seen = proc_pid(pidfd, (pid_t)pid);
    close(pidfd);
    if (write_proc(seen, "uid_map", uid_map) == 0 && write_proc(seen, "gid_map", gid_map) == 0) {
        *userns = open(proc_path(path, seen, "ns/user"), O_RDONLY | O_CLOEXEC);
        *mntns = open(proc_path(path, seen, "ns/mnt"), O_RDONLY | O_CLOEXEC);
        rc = (*userns >= 0 && *mntns >= 0) ? 0 : -1;
    }
    int err = errno;
    /* The helper exits once it reads EOF. We do not wait for it: the init
     * we become reaps it before it serves anything, and meanwhile the
     * setup goes on. */
    close(hold[1]);
    errno = err;
    return rc;
}
