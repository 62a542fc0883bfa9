/*
 * seccomp.c - the system call deny-list of everything a sandbox runs.
 *
 * A sandbox's processes run in a user namespace of their own, where sandbox
 * root holds every capability. The kernel then lets them reach interfaces
 * that ordinary users never touch, and that have been the way to most
 * kernel privilege escalations from unprivileged code: new namespaces they
 * fully control (a network namespace means nf_tables, a mount namespace
 * means fsconfig and overlayfs), the keyring, BPF, perf, userfaultfd (the
 * exploit writer's race widener), io_uring. Like the default profiles of
 * Docker and flatpak, this filter denies those, plus the calls that only
 * administer the machine (modules, kexec, reboot, swap, quotas, process
 * accounting, the kernel log) and the terminal ioctls that type into or
 * read from a terminal (TIOCSTI, TIOCLINUX). Everything else is allowed:
 * it is a deny-list, so a program that works in Docker works here.
 *
 * One more group protects the init itself. Sandbox root's nested user
 * namespace maps the same ids as the init's, so to the kernel it is the
 * init's owner: the init's non-dumpable flag keeps ptrace away, but
 * setting its resource limits (prlimit: same ids) or its scheduling
 * (sched_setaffinity, sched_setscheduler, sched_setparam, sched_setattr,
 * setpriority, ioprio_set: same owner) needs no capability. A limit set on
 * the init would be inherited by every later command (fsize 0), or end it
 * (cpu). So these calls are refused when they name process 1, and
 * setpriority and ioprio_set also when they name process group 1 (the
 * session the init leads) or a user (every process of that uid in the
 * namespace, the init included). On the caller itself (pid 0, its own
 * pid) and other sandbox processes they keep working. A sandbox nested
 * inside this one (nested_userns) has a PID namespace whose process 1 is
 * its own init: the calls are refused on it too.
 *
 * Denied calls fail with EPERM, except clone3, which fails with ENOSYS: its
 * flags live in memory that seccomp cannot read, so it is refused whatever
 * it asks, and ENOSYS makes the C library fall back to clone, whose flags
 * the filter can inspect (Docker does the same). With allow_nested_userns
 * (the nested_userns setting) namespaces, mounts and clone3 are allowed, so
 * that a sandbox can run inside the sandbox.
 *
 * Who installs it: the init, on itself, once, before it serves a request.
 * Every process of the sandbox is forked from the init and inherits the
 * filter, so a command starts with nothing to compile or attach (attaching
 * a filter JIT-compiles it: ~0.1 ms, once per exec when each request child
 * installed its own). The init's request children still have to join the
 * sandbox's nested namespaces, so setns is allowed in exactly two forms:
 * setns(NSBOX_FD_USERNS, CLONE_NEWUSER) and setns(NSBOX_FD_MNTNS,
 * CLONE_NEWNS) (see csrc/common/protocol.h). A sandbox process may put any
 * descriptor at those numbers, but the kernel lets it enter only a
 * namespace whose user namespace it holds CAP_SYS_ADMIN in: sandbox root
 * can re-enter its own mount namespace (which resets its root directory
 * to the sandbox's, as chroot(".") tricks already could) and nothing else.
 * It cannot create a namespace to enter (denied below), nor open the
 * init's (/proc/1 is not dumpable). tests/host/test_holder.py shows the
 * kernel refusing the other sandboxes' and the holder's namespaces even to
 * an unfiltered sandbox root.
 *
 * Architectures: the filter is compiled for the machine it runs on (x86_64
 * or aarch64) and compares numbers from that machine's <asm/unistd.h>. A
 * system call made through another ABI has other numbers and would slip
 * through the table, so it kills the process (SIGSYS): the i386 ABI (int
 * 0x80 on x86_64), the x32 ABI (numbers with bit 30 set, x86_64's
 * __X32_SYSCALL_BIT, which the kernel reports as AUDIT_ARCH_X86_64), and
 * 32-bit ARM on aarch64.
 *
 * Why not libseccomp: the program is small and fixed (a table, a few
 * argument checks, a binary search), so generating it here costs ~200
 * lines and keeps nsbox's build needing nothing but a C compiler and a
 * static libc, where libseccomp would add a build dependency to every
 * `pip install .`. The tests compare the program with libseccomp's own
 * syscall tables for both architectures and run every denied call for real.
 */
#define _GNU_SOURCE
#include "init/seccomp.h"
#include "common/protocol.h"

