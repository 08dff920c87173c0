/* tok_regex.c - the pre-tokenizer: translates a model's split pattern (written for tiktoken's
 * fancy-regex or HF's Oniguruma) into PCRE2 syntax with the same meaning, compiles it with
 * PCRE2_UTF | PCRE2_UCP (+ JIT), and splits text into pieces with it.
 *
 * Translation rules (measured differences, see docs/tokenizer.md):
 *   - class intersection [A&&[^B]] (PCRE2 10.42 reads "&&" literally) becomes a lookahead:
 *     (?:(?![B])[A]); nested classes in general become lookaheads / alternations;
 *   - a bare script name \p{Han} means Script in Rust regex and Oniguruma but Script_Extensions
 *     in PCRE2 >= 10.40 (U+3001 has scx=Han), so it becomes \p{sc=Han}; whether a name is a
 *     script is asked of PCRE2 itself, no table here;
 *   - \s / \S become \p{White_Space} / \P{White_Space} (PCRE2's \s also matches U+180E);
 *   - \d / \D become \p{Nd} / \P{Nd}; \uXXXX and \u{X} become \x{...};
 *   - \w, \W, \b, \B are refused: their Unicode meaning differs between the engines.
 */
#include "tok_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct xl {
    const char *p; /* [n] the source pattern */
    size_t n, i;   /* i = read position */
    const char *what;
} xl;

static kdt_status xl_err(const xl *x, kdt_status s, const char *msg) {
    return kdt_fail(s, "%s: pre-tokenizer pattern, offset %zu: %s", x->what, x->i, msg);
}

static kdt_status emit(kdt_tok_text *o, const char *s) { return kdt_tok_text_append(o, s, strlen(s)); }

/* Does PCRE2 know `name` as a script? (Then a bare \p{name} must become \p{sc=name}.) */
static int pcre2_is_script(const char *name, size_t len) {
    char buf[160];
    if (len + 16 > sizeof buf) return 0;
    int n = snprintf(buf, sizeof buf, "\\p{sc=%.*s}", (int)len, name);
    int err;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)buf, (PCRE2_SIZE)n, PCRE2_UTF | PCRE2_UCP, &err, &off, NULL);
    if (!re) return 0;
    pcre2_code_free(re);
    return 1;
}

/* At x->i: a backslash. Appends the PCRE2 form of the escape to o. */
static kdt_status xl_escape(xl *x, kdt_tok_text *o) {
    if (x->i + 1 >= x->n) return xl_err(x, KDT_ERR_FORMAT, "pattern ends with a backslash");
    char c = x->p[x->i + 1];
    kdt_status s = KDT_OK;
    switch (c) {
    case 's': s = emit(o, "\\p{White_Space}"); x->i += 2; return s;
    case 'S': s = emit(o, "\\P{White_Space}"); x->i += 2; return s;
    case 'd': s = emit(o, "\\p{Nd}"); x->i += 2; return s;
    case 'D': s = emit(o, "\\P{Nd}"); x->i += 2; return s;
    case 'w': case 'W': case 'b': case 'B':
        return xl_err(x, KDT_ERR_UNSUPPORTED,
                      "\\w / \\b match different characters in PCRE2 and in the reference engines");
    case 'p': case 'P': {
        if (x->i + 2 < x->n && x->p[x->i + 2] == '{') {
            const char *name = x->p + x->i + 3;
            const char *end = memchr(name, '}', x->n - (x->i + 3));
            if (!end) return xl_err(x, KDT_ERR_FORMAT, "unterminated \\p{");
            size_t len = (size_t)(end - name);
            int negate = len > 0 && name[0] == '^';
            const char *bare = name + negate;
            size_t bare_len = len - (size_t)negate;
            s = kdt_tok_text_append(o, c == 'p' ? "\\p{" : "\\P{", 3);
            if (s == KDT_OK && negate) s = emit(o, "^");
            if (s == KDT_OK && !memchr(bare, '=', bare_len) && !memchr(bare, ':', bare_len) &&
                pcre2_is_script(bare, bare_len))
                s = emit(o, "sc=");
            if (s == KDT_OK) s = kdt_tok_text_append(o, bare, bare_len);
            if (s == KDT_OK) s = emit(o, "}");
            x->i = (size_t)(end - x->p) + 1;
            return s;
        }
        /* one-letter form \pL: a general category, same in every engine */
        if (x->i + 2 >= x->n) return xl_err(x, KDT_ERR_FORMAT, "\\p without a property");
        s = kdt_tok_text_append(o, x->p + x->i, 3);
        x->i += 3;
        return s;
    }
    case 'u': {
        /* \u{X...} (Rust) or \uXXXX (Rust, Oniguruma) -> \x{...} */
        size_t j = x->i + 2;
        const char *hex;
        size_t hex_len;
        if (j < x->n && x->p[j] == '{') {
            const char *end = memchr(x->p + j, '}', x->n - j);
            if (!end) return xl_err(x, KDT_ERR_FORMAT, "unterminated \\u{");
            hex = x->p + j + 1;
            hex_len = (size_t)(end - hex);
            x->i = (size_t)(end - x->p) + 1;
        } else {
            if (j + 4 > x->n) return xl_err(x, KDT_ERR_FORMAT, "\\u needs 4 hex digits");
            hex = x->p + j;
            hex_len = 4;
            x->i = j + 4;
        }
        s = emit(o, "\\x{");
        if (s == KDT_OK) s = kdt_tok_text_append(o, hex, hex_len);
        if (s == KDT_OK) s = emit(o, "}");
        return s;
    }
    default: {
        /* same meaning in PCRE2: \r \n \t \- \\ \[ \x.. etc.; copy the whole escaped character */
        size_t len = 1;
        unsigned char b = (unsigned char)c;
        if (b >= 0xC0) len = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : 2;
        if (x->i + 1 + len > x->n) len = x->n - x->i - 1;
        s = kdt_tok_text_append(o, x->p + x->i, 1 + len);
        x->i += 1 + len;
        return s;
    }
    }
}

