/*
 * fdpass.h - messages with descriptors attached (SCM_RIGHTS), sent and
 * received the same way by nsbox-init and nsbox-create.
 */
#ifndef NSBOX_FDPASS_H
#define NSBOX_FDPASS_H

#include <errno.h>
#include <stdbool.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* Sends iov[0..niov) on sock, with fd attached unless it is negative, and
 * sendmsg flags `flags` (MSG_DONTWAIT: fail rather than wait for room).
 * Returns sendmsg's result; never raises SIGPIPE. */
static inline ssize_t send_with_fd_flags(int sock, struct iovec *iov, int niov, int fd, int flags)
{
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } u;
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
    if (fd >= 0) {
        msg.msg_control = u.buf;
        msg.msg_controllen = sizeof u.buf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof(int));
    }
    ssize_t n;
    while ((n = sendmsg(sock, &msg, MSG_NOSIGNAL | flags)) < 0 && errno == EINTR)
        ;
    return n;
}

static inline ssize_t send_with_fd(int sock, struct iovec *iov, int niov, int fd)
{
    return send_with_fd_flags(sock, iov, niov, fd, 0);
}

/* Receives one message of at most len bytes into buf and the descriptors
 * attached to it (at most maxfds; they are close-on-exec) into fds.
 * Returns recvmsg's result; *nfds is the number of descriptors kept and
 * *truncated is set when the message or its descriptors did not fit
 * (the caller must then close what came and drop the message). */
static inline ssize_t recv_with_fds(int sock, void *buf, size_t len, int *fds, int maxfds, int *nfds,
                                    bool *truncated, int flags)
{
    union {
        char buf[CMSG_SPACE(sizeof(int) * 16)];
        struct cmsghdr align;
    } u;
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                         .msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)(maxfds < 16 ? maxfds : 16))};
    *nfds = 0;
    *truncated = false;
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | flags);
    if (n < 0)
        return n;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int i = 0; i < k; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
            if (*nfds < maxfds)
                fds[(*nfds)++] = fd;
            else
                close(fd), *truncated = true;
        }
    }
    if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))
        *truncated = true;
    return n;
}

#endif
