/*
 * zygote.h - the parts of nsbox-create, the zygote (see create.h):
 *
 *   main.c   the server: one creation request at a time, clone3, the reply
 *   child.c  the cloned child: descriptors, the go byte, the setup steps,
 *            the locked namespaces, exec of the init
 *   idmap.c  writing a child's uid/gid maps (directly or with newuidmap)
 *   lock.c   the nested user + mount namespaces that lock the mounts
 *   proc.c   /proc/PID paths without the C library's formatting
 */
#ifndef NSBOX_ZYGOTE_H
#define NSBOX_ZYGOTE_H

#include <sys/types.h>

#include "common/create.h"

/* child.c: runs in the cloned child; never returns. */
void __attribute__((noreturn)) child(const struct nsbox_clone_request *req);

/* idmap.c: 0 or an errno; newuidmap's complaint goes into msg. */
int write_id_maps(const struct nsbox_clone_request *req, pid_t pid, char *msg, int *msglen);

/* lock.c */
int make_locked_namespaces(const char *uid_map, const char *gid_map, int *userns, int *mntns);

/* proc.c */
char *put_uint(char *p, unsigned long v);
char *put_str(char *p, const char *s);
const char *proc_path(char *buf, pid_t pid, const char *name);
int write_proc(pid_t pid, const char *name, const char *text);

#endif