/* One operand of a class (the parts between "&&"): plain items in `flat`, nested classes as
 * ready-made one-character expressions. */
typedef struct operand {
    kdt_tok_text flat;
    kdt_tok_text nested;  /* "|expr|expr..." */
    int n_nested;
    kdt_tok_text neg_pos; /* if the operand is exactly one nested negated simple class: that class
                             without its '^' (so it can become a negative lookahead) */
} operand;

/* A parsed class as a one-character expression. simple_neg: it is [^...] without nesting, and
 * `positive` holds [...] (the same class without '^'). */
typedef struct class_expr {
    kdt_tok_text expr;
    kdt_tok_text positive;
    int simple_neg;
} class_expr;

static void operand_free(operand *op) {
    kdt_tok_text_free(&op->flat);
    kdt_tok_text_free(&op->nested);
    kdt_tok_text_free(&op->neg_pos);
}

static kdt_status xl_class(xl *x, class_expr *out, int depth);

/* The operand as a one-character expression. */
static kdt_status operand_expr(const operand *op, kdt_tok_text *o) {
    kdt_status s = KDT_OK;
    if (op->n_nested == 0) {
        s = emit(o, "[");
        if (s == KDT_OK) s = kdt_tok_text_append(o, op->flat.data, op->flat.len);
        if (s == KDT_OK) s = emit(o, "]");
        return s;
    }
    if (op->n_nested == 1 && op->flat.len == 0) /* "|expr" */
        return kdt_tok_text_append(o, op->nested.data + 1, op->nested.len - 1);
    s = emit(o, "(?:");
    if (s == KDT_OK && op->flat.len) {
        s = emit(o, "[");
        if (s == KDT_OK) s = kdt_tok_text_append(o, op->flat.data, op->flat.len);
        if (s == KDT_OK) s = emit(o, "]");
        if (s == KDT_OK) s = kdt_tok_text_append(o, op->nested.data, op->nested.len);
    } else if (s == KDT_OK) {
        s = kdt_tok_text_append(o, op->nested.data + 1, op->nested.len - 1);
    }
    if (s == KDT_OK) s = emit(o, ")");
    return s;
}

#define MAX_OPERANDS 8

/* At x->i: '['. Parses up to the matching ']' (Rust / Oniguruma class syntax: nested classes and
 * "&&" intersection) and produces a PCRE2 expression matching exactly one character of it. */
