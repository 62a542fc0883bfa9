/*
 * proc.c - /proc/PID/NAME paths and writes, without the C library's
 * formatting (the cloned child calls these too).
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

/* Appends the decimal digits of v at p; returns the end. (snprintf would do
 * as well: the zygote is a single-threaded static program, and the children
 * it clones are copies of it. This cannot fail and needs no size.) */
char *put_uint(char *p, unsigned long v)
{
    char digits[24];
    int n = 0;
    do {
        digits[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    while (n)
        *p++ = digits[--n];
    return p;
}

char *put_str(char *p, const char *s)
{
    while (*s)
        *p++ = *s++;
    return p;
}

/* /proc/PID/NAME, into buf (at least 64 bytes). */
const char *proc_path(char *buf, pid_t pid, const char *name)
{
    char *p = put_str(buf, "/proc/");
    p = put_uint(p, (unsigned long)pid);
    *p++ = '/';
    *put_str(p, name) = 0;
    return buf;
}

int write_proc(pid_t pid, const char *name, const char *text)
{
    char path[64];
    int fd = open(proc_path(path, pid, name), O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = write(fd, text, strlen(text));
    int err = errno;
    close(fd);
    errno = err;
    return n == (ssize_t)strlen(text) ? 0 : -1;
}
