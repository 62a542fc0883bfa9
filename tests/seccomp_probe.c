/*
 * seccomp_probe.c - drives csrc/init/seccomp.c for tests/host/test_seccomp.py, which
 * builds it statically with the filter, as setup.py builds the init.
 *
 *   seccomp_probe [--userns] [--nnp] MODE             run every probe, print "name result"
 *   seccomp_probe [--userns] [--nnp] MODE -- CMD...   install the filter, then exec CMD
 *   seccomp_probe --dump MODE                         print the filter program
 *
 * MODE: none (no filter: what the kernel alone does), default, nested, or
 *       init (default plus the init's two setns calls, as the init installs
 *       it on itself).
 * --userns  first enter a new user and mount namespace as its root (mapped
 *           onto our own ids), holding CAP_SYS_ADMIN there as the init
 *           does in a sandbox's user namespace; the filter is then
 *           installed without no_new_privs, as there.
 * --nnp     set no_new_privs first (needed outside --userns, except as root).
 *
 * Each probe runs in a forked child, so one that kills its process (the
 * foreign-ABI probes) or changes it (unshare) cannot disturb the next.
 * A result is "ok", the errno name, "signal:N", or "setup-failed" (the
 * probe could not prepare what it tests).
 *
 * Denied calls are made with arguments that the kernel itself rejects, or
 * that change nothing, so that the probes are harmless when no filter
 * stops them, as real root too: reboot with a bad magic number, kexec with
 * unknown flags, swapon with invalid flags, acct and swapoff on a missing
 * file. Calls that an unprivileged process may make for real (unshare,
 * clone, keyctl, userfaultfd, perf_event_open, TIOCSTI on its own
 * terminal) have a second, real probe ("*_real").
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/perf_event.h>
#include <linux/sched.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/ptrace.h>
#include <sys/quota.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/timerfd.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <linux/seccomp.h>
#include <grp.h>
#include <termios.h>
#include <unistd.h>

#include "common/protocol.h"
#include "init/seccomp.h"

#define SETUP_FAILED 200
#define MISSING "/nonexistent-nsbox-probe"

extern char **environ;

static int result(long r)
{
    return r < 0 ? errno : 0;
}

/* ---- denied calls, with harmless arguments ----------------------------- */