#include <errno.h>
#include <stdbool.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#if defined(__x86_64__) && !defined(__ILP32__)
#define NATIVE_ARCH AUDIT_ARCH_X86_64
#define X32_SYSCALL_BIT 0x40000000u
#elif defined(__aarch64__) && defined(__AARCH64EL__)
#define NATIVE_ARCH AUDIT_ARCH_AARCH64
#else
#error "nsbox's seccomp filter supports x86_64 and little-endian aarch64 only"
#endif

/* System calls added since Linux 5.1 have one number on every
 * architecture; older C library headers may not name them yet. */
#ifndef __NR_io_uring_setup
#define __NR_io_uring_setup 425
#endif
#ifndef __NR_io_uring_enter
#define __NR_io_uring_enter 426
#endif
#ifndef __NR_io_uring_register
#define __NR_io_uring_register 427
#endif
#ifndef __NR_open_tree
#define __NR_open_tree 428
#endif
#ifndef __NR_move_mount
#define __NR_move_mount 429
#endif
#ifndef __NR_fsopen
#define __NR_fsopen 430
#endif
#ifndef __NR_fsconfig
#define __NR_fsconfig 431
#endif
#ifndef __NR_fsmount
#define __NR_fsmount 432
#endif
#ifndef __NR_fspick
#define __NR_fspick 433
#endif
#ifndef __NR_clone3
#define __NR_clone3 435
#endif
#ifndef __NR_mount_setattr
#define __NR_mount_setattr 442
#endif
#ifndef __NR_quotactl_fd
#define __NR_quotactl_fd 443
#endif
#ifndef __NR_open_tree_attr
#define __NR_open_tree_attr 467
#endif
#ifndef CLONE_NEWTIME
#define CLONE_NEWTIME 0x00000080
#endif

/* ioprio_set's `which` (<linux/ioprio.h>, not in older headers): process,
 * process group, user, in this order as setpriority's PRIO_PROCESS,
 * PRIO_PGRP, PRIO_USER. */
#define IOPRIO_WHO_PROCESS 1

/* Process 1 of the caller's PID namespace: the init (see the top). */
#define INIT_PID 1

/* Every namespace clone(2) can create. (CLONE_NEWTIME shares its bit with
 * clone's exit signal, so only unshare and clone3 can ask for it.) */
#define CLONE_NAMESPACES                                                      \
    (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | \
     CLONE_NEWPID | CLONE_NEWNET)
#define UNSHARE_NAMESPACES (CLONE_NAMESPACES | CLONE_NEWTIME)

/* Denied whatever their arguments. */
static const int denied[] = {
    /* The kernel keyring: only partly namespaced (key quotas are charged
     * to the host user), and a steady source of kernel bugs. */
    __NR_keyctl, __NR_add_key, __NR_request_key,
    /* Large kernel attack surfaces no sandboxed task needs. */
    __NR_bpf, __NR_perf_event_open, __NR_userfaultfd, __NR_io_uring_setup,
    __NR_io_uring_enter, __NR_io_uring_register,
    /* Administering the machine: capabilities the sandbox never holds in
     * the initial namespace; deny before the kernel looks at arguments. */
    __NR_kexec_load, __NR_kexec_file_load, __NR_init_module, __NR_finit_module,
    __NR_delete_module, __NR_acct, __NR_quotactl, __NR_quotactl_fd, __NR_swapon,
    __NR_swapoff, __NR_reboot, __NR_syslog, __NR_open_by_handle_at,
#ifdef __NR_lookup_dcookie
    __NR_lookup_dcookie,
#endif
#ifdef __NR_uselib
    __NR_uselib,
#endif
#ifdef __NR_iopl
    __NR_iopl,
#endif
#ifdef __NR_ioperm
    __NR_ioperm,
#endif
};

/* Denied when their first argument, a pid, is the init's (RULE_PID1). */
static const int init_sched_calls[] = {
    __NR_sched_setaffinity, __NR_sched_setscheduler, __NR_sched_setparam, __NR_sched_setattr,
};

/* Denied unless nested sandboxes are allowed: joining namespaces and
 * changing mounts. (Creating namespaces is checked on the flags of clone
 * and unshare below.) Sandbox root holds CAP_SYS_ADMIN over its own mount
 * namespace, so without this it could mount any filesystem that allows
 * mounting in a user namespace, and reach fsconfig's parsers. */
