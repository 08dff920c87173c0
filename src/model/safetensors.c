/* safetensors.c - the checkpoint reader: mmap's model.safetensors or the shards listed by
 * model.safetensors.index.json, parses and validates every header (length, JSON, dtype, shape,
 * sizes matching shapes, the tensors tiling the data section exactly: no overlap, no hole, nothing
 * after the last, as the reference reader requires) and keeps a name -> tensor hash.
 * Format: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape,
 * data_offsets: [begin, end]}, "__metadata__": {...}}, then the data; offsets are relative to
 * the data section. */
#include "model_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define KDT_ST_MAX_HEADER (512u << 20) /* far above any real header (Kimi shards: ~1 MB) */

static const struct {
    const char *name;
    kdt_wtype type;
    size_t size;
} st_dtypes[] = {
    {"F32", KDT_W_F32, 4},      {"BF16", KDT_W_BF16, 2},  {"F16", KDT_W_F16, 2},
    {"F8_E4M3", KDT_W_F8_E4M3, 1}, {"I32", KDT_W_I32, 4}, {"I64", KDT_W_I64, 8},
    {"F64", KDT_W_OTHER, 8},    {"F8_E5M2", KDT_W_OTHER, 1}, {"I8", KDT_W_OTHER, 1},
    {"U8", KDT_W_OTHER, 1},     {"BOOL", KDT_W_OTHER, 1}, {"I16", KDT_W_OTHER, 2},
    {"U16", KDT_W_OTHER, 2},    {"U32", KDT_W_OTHER, 4},  {"U64", KDT_W_OTHER, 8},
};

size_t kdt_wtype_size(kdt_wtype t) {
    switch (t) {
    case KDT_W_F32: case KDT_W_I32: return 4;
    case KDT_W_BF16: case KDT_W_F16: return 2;
    case KDT_W_F8_E4M3: return 1;
    case KDT_W_I64: return 8;
    default: return 0;
    }
}

const char *kdt_wtype_name(kdt_wtype t) {
    switch (t) {
    case KDT_W_F32: return "F32";
    case KDT_W_BF16: return "BF16";
    case KDT_W_F16: return "F16";
    case KDT_W_F8_E4M3: return "F8_E4M3";
    case KDT_W_I32: return "I32";
    case KDT_W_I64: return "I64";
    default: return "other";
    }
}

static uint64_t fnv1a(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

const kdt_st_tensor *kdt_st_find(const kdt_st_set *s, const char *name) {
    if (!s->hash_cap) return NULL;
    uint64_t mask = (uint64_t)s->hash_cap - 1;
    for (uint64_t i = fnv1a(name) & mask;; i = (i + 1) & mask) {
        int64_t t = s->hash[i];
        if (t < 0) return NULL;
        if (strcmp(s->tensors[t].name, name) == 0) return &s->tensors[t];
    }
}

static kdt_status build_hash(kdt_st_set *s) {
    int64_t cap = 16;
    while (cap < 2 * s->n_tensors) cap *= 2;
    s->hash = malloc((size_t)cap * sizeof *s->hash);
    if (!s->hash) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "safetensors: name table of %lld", (long long)cap);
    s->hash_cap = cap;
    for (int64_t i = 0; i < cap; i++) s->hash[i] = -1;
    uint64_t mask = (uint64_t)cap - 1;
    for (int64_t t = 0; t < s->n_tensors; t++) {
        uint64_t i = fnv1a(s->tensors[t].name) & mask;
        while (s->hash[i] >= 0) {
            const kdt_st_tensor *o = &s->tensors[s->hash[i]];
            if (strcmp(o->name, s->tensors[t].name) == 0)
                return kdt_fail(KDT_ERR_FORMAT, "%s: tensor \"%s\" also appears in %s",
                                s->files[s->tensors[t].file].path, o->name, s->files[o->file].path);
            i = (i + 1) & mask;
        }
        s->hash[i] = t;
    }
    return KDT_OK;
}

void kdt_st_close(kdt_st_set *s) {
    if (!s) return;
    for (int32_t i = 0; i < s->n_files; i++) {
        if (s->files[i].map) munmap(s->files[i].map, s->files[i].map_size);
        free(s->files[i].path);
    }
    for (int64_t i = 0; i < s->n_tensors; i++) free(s->tensors[i].name);
    for (int64_t i = 0; i < s->n_owned; i++) free(s->owned[i]);
    free(s->files);
    free(s->tensors);
    free(s->hash);
    free(s->owned);
    memset(s, 0, sizeof *s);
}

typedef struct span {
    uint64_t begin, end;
    int64_t tensor;
} span;