static int p_keyctl(void) { return result(syscall(__NR_keyctl, 0x7fffffff, 0, 0, 0, 0)); }
static int p_keyctl_real(void)
{
    /* KEYCTL_GET_KEYRING_ID of the session keyring, without creating one. */
    return result(syscall(__NR_keyctl, 0, -3, 0, 0, 0));
}
static int p_add_key(void) { return result(syscall(__NR_add_key, NULL, NULL, NULL, 0, 0)); }
static int p_request_key(void) { return result(syscall(__NR_request_key, NULL, NULL, NULL, 0)); }
static int p_bpf(void) { return result(syscall(__NR_bpf, 0x7fff, NULL, 0)); }
static int p_perf_event_open(void) { return result(syscall(__NR_perf_event_open, NULL, 0, -1, -1, 0)); }
static int p_perf_event_open_real(void)
{
    /* Counting our own user-space CPU time: allowed to anyone at
     * kernel.perf_event_paranoid <= 2. */
    struct perf_event_attr a = {.type = PERF_TYPE_SOFTWARE, .size = sizeof a,
                                .config = PERF_COUNT_SW_TASK_CLOCK, .exclude_kernel = 1,
                                .exclude_hv = 1};
    return result(syscall(__NR_perf_event_open, &a, 0, -1, -1, 0));
}
/* UFFD_USER_MODE_ONLY (allowed to anyone) plus an invalid flag. */
static int p_userfaultfd(void) { return result(syscall(__NR_userfaultfd, 1 | 2)); }
static int p_userfaultfd_real(void) { return result(syscall(__NR_userfaultfd, O_CLOEXEC | 1)); }
static int p_io_uring_setup(void) { return result(syscall(425, 1, NULL)); }
static int p_io_uring_enter(void) { return result(syscall(426, -1, 0, 0, 0, NULL, 0)); }
static int p_io_uring_register(void) { return result(syscall(427, -1, 0, NULL, 0)); }
static int p_kexec_load(void) { return result(syscall(__NR_kexec_load, 0, 0, NULL, 0x8000)); }
static int p_kexec_file_load(void) { return result(syscall(__NR_kexec_file_load, -1, -1, 0, NULL, 0x8000)); }
static int p_init_module(void) { return result(syscall(__NR_init_module, NULL, 0, "")); }
static int p_finit_module(void) { return result(syscall(__NR_finit_module, -1, "", 0x8000)); }
static int p_delete_module(void) { return result(syscall(__NR_delete_module, "nsbox_no_such_module", O_NONBLOCK)); }
static int p_acct(void) { return result(syscall(__NR_acct, MISSING "/acct")); }
static int p_quotactl(void) { return result(syscall(__NR_quotactl, QCMD(Q_GETFMT, USRQUOTA), NULL, 0, NULL)); }
static int p_quotactl_fd(void) { return result(syscall(443, -1, QCMD(Q_GETFMT, USRQUOTA), 0, NULL)); }
static int p_swapon(void) { return result(syscall(__NR_swapon, MISSING "/swap", 0x40000000)); }
static int p_swapoff(void) { return result(syscall(__NR_swapoff, MISSING "/swap")); }
static int p_reboot(void) { return result(syscall(__NR_reboot, 0, 0, 0, NULL)); }
static int p_syslog(void) { return result(syscall(__NR_syslog, 9999, NULL, 0)); }
static int p_open_by_handle_at(void) { return result(syscall(__NR_open_by_handle_at, -1, NULL, 0)); }
#ifdef __NR_lookup_dcookie
static int p_lookup_dcookie(void) { return result(syscall(__NR_lookup_dcookie, 0, NULL, 0)); }
#endif
#ifdef __NR_uselib
static int p_uselib(void) { return result(syscall(__NR_uselib, NULL)); }
#endif
#ifdef __NR_iopl
static int p_iopl(void) { return result(syscall(__NR_iopl, 99)); }
#endif
#ifdef __NR_ioperm
static int p_ioperm(void) { return result(syscall(__NR_ioperm, 65536, 1, 0)); }
#endif

/* ---- namespaces and mounts -------------------------------------------- */

static int p_setns(void) { return result(syscall(__NR_setns, -1, 0)); }

/* setns on one of our own namespaces, placed at descriptor `at`: the
 * init's two calls are setns(NSBOX_FD_USERNS, CLONE_NEWUSER) and
 * setns(NSBOX_FD_MNTNS, CLONE_NEWNS), which the init mode allows. */
static int entry_setns(const char *ns, int at, int nstype)
{
    int fd = open(ns, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || (fd != at && dup2(fd, at) < 0))
        return SETUP_FAILED;
    return result(syscall(__NR_setns, at, nstype));
}
static int p_setns_init_user(void) { return entry_setns("/proc/self/ns/user", NSBOX_FD_USERNS, CLONE_NEWUSER); }
static int p_setns_init_mnt(void) { return entry_setns("/proc/self/ns/mnt", NSBOX_FD_MNTNS, CLONE_NEWNS); }
/* The right namespace at the other number, or with any type allowed. */
static int p_setns_init_swapped(void) { return entry_setns("/proc/self/ns/mnt", NSBOX_FD_USERNS, CLONE_NEWNS); }
static int p_setns_init_anytype(void) { return entry_setns("/proc/self/ns/mnt", NSBOX_FD_MNTNS, 0); }
static int p_mount(void) { return result(mount("none", MISSING, "tmpfs", 0, NULL)); }
static int p_mount_real(void)
{
    char dir[] = "/tmp/nsbox-probe-XXXXXX";
    if (!mkdtemp(dir))
        return SETUP_FAILED;
    int r = result(mount("none", dir, "tmpfs", 0, "size=64k"));
    if (r == 0)
        umount2(dir, MNT_DETACH);
    rmdir(dir);
    return r;
}
static int p_umount2(void) { return result(umount2(MISSING, 0)); }
static int p_pivot_root(void) { return result(syscall(__NR_pivot_root, MISSING "/a", MISSING "/b")); }
static int p_open_tree(void) { return result(syscall(428, AT_FDCWD, MISSING, 0)); }
static int p_move_mount(void) { return result(syscall(429, -1, "", -1, "", 0)); }
static int p_fsopen(void) { return result(syscall(430, "nsbox-no-such-fs", 0)); }
static int p_fsconfig(void) { return result(syscall(431, -1, 0x7f, NULL, NULL, 0)); }
static int p_fsmount(void) { return result(syscall(432, -1, 0, 0)); }
static int p_fspick(void) { return result(syscall(433, -1, MISSING, 0)); }
static int p_mount_setattr(void) { return result(syscall(442, -1, MISSING, 0, NULL, 0)); }
static int p_open_tree_attr(void) { return result(syscall(467, AT_FDCWD, MISSING, 0, NULL, 0)); }