static const int namespace_calls[] = {
    __NR_setns, __NR_mount, __NR_umount2, __NR_pivot_root, __NR_open_tree, __NR_move_mount,
    __NR_fsopen, __NR_fsconfig, __NR_fsmount, __NR_fspick, __NR_mount_setattr,
    __NR_open_tree_attr,
};

#define N_ELEMS(a) (sizeof(a) / sizeof((a)[0]))
#define RET_ERRNO(e) (SECCOMP_RET_ERRNO | ((e) & SECCOMP_RET_DATA))

/* Offsets into struct seccomp_data, which the filter reads as 32-bit
 * words. An argument is 64 bits wide; on a little-endian machine its low
 * half comes first. */
#define OFF_NR offsetof(struct seccomp_data, nr)
#define OFF_ARCH offsetof(struct seccomp_data, arch)
#define OFF_ARG_LO(i) (offsetof(struct seccomp_data, args) + (i) * sizeof(uint64_t))
#define OFF_ARG_HI(i) (OFF_ARG_LO(i) + sizeof(uint32_t))

/* What the program does with one system call number. */
enum rule_kind {
    RULE_ERRNO, /* fail with `value` as errno, whatever the arguments */
    RULE_FLAGS, /* EPERM if the low 32 bits of argument 0 have any of `value` */
    RULE_IOCTL, /* EPERM for the terminal ioctls TIOCSTI and TIOCLINUX */
    RULE_SETNS, /* EPERM unless it is one of the init's two setns calls */
    RULE_PID1,  /* EPERM if argument 0, a pid, is INIT_PID */
    RULE_PRLIMIT, /* EPERM if prlimit64 sets (argument 2 not NULL) a limit of INIT_PID */
    RULE_PRIO,  /* EPERM if (which, who) reaches INIT_PID; `value` is which's "process" */
};

struct rule {
    uint32_t nr;
    enum rule_kind kind;
    uint32_t value;
};

#define MAX_RULES 64

struct prog {
    struct sock_filter *insn;
    size_t n, cap;
    bool too_far; /* a jump longer than classic BPF's 255 instructions */
};

static void emit(struct prog *p, uint16_t code, uint32_t k, uint8_t jt, uint8_t jf)
{
    if (p->n < p->cap)
        p->insn[p->n] = (struct sock_filter){.code = code, .jt = jt, .jf = jf, .k = k};
    p->n++; /* counted even past cap, so the caller sees the overflow */
}

static void ret(struct prog *p, uint32_t action)
{
    emit(p, BPF_RET | BPF_K, action, 0, 0);
}

static void load(struct prog *p, uint32_t offset)
{
    emit(p, BPF_LD | BPF_W | BPF_ABS, offset, 0, 0);
}

/* With the system call number in A: "if nr is the rule's, decide". Every
 * block that loads an argument ends in a return on both paths, since A no
 * longer holds the number after the load. */
/* For system call `nr`: EPERM if the low 32 bits of argument 0 match `k`
 * by `op` (BPF_JSET: have any of its bits; BPF_JEQ: are it), else allow. */
static void deny_if_arg0(struct prog *p, uint32_t nr, uint16_t op, uint32_t k)
{
    emit(p, BPF_JMP | BPF_JEQ | BPF_K, nr, 0, 4);
    load(p, OFF_ARG_LO(0));
    emit(p, BPF_JMP | op | BPF_K, k, 0, 1);
    ret(p, RET_ERRNO(EPERM));
    ret(p, SECCOMP_RET_ALLOW);
}