static kdt_status xl_class(xl *x, class_expr *out, int depth) {
    if (depth > 8) return xl_err(x, KDT_ERR_UNSUPPORTED, "character classes nested too deeply");
    operand ops[MAX_OPERANDS];
    memset(ops, 0, sizeof ops);
    int n_ops = 1, negated = 0;
    kdt_status s = KDT_OK;
    x->i++; /* '[' */
    if (x->i < x->n && x->p[x->i] == '^') {
        negated = 1;
        x->i++;
    }
    int first = 1;
    for (;;) {
        if (x->i >= x->n) {
            s = xl_err(x, KDT_ERR_FORMAT, "unterminated character class");
            goto done;
        }
        operand *op = &ops[n_ops - 1];
        char c = x->p[x->i];
        if (c == ']' && !first) {
            x->i++;
            break;
        }
        first = 0;
        if (c == ']') { /* a ']' right after '[' or '[^' is literal */
            s = emit(&op->flat, "\\]");
            x->i++;
        } else if (c == '\\') {
            s = xl_escape(x, &op->flat);
        } else if (c == '&' && x->i + 1 < x->n && x->p[x->i + 1] == '&') {
            if (n_ops == MAX_OPERANDS) {
                s = xl_err(x, KDT_ERR_UNSUPPORTED, "too many && operands in one class");
                goto done;
            }
            if (op->flat.len == 0 && op->n_nested == 0) {
                s = xl_err(x, KDT_ERR_FORMAT, "empty operand before &&");
                goto done;
            }
            n_ops++;
            x->i += 2;
            first = 0;
        } else if (c == '[' && x->i + 1 < x->n && x->p[x->i + 1] == ':') {
            /* POSIX class [:name:], the same in PCRE2 */
            const char *end = NULL;
            for (size_t j = x->i + 2; j + 1 < x->n; j++)
                if (x->p[j] == ':' && x->p[j + 1] == ']') {
                    end = x->p + j + 2;
                    break;
                }
            if (!end) {
                s = xl_err(x, KDT_ERR_FORMAT, "unterminated [: class");
                goto done;
            }
            s = kdt_tok_text_append(&op->flat, x->p + x->i, (size_t)(end - (x->p + x->i)));
            x->i = (size_t)(end - x->p);
        } else if (c == '[') {
            class_expr inner;
            memset(&inner, 0, sizeof inner);
            s = xl_class(x, &inner, depth + 1);
            if (s == KDT_OK) {
                if (op->n_nested == 0 && op->flat.len == 0 && inner.simple_neg)
                    s = kdt_tok_text_append(&op->neg_pos, inner.positive.data, inner.positive.len);
                else
                    kdt_tok_text_free(&op->neg_pos);
                if (s == KDT_OK) s = emit(&op->nested, "|");
                if (s == KDT_OK) s = kdt_tok_text_append(&op->nested, inner.expr.data, inner.expr.len);
                op->n_nested++;
            }
            kdt_tok_text_free(&inner.expr);
            kdt_tok_text_free(&inner.positive);
        } else {
            s = kdt_tok_text_append(&op->flat, &x->p[x->i], 1);
            x->i++;
        }
        if (s != KDT_OK) goto done;
        /* a nested class followed by more items is no longer a lone negated class */
        if (op->neg_pos.len && (op->flat.len || op->n_nested > 1)) kdt_tok_text_free(&op->neg_pos);
    }
    if (ops[n_ops - 1].flat.len == 0 && ops[n_ops - 1].n_nested == 0) {
        s = xl_err(x, KDT_ERR_FORMAT, "empty character class or && operand");
        goto done;
    }

    if (n_ops == 1 && ops[0].n_nested == 0) { /* plain class: copy it */
        s = emit(&out->expr, negated ? "[^" : "[");
        if (s == KDT_OK) s = kdt_tok_text_append(&out->expr, ops[0].flat.data, ops[0].flat.len);
        if (s == KDT_OK) s = emit(&out->expr, "]");
        if (s == KDT_OK && negated) {
            out->simple_neg = 1;
            s = emit(&out->positive, "[");
            if (s == KDT_OK) s = kdt_tok_text_append(&out->positive, ops[0].flat.data, ops[0].flat.len);
            if (s == KDT_OK) s = emit(&out->positive, "]");
        }
        goto done;
    }
    /* (?: lookaheads for operands 1.. , then operand 0 consumes the character ) */
    kdt_tok_text body = {0};
    if (n_ops == 1) {
        s = operand_expr(&ops[0], &body);
    } else {
        s = emit(&body, "(?:");
        for (int k = 1; k < n_ops && s == KDT_OK; k++) {
            if (ops[k].neg_pos.len) {
                s = emit(&body, "(?!");
                if (s == KDT_OK) s = kdt_tok_text_append(&body, ops[k].neg_pos.data, ops[k].neg_pos.len);
            } else {
                s = emit(&body, "(?=");
                if (s == KDT_OK) s = operand_expr(&ops[k], &body);
            }
            if (s == KDT_OK) s = emit(&body, ")");
        }
        if (s == KDT_OK) s = operand_expr(&ops[0], &body);
        if (s == KDT_OK) s = emit(&body, ")");
    }
    if (s == KDT_OK) {
        if (negated) {
            s = emit(&out->expr, "(?:(?!");
            if (s == KDT_OK) s = kdt_tok_text_append(&out->expr, body.data, body.len);
            if (s == KDT_OK) s = emit(&out->expr, ")(?s:.))");
        } else {
            s = kdt_tok_text_append(&out->expr, body.data, body.len);
        }
    }
    kdt_tok_text_free(&body);
done:
    for (int k = 0; k < MAX_OPERANDS; k++) operand_free(&ops[k]);
    return s;
}

