/*
 * fdpass.h - sending a message with one descriptor attached (SCM_RIGHTS),
 * shared by nsbox-init and nsbox-create.
 */
#ifndef NSBOX_FDPASS_H
#define NSBOX_FDPASS_H

#include <errno.h>
#include <string.h>
#include <sys/socket.h>

/* Sends iov[0..niov) on sock, with fd attached unless it is negative.
 * Returns sendmsg's result; never raises SIGPIPE. */
static inline ssize_t send_with_fd(int sock, struct iovec *iov, int niov, int fd)
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
    while ((n = sendmsg(sock, &msg, MSG_NOSIGNAL)) < 0 && errno == EINTR)
        ;
    return n;
}

#endif
