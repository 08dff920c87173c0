/* chat.c - the chat templates in C: Kimi K2 and DeepSeek-V3, for system / user / assistant turns.
 *
 * Each template is written once, as a sequence of "marker" (a special token) and "text" parts
 * sent to a sink. The text sink concatenates them (what the Jinja template renders); the ids
 * sink encodes markers as their special ids and text as ordinary text, so a marker string typed
 * inside a message cannot become a control token.
 *
 * Kimi K2 (Moonshot's chat_template.jinja, system/user/assistant only):
 *   [if the first message is not system: <|im_system|>system<|im_middle|>{default}<|im_end|>]
 *   per message: <|im_{system,user,assistant}|>{role}<|im_middle|>{content}<|im_end|>
 *   generation prompt: <|im_assistant|>assistant<|im_middle|>
 * DeepSeek-V3 (tokenizer_config.json chat_template):
 *   <｜begin▁of▁sentence｜>{all system contents joined by "\n\n"}
 *   user: <｜User｜>{content}; assistant: <｜Assistant｜>{content}<｜end▁of▁sentence｜>
 *   generation prompt: <｜Assistant｜>
 */
#include "tok_internal.h"

#include <string.h>

#define KIMI_DEFAULT_SYSTEM "You are Kimi, an AI assistant created by Moonshot AI."

typedef struct chat_sink {
    kdt_tok_text *text;       /* render mode: everything appended here */
    const kdt_tokenizer *tok; /* encode mode: */
    kdt_tok_ids *ids;
    kdt_tok_text pending;     /* text parts since the last marker */
} chat_sink;

static kdt_status sink_flush(chat_sink *k) {
    if (k->text || k->pending.len == 0) return KDT_OK;
    kdt_status s = kdt_tokenizer_encode(k->tok, k->pending.data, k->pending.len, 0, k->ids);
    k->pending.len = 0;
    return s;
}

static kdt_status sink_text(chat_sink *k, const char *s, size_t n) {
    return kdt_tok_text_append(k->text ? k->text : &k->pending, s, n);
}

static kdt_status sink_cstr(chat_sink *k, const char *s) { return sink_text(k, s, strlen(s)); }

static kdt_status sink_marker(chat_sink *k, const char *marker) {
    if (k->text) return kdt_tok_text_append(k->text, marker, strlen(marker));
    kdt_status s = sink_flush(k);
    if (s != KDT_OK) return s;
    int32_t id;
    if (kdt_tokenizer_special_id(k->tok, marker, &id) != KDT_OK)
        return kdt_fail(KDT_ERR_UNSUPPORTED, "chat_encode: the tokenizer has no \"%s\" token for this chat format",
                        marker);
    return kdt_tok_ids_push(k->ids, id);
}

static const char *const ROLE_NAME[] = {"system", "user", "assistant"};

static kdt_status render_kimi(chat_sink *k, const kdt_chat_message *m, size_t n, unsigned flags) {
    static const char *const HEADER[] = {"<|im_system|>", "<|im_user|>", "<|im_assistant|>"};
    kdt_status s = KDT_OK;
    for (size_t i = 0; i < n && s == KDT_OK; i++) {
        if (i == 0 && m[0].role != KDT_CHAT_SYSTEM) {
            s = sink_marker(k, "<|im_system|>");
            if (s == KDT_OK) s = sink_cstr(k, "system");
            if (s == KDT_OK) s = sink_marker(k, "<|im_middle|>");
            if (s == KDT_OK) s = sink_cstr(k, KIMI_DEFAULT_SYSTEM);
            if (s == KDT_OK) s = sink_marker(k, "<|im_end|>");
        }
        if (s == KDT_OK) s = sink_marker(k, HEADER[m[i].role]);
        if (s == KDT_OK) s = sink_cstr(k, ROLE_NAME[m[i].role]);
        if (s == KDT_OK) s = sink_marker(k, "<|im_middle|>");
        if (s == KDT_OK) s = sink_cstr(k, m[i].content);
        if (s == KDT_OK) s = sink_marker(k, "<|im_end|>");
    }
    if (s == KDT_OK && (flags & KDT_CHAT_ADD_GENERATION_PROMPT)) {
        s = sink_marker(k, "<|im_assistant|>");
        if (s == KDT_OK) s = sink_cstr(k, "assistant");
        if (s == KDT_OK) s = sink_marker(k, "<|im_middle|>");
    }
    return s;
}

