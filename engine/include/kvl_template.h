/* kvl_template.h — chat templates: a small interpreter for the Jinja subset that
 * Hugging Face chat templates use (the `tokenizer.chat_template` string in a GGUF file).
 *
 * It renders byte for byte what transformers renders: jinja2 3.1 in an
 * ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the
 * loopcontrols extension, `tojson` as json.dumps(..., ensure_ascii=False) and the
 * globals raise_exception, namespace, dict, range and strftime_now.
 *
 *   char err[256];
 *   kvl_template_t *t;
 *   if (kvl_template_parse(chat_template_string, &t, err, sizeof(err)) < 0) {
 *     fprintf(stderr, "%s\n", err);       // "template:12:5: unexpected ..."
 *     return 1;
 *   }
 *   json_t *ctx = json_pack("{s:[{s:s, s:s}], s:b, s:s, s:s}",
 *                           "messages", "role", "user", "content", "Hi",
 *                           "add_generation_prompt", 1,
 *                           "bos_token", "<|endoftext|>", "eos_token", "<|im_end|>");
 *   char *text;
 *   size_t len;
 *   int rc = kvl_template_render(t, ctx, &text, &len, err, sizeof(err));
 *   if (rc == 0) { fwrite(text, 1, len, stdout); free(text); }
 *   else fprintf(stderr, "%s (%s)\n", err, kvl_strerror(rc));
 *   json_decref(ctx);
 *   kvl_template_free(t);
 *
 * A parsed template is immutable: any number of threads may render it at once. Each
 * render works in its own memory pool, bounded (KVL_TEMPLATE_MAX_RENDER_BYTES), and
 * counts its steps (KVL_TEMPLATE_MAX_STEPS), so a hostile template in a model file can
 * fail a request but not take the process down.
 */
#ifndef KVL_TEMPLATE_H
#define KVL_TEMPLATE_H

#include <stddef.h>

#include <jansson.h>

#include "kvl_error.h"

typedef struct kvl_template kvl_template_t;

/* Limits of one render: memory of its pool (values, intermediate strings, output), and
 * statements + loop iterations + calls executed. */
#define KVL_TEMPLATE_MAX_RENDER_BYTES ((size_t)256 << 20)
#define KVL_TEMPLATE_MAX_STEPS 20000000L
/* Memory a parsed template may use (source copy, tokens, tree). */
#define KVL_TEMPLATE_MAX_PARSE_BYTES ((size_t)64 << 20)

/* Parse a NUL-terminated template source.
 *
 * Returns 0 and a new template in *out (the caller owns it: kvl_template_free), or:
 *   KVL_EFORMAT  syntax error; err says "template:LINE:COL: what" (LINE and COL 1-based,
 *                COL in bytes)
 *   KVL_ENOTSUP  a filter or test this interpreter does not have (jinja2 fails these at
 *                compile time too), or an unsupported tag; err has the position
 *   KVL_ENOMEM
 * err (errlen bytes, may be NULL/0) gets a NUL-terminated message on failure. */
int kvl_template_parse(const char *src, kvl_template_t **out, char *err, size_t errlen);

/* Render with `context`, a JSON object whose members become the template's variables;
 * for chat templates: messages (array of {role, content, optional name, optional
 * tool_calls [{type, function: {name, arguments}}]}), tools (optional array),
 * add_generation_prompt (bool), bos_token, eos_token, and any extra flags a template reads.
 * context is only read; the caller keeps ownership.
 *
 * Returns 0 with *out a malloc'ed NUL-terminated string of *len bytes (the caller frees
 * it; the text may itself contain NUL bytes if the context did), or:
 *   KVL_EINVAL   the template failed on this context: raise_exception(), an undefined
 *                value used, a type error, a missing method... err says
 *                "template:LINE:COL: message" (raise_exception's message verbatim)
 *   KVL_ERANGE   a limit was reached (steps, recursion, range() size)
 *   KVL_ENOMEM   the render's memory pool is exhausted
 * On failure *out is NULL and *len 0. */
int kvl_template_render(const kvl_template_t *t, const json_t *context, char **out, size_t *len,
                        char *err, size_t errlen);

/* Free a template (NULL is fine). */
void kvl_template_free(kvl_template_t *t);

#endif /* KVL_TEMPLATE_H */