static int p_unshare_user_real(void) { return result(unshare(CLONE_NEWUSER)); }
/* The namespace flag in the low word, an invalid one in the high word. */
static int p_unshare_user_highbits(void) { return result(syscall(__NR_unshare, CLONE_NEWUSER | (1UL << 32))); }
static int p_unshare_mnt_real(void) { return result(unshare(CLONE_NEWNS)); }
static int p_unshare_net_real(void) { return result(unshare(CLONE_NEWNET)); }
static int p_unshare_time_real(void) { return result(unshare(0x80 /* CLONE_NEWTIME */)); }

/* clone(flags) as a plain fork into new namespaces; the child exits. */
static int raw_clone(unsigned long flags)
{
    long pid = syscall(__NR_clone, flags | SIGCHLD, 0, NULL, NULL, 0);
    if (pid == 0)
        _exit(0);
    if (pid < 0)
        return errno;
    int st;
    waitpid((pid_t)pid, &st, 0);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : SETUP_FAILED;
}

static int raw_clone3(uint64_t flags)
{
    struct clone_args a = {.flags = flags, .exit_signal = SIGCHLD};
    long pid = syscall(435, &a, sizeof a);
    if (pid == 0)
        _exit(0);
    if (pid < 0)
        return errno;
    int st;
    waitpid((pid_t)pid, &st, 0);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : SETUP_FAILED;
}

static int p_clone_user_real(void) { return raw_clone(CLONE_NEWUSER); }
static int p_clone_net_real(void) { return raw_clone(CLONE_NEWNET); }
static int p_clone3_user_real(void) { return raw_clone3(CLONE_NEWUSER); }

/* ---- terminals -------------------------------------------------------- */

/* Makes a new pty the controlling terminal of a new session; returns the
 * terminal's fd, or -1. */
static int own_pty(int *master)
{
    int m = posix_openpt(O_RDWR | O_NOCTTY);
    if (m < 0 || grantpt(m) < 0 || unlockpt(m) < 0 || setsid() < 0)
        return -1;
    int s = open(ptsname(m), O_RDWR);
    if (s < 0 || ioctl(s, TIOCSCTTY, 0) < 0)
        return -1;
    *master = m;
    return s;
}

static int p_tiocsti_real(void)
{
    int m, s = own_pty(&m);
    if (s < 0)
        return SETUP_FAILED;
    char c = 'x';
    return result(ioctl(s, TIOCSTI, &c));
}

/* The kernel reads ioctl's cmd as an unsigned int: TIOCSTI with a high bit
 * set is TIOCSTI. */
static int p_tiocsti_highbits(void)
{
    int m, s = own_pty(&m);
    if (s < 0)
        return SETUP_FAILED;
    char c = 'x';
    return result(ioctl(s, TIOCSTI | (1UL << 32), &c));
}

static int p_tioclinux(void)
{
    int m, s = own_pty(&m);
    if (s < 0)
        return SETUP_FAILED;
    char subcode = 0x7f; /* no such subcode */
    return result(ioctl(s, TIOCLINUX, &subcode));
}

/* ---- other ABIs -------------------------------------------------------- */

#ifdef __x86_64__
static int p_x32_abi(void) { return result(syscall(0x40000000 | 39 /* x32 getpid */)); }

static int p_i386_abi(void)
{
    long r;
    /* getpid through the i386 entry point. */
    __asm__ volatile("int $0x80" : "=a"(r) : "a"(20L) : "r8", "r9", "r10", "r11", "memory");
    return r < 0 ? (int)-r : 0;
}
#endif

