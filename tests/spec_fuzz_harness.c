/*
 * spec_fuzz_harness.c - nsbox_spec_unpack (csrc/common/clone_request.c) on arbitrary input,
 * for a memory checker to watch: tests/host/test_spec_fuzz.py builds it with
 * -fsanitize=address,undefined and feeds it mutated specs, so a read past
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
 * every string the spec points to. Returns unpack's result. */
static int one(const uint8_t *data, size_t size)
{
    char *buf = malloc(size ? size : 1);
    if (!buf)
        abort();
    memcpy(buf, data, size);
    struct nsbox_spec spec;
    memset(&spec, 0xa5, sizeof spec);
    int rc = nsbox_spec_unpack(buf, size, &spec);
    if (rc == 0) {
        for (int i = 0; i < spec.nsteps; i++) {
            touch(spec.steps[i].a);
            touch(spec.steps[i].b);
            touch(spec.steps[i].c);
            touch(spec.steps[i].d);
        }
        for (char *const *v = spec.argv; *v; v++)
            touch(*v);
        for (char *const *v = spec.envp; *v; v++)
            touch(*v);
        touch(spec.uid_map);
        touch(spec.gid_map);
        touch(spec.newuidmap);
        touch(spec.newgidmap);
        touch(spec.lock_uid_map);
        touch(spec.lock_gid_map);
    } else {
        /* A refusal leaves the spec zeroed. */
        static const struct nsbox_spec zero;
        if (memcmp(&spec, &zero, sizeof spec) != 0)
            abort();
    }
    nsbox_spec_free(&spec);
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
