/* request.c — the front ends' request decoders: an OpenAI JSON body (http.c) or a gRPC
 * GenerateRequest (grpc.c) into the daemon's generation parameters, every field checked.
 * No I/O and no transport here, so that tests/fuzz/fuzz-request.c runs exactly this code
 * on arbitrary bytes. A client's mistake is a status and a message; on any failure the
 * parameters are freed. */
#include <float.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "daemon.h"
#include "kvl_error.h"
#include "kvlingo.pb-c.h"

static enum kvld_status refuse(struct kvld_gen_params *p, char *msg, size_t msglen, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static enum kvld_status refuse(struct kvld_gen_params *p, char *msg, size_t msglen, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, msglen, fmt, ap);
  va_end(ap);
  kvld_gen_params_free(p);
  return KVLD_INVALID_ARGUMENT;
}

/* ---- OpenAI JSON ------------------------------------------------------------------------ */

/* A number field: its value, or def when absent or null; *bad when present but not a number. */
static double num(const json_t *o, const char *k, double def, bool *present, bool *bad) {
  json_t *v = json_object_get(o, k);
  if (present) *present = v && !json_is_null(v);
  if (v && !json_is_null(v) && !json_is_number(v)) *bad = true;
  return json_is_number(v) ? json_number_value(v) : def;
}

/* To float without leaving its range (a conversion out of range is undefined in C); the
 * sampler's own checks then refuse what is out of bounds. */
static float to_float(double x) { return x > FLT_MAX ? FLT_MAX : x < -FLT_MAX ? -FLT_MAX : (float)x; }

/* messages[] normalised for the chat template: content parts [{type: text, text}] joined */
static json_t *chat_messages(const json_t *msgs, char *msg, size_t msglen) {
  json_t *norm = json_array(), *m;
  size_t i;
  json_array_foreach(msgs, i, m) {
    json_t *role = json_object_get(m, "role"), *content = json_object_get(m, "content");
    if (!json_is_string(role) || !(json_is_string(content) || json_is_array(content))) {
      json_decref(norm);
      snprintf(msg, msglen, "messages[%zu]: needs a string 'role' and a string 'content'", i);
      return NULL;
    }
    if (json_is_string(content)) {
      json_array_append_new(norm, json_pack("{s:O,s:O}", "role", role, "content", content));
      continue;
    }
    size_t total = 0, k, at = 0;
    json_t *part;
    json_array_foreach(content, k, part) {
      json_t *t = json_object_get(part, "text");
      if (!json_is_object(part) || (t && !json_is_string(t))) {
        json_decref(norm);
        snprintf(msg, msglen, "messages[%zu].content[%zu]: a content part is an object with a string 'text'", i, k);
        return NULL;
      }
      total += json_string_length(t);
    }
    char *txt = malloc(total + 1);
    KVL_ASSERT(txt);
    json_array_foreach(content, k, part) {
      json_t *t = json_object_get(part, "text");
      size_t n = json_string_length(t);
      if (n) memcpy(txt + at, json_string_value(t), n);
      at += n;
    }
    txt[at] = 0;
    json_array_append_new(norm, json_pack("{s:O,s:s%}", "role", role, "content", txt, at));
    free(txt);
  }
  return norm;
}

static enum kvld_status openai_input(struct kvld *d, bool chat, const json_t *j, struct kvld_gen_params *p, char *msg,
                                     size_t msglen) {
  json_t *jm = json_object_get(j, "model");
  if (jm && !json_is_null(jm) && !json_is_string(jm)) return refuse(p, msg, msglen, "'model' must be a string");
  const char *model = json_string_value(jm); /* NULL: absent or null, the default model */
  if (chat) {
    json_t *msgs = json_object_get(j, "messages");
    if (!json_is_array(msgs)) return refuse(p, msg, msglen, "'messages' must be an array of {role, content}");
    json_t *norm = chat_messages(msgs, msg, msglen);
    if (!norm) {
      kvld_gen_params_free(p);
      return KVLD_INVALID_ARGUMENT;
    }
    enum kvld_status st = kvld_prepare(d, model, NULL, 0, NULL, 0, norm, false, p, msg, msglen);
    json_decref(norm);
    return st;
  }
  json_t *pr = json_object_get(j, "prompt");
  if (json_is_string(pr))
    return kvld_prepare(d, model, json_string_value(pr), json_string_length(pr), NULL, 0, NULL, false, p, msg, msglen);
  if (!json_is_array(pr) || json_array_size(pr) == 0 || !json_is_integer(json_array_get(pr, 0)))
    return refuse(p, msg, msglen, "'prompt' must be a string or an array of token ids");
  size_t n = json_array_size(pr);
  int32_t *ids = malloc(n * sizeof(int32_t));
  KVL_ASSERT(ids);
  for (size_t i = 0; i < n; i++) {
    json_t *v = json_array_get(pr, i);
    json_int_t x = json_integer_value(v);
    if (!json_is_integer(v) || x < INT32_MIN || x > INT32_MAX) {
      free(ids);
      return refuse(p, msg, msglen, "prompt[%zu]: a token id is an integer", i);
    }
    ids[i] = (int32_t)x;
  }
  enum kvld_status st = kvld_prepare(d, model, NULL, 0, ids, n, NULL, false, p, msg, msglen);
  free(ids);
  return st;
}