/* ---- what must keep working ------------------------------------------ */

static int p_fork_exec(void)
{
    pid_t pid = fork();
    if (pid == 0) {
        char *argv[] = {"true", NULL};
        execve("/bin/true", argv, environ);
        _exit(127);
    }
    if (pid < 0)
        return errno;
    int st;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : SETUP_FAILED;
}

static int p_posix_spawn(void)
{
    pid_t pid;
    char *argv[] = {"true", NULL};
    int err = posix_spawn(&pid, "/bin/true", NULL, NULL, argv, environ);
    if (err)
        return err;
    int st;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : SETUP_FAILED;
}

static void *thread_main(void *arg) { return arg; }

static int p_thread(void)
{
    pthread_t t;
    int err = pthread_create(&t, NULL, thread_main, NULL);
    return err ? err : pthread_join(t, NULL);
}

static int p_vfork(void)
{
    pid_t pid = vfork();
    if (pid == 0)
        _exit(0);
    if (pid < 0)
        return errno;
    int st;
    waitpid(pid, &st, 0);
    return 0;
}

static int p_clone_plain(void) { return raw_clone(0); }
static int p_unshare_fs_files(void) { return result(unshare(CLONE_FS | CLONE_FILES)); }

static int p_files(void)
{
    char path[] = "/tmp/nsbox-probe-XXXXXX", buf[6] = {0};
    int fd = mkstemp(path);
    if (fd < 0)
        return errno;
    int ok = write(fd, "hello", 5) == 5 && lseek(fd, 0, SEEK_SET) == 0 && read(fd, buf, 5) == 5 &&
             strcmp(buf, "hello") == 0 && fsync(fd) == 0;
    void *map = mmap(NULL, 5, PROT_READ, MAP_SHARED, fd, 0);
    ok = ok && map != MAP_FAILED && memcmp(map, "hello", 5) == 0;
    close(fd);
    ok = ok && unlink(path) == 0 && chdir("/") == 0 && access("/bin/true", X_OK) == 0;
    return ok ? 0 : errno ? errno : SETUP_FAILED;
}

static int p_memory(void)
{
    size_t len = 1 << 20;
    char *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return errno;
    memset(p, 1, len);
    if (mprotect(p, len, PROT_READ) < 0 || madvise(p, len, MADV_DONTNEED) < 0 || munmap(p, len) < 0)
        return errno;
    int fd = memfd_create("probe", MFD_CLOEXEC);
    return fd < 0 ? errno : 0;
}

/* What an interactive shell with job control does with its terminal. */
static int p_pty_job_control(void)
{
    int m, s = own_pty(&m);
    if (s < 0)
        return errno ? errno : SETUP_FAILED;
    struct termios t;
    struct winsize ws = {.ws_row = 24, .ws_col = 80};
    if (tcgetattr(s, &t) < 0 || tcsetattr(s, TCSANOW, &t) < 0 || ioctl(m, TIOCSWINSZ, &ws) < 0 ||
        ioctl(s, TIOCGWINSZ, &ws) < 0 || ws.ws_col != 80)
        return errno;
    /* A job in its own process group gets the terminal, then the shell
     * takes it back (ignoring SIGTTOU, as shells do). */
    signal(SIGTTOU, SIG_IGN);
    pid_t job = fork();
    if (job == 0) {
        setpgid(0, 0);
        _exit(tcsetpgrp(s, getpid()) == 0 ? 0 : 1);
    }
    int st;
    waitpid(job, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0 || tcsetpgrp(s, getpgrp()) < 0)
        return errno ? errno : SETUP_FAILED;
    char buf[8] = {0};
    if (write(s, "hi\n", 3) != 3 || read(m, buf, sizeof buf - 1) <= 0 || strncmp(buf, "hi", 2) != 0)
        return errno ? errno : SETUP_FAILED;
    return 0;
}

static int p_creds(void)
{
    /* What apply_creds() does after the filter: here to our own ids. */
    if (setresgid(getgid(), getgid(), getgid()) < 0 || setresuid(getuid(), getuid(), getuid()) < 0)
        return errno;
    return 0;
}

