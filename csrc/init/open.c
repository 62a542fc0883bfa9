/*
 * open.c - an OPEN request's child: it opens a path inside the sandbox as
 * the requesting user and passes the descriptor back on the channel.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/magic.h>
#include <linux/openat2.h>
#include <stdbool.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "common/fdpass.h"
#include "init/init.h"

/* mkdir -p of every parent of `path`, resolved inside our root. */
static int make_parents(const char *path)
{
    char buf[PATH_MAX];
    size_t len = strlen(path);
    if (len >= sizeof buf)
        return ENAMETOOLONG;
    memcpy(buf, path, len + 1);
    for (char *p = buf + 1; (p = strchr(p, '/')); p++) {
        *p = 0;
        if (mkdir(buf, 0777) < 0 && errno != EEXIST) {
            int err = errno;
            *p = '/';
            return err;
        }
        *p = '/';
    }
    return 0;
}

/* Whether `fd` is a file of a kernel file system, or of FUSE, whose
 * bytes the host process may not move. Kernel files look regular, but many
 * check the credentials of whoever reads or writes, not of whoever opened:
 * the host process, which may hold capabilities the sandbox does not (as
 * host root, a write to /proc/1/autogroup sets a negative nice; one to
 * /proc/PID/oom_score_adj exempts from the OOM killer). A FUSE file system
 * a sandbox process serves may hold the host's read, or the flush of its
 * close, forever. Their contents are the sandbox's commands' to move. */
static bool on_kernel_fs(int fd)
{
    static const unsigned long kinds[] = {
        PROC_SUPER_MAGIC, SYSFS_MAGIC, CGROUP_SUPER_MAGIC, CGROUP2_SUPER_MAGIC, DEBUGFS_MAGIC, TRACEFS_MAGIC,
        SECURITYFS_MAGIC, BPF_FS_MAGIC, EFIVARFS_MAGIC, PSTOREFS_MAGIC, SELINUX_MAGIC, SMACK_MAGIC,
        BINFMTFS_MAGIC, NSFS_MAGIC,
        0x62656570, /* configfs */
        0x65735543, /* fusectl */
        0x65735546, /* FUSE */
    };
    struct statfs sf;
    if (fstatfs(fd, &sf) < 0)
        return true; /* unknown: not ours to move */
    for (size_t i = 0; i < sizeof kinds / sizeof *kinds; i++) {
        if ((unsigned long)sf.f_type == kinds[i])
            return true;
    }
    return false;
}

void __attribute__((noreturn)) child_open(struct request *rq)
{
    int none[1] = {-1};
    int chan = child_report_fd;
    if (!arrange_fds(none, 0, &chan))
        _exit(127);
    child_report_fd = chan;
    const char *path = rq->strings[0];
    int err = apply_creds(rq);
    if (err)
        child_fail(NSBOX_STAGE_CREDS, err);
    if ((rq->h.flags & NSBOX_F_MKDIRS) && (err = make_parents(path)))
        child_fail(NSBOX_STAGE_MKDIRS, err);

    /* The mount namespace we joined may have mounts of sandbox root's own
     * on top of ours; resolving from its "/" with RESOLVE_IN_ROOT keeps
     * every symlink and ".." inside, and RESOLVE_NO_MAGICLINKS keeps /proc
     * magic links from leading anywhere else. There is no fallback to a
     * plain open(): openat2 exists on every kernel nsbox runs on (5.12+).
     * O_NONBLOCK keeps a FIFO from hanging us. */
    struct open_how how = {
        .flags = (rq->h.open_flags & (O_ACCMODE | O_CREAT | O_TRUNC | O_EXCL)) | O_CLOEXEC |
                 O_NOCTTY | O_NONBLOCK,
        .mode = (rq->h.open_flags & O_CREAT) ? rq->h.mode & 07777 : 0,
        .resolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS,
    };
    int root = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (root < 0)
        child_fail(NSBOX_STAGE_OPEN, errno);
    int fd = (int)syscall(SYS_openat2, root, path, &how, sizeof how);
    if (fd < 0)
        child_fail(NSBOX_STAGE_OPEN, errno);
    struct stat st;
    if (fstat(fd, &st) < 0)
        child_fail(NSBOX_STAGE_OPEN, errno);
    /* File contents move over this descriptor in the host process: a FIFO,
     * a socket or a device there could block it, so callers that want file
     * contents accept nothing else. */
    if ((rq->h.flags & NSBOX_F_REGULAR) && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode))
        child_fail(NSBOX_STAGE_OPEN, EINVAL);
    if ((rq->h.flags & NSBOX_F_REGULAR) && S_ISREG(st.st_mode) && on_kernel_fs(fd))
        child_fail(NSBOX_STAGE_KERNEL_FS, EPERM);
    /* Without F_REGULAR the caller wants a device (a pty's master, whose
     * ioctls it makes): a file a sandbox process put there, served by FUSE
     * say, could hold those. A device node cannot come from such a mount
     * (it is nodev), nor be made by sandbox root. */
    if (!(rq->h.flags & NSBOX_F_REGULAR) && !S_ISCHR(st.st_mode))
        child_fail(NSBOX_STAGE_OPEN, ENODEV);
    send_reply(chan, NSBOX_REPLY_FD, S_ISDIR(st.st_mode) ? 1 : 0, 0, 0, fd);
    _exit(0);
}