static int span_cmp(const void *a, const void *b) {
    const span *x = a, *y = b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : 0;
}

static kdt_status push_tensor(kdt_st_set *s, kdt_st_tensor **out) {
    if (s->n_tensors == s->cap_tensors) {
        int64_t cap = s->cap_tensors ? 2 * s->cap_tensors : 256;
        kdt_st_tensor *t = realloc(s->tensors, (size_t)cap * sizeof *t);
        if (!t) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "safetensors: tensor table");
        s->tensors = t;
        s->cap_tensors = cap;
    }
    *out = &s->tensors[s->n_tensors++];
    memset(*out, 0, sizeof **out);
    return KDT_OK;
}

static kdt_status keep_owned(kdt_st_set *s, void *p) {
    void **o = realloc(s->owned, (size_t)(s->n_owned + 1) * sizeof *o);
    if (!o) {
        free(p);
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "safetensors: aligned copy");
    }
    s->owned = o;
    s->owned[s->n_owned++] = p;
    return KDT_OK;
}

/* Parses one file's header into s (file index fi already mapped). */
static kdt_status parse_header(kdt_st_set *s, int32_t fi) {
    const kdt_st_file *f = &s->files[fi];
    const unsigned char *base = f->map;
    if (f->map_size < 8)
        return kdt_fail(KDT_ERR_FORMAT, "%s: file of %zu bytes is too short for a safetensors header",
                        f->path, f->map_size);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | base[i];
    if (hlen < 2 || hlen > f->map_size - 8 || hlen > KDT_ST_MAX_HEADER)
        return kdt_fail(KDT_ERR_FORMAT, "%s: bad header length %llu (file size %zu)", f->path,
                        (unsigned long long)hlen, f->map_size);
    json_error_t jerr;
    json_t *root = json_loadb((const char *)base + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return kdt_fail(KDT_ERR_FORMAT, "%s: header is not valid JSON (%s, at byte %d)", f->path,
                        jerr.text, jerr.position);
    kdt_status st = KDT_OK;
    span *spans = NULL;
    int64_t n_spans = 0;
    if (!json_is_object(root)) {
        st = kdt_fail(KDT_ERR_FORMAT, "%s: header is not a JSON object", f->path);
        goto done;
    }
    const unsigned char *data = base + 8 + hlen;
    uint64_t data_size = f->map_size - 8 - hlen;
    spans = malloc((json_object_size(root) + 1) * sizeof *spans);
    if (!spans) {
        st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s: header", f->path);
        goto done;
    }
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (strcmp(key, "__metadata__") == 0) continue;
        json_t *jd = json_object_get(val, "dtype"), *js = json_object_get(val, "shape"),
               *jo = json_object_get(val, "data_offsets");
        if (!json_is_object(val) || !json_is_string(jd) || !json_is_array(js) || !json_is_array(jo) ||
            json_array_size(jo) != 2 || !json_is_integer(json_array_get(jo, 0)) ||
            !json_is_integer(json_array_get(jo, 1))) {
            st = kdt_fail(KDT_ERR_FORMAT,
                          "%s: tensor \"%s\": header entry needs dtype, shape and data_offsets [begin, end]",
                          f->path, key);
            goto done;
        }
        const char *dname = json_string_value(jd);
        size_t esize = 0;
        kdt_wtype wt = KDT_W_OTHER;
        int known = 0;
        for (size_t i = 0; i < sizeof st_dtypes / sizeof st_dtypes[0]; i++)
            if (strcmp(dname, st_dtypes[i].name) == 0) {
                wt = st_dtypes[i].type;
                esize = st_dtypes[i].size;
                known = 1;
            }
        if (!known) {
            st = kdt_fail(KDT_ERR_FORMAT, "%s: tensor \"%s\": unknown dtype \"%s\"", f->path, key, dname);
            goto done;
        }
        size_t ndim = json_array_size(js);
        if (ndim > 16) {
            st = kdt_fail(KDT_ERR_FORMAT, "%s: tensor \"%s\": %zu dimensions", f->path, key, ndim);
            goto done;
        }
        uint64_t numel = 1;
        int64_t shape[16];
        for (size_t d = 0; d < ndim; d++) {
            json_t *jv = json_array_get(js, d);
            if (!json_is_integer(jv) || json_integer_value(jv) < 0 ||
                json_integer_value(jv) > ((int64_t)1 << 40)) {
                st = kdt_fail(KDT_ERR_FORMAT, "%s: tensor \"%s\": bad shape entry %zu", f->path, key, d);
                goto done;
            }
            shape[d] = json_integer_value(jv);
            if (shape[d] && numel > (UINT64_MAX >> 4) / (uint64_t)shape[d]) {
                st = kdt_fail(KDT_ERR_FORMAT, "%s: tensor \"%s\": shape too large", f->path, key);
                goto done;
            }
            numel *= (uint64_t)shape[d];
        }
        json_int_t b = json_integer_value(json_array_get(jo, 0)), e = json_integer_value(json_array_get(jo, 1));
        if (b < 0 || e < b || (uint64_t)e > data_size) {
            st = kdt_fail(KDT_ERR_FORMAT,
                          "%s: tensor \"%s\": data_offsets [%lld, %lld] outside the %llu data bytes "
                          "(truncated file?)",
                          f->path, key, (long long)b, (long long)e, (unsigned long long)data_size);
            goto done;
        }
        if ((uint64_t)(e - b) != numel * esize) {
            st = kdt_fail(KDT_ERR_FORMAT,
                          "%s: tensor \"%s\": %lld data bytes but dtype %s and shape need %llu", f->path,
                          key, (long long)(e - b), dname, (unsigned long long)(numel * esize));
            goto done;
        }
        kdt_st_tensor *t = NULL;
        if ((st = push_tensor(s, &t)) != KDT_OK) goto done;
        t->name = strdup(key);
        if (!t->name) {
            s->n_tensors--;
            st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s: tensor name", f->path);
            goto done;
        }
        t->dtype = wt;
        snprintf(t->dtype_name, sizeof t->dtype_name, "%s", dname);
        t->ndim = (int32_t)ndim;
        for (size_t d = 0; d < ndim && d < KDT_MAX_DIMS; d++) t->shape[d] = shape[d];
        t->nbytes = (size_t)(e - b);
        t->file = fi;
        const unsigned char *p = data + b;
        if (esize > 1 && ((uintptr_t)p % esize) != 0 && t->nbytes) {
            /* safetensors does not promise alignment; typed reads need it */
            void *copy = malloc(t->nbytes);
            if (!copy) {
                st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s: tensor \"%s\": aligned copy", f->path, key);
                goto done;
            }
            memcpy(copy, p, t->nbytes);
            if ((st = keep_owned(s, copy)) != KDT_OK) goto done;
            p = copy;
        }
        t->data = p;
        spans[n_spans].begin = (uint64_t)b;
        spans[n_spans].end = (uint64_t)e;
        spans[n_spans].tensor = s->n_tensors - 1;
        n_spans++;
    }
    qsort(spans, (size_t)n_spans, sizeof *spans, span_cmp);
    /* sorted by begin, the non-empty spans must tile the data section exactly, as the reference
     * reader requires: an overlap, a hole, or bytes after the last tensor (a header length off by
     * a padding byte, or offsets off by a few, would otherwise shift tensors and load garbage) */
    int64_t last = -1;
    uint64_t covered = 0;
    for (int64_t i = 0; i < n_spans; i++) {
        if (spans[i].end == spans[i].begin) continue;
        if (spans[i].begin < covered) {
            st = kdt_fail(KDT_ERR_FORMAT, "%s: tensors \"%s\" and \"%s\" overlap in the data section",
                          f->path, s->tensors[spans[last].tensor].name, s->tensors[spans[i].tensor].name);
            goto done;
        }
        if (spans[i].begin > covered) {
            st = kdt_fail(KDT_ERR_FORMAT,
                          "%s: tensor \"%s\" starts at data byte %llu, but the tensors before it end at %llu "
                          "(a hole in the data section: wrong header length or data_offsets?)",
                          f->path, s->tensors[spans[i].tensor].name, (unsigned long long)spans[i].begin,
                          (unsigned long long)covered);
            goto done;
        }
        covered = spans[i].end;
        last = i;
    }
    if (covered != data_size) {
        st = kdt_fail(KDT_ERR_FORMAT,
                      "%s: the tensors cover %llu of the %llu data bytes (wrong header length or data_offsets?)",
                      f->path, (unsigned long long)covered, (unsigned long long)data_size);
    }