static enum kvld_status openai_sampling(const json_t *j, struct kvld_gen_params *p, char *msg, size_t msglen) {
  bool has, bad = false;
  kvl_sampler_params_init(&p->sampling);
  p->sampling.temperature = to_float(num(j, "temperature", 1.0, NULL, &bad));
  p->sampling.top_p = to_float(num(j, "top_p", 1.0, NULL, &bad));
  double tk = num(j, "top_k", 0, NULL, &bad);
  p->sampling.top_k = tk < 0 ? 0 : tk > INT32_MAX ? INT32_MAX : (int)tk;
  p->sampling.min_p = to_float(num(j, "min_p", 0, NULL, &bad));
  p->sampling.presence_penalty = to_float(num(j, "presence_penalty", 0, NULL, &bad));
  p->sampling.frequency_penalty = to_float(num(j, "frequency_penalty", 0, NULL, &bad));
  p->sampling.repetition_penalty = to_float(num(j, "repetition_penalty", 1, NULL, &bad));
  double nn = num(j, "n", 1, NULL, &bad);
  double mt = num(j, "max_completion_tokens", -1, &has, &bad);
  if (!has) mt = num(j, "max_tokens", 0, &has, &bad);
  if (bad)
    return refuse(p, msg, msglen,
                  "temperature, top_p, top_k, min_p, the penalties, n and max_tokens are numbers when given");
  json_t *seed = json_object_get(j, "seed");
  if (seed && !json_is_null(seed)) {
    if (!json_is_integer(seed)) return refuse(p, msg, msglen, "'seed' must be an integer");
    p->sampling.seed = (uint64_t)json_integer_value(seed); /* a negative seed wraps, as in C */
    p->sampling.has_seed = true;
  }
  if (nn != 1) return refuse(p, msg, msglen, "n = %g: only one choice per request is supported so far", nn);
  if (has && mt < 0) return refuse(p, msg, msglen, "'max_tokens' must not be negative");
  p->max_tokens = mt > INT32_MAX ? INT32_MAX : (int32_t)mt; /* over the limit: refused by kvld_check_sampling */
  json_t *bias = json_object_get(j, "logit_bias");
  if (bias && !json_is_null(bias) && !json_is_object(bias))
    return refuse(p, msg, msglen, "'logit_bias' must be an object {token id: bias}");
  if (json_is_object(bias) && json_object_size(bias)) {
    p->bias = calloc(json_object_size(bias), sizeof(*p->bias));
    KVL_ASSERT(p->bias);
    const char *k;
    json_t *v;
    int nb = 0;
    json_object_foreach(bias, k, v) {
      char *end;
      long id = strtol(k, &end, 10);
      if (!*k || *end || id < 0 || id > INT32_MAX || !json_is_number(v)) {
        char shown[64];
        kvld_escape(k, shown, sizeof(shown));
        return refuse(p, msg, msglen, "logit_bias: '%s' must be a token id with a number", shown);
      }
      p->bias[nb].token = (int32_t)id;
      p->bias[nb].bias = to_float(json_number_value(v));
      nb++;
    }
    p->sampling.bias = p->bias;
    p->sampling.n_bias = nb;
  }
  return KVLD_OK;
}

