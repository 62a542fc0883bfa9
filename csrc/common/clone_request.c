/*
 * clone_request.c - a struct nsbox_clone_request (the zygote's request to
 * clone one process), serialized for the nsbox-create zygote.
 *
 * Layout: a header, the steps with their strings replaced by offsets into
 * a string table, the argv/envp offsets, then the string table itself.
 * Descriptors are not serialized: they travel beside the request, as
 * SCM_RIGHTS (see create.h). unpack() checks every count, offset and
 * length, so a truncated, garbled or oversized request is refused rather
 * than followed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/create.h"

#define MAGIC 0x6e73626fU /* "nsbo" */
#define NONE UINT32_MAX   /* offset of a NULL string */

struct header {
    uint32_t magic;
    uint32_t nsteps, argc, envc, nkeep;
    uint32_t keep_present; /* bit i: keep_fds[i] >= 0 */
    uint32_t has_exec_fd, has_go_fd, keep_stdio, new_session;
    int32_t lock_slot;
    uint32_t lock_uid_map, lock_gid_map; /* offsets, or NONE */
    uint32_t uid_map, gid_map, newuidmap, newgidmap, deny_setgroups;
    uint32_t strtab_len;
    uint32_t host_go; /* 0 or 1; also keeps clone_flags 8-byte aligned with no hidden padding */
    uint64_t clone_flags;
};

struct wire_step {
    int32_t kind, slot;
    uint32_t mode;
    uint64_t flags, attr_set, attr_clr;
    uint32_t str[4]; /* a, b, c, d */
};

struct buf {
    char *data;
    size_t len, cap;
};

static int put(struct buf *b, const void *p, size_t n)
{
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 4096;
        while (cap < b->len + n)
            cap *= 2;
        char *d = realloc(b->data, cap);
        if (!d)
            return -1;
        b->data = d;
        b->cap = cap;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
    return 0;
}

/* Appends s to the string table; returns its offset. */
static uint32_t intern(struct buf *strtab, const char *s, int *fail)
{
    if (!s)
        return NONE;
    uint32_t off = (uint32_t)strtab->len;
    if (put(strtab, s, strlen(s) + 1) < 0)
        *fail = 1;
    return off;
}

static size_t count(char *const *v)
{
    size_t n = 0;
    while (v && v[n])
        n++;
    return n;
}

int nsbox_clone_request_pack(const struct nsbox_clone_request *req, int fd)
{
    struct buf body = {0}, strtab = {0};
    int fail = 0;
    size_t argc = count(req->argv), envc = count(req->envp);
    struct header h = {
        .magic = MAGIC, .nsteps = (uint32_t)req->nsteps, .argc = (uint32_t)argc, .envc = (uint32_t)envc,
        .nkeep = (uint32_t)req->nkeep, .has_exec_fd = req->exec_fd >= 0,
        .has_go_fd = req->go_fd >= 0, .host_go = req->go_fd >= 0 && req->host_go,
        .keep_stdio = (uint32_t)req->keep_stdio,
        .new_session = (uint32_t)req->new_session, .lock_slot = req->lock_slot,
        .clone_flags = req->clone_flags,
    };
    for (int i = 0; i < req->nkeep && i < 4; i++)
        h.keep_present |= req->keep_fds[i] >= 0 ? 1U << i : 0;
    h.lock_uid_map = intern(&strtab, req->lock_uid_map, &fail);
    h.lock_gid_map = intern(&strtab, req->lock_gid_map, &fail);
    h.uid_map = intern(&strtab, req->uid_map, &fail);
    h.gid_map = intern(&strtab, req->gid_map, &fail);
    h.newuidmap = intern(&strtab, req->newuidmap, &fail);
    h.newgidmap = intern(&strtab, req->newgidmap, &fail);
    h.deny_setgroups = (uint32_t)req->deny_setgroups;
    for (int i = 0; i < req->nsteps; i++) {
        const struct nsbox_step *s = &req->steps[i];
        struct wire_step w = {
            .kind = s->kind, .slot = s->slot, .mode = s->mode, .flags = s->flags,
            .attr_set = s->attr_set, .attr_clr = s->attr_clr,
            .str = {intern(&strtab, s->a, &fail), intern(&strtab, s->b, &fail),
                    intern(&strtab, s->c, &fail), intern(&strtab, s->d, &fail)},
        };
        fail |= put(&body, &w, sizeof w) < 0;
    }
    for (size_t i = 0; i < argc; i++) {
        uint32_t off = intern(&strtab, req->argv[i], &fail);
        fail |= put(&body, &off, sizeof off) < 0;
    }
    for (size_t i = 0; i < envc; i++) {
        uint32_t off = intern(&strtab, req->envp[i], &fail);
        fail |= put(&body, &off, sizeof off) < 0;
    }
    h.strtab_len = (uint32_t)strtab.len;
    int rc = -ENOMEM;
    if (!fail) {
        rc = 0;
        const struct buf parts[] = {{(char *)&h, sizeof h, 0}, body, strtab};
        for (int i = 0; i < 3 && rc == 0; i++) {
            for (size_t off = 0; off < parts[i].len;) {
                ssize_t n = write(fd, parts[i].data + off, parts[i].len - off);
                if (n < 0 && errno == EINTR)
                    continue;
                if (n <= 0) {
                    rc = -errno;
                    break;
                }
                off += (size_t)n;
            }
        }
    }
    free(body.data);
    free(strtab.data);
    return rc;
}