static void emit_rule(struct prog *p, const struct rule *r)
{
    switch (r->kind) {
    case RULE_ERRNO:
        emit(p, BPF_JMP | BPF_JEQ | BPF_K, r->nr, 0, 1);
        ret(p, RET_ERRNO(r->value));
        break;
    case RULE_FLAGS:
        /* clone keeps only the low 32 bits of its flags, and unshare's
         * namespace flags all lie there. */
        deny_if_arg0(p, r->nr, BPF_JSET, r->value);
        break;
    case RULE_IOCTL:
        /* ioctl(fd, cmd, ...): the kernel reads cmd as an unsigned int, so
         * compare only its low 32 bits; a caller may set the high ones
         * (CVE-2019-10063 in flatpak). TIOCSTI pushes input into a
         * terminal (typing commands into a shell outside), TIOCLINUX reads
         * or sets a virtual console's selection. */
        emit(p, BPF_JMP | BPF_JEQ | BPF_K, r->nr, 0, 5);
        load(p, OFF_ARG_LO(1));
        emit(p, BPF_JMP | BPF_JEQ | BPF_K, TIOCSTI, 2, 0);
        emit(p, BPF_JMP | BPF_JEQ | BPF_K, TIOCLINUX, 1, 0);
        ret(p, SECCOMP_RET_ALLOW);
        ret(p, RET_ERRNO(EPERM));
        break;
    case RULE_SETNS:
        /* setns(int fd, int nstype): the kernel reads both as int, so the
         * low halves are what it acts on. */
        emit(p, BPF_JMP | BPF_JEQ | BPF_K, r->nr, 0, 9);
        load(p, OFF_ARG_LO(1));
        emit(p, BPF_JMP | BPF_JEQ | BPF_K, CLONE_NEWUSER, 0, 2);
        load(p, OFF_ARG_LO(0));
        emit(p, BPF_JMP | BPF_JEQ | BPF_K, NSBOX_FD_USERNS, 3, 4);
        emit(p, BPF_JMP | BPF_JEQ | BPF_K, CLONE_NEWNS, 0, 3); /* A: nstype */
        load(p, OFF_ARG_LO(0));
        emit(p, BPF_JMP | BPF_JEQ | BPF_K, NSBOX_FD_MNTNS, 0, 1);
        ret(p, SECCOMP_RET_ALLOW);
        ret(p, RET_ERRNO(EPERM));
        break;
    case RULE_PID1:
        /* pid_t is an int: the kernel acts on the low half. */
        deny_if_arg0(p, r->nr, BPF_JEQ, INIT_PID);
        break;
    case RULE_PRLIMIT:
        /* prlimit64(pid, resource, new_limit, old_limit): reading the
         * init's limits (new_limit NULL, both halves of the pointer zero)
         * is harmless; setting them is not. */
        emit(p, BPF_JMP | BPF_JEQ | BPF_K, r->nr, 0, 8);
        load(p, OFF_ARG_LO(0));
        emit(p, BPF_JMP | BPF_JEQ | BPF_K, INIT_PID, 0, 5);
        load(p, OFF_ARG_LO(2));
        emit(p, BPF_JMP | BPF_JEQ | BPF_K, 0, 0, 2);
        load(p, OFF_ARG_HI(2));
        emit(p, BPF_JMP | BPF_JEQ | BPF_K, 0, 1, 0);
        ret(p, RET_ERRNO(EPERM));
        ret(p, SECCOMP_RET_ALLOW);
        break;
    case RULE_PRIO:
        /* setpriority / ioprio_set(int which, int who, ...): `value` is
         * which's "process", +1 its "process group", +2 its "user". A user
         * is refused whoever it is (the init shares sandbox root's ids); a
         * process or group only if it is 1 (who 0 means the caller's). */
        emit(p, BPF_JMP | BPF_JEQ | BPF_K, r->nr, 0, 8);
        load(p, OFF_ARG_LO(0));
        emit(p, BPF_JMP | BPF_JEQ | BPF_K, r->value + 2, 4, 0);
        emit(p, BPF_JMP | BPF_JEQ | BPF_K, r->value, 1, 0);
        emit(p, BPF_JMP | BPF_JEQ | BPF_K, r->value + 1, 0, 3);
        load(p, OFF_ARG_LO(1));
        emit(p, BPF_JMP | BPF_JEQ | BPF_K, INIT_PID, 0, 1);
        ret(p, RET_ERRNO(EPERM));
        ret(p, SECCOMP_RET_ALLOW);
        break;
    }
}

/*
 * Rules sorted by number, as a binary search: a few comparisons per system
 * call rather than one per rule. It matters when the filter is installed:
 * the kernel then runs the program for every system call number to find
 * those it may allow without running it (the seccomp action cache), once
 * per exec. Small groups are compared one by one, then allowed.
 */
static void emit_tree(struct prog *p, const struct rule *r, size_t n)
{
    if (n <= 4) {
        for (size_t i = 0; i < n; i++)
            emit_rule(p, &r[i]);
        ret(p, SECCOMP_RET_ALLOW);
        return;
    }
    size_t mid = n / 2, at = p->n;
    emit(p, BPF_JMP | BPF_JGE | BPF_K, r[mid].nr, 0, 0); /* jt: set below */
    emit_tree(p, r, mid); /* nr < r[mid].nr */
    size_t below = p->n - at - 1;
    if (below > 255)
        p->too_far = true;
    else if (at < p->cap)
        p->insn[at].jt = (uint8_t)below;
    emit_tree(p, r + mid, n - mid); /* nr >= r[mid].nr */
}