done:
    free(spans);
    json_decref(root);
    return st;
}

static kdt_status map_file(kdt_st_set *s, const char *path, const char *what) {
    kdt_st_file *nf = realloc(s->files, (size_t)(s->n_files + 1) * sizeof *nf);
    if (!nf) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "safetensors: file table");
    s->files = nf;
    kdt_st_file *f = &s->files[s->n_files];
    memset(f, 0, sizeof *f);
    f->path = strdup(path);
    if (!f->path) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "safetensors: path");
    s->n_files++;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kdt_fail(KDT_ERR_IO, "%s%s: cannot open: %s", what, path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return kdt_fail(KDT_ERR_IO, "%s%s: not a regular file", what, path);
    }
    if (sb.st_size < 8) {
        close(fd);
        return kdt_fail(KDT_ERR_FORMAT, "%s: file of %lld bytes is too short for a safetensors header",
                        path, (long long)sb.st_size);
    }
    void *m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return kdt_fail(KDT_ERR_IO, "%s: mmap failed: %s", path, strerror(errno));
    f->map = m;
    f->map_size = (size_t)sb.st_size;
    return parse_header(s, s->n_files - 1);
}

static int file_exists(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0;
}

static int show_progress(int progress) {
    const char *ci = getenv("CI");
    return progress && isatty(2) && !(ci && strcmp(ci, "true") == 0);
}