/* A string at offset off of the table, or NULL for NONE; sets *bad if the
 * offset is out of range. The table is NUL-terminated (checked below), so
 * every string in range ends inside it. */
static const char *str_at(const char *strtab, uint32_t len, uint32_t off, int *bad)
{
    if (off == NONE)
        return NULL;
    if (off >= len) {
        *bad = 1;
        return NULL;
    }
    return strtab + off;
}

/* The only clone flags a request may carry: the namespaces. The zygote adds
 * CLONE_PARENT | CLONE_PIDFD itself; anything else would have the child
 * share the zygote's memory (CLONE_VM), descriptors (CLONE_FILES) or root
 * and cwd (CLONE_FS), make the zygote wait for it (CLONE_VFORK: it waits
 * for the id maps the zygote writes, so both would hang), or take pointers
 * the request cannot give. */
#define NAMESPACE_FLAGS                                                                           \
    ((uint64_t)(CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | \
                CLONE_NEWNET))

#define MAX_STEPS 4096
#define MAX_ARGS 65536 /* for argv and for envp */

/*
 * Runs in the zygote on whatever its owner sends: checks every count,
 * offset and length before use, and refuses anything pack() would not have
 * produced from a usable req. On every refusal it frees what it allocated
 * and leaves the request zeroed, so the long-lived zygote leaks nothing.
 */
