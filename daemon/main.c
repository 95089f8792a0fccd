/* main.c — kvlingod: load the configured models and translators, start the engine's
 * compute thread, serve gRPC and HTTP on one libuv loop, drain gracefully on SIGTERM. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon.h"
#include "kvl_error.h"
#include "kvl_sched.h"

#ifndef KVLD_SOURCE_ROOT
#define KVLD_SOURCE_ROOT NULL
#endif

static void usage(FILE *f) {
  fprintf(f,
    "usage: kvlingod [--config FILE] [--grpc-port N] [--http-port N] [options]\n"
    "\n"
    "Serve several resident LLMs over gRPC (kvlingo.v1, grpc.health.v1) and HTTP (/health,\n"
    "/metrics in vLLM's names, OpenAI-compatible /v1/*). With no configuration it serves the\n"
    "Qwen2.5-Coder 0.5B/1.5B pair from $KVLINGO_MODELS with the committed translators.\n"
    "\n"
    "  -c, --config FILE      YAML configuration (docs/daemon.md lists every key)\n"
    "      --grpc-port N      gRPC port (default 50051; 0 = any free port)\n"
    "      --http-port N      HTTP port (default 8000; 0 = any free port; -1 = no HTTP)\n"
    "      --listen HOST      address to bind (default 127.0.0.1)\n"
    "  -m, --model NAME=PATH  serve this model (repeatable; replaces the default pair)\n"
    "  -t, --translator FILE  load this translator (repeatable)\n"
    "      --log-level L      debug, info, warn, error (default info)\n"
    "      --router POLICY    what model \"auto\" means: fixed (the default model), cascade,\n"
    "                         prefill-offload or pinned (docs/daemon.md, \"Routing\")\n"
    "      --replica-id ID    this replica's name in responses (default: the hostname)\n"
    "      --translation-precision auto|bf16|fp32\n"
    "                         the translators' products (auto: whichever of the two computes\n"
    "                         them faster here, timed when a translator loads)\n"
    "  -h, --help             this text\n"
    "      --version          print the version\n"
    "\n"
    "Environment: KVLINGO_GRPC_PORT, KVLINGO_HTTP_PORT, KVLINGO_LISTEN, KVLINGO_AUTH_TOKEN,\n"
    "KVLINGO_ADMIN_TOKEN, KVLINGO_LOG_LEVEL, KVLINGO_REPLICA_ID override the file; flags override both.\n"
    "Once listening, one line goes to stdout: 'kvlingod listening grpc=HOST:PORT http=HOST:PORT'.\n");
}

/* ---- models ------------------------------------------------------------------------- */

/* The spill directory and its parents (mode 0700 where created): the disk tiers' files
 * and the shutdown snapshots live there. */
static void make_spill_dir(const struct kvld *d) {
  char dir[sizeof(d->cfg.spill_dir)];
  snprintf(dir, sizeof(dir), "%s", d->cfg.spill_dir);
  for (char *q = dir + 1; *q; q++)
    if (*q == '/') { *q = 0; mkdir(dir, 0700); *q = '/'; }
  mkdir(dir, 0700);
}

/* what a model's attention multiplies in ("bf16" or "fp32": kvl_backend_attention), for
 * model_loaded; "backend" for a backend that does not say */
static const char *attention_products(const struct kvld_model *m) {
  const char *a = kvl_backend_attention(m->be ? m->be : kvl_backend_cpu(), !strcmp(m->kv_dtype, "bf16"));
  return a ? a : "backend";
}

