/*
 * fuse_hold.c - a FUSE file system that never answers: it mounts itself at
 * argv[1] (through /dev/fuse, no libfuse), answers the kernel's INIT and
 * the root directory's GETATTR, and holds every other request. A process
 * that touches the mount waits in the kernel, uninterruptibly once the
 * request has reached us, even after SIGKILL: what a hung network file
 * system does. Exits after argv[2] seconds (a bound for a failed test).
 * With argv[3] "file", every name in the root is a 10-byte regular file
 * that can be looked up, opened and statfs'd, and it is its READ that is
 * held.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <time.h>
#include <unistd.h>

static char buf[1 << 20]; /* the kernel wants room for its largest request */

int main(int argc, char **argv)
{
    if (argc != 3 && argc != 4)
        return 2;
    int files = argc == 4 && strcmp(argv[3], "file") == 0;
    int fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        perror("open /dev/fuse");
        return 1;
    }
    char opts[128];
    snprintf(opts, sizeof opts, "fd=%d,rootmode=40000,user_id=0,group_id=0", fd);
    if (mount("hold", argv[1], "fuse", 0, opts) < 0) {
        perror("mount");
        return 1;
    }
    printf("mounted\n");
    fflush(stdout);
    time_t end = time(NULL) + atoi(argv[2]);
    while (time(NULL) < end) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 200) <= 0)
            continue;
        ssize_t n = read(fd, buf, sizeof buf);
        if (n < (ssize_t)sizeof(struct fuse_in_header))
            break;
        struct fuse_in_header *in = (void *)buf;
        struct {
            struct fuse_out_header h;
            union {
                struct fuse_init_out init;
                struct fuse_attr_out attr;
                struct fuse_entry_out entry;
                struct fuse_open_out open;
                struct fuse_statfs_out statfs;
            } u;
        } out;
        memset(&out, 0, sizeof out);
        out.h.unique = in->unique;
        if (in->opcode == FUSE_INIT) {
            struct fuse_init_in *ii = (void *)(in + 1);
            out.u.init.major = FUSE_KERNEL_VERSION;
            out.u.init.minor = ii->minor < 31 ? ii->minor : 31;
            out.u.init.max_readahead = ii->max_readahead;
            out.u.init.max_write = 4096;
            out.h.len = sizeof out.h + sizeof out.u.init;
        } else if (in->opcode == FUSE_GETATTR && (in->nodeid == 1 || files)) {
            int root = in->nodeid == 1;
            out.u.attr.attr.mode = root ? 040755 : 0100644;
            out.u.attr.attr.ino = in->nodeid;
            out.u.attr.attr.nlink = root ? 2 : 1;
            out.u.attr.attr.size = root ? 0 : 10;
            out.u.attr.attr_valid = 100;
            out.h.len = sizeof out.h + sizeof out.u.attr;
        } else if (in->opcode == FUSE_LOOKUP && files) {
            out.u.entry.nodeid = 2;
            out.u.entry.attr.mode = 0100644;
            out.u.entry.attr.ino = 2;
            out.u.entry.attr.nlink = 1;
            out.u.entry.attr.size = 10;
            out.u.entry.attr_valid = 100;
            out.u.entry.entry_valid = 100;
            out.h.len = sizeof out.h + sizeof out.u.entry;
        } else if (in->opcode == 52 /* FUSE_STATX, newer than some headers */ && files) {
            out.h.error = -ENOSYS; /* the kernel asks with GETATTR instead */
            out.h.len = sizeof out.h;
        } else if (in->opcode == FUSE_STATFS && files) {
            out.u.statfs.st.namelen = 255;
            out.u.statfs.st.bsize = 4096;
            out.h.len = sizeof out.h + sizeof out.u.statfs;
        } else if (in->opcode == FUSE_OPEN && files) {
            out.u.open.fh = 1;
            out.u.open.open_flags = FOPEN_DIRECT_IO; /* every read reaches us */
            out.h.len = sizeof out.h + sizeof out.u.open;
        } else {
            printf("holding opcode %u\n", in->opcode);
            fflush(stdout);
            continue; /* never answered */
        }
        if (write(fd, &out, out.h.len) < 0) {
            printf("reply to opcode %u refused: %m\n", in->opcode);
            break;
        }
    }
    return 0;
}
