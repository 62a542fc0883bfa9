/*
 * seccomp.h - the system call filter of everything a sandbox runs.
 */
#ifndef NSBOX_SECCOMP_H
#define NSBOX_SECCOMP_H

#include <stddef.h>
#include <linux/filter.h>

/*
 * Installs nsbox's deny-list on the calling thread (see seccomp.c for what
 * it denies and why). The caller must hold CAP_SYS_ADMIN in its user
 * namespace (the init does, in the sandbox's outer one) or have set
 * PR_SET_NO_NEW_PRIVS. The filter is inherited across fork and execve and
 * cannot be removed.
 *
 * allow_nested_userns: nonzero lets sandbox processes create namespaces
 * (user, mount, network, ...) and mount filesystems, which a sandbox
 * nested inside this one needs (the nested_userns setting).
 *
 * init_entry: nonzero allows the two setns calls by which the init's
 * children join the sandbox's nested namespaces (NSBOX_FD_USERNS with
 * CLONE_NEWUSER, NSBOX_FD_MNTNS with CLONE_NEWNS); every other setns stays
 * denied. Without allow_nested_userns, that is.
 *
 * Returns 0, or -errno if the kernel refused the filter.
 */
int nsbox_seccomp_install(int allow_nested_userns, int init_entry);

/*
 * Writes the filter program into `out` (room for `cap` instructions)
 * without installing it; returns its length, or -E2BIG. For tests, which
 * check the program an architecture gets without running on it.
 */
int nsbox_seccomp_build(int allow_nested_userns, int init_entry, struct sock_filter *out, size_t cap);

#endif