static int load_models(struct kvld *d, kvl_sched_t *s, char *err, size_t errlen) {
  bool spill_used = d->cfg.cache_snapshot; /* snapshots are written there at shutdown */
  for (int i = 0; i < d->cfg.n_models; i++) spill_used |= d->cfg.models[i].disk_bytes > 0;
  if (spill_used) make_spill_dir(d);
  for (int i = 0; i < d->cfg.n_models; i++) {
    struct kvld_model *m = &d->models[i];
    int rc = kvld_model_open(m, &d->cfg.models[i], err, errlen);
    if (rc < 0) return rc;
    if (d->cfg.models[i].disk_bytes > 0) {
      char path[sizeof(m->disk_path)]; /* built apart: source and destination both live in *d */
      snprintf(path, sizeof(path), "%s/%s.%d.kv", d->cfg.spill_dir, d->cfg.models[i].name, (int)getpid());
      memcpy(m->disk_path, path, sizeof(path));
    }
    struct kvl_sched_model sm;
    kvld_model_sched_cfg(m, &d->cfg.models[i], d->cfg.kv_prefault, &sm);
    if ((rc = kvl_sched_add_model(s, &sm, &m->sched_id, err, errlen)) < 0) return rc;
    m->active = true;
    d->n_models++;
    struct kvl_sched_model_stats st = {0};
    kvl_sched_model_stats(s, m->sched_id, &st);
    kvld_log(KVLD_INFO, "model_loaded",
             "\"model\":\"%s\",\"file\":\"%s\",\"layers\":%d,\"kv_dtype\":\"%s\",\"hot_mib\":%lld,\"prefault_s\":%.3f,"
             "\"repacked_mib\":%.1f,\"attention\":\"%s\"",
             m->name, m->path, kvl_model_hparams(m->m)->n_layer, m->kv_dtype, (long long)(d->cfg.models[i].hot_bytes >> 20),
             st.pool.prefault_ms / 1e3, (double)m->repacked_bytes / (1 << 20), attention_products(m));
  }
  return 0;
}

static int load_translators(struct kvld *d, char *err, size_t errlen) {
  for (int i = 0; i < d->cfg.n_translators; i++) {
    int rc = kvld_translator_add(d, d->cfg.translators[i], err, errlen);
    if (rc < 0) return rc;
  }
  return 0;
}

/* ---- shutdown ----------------------------------------------------------------------- */

static void on_engine_closed(kvl_engine_t *e) {
  (void)e;
}

static struct kvld *g_d;

static void stop_engine(struct kvld *d) {
  if (d->engine) kvl_engine_stop(d->engine, on_engine_closed);
  d->engine = NULL;
}

static void on_snapshots_saved(void *arg, int rc) {
  (void)rc; /* each failure is logged */
  stop_engine(arg);
}

static void on_grpc_down(struct kvld *d) {
  kvld_http_stop(d);
  /* drained: the prefix caches go to their snapshots first (on the compute thread) */
  if (!d->engine || !d->cfg.cache_snapshot || kvl_engine_run(d->engine, kvld_snapshot_save_all, on_snapshots_saved, d) < 0)
    stop_engine(d);
  uv_close((uv_handle_t *)&d->sig_term, NULL);
  uv_close((uv_handle_t *)&d->sig_int, NULL);
  uv_close((uv_handle_t *)&d->drain_timer, NULL);
  kvld_conv_stop(d);
  kvld_log(KVLD_INFO, "stopped", NULL);
}

static void on_drain_tick(uv_timer_t *t) {
  struct kvld *d = t->data;
  static double t0 = 0;
  if (t0 == 0) t0 = kvld_now();
  int busy = d->in_flight + kvld_grpc_active(d) + kvld_http_active(d);
  if (busy > 0 && kvld_now() - t0 < d->cfg.drain_s) return;
  uv_timer_stop(t);
  kvld_log(KVLD_INFO, "drained", "\"in_flight\":%d,\"grpc_calls\":%d,\"http_requests\":%d,\"seconds\":%.2f",
           d->in_flight, kvld_grpc_active(d), kvld_http_active(d), kvld_now() - t0);
  kvld_grpc_shutdown(d, on_grpc_down);
}

static void on_signal(uv_signal_t *s, int signum) {
  struct kvld *d = s->data;
  if (d->draining) return;
  d->draining = true;
  d->serving = false;
  kvld_log(KVLD_INFO, "draining", "\"signal\":%d,\"in_flight\":%d,\"grace_s\":%.1f", signum, d->in_flight, d->cfg.drain_s);
  uv_timer_start(&d->drain_timer, on_drain_tick, 0, 50);
}

