/* fuzz-request.c — libFuzzer target for the daemon's request decoders (daemon/request.c),
 * the code between a client's bytes and the engine: an OpenAI completions or chat body,
 * or a protobuf GenerateRequest, decoded against two resident tiny models (opened with
 * the daemon's own kvld_model_open: tokenizer, ChatML template, end tokens). The first
 * input byte picks the decoder (bits 0-1: completions, chat, protobuf, protobuf) and
 * whether an affinity header comes with it (bit 2); the rest is the body.
 * Every input is either refused with a message and nothing left allocated, or accepted
 * as parameters the engine can run: a model that is resident, a prompt of ids in the
 * vocabulary that fits the model with at least one token to generate, sampling the
 * sampler accepts, stop ids in the vocabulary, stop strings non-empty. A refusal's message
 * is valid UTF-8: what it echoes of the client's bytes is escaped (kvld_escape). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <unistr.h>

#include "../tiny_model.h"
#include "daemon.h"
#include "kvl_error.h"
#include "kvlingo.pb-c.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct kvld d; /* large: not on the stack */

static void setup(void) {
  void *buf;
  size_t len;
  struct tiny_opts o = {.tokenizer = 1, .seed = 7};
  KVL_ASSERT(tiny_qwen2(&o, &buf, &len) == 0);
  char path[] = "/tmp/fuzz-request-XXXXXX";
  int fd = mkstemp(path);
  KVL_ASSERT(fd >= 0 && write(fd, buf, len) == (ssize_t)len);
  close(fd);
  free(buf);
  kvld_config_defaults(&d.cfg, "/src");
  const char *names[2] = {"tiny-small", "tiny-large"};
  for (int i = 0; i < 2; i++) {
    struct kvld_model_cfg mc;
    kvld_model_cfg_default(&mc);
    snprintf(mc.name, sizeof(mc.name), "%s", names[i]);
    snprintf(mc.path, sizeof(mc.path), "%s", path);
    mc.max_model_len = 64 << i; /* small, so that "does not fit" is reachable */
    char err[256];
    KVL_ASSERT(kvld_model_open(&d.models[i], &mc, err, sizeof(err)) == 0);
    KVL_ASSERT(d.models[i].tmpl != NULL);
    d.models[i].active = true;
  }
  d.n_models = 2;
  snprintf(d.cfg.default_model, sizeof(d.cfg.default_model), "tiny-small");
  unlink(path); /* the models keep their mappings */
}

static void check_accepted(const struct kvld_gen_params *p) {
  KVL_ASSERT(p->model >= 0 && p->model < d.n_models && kvld_model_live(&d, p->model));
  const struct kvld_model *m = &d.models[p->model];
  int nv = kvl_model_hparams(m->m)->n_vocab;
  KVL_ASSERT(p->prompt && p->n_prompt >= 1 && p->n_prompt < m->max_model_len);
  for (int32_t i = 0; i < p->n_prompt; i++) KVL_ASSERT(p->prompt[i] >= 0 && p->prompt[i] < nv);
  KVL_ASSERT(p->max_tokens >= 1 && p->n_prompt + p->max_tokens <= m->max_model_len);
  KVL_ASSERT(p->n_stop_ids >= 0 && p->stop_ids && p->stops);
  for (int32_t i = 0; i < p->n_stop_ids; i++) KVL_ASSERT(p->stop_ids[i] >= 0 && p->stop_ids[i] < nv);
  for (char **s = p->stops; *s; s++) KVL_ASSERT((*s)[0] != 0);
  KVL_ASSERT(memchr(p->conversation, 0, sizeof(p->conversation)));
  KVL_ASSERT(memchr(p->request_id, 0, sizeof(p->request_id)));
  char err[256];
  kvl_sampler_t *s;
  KVL_ASSERT(kvl_sampler_new(&p->sampling, nv, 0, &s, err, sizeof(err)) == 0);
  kvl_sampler_free(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!d.n_models) setup();
  if (size < 1) return 0;
  int mode = data[0] & 3;
  const char *conv = (data[0] & 4) ? "conv-1" : NULL;
  const uint8_t *body = data + 1;
  size_t len = size - 1;
  struct kvld_gen_params p;
  char msg[512] = "";
  enum kvld_status st;
  if (mode < 2) {
    struct kvld_openai_flags f;
    st = kvld_openai_request(&d, mode == 1, (const char *)body, len, conv, &p, &f, msg, sizeof(msg));
  } else {
    Kvlingo__V1__GenerateRequest *q =
        (Kvlingo__V1__GenerateRequest *)protobuf_c_message_unpack(&kvlingo__v1__generate_request__descriptor, NULL,
                                                                   len, body);
    if (!q) return 0; /* refused by the transport as malformed */
    st = kvld_pb_request(&d, q, conv, &p, msg, sizeof(msg));
    kvlingo__v1__generate_request__free_unpacked(q, NULL);
  }
  if (getenv("FUZZ_REQUEST_VERBOSE")) /* what each corpus input does, for whoever curates it */
    fprintf(stderr, "mode %d: %s%s\n", mode, st == KVLD_OK ? "accepted" : "refused: ", st == KVLD_OK ? "" : msg);
  if (st != KVLD_OK) {
    /* a message, valid UTF-8 (it goes into a JSON body or a gRPC status as it is) */
    KVL_ASSERT(msg[0] != 0 && memchr(msg, 0, sizeof(msg)) && !u8_check((const uint8_t *)msg, strlen(msg)));
    KVL_ASSERT(!p.prompt && !p.bias && !p.stops && !p.stop_ids); /* left freed */
    return 0;
  }
  check_accepted(&p);
  kvld_gen_params_free(&p);
  return 0;
}
