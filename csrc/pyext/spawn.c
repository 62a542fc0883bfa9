/*
 * spawn.c - starting the nsbox-create zygote; called through cffi.
 *
 * It runs in the (possibly large, multi-threaded) Python process, so it
 * uses posix_spawn, which costs the same whatever the caller's size.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <unistd.h>

#include "common/create.h"
#include "common/protocol.h"

const char *nsbox_default_path(void)
{
    return NSBOX_DEFAULT_PATH;
}

int nsbox_start_zygote(const char *path, int sock)
{
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t attr;
    posix_spawn_file_actions_init(&fa);
    posix_spawnattr_init(&attr);
    /* Everything but the socket is left behind: Python's own descriptors are
     * close-on-exec, but the process may have inherited others that are not
     * (the zygote closes any that get through, too). stdin/out/err go to
     * /dev/null. */
    int err = posix_spawn_file_actions_adddup2(&fa, sock, NSBOX_ZYGOTE_SOCKET);
    for (int fd = 0; fd < 3 && !err; fd++)
        err = posix_spawn_file_actions_addopen(&fa, fd, "/dev/null", O_RDWR, 0);
#if defined(__GLIBC__) && __GLIBC_PREREQ(2, 34)
    if (!err)
        err = posix_spawn_file_actions_addclosefrom_np(&fa, NSBOX_ZYGOTE_SOCKET + 1);
#endif
    /* A clean signal state: nothing blocked or caught (the zygote resets
     * the two signals glibc keeps for itself, see csrc/create/main.c). */
    sigset_t none, all;
    sigemptyset(&none);
    sigfillset(&all);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &all);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSID);
    char *argv[] = {"nsbox-create", NULL}, *envp[] = {NULL};
    pid_t pid;
    if (!err)
        err = posix_spawn(&pid, path, &fa, &attr, argv, envp);
    posix_spawn_file_actions_destroy(&fa);
    posix_spawnattr_destroy(&attr);
    return err ? -err : pid;
}