/* A shard name from index.json must be a plain file name inside the directory. */
static int safe_shard_name(const char *n) {
    return n[0] && !strchr(n, '/') && strcmp(n, ".") != 0 && strcmp(n, "..") != 0;
}

kdt_status kdt_st_open_dir(const char *dir, int progress, kdt_st_set *out) {
    memset(out, 0, sizeof *out);
    size_t dl = strlen(dir);
    char *path = malloc(dl + 4096);
    if (!path) return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "safetensors: path");
    kdt_status st = KDT_OK;
    json_t *index = NULL;
    const char **shards = NULL;
    int show = show_progress(progress);

    snprintf(path, dl + 4096, "%s/model.safetensors.index.json", dir);
    if (file_exists(path)) {
        json_error_t jerr;
        index = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
        if (!index) {
            st = kdt_fail(KDT_ERR_FORMAT, "%s: not valid JSON (%s, line %d)", path, jerr.text, jerr.line);
            goto done;
        }
        json_t *wm = json_object_get(index, "weight_map");
        if (!json_is_object(wm) || json_object_size(wm) == 0) {
            st = kdt_fail(KDT_ERR_FORMAT, "%s: no \"weight_map\" object", path);
            goto done;
        }
        /* distinct shard names in first-seen order */
        shards = calloc(json_object_size(wm), sizeof *shards);
        if (!shards) {
            st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "index");
            goto done;
        }
        size_t n_shards = 0;
        const char *key;
        json_t *val;
        json_object_foreach(wm, key, val) {
            if (!json_is_string(val) || !safe_shard_name(json_string_value(val))) {
                st = kdt_fail(KDT_ERR_FORMAT, "%s: weight_map[\"%s\"] is not a shard file name", path, key);
                goto done;
            }
            const char *sn = json_string_value(val);
            size_t k = 0;
            while (k < n_shards && strcmp(shards[k], sn) != 0) k++;
            if (k == n_shards) shards[n_shards++] = sn;
        }
        for (size_t k = 0; k < n_shards; k++) {
            char *sp = malloc(dl + strlen(shards[k]) + 2);
            if (!sp) {
                st = kdt_fail(KDT_ERR_OUT_OF_MEMORY, "shard path");
                goto done;
            }
            sprintf(sp, "%s/%s", dir, shards[k]);
            if (show) fprintf(stderr, "\rkdtree: reading shard %zu/%zu", k + 1, n_shards);
            st = map_file(out, sp, "shard listed in model.safetensors.index.json: ");
            free(sp);
            if (st != KDT_OK) goto done;
        }
        if (show) fprintf(stderr, "\n");
        if ((st = build_hash(out)) != KDT_OK) goto done;
        /* every mapped tensor must be in the shard the index names */
        json_object_foreach(wm, key, val) {
            const kdt_st_tensor *t = kdt_st_find(out, key);
            const char *want = json_string_value(val);
            const char *have = t ? strrchr(out->files[t->file].path, '/') + 1 : NULL;
            if (!t || strcmp(have, want) != 0) {
                st = kdt_fail(KDT_ERR_FORMAT, "%s: tensor \"%s\" is mapped to %s, which does not contain it",
                              path, key, want);
                goto done;
            }
        }
    } else {
        snprintf(path, dl + 4096, "%s/model.safetensors", dir);
        if (!file_exists(path)) {
            st = kdt_fail(KDT_ERR_IO, "%s: neither model.safetensors.index.json nor model.safetensors", dir);
            goto done;
        }
        if ((st = map_file(out, path, "")) != KDT_OK) goto done;
        if ((st = build_hash(out)) != KDT_OK) goto done;
    }
done:
    free(shards);
    json_decref(index);
    free(path);
    if (st != KDT_OK) kdt_st_close(out);
    return st;
}