enum kvld_status kvld_openai_request(struct kvld *d, bool chat, const char *body, size_t len, const char *conv_header,
                                     struct kvld_gen_params *p, struct kvld_openai_flags *f, char *msg,
                                     size_t msglen) {
  memset(p, 0, sizeof(*p));
  memset(f, 0, sizeof(*f));
  json_error_t je;
  /* JSON_ALLOW_NUL: "\u0000" in a prompt is text like any other (the daemon writes it in answers) */
  json_t *j = json_loadb(body ? body : "", len, JSON_ALLOW_NUL, &je);
  if (!j || !json_is_object(j)) {
    char shown[200]; /* jansson's text quotes the input near the error, cut anywhere */
    kvld_escape(j ? "not an object" : je.text, shown, sizeof(shown));
    snprintf(msg, msglen, "the body is not a JSON object (%s)", shown);
    json_decref(j);
    return KVLD_INVALID_ARGUMENT;
  }
  enum kvld_status st;
  /* the conversation: the affinity header, else the body's conversation_id */
  const char *cid = conv_header;
  json_t *jc = json_object_get(j, "conversation_id");
  if ((!cid || !*cid) && jc && !json_is_null(jc) && !json_is_string(jc)) {
    st = refuse(p, msg, msglen, "'conversation_id' must be a string");
    goto out;
  }
  if (!cid || !*cid) cid = json_string_value(jc);
  char conv[sizeof(p->conversation)] = "";
  if (cid && *cid) {
    if ((st = kvld_conv_check_id(cid, msg, msglen)) != KVLD_OK) goto out;
    snprintf(conv, sizeof(conv), "%.127s", cid);
  }
  if ((st = openai_input(d, chat, j, p, msg, msglen)) != KVLD_OK) goto out;
  memcpy(p->conversation, conv, sizeof(conv));
  if ((st = openai_sampling(j, p, msg, msglen)) != KVLD_OK) goto out;
  if ((st = kvld_check_sampling(d, p, msg, msglen)) != KVLD_OK) goto out;
  p->ignore_eos = json_is_true(json_object_get(j, "ignore_eos"));
  /* kvlingo's extension, as gRPC's GenerateRequest.reprefill: prefill instead of translating */
  p->reprefill = json_is_true(json_object_get(j, "reprefill"));
  json_t *stop = json_object_get(j, "stop");
  if (stop && !json_is_null(stop) && !json_is_string(stop) && !json_is_array(stop)) {
    st = refuse(p, msg, msglen, "'stop' must be a string or an array of strings");
    goto out;
  }
  size_t ns = json_is_string(stop) ? 1 : json_array_size(stop);
  const char **strs = calloc(ns + 1, sizeof(char *));
  KVL_ASSERT(strs);
  for (size_t i = 0; i < ns; i++) {
    json_t *sv = json_is_string(stop) ? stop : json_array_get(stop, i);
    strs[i] = json_is_string(sv) ? json_string_value(sv) : NULL; /* refused as empty */
  }
  st = kvld_set_stops(d, p, NULL, 0, strs, ns, msg, msglen);
  free(strs);
  if (st != KVLD_OK) goto out;
  f->stream = json_is_true(json_object_get(j, "stream"));
  f->include_usage = json_is_true(json_object_get(json_object_get(j, "stream_options"), "include_usage"));
out:
  if (st != KVLD_OK) kvld_gen_params_free(p);
  json_decref(j);
  return st;
}

/* ---- gRPC GenerateRequest ---------------------------------------------------------------- */

static enum kvld_status sampling_from_pb(const Kvlingo__V1__SamplingParams *s, struct kvld_gen_params *p, char *msg,
                                         size_t msglen) {
  kvl_sampler_params_init(&p->sampling);
  if (!s) return KVLD_OK;
  if (s->has_temperature_case) p->sampling.temperature = s->temperature;
  if (s->has_top_p_case) p->sampling.top_p = s->top_p;
  if (s->has_top_k_case) p->sampling.top_k = s->top_k < 0 ? 0 : s->top_k;
  if (s->has_min_p_case) p->sampling.min_p = s->min_p;
  if (s->has_repetition_penalty_case) p->sampling.repetition_penalty = s->repetition_penalty;
  if (s->has_presence_penalty_case) p->sampling.presence_penalty = s->presence_penalty;
  if (s->has_frequency_penalty_case) p->sampling.frequency_penalty = s->frequency_penalty;
  if (s->has_seed_case) {
    p->sampling.seed = s->seed;
    p->sampling.has_seed = true;
  }
  if (s->n > 1) {
    snprintf(msg, msglen, "n = %u: more than one choice per request is not supported yet", s->n);
    return KVLD_INVALID_ARGUMENT;
  }
  if (s->n_logit_bias) {
    p->bias = calloc(s->n_logit_bias, sizeof(*p->bias));
    if (!p->bias) return KVLD_RESOURCE_EXHAUSTED;
    for (size_t i = 0; i < s->n_logit_bias; i++) {
      p->bias[i].token = s->logit_bias[i]->key;
      p->bias[i].bias = s->logit_bias[i]->value;
    }
    p->sampling.bias = p->bias;
    p->sampling.n_bias = (int)s->n_logit_bias;
  }
  return KVLD_OK;
}

