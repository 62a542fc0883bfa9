/*
 * rawsys_probe.c - checks csrc/init/rawsys.h: each call the init makes
 * through it while a child shares its memory returns the kernel's result
 * (a negative errno on failure) and leaves errno as it was.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>

#include "init/rawsys.h"

static int failures;

static void expect(const char *what, long got, long want)
{
    if (got != want || errno != 4321) {
        printf("%s: got %ld (errno %d), want %ld (errno 4321)\n", what, got, errno, want);
        failures++;
    }
}

int main(void)
{
    errno = 4321;
    expect("getpid", raw_syscall5(SYS_getpid, 0, 0, 0, 0, 0), getpid());
    errno = 4321; /* getpid() is the C library's: restore in case */
    int word = 7;
    struct timespec ms = {.tv_nsec = 1000000};
    expect("futex wait, timed out", raw_syscall5(SYS_futex, (long)&word, FUTEX_WAIT, 7, (long)&ms, 0), -ETIMEDOUT);
    expect("futex wait, value changed", raw_syscall5(SYS_futex, (long)&word, FUTEX_WAIT, 8, (long)&ms, 0), -EAGAIN);
    int p[2];
    if (pipe(p) < 0)
        return 2;
    errno = 4321;
    struct pollfd pf = {.fd = p[0], .events = POLLIN};
    struct timespec zero = {0};
    expect("ppoll, nothing ready", raw_syscall5(SYS_ppoll, (long)&pf, 1, (long)&zero, 0, 0), 0);
    close(p[1]);
    errno = 4321;
    expect("ppoll, hung up", raw_syscall5(SYS_ppoll, (long)&pf, 1, (long)&zero, 0, 0), 1);
    siginfo_t si = {0};
    expect("waitid, no child", raw_syscall5(SYS_waitid, P_PID, 1, (long)&si, WSTOPPED | WNOHANG, 0), -ECHILD);
    expect("kill, no such process", raw_syscall5(SYS_kill, -2147483647, 0, 0, 0, 0), -ESRCH);
    if (failures)
        return 1;
    puts("ok");
    return 0;
}
