/* kvl_chat.h — chat messages to prompt tokens through the model's own chat template.
 *
 * Special tokens are recognised only where the template writes them: the text of every
 * message is tokenised as plain text, so a user who types "<|im_start|>" gets those
 * characters, not the control token (the model's own tokenizer would parse it).
 *
 *   json_t *ctx = json_pack("{s:[{s:s,s:s}], s:b}", "messages", "role", "user",
 *                           "content", "Hi!", "add_generation_prompt", 1);
 *   int32_t *ids; size_t n;
 *   if (kvl_chat_encode(tmpl, tk, ctx, &ids, &n, NULL, err, sizeof(err)) < 0) ...
 *   free(ids);
 *
 * How the content is located: the template is rendered twice, once as is and once with
 * every message's content replaced by a unique marker; when putting the contents back
 * at the markers gives the real rendering, those are the literal spans. A template that
 * transforms content (trims it, say) cannot be mapped so: then the whole rendering is
 * tokenised with specials recognised everywhere, and *literal_ok says so.
 */
#ifndef KVL_CHAT_H
#define KVL_CHAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "kvl_model.h"
#include "kvl_template.h"
#include "kvl_tokenizer.h"

/* Render `context` (messages, tools, add_generation_prompt; bos_token and eos_token are
 * filled from the tokenizer when absent) and tokenise it. *ids malloc'd; text (optional)
 * receives the malloc'd rendering. */
int kvl_chat_encode(const kvl_template_t *t, const kvl_tokenizer_t *tk, const json_t *context, int32_t **ids,
                    size_t *n_ids, char **text, bool *literal_ok, char *err, size_t errlen);

/* Convenience: the model's template, an optional system message and one user message,
 * generation prompt added. */
int kvl_chat_encode_user(const kvl_model_t *m, const kvl_tokenizer_t *tk, const char *system, const char *user,
                         int32_t **ids, size_t *n_ids, char *err, size_t errlen);

#endif
