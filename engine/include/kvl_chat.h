/* kvl_chat.h — chat messages to prompt tokens through the model's own chat template.
 *
 * Special tokens are recognised only where the template writes them: the text of every
 * message is tokenised as plain text, so a user who types "<|im_start|>" gets the
 * characters, not the control token.
 *
 *   int32_t *ids; size_t n;
 *   if (kvl_chat_encode_user(model, tk, "You are terse.", "Hi!", &ids, &n, err, sizeof(err)) < 0) ...
 *   free(ids);
 */
#ifndef KVL_CHAT_H
#define KVL_CHAT_H

#include <stddef.h>
#include <stdint.h>

#include "kvl_model.h"
#include "kvl_tokenizer.h"

/* One optional system message and one user message, generation prompt added. *ids is
 * malloc'd. Errors (no template, template error, bad UTF-8) come with a message. */
int kvl_chat_encode_user(const kvl_model_t *m, const kvl_tokenizer_t *tk, const char *system, const char *user,
                         int32_t **ids, size_t *n_ids, char *err, size_t errlen);

#endif
