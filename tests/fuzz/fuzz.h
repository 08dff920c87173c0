/* fuzz.h - what the harnesses in tests/fuzz/ share.
 *
 * A harness defines LLVMFuzzerTestOneInput (libFuzzer's entry point) for one parser or kernel
 * twin that takes outside input, and checks the promise its header makes (a clean error, or a
 * result with the stated properties). A broken promise calls FUZZ_FAIL, which aborts, so the
 * fuzzer keeps the input and the replay fails. Each harness is built two ways:
 *   - with clang -fsanitize=fuzzer,address,undefined by scripts/fuzz.sh: a coverage-guided
 *     campaign of a chosen length;
 *   - with fuzz_replay.c's main in every build: ctest replays the committed inputs in
 *     tests/fuzz/corpus/<harness>/ (seeds, and every input a campaign found failing), so CI
 *     runs them deterministically, under ASan / UBSan in its sanitizer build.
 */
#ifndef KDT_FUZZ_H
#define KDT_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define FUZZ_FAIL(...)                                            \
    do {                                                          \
        fprintf(stderr, "fuzz: %s:%d: ", __FILE__, __LINE__);     \
        fprintf(stderr, __VA_ARGS__);                             \
        fprintf(stderr, "\n");                                    \
        abort();                                                  \
    } while (0)

#define FUZZ_CHECK(cond, ...)                                                   \
    do {                                                                        \
        if (!(cond)) {                                                          \
            fprintf(stderr, "fuzz: %s:%d: %s: ", __FILE__, __LINE__, #cond);    \
            fprintf(stderr, __VA_ARGS__);                                       \
            fprintf(stderr, "\n");                                              \
            abort();                                                            \
        }                                                                       \
    } while (0)

/* FUZZ_VERBOSE=1: each harness says what became of an input (loaded, refused and why), so a
 * replayed seed shows which path it reaches. */
void fuzz_note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Draws bytes from an input: the harnesses that build structures (trees, kernel parameters) read
 * their fields one byte at a time; past the end every byte is 0. */
typedef struct fuzz_reader {
    const uint8_t *p;
    size_t n, at;
} fuzz_reader;
static inline int fuzz_byte(fuzz_reader *r) { return r->at < r->n ? r->p[r->at++] : 0; }
static inline int fuzz_pick(fuzz_reader *r, int lo, int hi) { return lo + fuzz_byte(r) % (hi - lo + 1); } /* lo..hi */

/* A whole file, malloc'ed at its exact size (so ASan sees a read past it; NULL on error). */
uint8_t *fuzz_read_file(const char *path, size_t *len);

/* A private directory for harnesses whose subject reads files (model and tokenizer loaders),
 * made once per process and removed at exit. */
const char *fuzz_tmpdir(void);
/* Writes data[0..n) to fuzz_tmpdir()/name, replacing it; returns the path (static buffer). */
const char *fuzz_write_file(const char *name, const void *data, size_t n);
/* Removes fuzz_tmpdir()/name if it exists. */
void fuzz_remove_file(const char *name);

#endif