static bool add_rule(struct rule *rules, size_t *n, int nr, enum rule_kind kind, uint32_t value)
{
    if (*n >= MAX_RULES)
        return false;
    rules[(*n)++] = (struct rule){.nr = (uint32_t)nr, .kind = kind, .value = value};
    return true;
}

int nsbox_seccomp_build(int allow_nested_userns, int init_entry, struct sock_filter *out, size_t cap)
{
    struct rule rules[MAX_RULES];
    size_t n = 0;
    bool ok = true;
    for (size_t i = 0; i < N_ELEMS(denied); i++)
        ok &= add_rule(rules, &n, denied[i], RULE_ERRNO, EPERM);
    ok &= add_rule(rules, &n, __NR_ioctl, RULE_IOCTL, 0);
    for (size_t i = 0; i < N_ELEMS(init_sched_calls); i++)
        ok &= add_rule(rules, &n, init_sched_calls[i], RULE_PID1, 0);
    ok &= add_rule(rules, &n, __NR_prlimit64, RULE_PRLIMIT, 0);
    ok &= add_rule(rules, &n, __NR_setpriority, RULE_PRIO, PRIO_PROCESS);
    ok &= add_rule(rules, &n, __NR_ioprio_set, RULE_PRIO, IOPRIO_WHO_PROCESS);
    if (!allow_nested_userns) {
        for (size_t i = 0; i < N_ELEMS(namespace_calls); i++) {
            bool entry = init_entry && namespace_calls[i] == __NR_setns;
            ok &= add_rule(rules, &n, namespace_calls[i], entry ? RULE_SETNS : RULE_ERRNO, EPERM);
        }
        /* New namespaces. Sandbox root holds every capability in its user
         * namespace, so a namespace it creates is one it controls: a
         * network namespace gives it CAP_NET_ADMIN (nf_tables and
         * friends), a user namespace all of the above again. clone3's
         * flags are out of reach (see the top of this file). */
        ok &= add_rule(rules, &n, __NR_clone, RULE_FLAGS, CLONE_NAMESPACES);
        ok &= add_rule(rules, &n, __NR_unshare, RULE_FLAGS, UNSHARE_NAMESPACES);
        ok &= add_rule(rules, &n, __NR_clone3, RULE_ERRNO, ENOSYS);
    }
    if (!ok)
        return -E2BIG;
    /* Insertion sort; two rules for one number would be a bug here. */
    for (size_t i = 1; i < n; i++) {
        struct rule r = rules[i];
        size_t j = i;
        for (; j > 0 && rules[j - 1].nr > r.nr; j--)
            rules[j] = rules[j - 1];
        rules[j] = r;
        if (j > 0 && rules[j - 1].nr == r.nr)
            return -EINVAL;
    }

    struct prog p = {.insn = out, .cap = cap};
    /* Another ABI numbers its calls differently: kill rather than guess. */
    load(&p, OFF_ARCH);
    emit(&p, BPF_JMP | BPF_JEQ | BPF_K, NATIVE_ARCH, 1, 0);
    ret(&p, SECCOMP_RET_KILL_PROCESS);
    load(&p, OFF_NR);
#ifdef X32_SYSCALL_BIT
    /* x32 calls arrive as AUDIT_ARCH_X86_64 with this bit set. */
    emit(&p, BPF_JMP | BPF_JGE | BPF_K, X32_SYSCALL_BIT, 0, 1);
    ret(&p, SECCOMP_RET_KILL_PROCESS);
#endif
    emit_tree(&p, rules, n);
    if (p.too_far)
        return -E2BIG;
    return p.n <= cap ? (int)p.n : -E2BIG;
}

int nsbox_seccomp_install(int allow_nested_userns, int init_entry)
{
    struct sock_filter insn[256];
    int n = nsbox_seccomp_build(allow_nested_userns, init_entry, insn, N_ELEMS(insn));
    if (n < 0)
        return n;
    struct sock_fprog fprog = {.len = (unsigned short)n, .filter = insn};
    /* No flags: SECCOMP_FILTER_FLAG_TSYNC is not needed in a
     * single-threaded process, and without SPEC_ALLOW older kernels
     * (before 5.16) keep applying their speculation mitigations to
     * seccomp-confined tasks, which is what untrusted code should get. */
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &fprog) < 0)
        return -errno;
    return 0;
}