int main(int argc, char **argv) {
  enum { O_GRPC = 1000, O_HTTP, O_LISTEN, O_LOG, O_VERSION, O_REPLICA, O_ROUTER, O_PRECISION };
  static const struct option opts[] = {
    {"config", required_argument, 0, 'c'}, {"grpc-port", required_argument, 0, O_GRPC},
    {"http-port", required_argument, 0, O_HTTP}, {"listen", required_argument, 0, O_LISTEN},
    {"model", required_argument, 0, 'm'}, {"translator", required_argument, 0, 't'},
    {"log-level", required_argument, 0, O_LOG}, {"help", no_argument, 0, 'h'},
    {"replica-id", required_argument, 0, O_REPLICA}, {"router", required_argument, 0, O_ROUTER},
    {"version", no_argument, 0, O_VERSION}, {"translation-precision", required_argument, 0, O_PRECISION},
    {0, 0, 0, 0}};
  static struct kvld d;
  g_d = &d;
  kvld_config_defaults(&d.cfg, KVLD_SOURCE_ROOT);
  char err[1024];
  /* the file first, then the environment, then flags */
  const char *config = NULL;
  int c;
  while ((c = getopt_long(argc, argv, "c:m:t:h", opts, NULL)) != -1) {
    if (c == 'c') config = optarg;
    else if (c == 'h') {
      usage(stdout);
      return 0;
    } else if (c == O_VERSION) {
      puts("kvlingod " KVLD_VERSION);
      return 0;
    } else if (c == '?') {
      usage(stderr);
      return 2;
    }
  }
  if (config && kvld_config_load(&d.cfg, config, err, sizeof(err)) < 0) {
    fprintf(stderr, "kvlingod: %s\n", err);
    return 2;
  }
  if (kvld_config_env(&d.cfg, err, sizeof(err)) < 0) {
    fprintf(stderr, "kvlingod: %s\n", err);
    return 2;
  }
  bool flag_models = false, flag_translators = false;
  optind = 1;
  while ((c = getopt_long(argc, argv, "c:m:t:h", opts, NULL)) != -1) {
    char *end;
    switch (c) {
    case O_GRPC: d.cfg.grpc_port = (int)strtol(optarg, &end, 10); if (*end || d.cfg.grpc_port < 0 || d.cfg.grpc_port > 65535) { fprintf(stderr, "kvlingod: --grpc-port: '%s' is not a port\n", optarg); return 2; } break;
    case O_HTTP: d.cfg.http_port = (int)strtol(optarg, &end, 10); if (*end || d.cfg.http_port < -1 || d.cfg.http_port > 65535) { fprintf(stderr, "kvlingod: --http-port: '%s' is not a port\n", optarg); return 2; } break;
    case O_LISTEN: snprintf(d.cfg.listen, sizeof(d.cfg.listen), "%s", optarg); break;
    case O_LOG: snprintf(d.cfg.log_level, sizeof(d.cfg.log_level), "%s", optarg); break;
    case O_REPLICA: snprintf(d.cfg.replica_id, sizeof(d.cfg.replica_id), "%s", optarg); break;
    case O_PRECISION:
      if (strcmp(optarg, "auto") && strcmp(optarg, "bf16") && strcmp(optarg, "fp32")) { fprintf(stderr, "kvlingod: --translation-precision: expected auto, bf16 or fp32, got '%s'\n", optarg); return 2; }
      snprintf(d.cfg.translation_precision, sizeof(d.cfg.translation_precision), "%s", optarg);
      break;
    case O_ROUTER: {
      static const char *const ok[] = {"fixed", "cascade", "prefill-offload", "pinned"};
      bool found = false;
      for (int i = 0; i < 4; i++) found |= !strcmp(optarg, ok[i]);
      if (!found) { fprintf(stderr, "kvlingod: --router: expected fixed, cascade, prefill-offload or pinned, got '%s'\n", optarg); return 2; }
      snprintf(d.cfg.router.policy, sizeof(d.cfg.router.policy), "%s", optarg);
      break;
    }
    case 'm': {
      char *eq = strchr(optarg, '=');
      if (!eq || eq == optarg || !eq[1]) { fprintf(stderr, "kvlingod: --model: expected NAME=PATH, got '%s'\n", optarg); return 2; }
      if (!flag_models) { d.cfg.n_models = 0; flag_models = true; if (!flag_translators) d.cfg.n_translators = 0; }
      if (d.cfg.n_models == KVLD_MAX_MODELS) { fprintf(stderr, "kvlingod: too many models\n"); return 2; }
      struct kvld_model_cfg *m = &d.cfg.models[d.cfg.n_models++];
      snprintf(m->name, sizeof(m->name), "%.*s", (int)(eq - optarg), optarg);
      snprintf(m->path, sizeof(m->path), "%s", eq + 1);
      snprintf(m->kv_dtype, sizeof(m->kv_dtype), "bf16");
      kvld_model_cfg_default(m);
      snprintf(m->name, sizeof(m->name), "%.*s", (int)(eq - optarg), optarg);
      snprintf(m->path, sizeof(m->path), "%s", eq + 1);
      if (d.cfg.n_models == 1) snprintf(d.cfg.default_model, sizeof(d.cfg.default_model), "%s", m->name);
      break;
    }
    case 't':
      if (!flag_translators) { d.cfg.n_translators = 0; flag_translators = true; }
      if (d.cfg.n_translators == KVLD_MAX_TRANSLATORS) { fprintf(stderr, "kvlingod: too many translators\n"); return 2; }
      snprintf(d.cfg.translators[d.cfg.n_translators++], sizeof(d.cfg.translators[0]), "%s", optarg);
      break;
    default: break;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "kvlingod: unexpected argument '%s'\n", argv[optind]);
    return 2;
  }
  if (flag_models) kvld_config_settle_router(&d.cfg);
  if (kvld_config_check(&d.cfg, err, sizeof(err)) < 0) {
    fprintf(stderr, "kvlingod: configuration: %s\n", err);
    return 2;
  }
  kvld_log_set_level(d.cfg.log_level);
  d.t_start = kvld_now();
  d.loop = uv_default_loop();

  struct kvl_sched_config sc = {.step_tokens = d.cfg.step_tokens};
  kvl_sched_t *s;
  if (kvl_sched_new(&sc, &s) < 0) return 1;
  int rc = load_models(&d, s, err, sizeof(err));
  d.boot_sched = s;
  if (rc == 0) rc = load_translators(&d, err, sizeof(err));
  if (rc == 0) kvld_snapshot_load_all(&d, s);
  if (rc == 0 && (rc = kvl_engine_start(d.loop, s, &d.engine)) < 0) snprintf(err, sizeof(err), "engine: %s", kvl_strerror(rc));
  d.boot_sched = NULL;
  if (rc < 0) {
    fprintf(stderr, "kvlingod: %s\n", err);
    kvld_log(KVLD_ERROR, "start_failed", NULL);
    return 1;
  }
  if ((rc = kvld_grpc_start(&d, err, sizeof(err))) == 0 && d.cfg.http_port >= 0) rc = kvld_http_start(&d, err, sizeof(err));
  if (rc < 0) {
    fprintf(stderr, "kvlingod: %s\n", err);
    return 1;
  }
  uv_signal_init(d.loop, &d.sig_term);
  uv_signal_init(d.loop, &d.sig_int);
  d.sig_term.data = d.sig_int.data = &d;
  uv_signal_start(&d.sig_term, on_signal, SIGTERM);
  uv_signal_start(&d.sig_int, on_signal, SIGINT);
  uv_timer_init(d.loop, &d.drain_timer);
  d.drain_timer.data = &d;
  kvld_conv_start(&d);
  d.serving = true;
  char http[160] = "off";
  if (d.cfg.http_port >= 0) snprintf(http, sizeof(http), "%s:%d", d.cfg.listen, d.http_port);
  printf("kvlingod listening grpc=%s:%d http=%s\n", d.cfg.listen, d.grpc_port, http);
  fflush(stdout);
  kvld_log(KVLD_INFO, "listening", "\"grpc\":\"%s:%d\",\"http\":\"%s\",\"models\":%d,\"translators\":%d", d.cfg.listen,
           d.grpc_port, http, d.n_models, d.n_translators);
  uv_run(d.loop, UV_RUN_DEFAULT);
  for (int i = 0; i < d.n_translators; i++) kvl_translator_free(d.translators[i].t);
  for (int i = 0; i < d.n_models; i++) kvld_model_close(&d.models[i]);
  uv_loop_close(d.loop);
  return 0;
}