kdt_status kdt_tok_translate_pattern(const char *pat, size_t len, const char *what, char **out) {
    xl x = {pat, len, 0, what};
    kdt_tok_text o = {0};
    kdt_status s = kdt_tok_text_append(&o, "", 0);
    while (s == KDT_OK && x.i < x.n) {
        char c = x.p[x.i];
        if (c == '\\') {
            s = xl_escape(&x, &o);
        } else if (c == '[') {
            class_expr ce;
            memset(&ce, 0, sizeof ce);
            s = xl_class(&x, &ce, 0);
            if (s == KDT_OK) s = kdt_tok_text_append(&o, ce.expr.data, ce.expr.len);
            kdt_tok_text_free(&ce.expr);
            kdt_tok_text_free(&ce.positive);
        } else {
            s = kdt_tok_text_append(&o, &c, 1);
            x.i++;
        }
    }
    if (s != KDT_OK) {
        kdt_tok_text_free(&o);
        return s;
    }
    *out = o.data;
    return KDT_OK;
}

kdt_status kdt_tok_pretok_add(tok_pretok *p, const char *pat, size_t len, const char *what) {
    if (p->n_steps == KDT_TOK_MAX_STEPS)
        return kdt_fail(KDT_ERR_UNSUPPORTED, "%s: more than %d pre-tokenizer regex steps", what,
                        KDT_TOK_MAX_STEPS);
    char *translated = NULL;
    kdt_status s = kdt_tok_translate_pattern(pat, len, what, &translated);
    if (s != KDT_OK) return s;
    int err;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)translated, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                                   &err, &off, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        s = kdt_fail(KDT_ERR_FORMAT, "%s: pre-tokenizer pattern does not compile (PCRE2 at offset %zu of "
                     "the translated pattern \"%.200s\"): %s", what, (size_t)off, translated, (char *)msg);
        free(translated);
        return s;
    }
    free(translated);
    /* JIT is an optimisation only: without it pcre2_match interprets the same code. */
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    char *copy = malloc(len + 1);
    if (!copy) {
        pcre2_code_free(re);
        return kdt_fail(KDT_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
    }
    memcpy(copy, pat, len);
    copy[len] = '\0';
    p->re[p->n_steps] = re;
    p->source[p->n_steps] = copy;
    p->n_steps++;
    return KDT_OK;
}

void kdt_tok_pretok_free(tok_pretok *p) {
    for (int i = 0; i < p->n_steps; i++) {
        pcre2_code_free(p->re[i]);
        free(p->source[i]);
    }
    p->n_steps = 0;
}

static kdt_status split_step(const tok_pretok *p, int step, const uint8_t *s, size_t n,
                             pcre2_match_data *md, tok_piece_fn piece, void *ctx) {
    if (n == 0) return KDT_OK;
    if (step == p->n_steps) return piece(ctx, s, n);
    size_t last = 0, pos = 0;
    kdt_status st;
    while (pos < n) {
        int rc = pcre2_match(p->re[step], s, n, pos, PCRE2_NO_UTF_CHECK, md, NULL);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT) /* deep backtracking: the interpreter uses the heap */
            rc = pcre2_match(p->re[step], s, n, pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return kdt_fail(rc == PCRE2_ERROR_NOMEMORY ? KDT_ERR_OUT_OF_MEMORY : KDT_ERR_CAPACITY,
                            "tokenizer: pre-tokenizer step %d failed on a %zu-byte piece at byte %zu: %s",
                            step, n, pos, (char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t ms = ov[0], me = ov[1];
        if (me <= ms || ms < last) { /* empty match (or \K games): step over one character */
            size_t len = 1;
            if (ms < n) (void)kdt_utf8_decode(s + ms, n - ms, &len);
            pos = (ms < pos ? pos : ms) + len;
            continue;
        }
        if (ms > last && (st = split_step(p, step + 1, s + last, ms - last, md, piece, ctx)) != KDT_OK)
            return st;
        if ((st = split_step(p, step + 1, s + ms, me - ms, md, piece, ctx)) != KDT_OK) return st;
        last = pos = me;
    }
    if (last < n) return split_step(p, step + 1, s + last, n - last, md, piece, ctx);
    return KDT_OK;
}

kdt_status kdt_tok_pretokenize(const tok_pretok *p, const uint8_t *text, size_t n,
                               pcre2_match_data *md, tok_piece_fn piece, void *ctx) {
    return split_step(p, 0, text, n, md, piece, ctx);
}