static int p_setgroups(void)
{
    gid_t g = getgid();
    return result(setgroups(1, &g));
}

static int p_sockets(void)
{
    int sv[2];
    char c;
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) < 0 || write(sv[0], "x", 1) != 1 || read(sv[1], &c, 1) != 1)
        return errno;
    /* A server on the loopback, as Inspect's tool support starts. */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 1) < 0)
        return errno;
    return 0;
}

static int p_events(void)
{
    int e = epoll_create1(EPOLL_CLOEXEC), v = eventfd(0, EFD_CLOEXEC);
    int i = inotify_init1(IN_CLOEXEC), t = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC);
    int p[2], n = 0;
    char r[8];
    if (e < 0 || v < 0 || i < 0 || t < 0 || pipe(p) < 0 || ioctl(p[0], FIONREAD, &n) < 0 ||
        getrandom(r, sizeof r, 0) != sizeof r)
        return errno;
    return 0;
}

static int p_ptrace(void)
{
    pid_t pid = fork();
    if (pid == 0) {
        if (ptrace(PTRACE_TRACEME, 0, NULL, NULL) < 0)
            _exit(1);
        raise(SIGSTOP);
        _exit(0);
    }
    int st;
    waitpid(pid, &st, 0);
    if (!WIFSTOPPED(st))
        return SETUP_FAILED;
    ptrace(PTRACE_CONT, pid, NULL, NULL);
    waitpid(pid, &st, 0);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : SETUP_FAILED;
}

/* A program in the sandbox may stack a filter of its own. */
static int p_own_filter(void)
{
    struct sock_filter allow[] = {BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW)};
    struct sock_fprog f = {.len = 1, .filter = allow};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        return errno;
    return result(syscall(__NR_seccomp, SECCOMP_SET_MODE_FILTER, 0, &f));
}

#define PROBE(name) {#name, p_##name}
static const struct {
    const char *name;
    int (*fn)(void);
} probes[] = {
    PROBE(keyctl), PROBE(keyctl_real), PROBE(add_key), PROBE(request_key), PROBE(bpf),
    PROBE(perf_event_open), PROBE(perf_event_open_real), PROBE(userfaultfd), PROBE(userfaultfd_real),
    PROBE(io_uring_setup), PROBE(io_uring_enter), PROBE(io_uring_register), PROBE(kexec_load),
    PROBE(kexec_file_load), PROBE(init_module), PROBE(finit_module), PROBE(delete_module),
    PROBE(acct), PROBE(quotactl), PROBE(quotactl_fd), PROBE(swapon), PROBE(swapoff), PROBE(reboot),
    PROBE(syslog), PROBE(open_by_handle_at),
#ifdef __NR_lookup_dcookie
    PROBE(lookup_dcookie),
#endif
#ifdef __NR_uselib
    PROBE(uselib),
#endif
#ifdef __NR_iopl
    PROBE(iopl),
#endif
#ifdef __NR_ioperm
    PROBE(ioperm),
#endif
    PROBE(setns), PROBE(setns_init_user), PROBE(setns_init_mnt), PROBE(setns_init_swapped),
    PROBE(setns_init_anytype), PROBE(mount), PROBE(mount_real), PROBE(umount2), PROBE(pivot_root),
    PROBE(open_tree), PROBE(move_mount), PROBE(fsopen), PROBE(fsconfig), PROBE(fsmount),
    PROBE(fspick), PROBE(mount_setattr), PROBE(open_tree_attr), PROBE(unshare_user_real),
    PROBE(unshare_user_highbits), PROBE(unshare_mnt_real), PROBE(unshare_net_real),
    PROBE(unshare_time_real), PROBE(clone_user_real), PROBE(clone_net_real), PROBE(clone3_user_real),
    PROBE(tiocsti_real), PROBE(tiocsti_highbits), PROBE(tioclinux),
#ifdef __x86_64__
    PROBE(x32_abi), PROBE(i386_abi),
#endif
    PROBE(fork_exec), PROBE(posix_spawn), PROBE(thread), PROBE(vfork), PROBE(clone_plain),
    PROBE(unshare_fs_files), PROBE(files), PROBE(memory), PROBE(pty_job_control), PROBE(creds),
    PROBE(setgroups), PROBE(sockets), PROBE(events), PROBE(ptrace), PROBE(own_filter),
};

