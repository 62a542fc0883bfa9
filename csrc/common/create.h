/*
 * create.h - the interface of the zygote (csrc/create/), as cffi sees it.
 *
 * Python (nsbox/plan/: Plan and its contributors) composes a sandbox as a
 * list of steps; the C side only carries them out, in order, in a freshly cloned child. Keeping
 * the policy in Python keeps this file small and the order of operations
 * readable in one place.
 */

/* Step kinds. Paths are host paths before NSBOX_STEP_PIVOT and sandbox paths
 * after it. */
enum nsbox_step_kind {
    NSBOX_STEP_MOUNT = 1,       /* mount(a, b, c, flags, d); flags: NSBOX_IN_ROOT too */
    NSBOX_STEP_TREE_CLONE = 2,  /* slots[slot] = detached copy of the mount tree at a,
                                   with attr_set / attr_clr applied (read-only etc.);
                                   flags: AT_RECURSIVE, NSBOX_TREE_NO_SYMLINKS */
    NSBOX_STEP_TREE_ATTACH = 3, /* attach slots[slot] at b; flags: NSBOX_IN_ROOT */
    NSBOX_STEP_MKDIR = 4,       /* mkdir(b, mode); an existing directory (not a symlink) is fine;
                                   flags: NSBOX_IN_ROOT (then a symlink inside the root is followed) */
    NSBOX_STEP_MKFILE = 5,      /* create the empty file b where missing (a mount point for a file);
                                   flags: NSBOX_IN_ROOT */
    NSBOX_STEP_SYMLINK = 6,     /* symlink a at b; an existing link is replaced */
    NSBOX_STEP_PIVOT = 7,       /* make b the root; the old root is detached */
    NSBOX_STEP_HOSTNAME = 8,    /* sethostname(a) */
    NSBOX_STEP_LOOPBACK_UP = 9, /* bring up "lo" in the new network namespace; write "0" to a, c to b, if given */
    NSBOX_STEP_REMOUNT = 10,    /* mount(NULL, b, NULL, MS_REMOUNT | flags, NULL) */
    NSBOX_STEP_BECOME_ROOT = 11, /* setresgid/setresuid(0): become the namespace's root */
    NSBOX_STEP_PATH_FD = 12,    /* open a as O_PATH at descriptor NSBOX_PATH_FD_BASE + slot */
    NSBOX_STEP_SYSCTL = 13,     /* write b to the /proc/sys file a; any failure fails the sandbox */
};

/* Host directories looked up before NSBOX_STEP_BECOME_ROOT are held open at
 * NSBOX_PATH_FD_BASE + slot, so later steps name them /proc/self/fd/N (see
 * Plan.host_dir in nsbox/plan/plan.py). They are close-on-exec, closed
 * once NSBOX_STEP_PIVOT succeeds (steps after it name sandbox paths only)
 * and after the steps; nothing else the child opens reaches this range. */
#define NSBOX_PATH_FD_BASE 200
#define NSBOX_PATH_FDS 512

/* C libraries older than the kernel's mount API (5.2) lack this flag of
 * open_tree and mount_setattr. (A fallback for a system header: the cffi
 * build reads the value from the headers, see nsbox/_build_ffi.py.) */
#ifndef AT_RECURSIVE
#define AT_RECURSIVE 0x8000
#endif

/* TREE_CLONE: `a` is opened with no symlink followed (RESOLVE_NO_SYMLINKS).
 * A bind source is resolved once, when its Bind is made; one a sandbox has
 * since turned into a symlink (a directory of a volume it shares, swapped
 * for a link to /) fails the step instead of leading to the host. */
#define NSBOX_TREE_NO_SYMLINKS 0x40000000

/* MKDIR, MKFILE, TREE_ATTACH, MOUNT after the pivot: b is resolved inside
 * the sandbox's root, as a container runtime resolves a mount's target: an
 * image's symlink on the way (/var/run -> /run) is followed there, a /proc
 * magic link is not, and a target that lands in /proc or /sys is refused. */
#define NSBOX_IN_ROOT 0x20000000

struct nsbox_step {
    int kind;
    int slot;
    unsigned int mode;
    unsigned long flags;
    unsigned long long attr_set;
    unsigned long long attr_clr;
    const char *a;
    const char *b;
    const char *c;
    const char *d;
};

#define NSBOX_SLOTS 256

/* A clone request: what the zygote is to create, one process (see below). */
struct nsbox_clone_request {
    unsigned long clone_flags;      /* CLONE_NEW* for the child, and nothing else */
    const struct nsbox_step *steps; /* run in order once the id maps are written */
    int nsteps;
    /* The new user namespace's maps, as /proc/PID/uid_map takes them. With
     * newuidmap set, the setuid helpers newuidmap/newgidmap write them
     * (subordinate ids); otherwise they are written directly, after
     * denying setgroups if deny_setgroups is set. */
    const char *uid_map;
    const char *gid_map;
    const char *newuidmap;
    const char *newgidmap;
    int deny_setgroups;
    int sync_fd;  /* child reads one byte here before its steps: the host's "go", sent
                     once the id maps are written and its hooks are done */
    int go_fd;    /* the write end of that pipe, or -1: with it, the zygote sends
                     the go itself once the maps are written (a host with no hooks
                     to run first need not wake for it) */
    int host_go;  /* with go_fd: the host sends a go too, once its own work for the
                     setup is done (the writable layer); the child waits for both */
    int error_fd; /* child writes struct nsbox_setup_error here on failure */
    int keep_fds[4]; /* become fds 3, 4, ... of the program; -1 entries give closed fds */
    int nkeep;
    int exec_fd;             /* program to execveat (the init), or -1 to use argv[0] */
    char *const *argv;
    char *const *envp;
    int keep_stdio;          /* 0: stdin/out/err become /dev/null (after the steps) */
    int new_session;         /* call setsid() */
    /* When lock_uid_map is set: after the steps, create a user namespace
     * nested in the new one, with these uid/gid maps (identity lines, one per
     * extent of the outer map: an extent may not span two outer ones), and
     * its own mount namespace, in which every mount is locked. Descriptors
     * of the two land in keep positions lock_slot and lock_slot + 1, which
     * must be within nkeep and empty (keep_fds -1). */
    const char *lock_uid_map;
    const char *lock_gid_map;
    int lock_slot;
};

