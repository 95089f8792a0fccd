/* metrics.c — Prometheus text exposition (format 0.0.4) with vLLM's metric names and a
 * model_name label, so dashboards, KEDA scalers and gateway recipes written for vLLM
 * work unchanged; kvlingo's own series carry the kvlingo: prefix. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon.h"
#include <stddef.h>
#include "kvl_kvpool.h"

const double kvld_ttft_buckets[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                    2.5,   5.0,   7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
const int kvld_n_ttft_buckets = sizeof(kvld_ttft_buckets) / sizeof(double);
const double kvld_itl_buckets[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                   7.5,  10.0,  20.0, 40.0,  80.0};
const int kvld_n_itl_buckets = sizeof(kvld_itl_buckets) / sizeof(double);
const double kvld_e2e_buckets[] = {0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
const int kvld_n_e2e_buckets = sizeof(kvld_e2e_buckets) / sizeof(double);

void kvld_hist_init(struct kvld_hist *h, const double *bounds, int n) {
  memset(h, 0, sizeof(*h));
  h->bounds = bounds;
  h->n = n > KVLD_HIST_MAX_BUCKETS ? KVLD_HIST_MAX_BUCKETS : n;
}

void kvld_hist_observe(struct kvld_hist *h, double v) {
  int i = 0;
  while (i < h->n && v > h->bounds[i]) i++;
  h->counts[i]++;
  h->sum += v;
  h->count++;
}

struct buf {
  char *s;
  size_t len, cap;
};

static void put(struct buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(struct buf *b, const char *fmt, ...) {
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->s + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    if (n >= 0 && (size_t)n < b->cap - b->len) {
      b->len += (size_t)n;
      return;
    }
    size_t cap = b->cap * 2 + (size_t)(n > 0 ? n : 0) + 1024;
    char *s = realloc(b->s, cap);
    if (!s) return;
    b->s = s;
    b->cap = cap;
  }
}

static void head(struct buf *b, const char *name, const char *type, const char *help) {
  put(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void hist(struct buf *b, const struct kvld *d, const char *name, const char *help, size_t off) {
  head(b, name, "histogram", help);
  for (int i = 0; i < d->n_models; i++) {
    if (!d->models[i].active) continue;
    const struct kvld_hist *h = (const struct kvld_hist *)((const char *)&d->models[i].mx + off);
    uint64_t cum = 0;
    for (int k = 0; k < h->n; k++) {
      cum += h->counts[k];
      put(b, "%s_bucket{le=\"%g\",model_name=\"%s\"} %llu\n", name, h->bounds[k], d->models[i].name,
          (unsigned long long)cum);
    }
    cum += h->counts[h->n];
    put(b, "%s_bucket{le=\"+Inf\",model_name=\"%s\"} %llu\n", name, d->models[i].name, (unsigned long long)cum);
    put(b, "%s_sum{model_name=\"%s\"} %.9g\n", name, d->models[i].name, h->sum);
    put(b, "%s_count{model_name=\"%s\"} %llu\n", name, d->models[i].name, (unsigned long long)h->count);
  }
}

#define EACH_MODEL_U64(series, field)                                                                          \
  for (int i = 0; i < d->n_models; i++)                                                                        \
    if (d->models[i].active)                                                                                   \
  put(&b, "%s{model_name=\"%s\"} %llu\n", series, d->models[i].name, (unsigned long long)d->models[i].mx.field)

char *kvld_metrics_render(const struct kvld *d) {
  struct buf b = {malloc(8192), 0, 8192};
  if (!b.s) return NULL;
  b.s[0] = 0;
  /* running / waiting as the scheduler saw them after its last step; requests handed to
   * the engine but not yet taken in by it count as waiting */
  struct kvl_sched_model_stats st[KVLD_MAX_MODELS];
  for (int i = 0; i < d->n_models; i++) {
    memset(&st[i], 0, sizeof(st[i]));
    if (d->engine && d->models[i].active) kvl_engine_model_stats(d->engine, d->models[i].sched_id, &st[i]);
    int seen = st[i].running + st[i].waiting, live = d->models[i].mx.running;
    if (live > seen) st[i].waiting += live - seen;
    if (live < seen) { /* finished since the snapshot */
      int drop = seen - live, w = drop < st[i].waiting ? drop : st[i].waiting;
      st[i].waiting -= w;
      st[i].running -= drop - w;
    }
  }
  head(&b, "vllm:num_requests_running", "gauge", "Number of requests in model execution batches.");
  for (int i = 0; i < d->n_models; i++)
    if (d->models[i].active) put(&b, "vllm:num_requests_running{model_name=\"%s\"} %d\n", d->models[i].name, st[i].running);
  head(&b, "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.");
  for (int i = 0; i < d->n_models; i++)
    if (d->models[i].active) put(&b, "vllm:num_requests_waiting{model_name=\"%s\"} %d\n", d->models[i].name, st[i].waiting);
  head(&b, "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.");
  for (int i = 0; i < d->n_models; i++) {
    if (!d->models[i].active) continue;
    struct kvl_sched_model_stats st = {0};
    if (d->engine) kvl_engine_model_stats(d->engine, d->models[i].sched_id, &st);
    put(&b, "vllm:kv_cache_usage_perc{model_name=\"%s\"} %.6f\n", d->models[i].name, st.kv_usage);
  }
  /* the KV tiers (hot arena, cold host copies, disk), per model, from the same snapshot */
  head(&b, "kvlingo:kv_blocks", "gauge", "KV blocks per tier: capacity, and in use (hot: referenced by running lines).");
  for (int i = 0; i < d->n_models; i++) {
    if (!d->models[i].active) continue;
    const struct kvl_pool_stats *p = &st[i].pool;
    const char *n = d->models[i].name;
    put(&b, "kvlingo:kv_blocks{model_name=\"%s\",tier=\"hot\",state=\"capacity\"} %d\n", n, p->hot_blocks);
    put(&b, "kvlingo:kv_blocks{model_name=\"%s\",tier=\"hot\",state=\"used\"} %d\n", n, p->hot_used);
    put(&b, "kvlingo:kv_blocks{model_name=\"%s\",tier=\"hot\",state=\"cached\"} %d\n", n, p->hot_cached);
    put(&b, "kvlingo:kv_blocks{model_name=\"%s\",tier=\"cold\",state=\"capacity\"} %d\n", n, p->cold_blocks);
    put(&b, "kvlingo:kv_blocks{model_name=\"%s\",tier=\"cold\",state=\"used\"} %d\n", n, p->cold_used);
    put(&b, "kvlingo:kv_blocks{model_name=\"%s\",tier=\"disk\",state=\"capacity\"} %d\n", n, p->disk_blocks);
    put(&b, "kvlingo:kv_blocks{model_name=\"%s\",tier=\"disk\",state=\"used\"} %d\n", n, p->disk_used);
  }
  head(&b, "kvlingo:kv_block_moves_total", "counter",
       "KV blocks moved between tiers (to_cold, to_disk, from_cold_or_disk, from_disk), dropped, or lost to disk errors.");
  for (int i = 0; i < d->n_models; i++) {
    if (!d->models[i].active) continue;
    const struct kvl_pool_stats *p = &st[i].pool;
    const char *n = d->models[i].name;
    const struct { const char *move; uint64_t v; } mv[] = {
        {"to_cold", p->evicted_to_cold},   {"to_disk", p->spilled_to_disk},   {"from_cold_or_disk", p->restored},
        {"from_disk", p->restored_from_disk}, {"dropped", p->dropped},       {"dropped_writeback_full", p->disk_busy},
        {"disk_error", p->disk_errors}};
    for (size_t k = 0; k < sizeof(mv) / sizeof(mv[0]); k++)
      put(&b, "kvlingo:kv_block_moves_total{model_name=\"%s\",move=\"%s\"} %llu\n", n, mv[k].move,
          (unsigned long long)mv[k].v);
  }
  head(&b, "vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.");
  EACH_MODEL_U64("vllm:prefix_cache_queries_total", prefix_queries);
  head(&b, "vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.");
  EACH_MODEL_U64("vllm:prefix_cache_hits_total", prefix_hits);
  head(&b, "vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.");
  EACH_MODEL_U64("vllm:prompt_tokens_total", prompt_tokens);
  head(&b, "vllm:generation_tokens_total", "counter", "Number of generation tokens processed.");
  EACH_MODEL_U64("vllm:generation_tokens_total", generation_tokens);
  head(&b, "vllm:request_success_total", "counter", "Count of successfully processed requests.");
  static const char *const reasons[] = {"stop", "length", "abort", "error"};
  for (int i = 0; i < d->n_models; i++)
    for (int k = 0; k < 4 && d->models[i].active; k++)
      put(&b, "vllm:request_success_total{finished_reason=\"%s\",model_name=\"%s\"} %llu\n", reasons[k],
          d->models[i].name, (unsigned long long)d->models[i].mx.success[k]);
  hist(&b, d, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
       offsetof(struct kvld_model_metrics, ttft));
  hist(&b, d, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
       offsetof(struct kvld_model_metrics, itl));
  hist(&b, d, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
       offsetof(struct kvld_model_metrics, e2e));
  hist(&b, d, "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
       offsetof(struct kvld_model_metrics, queue));
  head(&b, "kvlingo:translated_tokens_total", "counter", "KV positions this model received by translation.");
  EACH_MODEL_U64("kvlingo:translated_tokens_total", translated_tokens);
  head(&b, "kvlingo:translators_loaded", "gauge", "Translators loaded, by source and target model.");
  for (int i = 0; i < d->n_translators; i++)
    put(&b, "kvlingo:translators_loaded{source=\"%s\",target=\"%s\"} 1\n", d->models[d->translators[i].src].name,
        d->models[d->translators[i].dst].name);
  head(&b, "kvlingo:translation_outcomes_total", "counter",
       "Finished requests by translation outcome (applied, fallback_reprefill, unsupported, not_needed).");
  for (int o = KVLD_TR_NOT_NEEDED; o <= KVLD_TR_UNSUPPORTED; o++)
    put(&b, "kvlingo:translation_outcomes_total{outcome=\"%s\"} %llu\n", kvld_outcome_name((enum kvld_outcome)o),
        (unsigned long long)d->outcomes[o]);
  head(&b, "kvlingo:route_decisions_total", "counter", "Routing decisions by policy and decision.");
  for (int i = 0; i < d->n_routes; i++)
    put(&b, "kvlingo:route_decisions_total{policy=\"%s\",decision=\"%s\"} %llu\n", d->routes[i].policy,
        d->routes[i].decision, (unsigned long long)d->routes[i].n);
  head(&b, "kvlingo:handoffs_total", "counter", "Requests that moved from one model to another mid-answer (cascade).");
  for (int i = 0; i < d->n_models; i++)
    for (int k = 0; k < d->n_models; k++)
      if (i != k && d->models[i].active && d->models[k].active)
        put(&b, "kvlingo:handoffs_total{source=\"%s\",target=\"%s\"} %llu\n", d->models[i].name, d->models[k].name,
            (unsigned long long)d->handoffs[i][k]);
  /* the quality gate: the scheduler's per-translator statistics, from its snapshot */
  head(&b, "kvlingo:translator_shadows_total", "counter", "Translated requests re-prefilled natively to measure the translator.");
  for (int pass = 0; pass < 4; pass++) {
    if (pass == 1) head(&b, "kvlingo:translator_online_kl", "gauge", "Online estimate of KL(native || translated), nats.");
    if (pass == 3)
      head(&b, "kvlingo:translator_head_warmups_total", "counter",
           "Sequence heads computed in the background in the target after the source served them (translate_warm_head).");
    if (pass == 2) head(&b, "kvlingo:translator_gated", "gauge", "1 when the quality gate re-prefills instead of translating.");
    for (int i = 0; i < d->n_translators; i++) {
      const struct kvld_translator *t = &d->translators[i];
      struct kvl_sched_model_stats ms = {0};
      if (!d->engine || kvl_engine_model_stats(d->engine, d->models[t->dst].sched_id, &ms) < 0) continue;
      const struct kvl_translator_stats *ts = &ms.from[d->models[t->src].sched_id];
      const char *sn = d->models[t->src].name, *tn = d->models[t->dst].name;
      if (pass == 0) put(&b, "kvlingo:translator_shadows_total{source=\"%s\",target=\"%s\"} %llu\n", sn, tn, (unsigned long long)ts->shadows);
      if (pass == 1) put(&b, "kvlingo:translator_online_kl{source=\"%s\",target=\"%s\"} %.6g\n", sn, tn, ts->kl_mean);
      if (pass == 2) put(&b, "kvlingo:translator_gated{source=\"%s\",target=\"%s\"} %d\n", sn, tn, ts->gated ? 1 : 0);
      if (pass == 3)
        put(&b, "kvlingo:translator_head_warmups_total{source=\"%s\",target=\"%s\"} %llu\n", sn, tn,
            (unsigned long long)ts->head_warmups);
    }
  }
  head(&b, "kvlingo:conversations_started_total", "counter", "Conversation ids this replica saw for the first time.");
  put(&b, "kvlingo:conversations_started_total %llu\n", (unsigned long long)d->conv_started);
  head(&b, "kvlingo:conversation_turns_total", "counter", "Requests that carried a conversation id.");
  put(&b, "kvlingo:conversation_turns_total %llu\n", (unsigned long long)d->conv_turns);
  head(&b, "kvlingo:conversations_active", "gauge", "Conversations known to this replica (not yet expired).");
  put(&b, "kvlingo:conversations_active %d\n", d->conv_active);
  head(&b, "kvlingo:uptime_seconds", "gauge", "Seconds since the daemon started.");
  put(&b, "kvlingo:uptime_seconds %.3f\n", kvld_now() - d->t_start);
  return b.s;
}
