/* A RUN step's background process racing the layer archiver.
 *
 *   swap_race KIND DIR PAIRS TARGET TOKEN
 *
 * Makes DIR/file-I (a regular file holding "harmless\n"; KIND "dir": a
 * directory holding such a file, f) and DIR/alt-I (KIND "symlink" or
 * "dir": a symlink to TARGET; "fifo": a FIFO) for I < PAIRS,
 * then swaps each pair (renameat2 RENAME_EXCHANGE) in a loop until it is
 * killed, so that any name may be either at any time. DIR.ready appears
 * once it has swapped a while. TOKEN only marks its command line.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: swap_race symlink|dir|fifo DIR PAIRS TARGET TOKEN\n");
        return 2;
    }
    int fifo = strcmp(argv[1], "fifo") == 0, dir = strcmp(argv[1], "dir") == 0, pairs = atoi(argv[3]);
    char a[4096], b[4096];
    if (mkdir(argv[2], 0755) != 0)
        return perror("mkdir"), 1;
    for (int i = 0; i < pairs; i++) {
        snprintf(a, sizeof a, "%s/file-%d", argv[2], i);
        if (dir && mkdir(a, 0755) != 0)
            return perror(a), 1;
        if (dir)
            strcat(a, "/f");
        int fd = open(a, O_WRONLY | O_CREAT | O_EXCL, 0644);
        if (fd < 0 || write(fd, "harmless\n", 9) != 9 || close(fd) != 0)
            return perror(a), 1;
        snprintf(b, sizeof b, "%s/alt-%d", argv[2], i);
        if ((fifo ? mkfifo(b, 0644) : symlink(argv[4], b)) != 0)
            return perror(b), 1;
    }
    for (unsigned long n = 0;; n++) {
        for (int i = 0; i < pairs; i++) {
            snprintf(a, sizeof a, "%s/file-%d", argv[2], i);
            snprintf(b, sizeof b, "%s/alt-%d", argv[2], i);
            if (renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) != 0)
                return perror("renameat2"), 1;
        }
        if (n == 200) {
            snprintf(a, sizeof a, "%s.ready", argv[2]);
            close(open(a, O_WRONLY | O_CREAT, 0644));
        }
    }
}
