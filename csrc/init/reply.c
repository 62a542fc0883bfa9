/*
 * reply.c - what the server and its request children share: a reply on a
 * channel, and a growing array (see init.h).
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/fdpass.h"
#include "init/init.h"

void *grow(void *p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return p;
    size_t n = *cap ? *cap * 2 : 16;
    while (n < need)
        n *= 2;
    void *q = realloc(p, n * elem);
    if (!q) /* out of memory in PID 1: nothing sensible is left to do */
        _exit(70);
    *cap = n;
    return q;
}

void send_reply(int chan, int32_t kind, int32_t code, int32_t err, int32_t stage, int fd)
{
    struct nsbox_reply r = {.kind = kind, .code = code, .err = err, .stage = stage};
    struct iovec iov = {.iov_base = &r, .iov_len = sizeof r};
    /* A host that went away makes this fail with EPIPE; nothing to do then. */
    send_with_fd(chan, &iov, 1, fd);
}