static kdt_status render_deepseek(chat_sink *k, const kdt_chat_message *m, size_t n, unsigned flags) {
    kdt_status s = sink_marker(k, "<｜begin▁of▁sentence｜>");
    int first_system = 1;
    for (size_t i = 0; i < n && s == KDT_OK; i++) { /* every system message, wherever it is */
        if (m[i].role != KDT_CHAT_SYSTEM) continue;
        if (!first_system) s = sink_cstr(k, "\n\n");
        if (s == KDT_OK) s = sink_cstr(k, m[i].content);
        first_system = 0;
    }
    for (size_t i = 0; i < n && s == KDT_OK; i++) {
        if (m[i].role == KDT_CHAT_USER) {
            s = sink_marker(k, "<｜User｜>");
            if (s == KDT_OK) s = sink_cstr(k, m[i].content);
        } else if (m[i].role == KDT_CHAT_ASSISTANT) {
            s = sink_marker(k, "<｜Assistant｜>");
            if (s == KDT_OK) s = sink_cstr(k, m[i].content);
            if (s == KDT_OK) s = sink_marker(k, "<｜end▁of▁sentence｜>");
        }
    }
    if (s == KDT_OK && (flags & KDT_CHAT_ADD_GENERATION_PROMPT)) s = sink_marker(k, "<｜Assistant｜>");
    return s;
}

static kdt_status check_messages(const char *fn, const kdt_chat_message *m, size_t n, unsigned flags) {
    KDT_CHECK_ARG(m != NULL || n == 0, "%s: msgs is NULL with n = %zu", fn, n);
    KDT_CHECK_ARG((flags & ~KDT_CHAT_ADD_GENERATION_PROMPT) == 0, "%s: unknown flags 0x%x", fn, flags);
    for (size_t i = 0; i < n; i++) {
        KDT_CHECK_ARG(m[i].role == KDT_CHAT_SYSTEM || m[i].role == KDT_CHAT_USER || m[i].role == KDT_CHAT_ASSISTANT,
                      "%s: msgs[%zu].role = %d is not system, user or assistant", fn, i, (int)m[i].role);
        KDT_CHECK_ARG(m[i].content != NULL, "%s: msgs[%zu].content is NULL", fn, i);
    }
    return KDT_OK;
}

static kdt_status render(chat_sink *k, kdt_chat_format fmt, const kdt_chat_message *m, size_t n, unsigned flags) {
    if (fmt == KDT_CHAT_KIMI_K2) return render_kimi(k, m, n, flags);
    return render_deepseek(k, m, n, flags);
}

kdt_status kdt_chat_render(kdt_chat_format fmt, const kdt_chat_message *msgs, size_t n, unsigned flags,
                           kdt_tok_text *out) {
    KDT_CHECK_ARG(out != NULL, "chat_render: out is NULL");
    KDT_CHECK_ARG(fmt == KDT_CHAT_KIMI_K2 || fmt == KDT_CHAT_DEEPSEEK_V3,
                  "chat_render: format = %d (name KDT_CHAT_KIMI_K2 or KDT_CHAT_DEEPSEEK_V3)", (int)fmt);
    kdt_status s = check_messages("chat_render", msgs, n, flags);
    if (s != KDT_OK) return s;
    size_t len0 = out->len;
    chat_sink k = {.text = out};
    s = kdt_tok_text_append(out, "", 0);
    if (s == KDT_OK) s = render(&k, fmt, msgs, n, flags);
    if (s != KDT_OK && out->data) {
        out->len = len0;
        out->data[len0] = '\0';
    }
    return s;
}

kdt_status kdt_chat_encode(const kdt_tokenizer *tok, kdt_chat_format fmt, const kdt_chat_message *msgs, size_t n,
                           unsigned flags, kdt_tok_ids *out) {
    KDT_CHECK_ARG(tok != NULL && out != NULL, "chat_encode: tokenizer or out is NULL");
    if (fmt == KDT_CHAT_AUTO) fmt = tok->kind == KDT_TOK_TIKTOKEN ? KDT_CHAT_KIMI_K2 : KDT_CHAT_DEEPSEEK_V3;
    KDT_CHECK_ARG(fmt == KDT_CHAT_KIMI_K2 || fmt == KDT_CHAT_DEEPSEEK_V3, "chat_encode: format = %d", (int)fmt);
    kdt_status s = check_messages("chat_encode", msgs, n, flags);
    if (s != KDT_OK) return s;
    size_t n0 = out->n;
    chat_sink k = {.tok = tok, .ids = out};
    s = render(&k, fmt, msgs, n, flags);
    if (s == KDT_OK) s = sink_flush(&k);
    kdt_tok_text_free(&k.pending);
    if (s != KDT_OK) out->n = n0;
    return s;
}
