/*
 * kill.c - signalling a command's whole process tree: its session, its
 * process group, and descendants that left both (see init.h).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <fcntl.h>
#include <unistd.h>

#include "init/init.h"

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
 * Signals the process the scan found as `pi`, and not a process that took
 * its pid since: a pidfd pins the process, and its session and process
 * group must still be what the scan saw. (Its parent may have changed: we
 * may just have killed it. A new process reusing the pid in the same
 * session and group would belong to the same tree, ours to kill too.)
 */
static bool signal_pinned(const struct procinfo *pi, int sig)
{
    int pidfd = (int)syscall(SYS_pidfd_open, pi->pid, 0);
    if (pidfd < 0)
        return false;
    struct procinfo now;
    bool same = read_stat(pi->pid, &now) && now.pgid == pi->pgid && now.sid == pi->sid;
    bool sent = same && syscall(SYS_pidfd_send_signal, pidfd, sig, NULL, 0) == 0;
    close(pidfd);
    return sent;
}

/*
 * Signals every process belonging to the command led by `leader`: its
 * session and process group (the leader called setsid), and, through the
 * parent links, descendants that moved to a session of their own. Returns
 * how many processes were signalled.
 */
static int signal_tree(pid_t leader, int sig, bool leader_alive)
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
        mark[i] = (leader_alive && ps[i].pid == leader) || ps[i].sid == leader || ps[i].pgid == leader;
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
        if (mark[i] && signal_pinned(&ps[i], sig))
            count++;
    }
    free(mark);
    free(ps);
    return count;
}

void kill_tree(pid_t leader, int sig)
{
    if (sig != SIGKILL) {
        signal_tree(leader, sig, true);
        return;
    }
    /* A process may fork between our scan and its death; its orphans keep
     * the session id, so rescan until a pass finds nobody. */
    for (int round = 0; round < 50 && signal_tree(leader, SIGKILL, true) > 0; round++)
        ;
}

void kill_leftovers(pid_t leader)
{
    /* The leader is reaped: its pid may name a new process now, but not a
     * session or group while members keep it (the kernel holds the id). */
    for (int round = 0; round < 50 && signal_tree(leader, SIGKILL, false) > 0; round++)
        ;
}
