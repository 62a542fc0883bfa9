/*
 * main.c - nsbox-tied: run a program that dies with the process that started it.
 *
 *   nsbox-tied PARENT_PID PROGRAM [ARG...]
 *
 * The network helper (nsbox/net/helper.py) starts pasta and slirp4netns
 * through this program. They hold a sandbox's network namespace open, so
 * they must get SIGKILL when the helper dies, however it dies. Asking for
 * that (PR_SET_PDEATHSIG) between fork and exec from Python takes a
 * preexec_fn, which makes Python fork its whole process and run Python in
 * the child: ~3 ms per program started, on the path of every sandbox with
 * the nat network and every compose member that reaches out. Python
 * starts this static program with vfork instead, and it asks for the
 * signal itself before it execs PROGRAM.
 *
 * The signal is asked for first and the parent checked after: a parent
 * that died before the prctl cannot send it, and then our parent is no
 * longer PARENT_PID (we were reparented), so we exit without running
 * PROGRAM. The setting survives the execve, as PROGRAM is neither
 * set-user-ID nor given file capabilities (neither pasta nor slirp4netns
 * is).
 *
 * Exit status, when PROGRAM does not run: 2 bad usage, 125 the parent is
 * gone, 126 the prctl failed, 127 the exec failed (a line on stderr says
 * why, which the helper reports).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc < 3) {
        fputs("usage: nsbox-tied PARENT_PID PROGRAM [ARG...]\n", stderr);
        return 2;
    }
    char *end;
    errno = 0;
    long parent = strtol(argv[1], &end, 10);
    if (errno != 0 || *end != '\0' || parent <= 0) {
        fprintf(stderr, "nsbox-tied: not a process id: %s\n", argv[1]);
        return 2;
    }
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0) {
        fprintf(stderr, "cannot start %s: PR_SET_PDEATHSIG: %s\n", argv[2], strerror(errno));
        return 126;
    }
    if (getppid() != (pid_t)parent)
        return 125;
    execv(argv[2], argv + 2);
    fprintf(stderr, "cannot start %s: %s\n", argv[2], strerror(errno));
    return 127;
}
