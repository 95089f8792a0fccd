/* cmd_remote.c — the remote subcommands of `kvlingo`: generate, chat, models, health,
 * talking to a kvlingod over gRPC (C core, one pluck completion queue per call). */
#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <jansson.h>

#include "cli.h"
#include "health.pb-c.h"
#include "kvlingo.pb-c.h"

struct conn {
  const char *server, *token;
  grpc_channel *ch;
  bool json;
};

struct rpc {
  grpc_call *call;
  grpc_completion_queue *cq;
  grpc_metadata_array md_in, trailers;
  grpc_status_code status;
  grpc_slice details;
  grpc_metadata auth;
  char auth_value[600];
};

static void conn_open(struct conn *c) {
  grpc_init();
  grpc_channel_credentials *cr = grpc_insecure_credentials_create();
  c->ch = grpc_channel_create(c->server, cr, NULL);
  grpc_channel_credentials_release(cr);
}

static void conn_close(struct conn *c) {
  grpc_channel_destroy(c->ch);
  grpc_shutdown();
}

static void pluck(struct rpc *r, void *tag) {
  grpc_completion_queue_pluck(r->cq, tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
}

/* Start a call: send the request, close the client side, ask for status. */
static int rpc_start(struct conn *c, struct rpc *r, const char *method, const ProtobufCMessage *req, double timeout_s) {
  memset(r, 0, sizeof(*r));
  r->cq = grpc_completion_queue_create_for_pluck(NULL);
  grpc_slice m = grpc_slice_from_static_string(method);
  gpr_timespec dl = timeout_s > 0 ? gpr_time_add(gpr_now(GPR_CLOCK_REALTIME), gpr_time_from_millis((int64_t)(timeout_s * 1e3), GPR_TIMESPAN))
                                  : gpr_inf_future(GPR_CLOCK_REALTIME);
  r->call = grpc_channel_create_call(c->ch, NULL, GRPC_PROPAGATE_DEFAULTS, r->cq, m, NULL, dl, NULL);
  grpc_metadata_array_init(&r->md_in);
  grpc_metadata_array_init(&r->trailers);
  size_t n = protobuf_c_message_get_packed_size(req);
  grpc_slice s = grpc_slice_malloc(n);
  protobuf_c_message_pack(req, GRPC_SLICE_START_PTR(s));
  grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
  grpc_slice_unref(s);
  grpc_op ops[4];
  memset(ops, 0, sizeof(ops));
  ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
  if (c->token && *c->token) {
    snprintf(r->auth_value, sizeof(r->auth_value), "Bearer %s", c->token);
    r->auth.key = grpc_slice_from_static_string("authorization");
    r->auth.value = grpc_slice_from_copied_string(r->auth_value);
    ops[0].data.send_initial_metadata.count = 1;
    ops[0].data.send_initial_metadata.metadata = &r->auth;
  }
  ops[1].op = GRPC_OP_SEND_MESSAGE;
  ops[1].data.send_message.send_message = bb;
  ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
  ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
  ops[3].data.recv_initial_metadata.recv_initial_metadata = &r->md_in;
  grpc_call_start_batch(r->call, ops, 4, (void *)1, NULL);
  pluck(r, (void *)1);
  grpc_byte_buffer_destroy(bb);
  grpc_op st;
  memset(&st, 0, sizeof(st));
  st.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
  st.data.recv_status_on_client.trailing_metadata = &r->trailers;
  st.data.recv_status_on_client.status = &r->status;
  st.data.recv_status_on_client.status_details = &r->details;
  grpc_call_start_batch(r->call, &st, 1, (void *)2, NULL);
  return 0;
}

/* Next message (malloc'd bytes) or NULL at the end of the stream. */
static uint8_t *rpc_next(struct rpc *r, size_t *len) {
  grpc_byte_buffer *bb = NULL;
  grpc_op op;
  memset(&op, 0, sizeof(op));
  op.op = GRPC_OP_RECV_MESSAGE;
  op.data.recv_message.recv_message = &bb;
  grpc_call_start_batch(r->call, &op, 1, (void *)3, NULL);
  pluck(r, (void *)3);
  if (!bb) return NULL;
  grpc_byte_buffer_reader rd;
  grpc_byte_buffer_reader_init(&rd, bb);
  grpc_slice s = grpc_byte_buffer_reader_readall(&rd);
  grpc_byte_buffer_reader_destroy(&rd);
  grpc_byte_buffer_destroy(bb);
  *len = GRPC_SLICE_LENGTH(s);
  uint8_t *out = malloc(*len + 1);
  memcpy(out, GRPC_SLICE_START_PTR(s), *len);
  grpc_slice_unref(s);
  return out;
}

/* Wait for the status; print it when not OK. Returns the gRPC status code. */
static int rpc_finish(struct rpc *r) {
  pluck(r, (void *)2);
  int code = (int)r->status;
  if (code != GRPC_STATUS_OK)
    fprintf(stderr, "kvlingo: server said %d: %.*s\n", code, (int)GRPC_SLICE_LENGTH(r->details),
            (const char *)GRPC_SLICE_START_PTR(r->details));
  grpc_slice_unref(r->details);
  grpc_metadata_array_destroy(&r->md_in);
  grpc_metadata_array_destroy(&r->trailers);
  grpc_call_unref(r->call);
  grpc_completion_queue_shutdown(r->cq);
  while (grpc_completion_queue_pluck(r->cq, NULL, gpr_inf_past(GPR_CLOCK_REALTIME), NULL).type != GRPC_QUEUE_SHUTDOWN) {}
  grpc_completion_queue_destroy(r->cq);
  if (r->auth_value[0]) grpc_slice_unref(r->auth.value);
  return code;
}

/* A unary call: the reply decoded as `desc` (NULL on failure), *code the gRPC status. */
static ProtobufCMessage *unary(struct conn *c, const char *method, const ProtobufCMessage *req,
                               const ProtobufCMessageDescriptor *desc, double timeout_s, int *code) {
  struct rpc r;
  rpc_start(c, &r, method, req, timeout_s);
  size_t len;
  uint8_t *msg = rpc_next(&r, &len);
  ProtobufCMessage *m = msg ? protobuf_c_message_unpack(desc, NULL, len, msg) : NULL;
  free(msg);
  *code = rpc_finish(&r);
  return m;
}

static const char *finish_name(Kvlingo__V1__FinishReason f) {
  switch (f) {
  case KVLINGO__V1__FINISH_REASON__FINISH_REASON_STOP: return "stop";
  case KVLINGO__V1__FINISH_REASON__FINISH_REASON_LENGTH: return "length";
  case KVLINGO__V1__FINISH_REASON__FINISH_REASON_CANCELLED: return "cancelled";
  case KVLINGO__V1__FINISH_REASON__FINISH_REASON_ERROR: return "error";
  default: return NULL;
  }
}

/* Stream one Generate; text goes to stdout (or JSON lines); the whole text is returned. */
static int stream_generate(struct conn *c, Kvlingo__V1__GenerateRequest *q, char **all_text) {
  struct rpc r;
  rpc_start(c, &r, "/kvlingo.v1.Inference/Generate", &q->base, 0);
  size_t len, cap = 256, n = 0;
  char *acc = malloc(cap);
  acc[0] = 0;
  uint8_t *msg;
  double t0 = kvl_cli_now();
  while ((msg = rpc_next(&r, &len))) {
    Kvlingo__V1__GenerateResponse *m = kvlingo__v1__generate_response__unpack(NULL, len, msg);
    free(msg);
    if (!m) break;
    size_t tl = strlen(m->text);
    if (n + tl + 1 > cap) {
      cap = (n + tl + 1) * 2;
      acc = realloc(acc, cap);
    }
    memcpy(acc + n, m->text, tl + 1);
    n += tl;
    if (c->json) {
      json_t *j = json_pack("{s:s,s:s}", "model", m->model, "text", m->text);
      json_t *ids = json_array();
      for (size_t i = 0; i < m->n_token_ids; i++) json_array_append_new(ids, json_integer(m->token_ids[i]));
      json_object_set_new(j, "token_ids", ids);
      if (finish_name(m->finish_reason)) json_object_set_new(j, "finish_reason", json_string(finish_name(m->finish_reason)));
      if (m->usage)
        json_object_set_new(j, "usage", json_pack("{s:i,s:i,s:i,s:i}", "prompt_tokens", m->usage->prompt_tokens,
                                                  "cached_tokens", m->usage->cached_native_tokens + m->usage->cached_translated_tokens,
                                                  "prefilled_tokens", m->usage->prefilled_tokens, "generated_tokens",
                                                  m->usage->generated_tokens));
      if (m->timings) json_object_set_new(j, "ttft_s", json_real(m->timings->time_to_first_token_seconds));
      char *s = json_dumps(j, JSON_COMPACT);
      puts(s);
      free(s);
      json_decref(j);
    } else {
      fputs(m->text, stdout);
      fflush(stdout);
      if (m->usage)
        fprintf(stderr, "\n[%s: %u prompt tokens (%u cached), %u generated, first token %.3f s, %.1f tokens/s, %s]\n",
                m->model, m->usage->prompt_tokens, m->usage->cached_native_tokens, m->usage->generated_tokens,
                m->timings ? m->timings->time_to_first_token_seconds : 0,
                m->usage->generated_tokens / (kvl_cli_now() - t0), finish_name(m->finish_reason));
    }
    kvlingo__v1__generate_response__free_unpacked(m, NULL);
  }
  if (all_text) *all_text = acc;
  else free(acc);
  return rpc_finish(&r);
}

struct gen_opts {
  const char *model, *prompt, *system, *conversation;
  int max_tokens;
  float temperature;
  bool has_temp;
  long long seed;
  bool has_seed, chat;
  const char *stops[8];
  int n_stops;
};

static void usage(FILE *f, const char *cmd) {
  fprintf(f,
    "usage: kvlingo %s [options]\n"
    "\n"
    "Talk to a running kvlingod over gRPC.\n"
    "  generate -p PROMPT   stream a completion (--chat: as a user message)\n"
    "  chat                 interactive chat; the history is kept and resent each turn\n"
    "  models               resident models and translators\n"
    "  health               exit 0 when the server is SERVING\n"
    "\n"
    "  -s, --server HOST:PORT  default $KVLINGO_SERVER or 127.0.0.1:50051\n"
    "      --token TOKEN       bearer token (default $KVLINGO_TOKEN)\n"
    "  -m, --model NAME        a resident model, or auto (default)\n"
    "  -p, --prompt TEXT       generate: the prompt\n"
    "      --chat              generate: wrap the prompt as a chat message\n"
    "      --system TEXT       system message (chat, generate --chat)\n"
    "  -n, --max-tokens N      default: the server's\n"
    "      --temperature T     0 = greedy; default the server's (1)\n"
    "      --seed S\n"
    "      --stop TEXT         stop string (repeatable)\n"
    "      --conversation ID   conversation id (affinity; kept lines)\n"
    "      --json              JSON lines instead of text\n"
    "  -h, --help\n", cmd);
}

static int parse(int argc, char **argv, struct conn *c, struct gen_opts *g, const char *cmd) {
  enum { O_TOKEN = 1000, O_CHAT, O_SYSTEM, O_TEMP, O_SEED, O_STOP, O_CONV, O_JSON };
  static const struct option opts[] = {
    {"server", required_argument, 0, 's'}, {"token", required_argument, 0, O_TOKEN},
    {"model", required_argument, 0, 'm'}, {"prompt", required_argument, 0, 'p'},
    {"chat", no_argument, 0, O_CHAT}, {"system", required_argument, 0, O_SYSTEM},
    {"max-tokens", required_argument, 0, 'n'}, {"temperature", required_argument, 0, O_TEMP},
    {"seed", required_argument, 0, O_SEED}, {"stop", required_argument, 0, O_STOP},
    {"conversation", required_argument, 0, O_CONV}, {"json", no_argument, 0, O_JSON},
    {"stream", no_argument, 0, 1}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
  c->server = getenv("KVLINGO_SERVER") ? getenv("KVLINGO_SERVER") : "127.0.0.1:50051";
  c->token = getenv("KVLINGO_TOKEN");
  memset(g, 0, sizeof(*g));
  g->model = "auto";
  int o;
  optind = 1;
  while ((o = getopt_long(argc, argv, "s:m:p:n:h", opts, NULL)) != -1) {
    switch (o) {
    case 's': c->server = optarg; break;
    case O_TOKEN: c->token = optarg; break;
    case 'm': g->model = optarg; break;
    case 'p': g->prompt = optarg; break;
    case O_CHAT: g->chat = true; break;
    case O_SYSTEM: g->system = optarg; break;
    case 'n': g->max_tokens = atoi(optarg); break;
    case O_TEMP: g->temperature = (float)atof(optarg); g->has_temp = true; break;
    case O_SEED: g->seed = atoll(optarg); g->has_seed = true; break;
    case O_STOP: if (g->n_stops < 8) g->stops[g->n_stops++] = optarg; break;
    case O_CONV: g->conversation = optarg; break;
    case O_JSON: c->json = true; break;
    case 1: break; /* --stream: streaming is the default */
    case 'h': usage(stdout, cmd); return 1;
    default: usage(stderr, cmd); return 2;
    }
  }
  return 0;
}

static void fill_request(const struct gen_opts *g, Kvlingo__V1__GenerateRequest *q, Kvlingo__V1__SamplingParams *sp) {
  q->model = (char *)g->model;
  q->max_tokens = g->max_tokens > 0 ? (uint32_t)g->max_tokens : 0;
  if (g->has_temp) {
    sp->has_temperature_case = KVLINGO__V1__SAMPLING_PARAMS__HAS_TEMPERATURE_TEMPERATURE;
    sp->temperature = g->temperature;
  }
  if (g->has_seed) {
    sp->has_seed_case = KVLINGO__V1__SAMPLING_PARAMS__HAS_SEED_SEED;
    sp->seed = (uint64_t)g->seed;
  }
  q->sampling = sp;
  q->n_stop = (size_t)g->n_stops;
  q->stop = (char **)g->stops;
  if (g->conversation) q->conversation_id = (char *)g->conversation;
}

int kvl_cli_generate(int argc, char **argv) {
  struct conn c = {0};
  struct gen_opts g;
  int rc = parse(argc, argv, &c, &g, "generate");
  if (rc) return rc == 1 ? 0 : 2;
  if (!g.prompt) {
    fprintf(stderr, "kvlingo generate: -p PROMPT is required\n");
    return 2;
  }
  conn_open(&c);
  Kvlingo__V1__GenerateRequest q = KVLINGO__V1__GENERATE_REQUEST__INIT;
  Kvlingo__V1__SamplingParams sp = KVLINGO__V1__SAMPLING_PARAMS__INIT;
  Kvlingo__V1__ChatInput ci = KVLINGO__V1__CHAT_INPUT__INIT;
  Kvlingo__V1__ChatMessage m[2] = {KVLINGO__V1__CHAT_MESSAGE__INIT, KVLINGO__V1__CHAT_MESSAGE__INIT}, *mp[2];
  fill_request(&g, &q, &sp);
  if (g.chat) {
    size_t n = 0;
    if (g.system) {
      m[n].role = "system";
      m[n].content = (char *)g.system;
      mp[n] = &m[n];
      n++;
    }
    m[n].role = "user";
    m[n].content = (char *)g.prompt;
    mp[n] = &m[n];
    n++;
    ci.n_messages = n;
    ci.messages = mp;
    q.input_case = KVLINGO__V1__GENERATE_REQUEST__INPUT_CHAT;
    q.chat = &ci;
  } else {
    q.input_case = KVLINGO__V1__GENERATE_REQUEST__INPUT_TEXT;
    q.text = (char *)g.prompt;
  }
  rc = stream_generate(&c, &q, NULL);
  if (!c.json) putchar('\n');
  conn_close(&c);
  return rc == 0 ? 0 : 1;
}

int kvl_cli_chat(int argc, char **argv) {
  struct conn c = {0};
  struct gen_opts g;
  int rc = parse(argc, argv, &c, &g, "chat");
  if (rc) return rc == 1 ? 0 : 2;
  conn_open(&c);
  size_t cap = 64, n = 0;
  Kvlingo__V1__ChatMessage **msgs = calloc(cap, sizeof(*msgs));
  if (g.system) {
    msgs[n] = calloc(1, sizeof(**msgs));
    kvlingo__v1__chat_message__init(msgs[n]);
    msgs[n]->role = strdup("system");
    msgs[n]->content = strdup(g.system);
    n++;
  }
  char line[65536];
  int status = 0;
  for (;;) {
    fprintf(stderr, "you> ");
    if (!fgets(line, sizeof(line), stdin)) break;
    line[strcspn(line, "\n")] = 0;
    if (!line[0]) continue;
    if (!strcmp(line, "/quit") || !strcmp(line, "/exit")) break;
    if (n + 2 >= cap) msgs = realloc(msgs, (cap *= 2) * sizeof(*msgs));
    msgs[n] = calloc(1, sizeof(**msgs));
    kvlingo__v1__chat_message__init(msgs[n]);
    msgs[n]->role = strdup("user");
    msgs[n]->content = strdup(line);
    n++;
    Kvlingo__V1__GenerateRequest q = KVLINGO__V1__GENERATE_REQUEST__INIT;
    Kvlingo__V1__SamplingParams sp = KVLINGO__V1__SAMPLING_PARAMS__INIT;
    Kvlingo__V1__ChatInput ci = KVLINGO__V1__CHAT_INPUT__INIT;
    fill_request(&g, &q, &sp);
    ci.n_messages = n;
    ci.messages = msgs;
    q.input_case = KVLINGO__V1__GENERATE_REQUEST__INPUT_CHAT;
    q.chat = &ci;
    char *answer = NULL;
    fprintf(stderr, "assistant> ");
    status = stream_generate(&c, &q, &answer);
    putchar('\n');
    if (status != 0) {
      free(answer);
      break;
    }
    msgs[n] = calloc(1, sizeof(**msgs));
    kvlingo__v1__chat_message__init(msgs[n]);
    msgs[n]->role = strdup("assistant");
    msgs[n]->content = answer;
    n++;
  }
  for (size_t i = 0; i < n; i++) {
    free(msgs[i]->role);
    free(msgs[i]->content);
    free(msgs[i]);
  }
  free(msgs);
  conn_close(&c);
  return status == 0 ? 0 : 1;
}

int kvl_cli_models(int argc, char **argv) {
  struct conn c = {0};
  struct gen_opts g;
  int rc = parse(argc, argv, &c, &g, "models");
  if (rc) return rc == 1 ? 0 : 2;
  conn_open(&c);
  Kvlingo__V1__ListModelsRequest q = KVLINGO__V1__LIST_MODELS_REQUEST__INIT;
  Kvlingo__V1__ListModelsResponse *m = (Kvlingo__V1__ListModelsResponse *)unary(
      &c, "/kvlingo.v1.Inference/ListModels", &q.base, &kvlingo__v1__list_models_response__descriptor, 10, &rc);
  if (m) {
    if (c.json) {
      json_t *j = json_pack("{s:[],s:[]}", "models", "translators");
      for (size_t i = 0; i < m->n_models; i++)
        json_array_append_new(json_object_get(j, "models"),
                              json_pack("{s:s,s:s,s:i,s:i,s:s,s:s}", "name", m->models[i]->name, "architecture",
                                        m->models[i]->architecture, "n_layer", m->models[i]->n_layer, "max_model_len",
                                        m->models[i]->max_model_len, "kv_dtype", m->models[i]->kv_dtype, "file",
                                        m->models[i]->file));
      for (size_t i = 0; i < m->n_translators; i++)
        json_array_append_new(json_object_get(j, "translators"),
                              json_pack("{s:s,s:s,s:i,s:b,s:s}", "source", m->translators[i]->source, "target",
                                        m->translators[i]->target, "nu", m->translators[i]->nu, "affine",
                                        m->translators[i]->affine, "file", m->translators[i]->file));
      char *s = json_dumps(j, JSON_INDENT(1));
      puts(s);
      free(s);
      json_decref(j);
    } else {
      printf("%-24s %-8s %6s %9s %5s\n", "MODEL", "ARCH", "LAYERS", "CONTEXT", "KV");
      for (size_t i = 0; i < m->n_models; i++)
        printf("%-24s %-8s %6u %9u %5s\n", m->models[i]->name, m->models[i]->architecture, m->models[i]->n_layer,
               m->models[i]->max_model_len, m->models[i]->kv_dtype);
      for (size_t i = 0; i < m->n_translators; i++)
        printf("translator %s -> %s (nu %u, %s): %s\n", m->translators[i]->source, m->translators[i]->target,
               m->translators[i]->nu, m->translators[i]->affine ? "affine" : "linear", m->translators[i]->file);
    }
    kvlingo__v1__list_models_response__free_unpacked(m, NULL);
  }
  conn_close(&c);
  return rc == 0 && m ? 0 : 1;
}

int kvl_cli_health(int argc, char **argv) {
  struct conn c = {0};
  struct gen_opts g;
  int rc = parse(argc, argv, &c, &g, "health");
  if (rc) return rc == 1 ? 0 : 2;
  conn_open(&c);
  Grpc__Health__V1__HealthCheckRequest q = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  Grpc__Health__V1__HealthCheckResponse *m = (Grpc__Health__V1__HealthCheckResponse *)unary(
      &c, "/grpc.health.v1.Health/Check", &q.base, &grpc__health__v1__health_check_response__descriptor, 5, &rc);
  bool ok = m && m->status == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
  printf("%s %s\n", c.server, !m ? "UNREACHABLE" : ok ? "SERVING" : "NOT_SERVING");
  if (m) grpc__health__v1__health_check_response__free_unpacked(m, NULL);
  conn_close(&c);
  return ok && rc == 0 ? 0 : 1;
}
