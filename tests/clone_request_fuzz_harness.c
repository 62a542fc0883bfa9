/*
 * clone_request_fuzz_harness.c - nsbox_clone_request_unpack
 * (csrc/common/clone_request.c) on arbitrary input, for a memory checker
 * to watch: tests/host/test_clone_request_fuzz.py builds it
 * -fsanitize=address,undefined and feeds it mutated requests, so a read past
 * the buffer or a leak is caught even where it would not crash.
 *
 * Input (stdin): records of a native uint32 length and that many bytes.
 * Output: "accepted N refused M". With clang, -DNSBOX_LIBFUZZER
 * -fsanitize=fuzzer,address builds a libFuzzer target instead.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/create.h"

static void touch(const char *s)
{
    if (s && strlen(s) == (size_t)-1)
        abort();
}

/* Unpacks one input from a buffer of exactly its size; on acceptance reads
 * every string the request points to. Returns unpack's result. */
static int one(const uint8_t *data, size_t size)
{
    char *buf = malloc(size ? size : 1);
    if (!buf)
        abort();
    memcpy(buf, data, size);
    struct nsbox_clone_request req;
    memset(&req, 0xa5, sizeof req);
    int rc = nsbox_clone_request_unpack(buf, size, &req);
    if (rc == 0) {
        for (int i = 0; i < req.nsteps; i++) {
            touch(req.steps[i].a);
            touch(req.steps[i].b);
            touch(req.steps[i].c);
            touch(req.steps[i].d);
        }
        for (char *const *v = req.argv; *v; v++)
            touch(*v);
        for (char *const *v = req.envp; *v; v++)
            touch(*v);
        touch(req.uid_map);
        touch(req.gid_map);
        touch(req.newuidmap);
        touch(req.newgidmap);
        touch(req.lock_uid_map);
        touch(req.lock_gid_map);
    } else {
        /* A refusal leaves the request zeroed. */
        static const struct nsbox_clone_request zero;
        if (memcmp(&req, &zero, sizeof req) != 0)
            abort();
    }
    nsbox_clone_request_free(&req);
    free(buf);
    return rc;
}

#ifdef NSBOX_LIBFUZZER
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    one(data, size);
    return 0;
}
#else
int main(void)
{
    long accepted = 0, refused = 0;
    uint32_t n;
    while (fread(&n, sizeof n, 1, stdin) == 1) {
        uint8_t *data = malloc(n ? n : 1);
        if (!data || fread(data, 1, n, stdin) != n)
            return 2;
        if (one(data, n) == 0)
            accepted++;
        else
            refused++;
        free(data);
    }
    printf("accepted %ld refused %ld\n", accepted, refused);
    return 0;
}
#endif
