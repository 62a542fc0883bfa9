/*
 * rawsys.h - system calls that leave errno alone.
 *
 * While a child of spawn_shared runs on our memory, it shares our errno
 * too (same thread pointer, same TLS): the C library's wrappers would
 * write our failures (a futex wait's ETIMEDOUT, say) into the errno the
 * child is about to read after a call of its own. The init waits for that
 * child with these instead. They return the kernel's result: a negative
 * errno on failure.
 */
#ifndef NSBOX_RAWSYS_H
#define NSBOX_RAWSYS_H

static inline long raw_syscall5(long nr, long a, long b, long c, long d, long e)
{
#if defined(__x86_64__)
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    long ret;
    /* The syscall instruction itself clobbers rcx and r11. */
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(nr), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8)
                     : "rcx", "r11", "memory");
    return ret;
#elif defined(__aarch64__)
    register long x8 __asm__("x8") = nr;
    register long x0 __asm__("x0") = a;
    register long x1 __asm__("x1") = b;
    register long x2 __asm__("x2") = c;
    register long x3 __asm__("x3") = d;
    register long x4 __asm__("x4") = e;
    __asm__ volatile("svc 0" : "+r"(x0) : "r"(x8), "r"(x1), "r"(x2), "r"(x3), "r"(x4) : "memory", "cc");
    return x0;
#else
#error "nsbox-init supports x86_64 and aarch64 (as its seccomp filter does)"
#endif
}

#endif