static void run_probe(const char *name, int (*fn)(void))
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        exit(2);
    }
    if (pid == 0) {
        errno = 0;
        _exit(fn());
    }
    int st;
    if (waitpid(pid, &st, 0) < 0) {
        perror("waitpid");
        exit(2);
    }
    if (WIFSIGNALED(st)) {
        printf("%s signal:%d\n", name, WTERMSIG(st));
    } else if (WEXITSTATUS(st) == 0) {
        printf("%s ok\n", name);
    } else if (WEXITSTATUS(st) == SETUP_FAILED) {
        printf("%s setup-failed\n", name);
    } else {
        const char *e = strerrorname_np(WEXITSTATUS(st));
        printf("%s %s\n", name, e ? e : "E?");
    }
}

static void write_file(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY);
    if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text)) {
        fprintf(stderr, "seccomp_probe: writing %s: %s\n", path, strerror(errno));
        exit(2);
    }
    close(fd);
}

/* Becomes root of a new user namespace (and owner of a new mount
 * namespace), mapped onto our own uid and gid. */
static void enter_userns(void)
{
    char map[64];
    uid_t uid = getuid();
    gid_t gid = getgid();
    if (unshare(CLONE_NEWUSER | CLONE_NEWNS) < 0) {
        fprintf(stderr, "seccomp_probe: unshare: %s\n", strerror(errno));
        exit(2);
    }
    write_file("/proc/self/setgroups", "deny");
    snprintf(map, sizeof map, "0 %u 1\n", (unsigned)uid);
    write_file("/proc/self/uid_map", map);
    snprintf(map, sizeof map, "0 %u 1\n", (unsigned)gid);
    write_file("/proc/self/gid_map", map);
}

static int parse_mode(const char *s)
{
    if (strcmp(s, "none") == 0)
        return -1;
    if (strcmp(s, "default") == 0)
        return 0;
    if (strcmp(s, "nested") == 0)
        return 1;
    if (strcmp(s, "init") == 0)
        return 2;
    fprintf(stderr, "seccomp_probe: unknown mode %s\n", s);
    exit(2);
}

int main(int argc, char **argv)
{
    int i = 1;
    bool userns = false, nnp = false, dump = false;
    for (; i < argc && strncmp(argv[i], "--", 2) == 0 && argv[i][2]; i++) {
        if (strcmp(argv[i], "--userns") == 0)
            userns = true;
        else if (strcmp(argv[i], "--nnp") == 0)
            nnp = true;
        else if (strcmp(argv[i], "--dump") == 0)
            dump = true;
        else {
            fprintf(stderr, "seccomp_probe: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (i >= argc) {
        fprintf(stderr, "usage: seccomp_probe [--userns] [--nnp] [--dump] none|default|nested|init [-- CMD...]\n");
        return 2;
    }
    int mode = parse_mode(argv[i++]);

    if (dump) {
        struct sock_filter insn[256];
        int n = nsbox_seccomp_build(mode == 1, mode == 2, insn, 256);
        if (n < 0)
            return 1;
        for (int k = 0; k < n; k++)
            printf("%u %u %u %u\n", insn[k].code, insn[k].jt, insn[k].jf, insn[k].k);
        return 0;
    }
    if (userns)
        enter_userns();
    if (nnp && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) {
        perror("seccomp_probe: PR_SET_NO_NEW_PRIVS");
        return 2;
    }
    if (mode >= 0) {
        int err = nsbox_seccomp_install(mode == 1, mode == 2);
        if (err) {
            fprintf(stderr, "seccomp_probe: installing the filter: %s\n", strerror(-err));
            return 2;
        }
    }
    if (i < argc && strcmp(argv[i], "--") == 0) {
        if (i + 1 >= argc)
            return 2;
        execvp(argv[i + 1], argv + i + 1);
        fprintf(stderr, "seccomp_probe: %s: %s\n", argv[i + 1], strerror(errno));
        return 127;
    }
    for (size_t k = 0; k < sizeof probes / sizeof probes[0]; k++)
        run_probe(probes[k].name, probes[k].fn);
    return 0;
}