int nsbox_clone_request_unpack(char *buf, unsigned long len, struct nsbox_clone_request *req)
{
    struct header h;
    memset(req, 0, sizeof *req);
    if (len < sizeof h)
        return -EINVAL;
    memcpy(&h, buf, sizeof h);
    if (h.magic != MAGIC || h.host_go > 1 || (h.host_go && !h.has_go_fd) || h.nkeep > 4 || h.nsteps > MAX_STEPS ||
        h.argc == 0 || h.argc > MAX_ARGS || h.envc > MAX_ARGS || (h.clone_flags & ~NAMESPACE_FLAGS))
        return -EINVAL;
    /* The counts are bounded above, so none of this overflows. */
    uint64_t body = (uint64_t)h.nsteps * sizeof(struct wire_step) + ((uint64_t)h.argc + h.envc) * sizeof(uint32_t);
    if ((uint64_t)len != sizeof h + body + h.strtab_len || h.strtab_len == 0 || buf[len - 1] != 0)
        return -EINVAL;
    /* The nested namespaces' descriptors are dup2()ed to fds 3 + lock_slot
     * and 4 + lock_slot of the program: both must be keep positions the
     * the request leaves empty, or they would land on a descriptor it passes on. */
    int lock = h.lock_uid_map != NONE;
    if (lock != (h.lock_gid_map != NONE))
        return -EINVAL;
    if (lock && (h.lock_slot < 0 || (uint32_t)h.lock_slot + 1 >= h.nkeep || (h.keep_present >> h.lock_slot) & 3))
        return -EINVAL;
    const char *strtab = buf + sizeof h + body;
    int bad = 0;

    struct nsbox_step *steps = calloc(h.nsteps ? h.nsteps : 1, sizeof *steps);
    char **argv = calloc(h.argc + 1, sizeof *argv);
    char **envp = calloc(h.envc + 1, sizeof *envp);
    if (!steps || !argv || !envp) {
        free(steps);
        free(argv);
        free(envp);
        return -ENOMEM;
    }
    const char *p = buf + sizeof h;
    for (uint32_t i = 0; i < h.nsteps; i++, p += sizeof(struct wire_step)) {
        struct wire_step w;
        memcpy(&w, p, sizeof w);
        steps[i] = (struct nsbox_step){
            .kind = w.kind, .slot = w.slot, .mode = w.mode, .flags = (unsigned long)w.flags,
            .attr_set = w.attr_set, .attr_clr = w.attr_clr,
            .a = str_at(strtab, h.strtab_len, w.str[0], &bad), .b = str_at(strtab, h.strtab_len, w.str[1], &bad),
            .c = str_at(strtab, h.strtab_len, w.str[2], &bad), .d = str_at(strtab, h.strtab_len, w.str[3], &bad),
        };
    }
    /* Every argv and envp entry is a string: a NULL would cut the vector short. */
    for (uint32_t i = 0; i < h.argc + h.envc; i++, p += sizeof(uint32_t)) {
        uint32_t off;
        memcpy(&off, p, sizeof off);
        const char *s = str_at(strtab, h.strtab_len, off, &bad);
        bad |= !s;
        if (i < h.argc)
            argv[i] = (char *)s;
        else
            envp[i - h.argc] = (char *)s;
    }

    req->clone_flags = (unsigned long)h.clone_flags;
    req->steps = steps;
    req->nsteps = (int)h.nsteps;
    /* The descriptors come separately; mark which ones the request expects. */
    req->sync_fd = req->error_fd = -1;
    req->nkeep = (int)h.nkeep;
    for (uint32_t i = 0; i < h.nkeep; i++)
        req->keep_fds[i] = (h.keep_present & (1U << i)) ? 0 : -1;
    req->exec_fd = h.has_exec_fd ? 0 : -1;
    req->go_fd = h.has_go_fd ? 0 : -1;
    req->host_go = (int)h.host_go;
    req->argv = argv;
    req->envp = envp;
    req->keep_stdio = h.keep_stdio != 0;
    req->new_session = h.new_session != 0;
    req->lock_uid_map = str_at(strtab, h.strtab_len, h.lock_uid_map, &bad);
    req->lock_gid_map = str_at(strtab, h.strtab_len, h.lock_gid_map, &bad);
    req->lock_slot = h.lock_slot;
    req->uid_map = str_at(strtab, h.strtab_len, h.uid_map, &bad);
    req->gid_map = str_at(strtab, h.strtab_len, h.gid_map, &bad);
    req->newuidmap = str_at(strtab, h.strtab_len, h.newuidmap, &bad);
    req->newgidmap = str_at(strtab, h.strtab_len, h.newgidmap, &bad);
    req->deny_setgroups = h.deny_setgroups != 0;
    if (bad || !req->uid_map || !req->gid_map || (!req->newuidmap != !req->newgidmap)) {
        nsbox_clone_request_free(req);
        return -EINVAL;
    }
    return 0;
}

/* Frees what nsbox_clone_request_unpack allocated (nothing, for a zeroed request) and
 * zeroes the request. Not for requests built elsewhere (Python's are cffi's). */
void nsbox_clone_request_free(struct nsbox_clone_request *req)
{
    free((void *)req->steps);
    free((void *)req->argv);
    free((void *)req->envp);
    memset(req, 0, sizeof *req);
}

int nsbox_clone_request_fds(const struct nsbox_clone_request *req)
{
    int n = 2 + (req->go_fd >= 0) + (req->exec_fd >= 0); /* error pipe, sync pipe, its write end, program */
    for (int i = 0; i < req->nkeep; i++)
        n += req->keep_fds[i] >= 0;
    return n;
}