/* What the child reports when a step fails: the step's index (or one of the
 * negative stages below) and the errno. */
struct nsbox_setup_error {
    int step;
    int err;
};

enum nsbox_setup_stage {
    NSBOX_SETUP_SYNC = -1, /* waiting for the id maps failed */
    NSBOX_SETUP_FDS = -2,  /* arranging descriptors failed */
    NSBOX_SETUP_EXEC = -3, /* execve of the program failed */
    /* -4 was "becoming root", now a step (NSBOX_STEP_BECOME_ROOT) */
    NSBOX_SETUP_LOCK = -5, /* creating the locked namespaces failed */
    NSBOX_SETUP_SESSION = -6, /* setsid() failed */
    NSBOX_SETUP_SIGNALS = -7, /* blocking or unblocking signals failed */
};

/*
 * The Python process creates sandboxes through nsbox-create (csrc/create/),
 * a small static "zygote" it starts once with nsbox_start_zygote(): cloning
 * the Python process itself would copy its page tables, which costs
 * milliseconds per sandbox for a large process. For each sandbox the zygote
 * receives one message on its socket (fd NSBOX_ZYGOTE_SOCKET) carrying, as
 * SCM_RIGHTS and in this order: a socket for the reply, a memfd with the
 * clone request (nsbox_clone_request_pack), the error pipe, the read end of
 * the sync pipe, its write end (if the request has go_fd), the program to
 * exec (if the request has one) and the keep_fds that are present. It clones the sandbox's
 * first process with CLONE_PARENT, so that process is a child of the
 * Python process, writes its id maps and replies with struct
 * nsbox_zygote_reply, the child's pidfd, and any message from
 * newuidmap/newgidmap. The child waits for the go byte on the sync pipe:
 * the zygote sends it right after the maps when it has go_fd; otherwise
 * the host does, after running its own hooks (placing the child in a
 * cgroup). With go_fd and host_go, both send one and the child waits for
 * the two. A request it cannot use is answered with -1,
 * EINVAL and NSBOX_ZYGOTE_REQUEST, or not at all if it carried no
 * descriptor to answer on; replies never wait for room on the socket.
 * EOF on its socket (the Python process exited) ends it.
 *
 * A message whose byte is 'j' asks instead for a sub-zygote inside another
 * sandbox's user and network namespaces (see enter() in create/main.c); it
 * carries the reply socket, the sub-zygote's socket and the two namespace
 * descriptors, and is answered with the sub-zygote's pid and pidfd.
 *
 * A message whose byte is 'h' asks for a holder: a sub-zygote in a new user
 * namespace with the request's id maps (see hold() in create/main.c), in which
 * sandboxes get nested user namespaces whose maps it writes directly. It
 * carries the reply socket, the holder's socket and a request memfd.
 */
#define NSBOX_ZYGOTE_SOCKET 3
#define NSBOX_ZYGOTE_MSG_MAX 1024
#define NSBOX_CLONE_REQUEST_MAX 16777216 /* bytes: a larger request is refused unread */

enum nsbox_zygote_stage {
    NSBOX_ZYGOTE_REQUEST = 1, /* the request was malformed */
    NSBOX_ZYGOTE_CLONE = 2,   /* clone3 failed */
    NSBOX_ZYGOTE_IDMAP = 3,   /* writing the id maps failed */
    NSBOX_ZYGOTE_JOIN = 4,    /* a sub-zygote could not enter the namespaces given */
};

struct nsbox_zygote_reply {
    int pid;   /* > 0, or -1 with err and stage set */
    int err;
    int stage;
    int msglen; /* bytes of message text following the struct */
};

/* NSBOX_DEFAULT_PATH of protocol.h, for Python (spawn.c). */
const char *nsbox_default_path(void);

/* Starts the zygote `path` with `sock` as its socket; returns its pid or -errno. */
int nsbox_start_zygote(const char *path, int sock);

/* clone_request.c: the request, serialized with its strings. unpack()
 * points the strings into buf, allocates the steps, argv and envp arrays
 * (free them with nsbox_clone_request_free) and marks the descriptors the
 * message must carry (0 for one expected, -1 for none); it returns 0, or
 * -EINVAL (-ENOMEM) and leaves the request zeroed, having freed what it
 * allocated. It refuses anything pack() would not produce and anything the
 * zygote must not do (see clone_request.c). nsbox_clone_request_fds() says
 * how many descriptors follow the request in the zygote's message. */
int nsbox_clone_request_pack(const struct nsbox_clone_request *req, int fd);
int nsbox_clone_request_unpack(char *buf, unsigned long len, struct nsbox_clone_request *req);
void nsbox_clone_request_free(struct nsbox_clone_request *req);
int nsbox_clone_request_fds(const struct nsbox_clone_request *req);
