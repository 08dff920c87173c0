/* fuzz_replay.c - main() for the harnesses outside libFuzzer: runs LLVMFuzzerTestOneInput once
 * on every file named on the command line and on every regular file inside each directory named
 * (sorted by name, so a run is reproducible). A harness's failed promise aborts, so a non-zero
 * exit names the input printed last. Fails too when there was no input at all, so a corpus path
 * that moved never reads as a pass.
 *   fuzz_<name> FILE|DIR ...   */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* scandir */
#endif
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz.h"

static int run_file(const char *path) {
    size_t n;
    uint8_t *in = fuzz_read_file(path, &n);
    if (!in) {
        fprintf(stderr, "fuzz_replay: cannot read %s\n", path);
        return -1;
    }
    fprintf(stderr, "fuzz_replay: %s (%zu bytes)\n", path, n);
    LLVMFuzzerTestOneInput(in, n);
    free(in);
    return 0;
}

static int by_name(const struct dirent **a, const struct dirent **b) { return strcmp((*a)->d_name, (*b)->d_name); }

int main(int argc, char **argv) {
    int ran = 0, bad = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) {
            fprintf(stderr, "fuzz_replay: %s does not exist\n", argv[i]);
            bad++;
        } else if (S_ISDIR(st.st_mode)) {
            struct dirent **ents;
            const int n = scandir(argv[i], &ents, NULL, by_name);
            if (n < 0) {
                fprintf(stderr, "fuzz_replay: cannot list %s\n", argv[i]);
                bad++;
                continue;
            }
            for (int k = 0; k < n; k++) {
                char p[4096];
                snprintf(p, sizeof p, "%s/%s", argv[i], ents[k]->d_name);
                struct stat fs;
                if (ents[k]->d_name[0] != '.' && stat(p, &fs) == 0 && S_ISREG(fs.st_mode)) {
                    if (run_file(p) == 0) ran++; else bad++;
                }
                free(ents[k]);
            }
            free(ents);
        } else {
            if (run_file(argv[i]) == 0) ran++; else bad++;
        }
    }
    printf("fuzz_replay: %d inputs replayed, %d unreadable\n", ran, bad);
    return ran > 0 && bad == 0 ? 0 : 1;
}