static enum kvld_status pb_input(struct kvld *d, const Kvlingo__V1__GenerateRequest *q, struct kvld_gen_params *p,
                                 char *msg, size_t msglen) {
  switch (q->input_case) {
  case KVLINGO__V1__GENERATE_REQUEST__INPUT_TEXT:
    return kvld_prepare(d, q->model, q->text, strlen(q->text), NULL, 0, NULL, false, p, msg, msglen);
  case KVLINGO__V1__GENERATE_REQUEST__INPUT_TOKENS:
    if (q->tokens->n_ids == 0) return refuse(p, msg, msglen, "the prompt is empty (no token ids)");
    return kvld_prepare(d, q->model, NULL, 0, q->tokens->ids, q->tokens->n_ids, NULL, false, p, msg, msglen);
  case KVLINGO__V1__GENERATE_REQUEST__INPUT_CHAT: {
    json_t *chat = json_array();
    for (size_t i = 0; i < q->chat->n_messages; i++)
      json_array_append_new(chat, json_pack("{s:s,s:s}", "role", q->chat->messages[i]->role, "content",
                                            q->chat->messages[i]->content));
    if (json_array_size(chat) != q->chat->n_messages) { /* json_pack refuses invalid UTF-8 */
      json_decref(chat);
      return refuse(p, msg, msglen, "a chat message is not valid UTF-8");
    }
    enum kvld_status st = kvld_prepare(d, q->model, NULL, 0, NULL, 0, chat, q->chat->continue_final_message, p, msg,
                                       msglen);
    json_decref(chat);
    return st;
  }
  default:
    return refuse(p, msg, msglen, "no input: set text, tokens or chat");
  }
}

enum kvld_status kvld_pb_request(struct kvld *d, const Kvlingo__V1__GenerateRequest *q, const char *conv_md,
                                 struct kvld_gen_params *p, char *msg, size_t msglen) {
  memset(p, 0, sizeof(*p));
  /* the conversation: the field, else the affinity header's metadata */
  const char *cid = q->conversation_id && q->conversation_id[0] ? q->conversation_id : NULL;
  if (!cid && conv_md && conv_md[0]) cid = conv_md;
  char conv[sizeof(p->conversation)] = "";
  if (cid) {
    if (kvld_conv_check_id(cid, msg, msglen) != KVLD_OK) return KVLD_INVALID_ARGUMENT;
    snprintf(conv, sizeof(conv), "%.127s", cid);
  }
  enum kvld_status st = pb_input(d, q, p, msg, msglen);
  if (st != KVLD_OK) goto out;
  memcpy(p->conversation, conv, sizeof(conv));
  if ((st = sampling_from_pb(q->sampling, p, msg, msglen)) != KVLD_OK) goto out;
  p->max_tokens = q->max_tokens > (uint32_t)INT32_MAX ? INT32_MAX : (int32_t)q->max_tokens;
  p->logprobs = q->logprobs > 0;
  p->sampling.logprobs = p->logprobs;
  p->ignore_eos = q->ignore_eos;
  p->reprefill = q->reprefill;
  snprintf(p->request_id, sizeof(p->request_id), "%s", q->request_id ? q->request_id : "");
  if ((st = kvld_check_sampling(d, p, msg, msglen)) != KVLD_OK) goto out;
  st = kvld_set_stops(d, p, q->stop_token_ids, q->n_stop_token_ids, (const char *const *)q->stop, q->n_stop, msg,
                      msglen);
out:
  if (st != KVLD_OK) kvld_gen_params_free(p);
  return st;
}
