/* test-engine.c — the scheduler on its compute thread, driven from a real libuv loop:
 * requests submitted in bursts from a timer stream their tokens back on the loop thread;
 * every request gets exactly one final event; greedy outputs equal a synchronous run of
 * the same requests through kvl_sched_step; cancels (queued, mid-stream, unknown,
 * finished, repeated) behave; refusals come synchronously or as a final ERROR event;
 * stopping with requests in flight cancels them; an idle engine burns no CPU; every test
 * ends with the loop closing cleanly. */
#include <pthread.h>
#include <sys/resource.h>

#include "../kvl_test.h"
#include "../tiny_model.h"
#include "kvl_engine.h"
#include "kvl_error.h"
#include "kvl_sched.h"

enum { N = 30, MAXR = 64, MAXT = 64, MAX_TOKENS = 16, BURST = 10 };

static pthread_t loop_thread;

static kvl_model_t *tiny(void **buf) { return tiny_model_load(&(struct tiny_opts){.n_layer = 2}, buf); }

static kvl_sched_t *sched(kvl_model_t *m, int hot_blocks, int *mid) {
  kvl_sched_t *s;
  KVL_ASSERT(kvl_sched_new(&(struct kvl_sched_config){.step_tokens = 128, .max_seqs = 32}, &s) == 0);
  struct kvl_kv_layout kl = kvl_model_kv_layout(m, KVL_KV_F32);
  size_t bb = kvl_kv_block_bytes(&kl);
  struct kvl_sched_model sm = {"tiny", m, kvl_backend_ref(), {kl, (size_t)hot_blocks * bb, 0, 0, NULL, 0, false}, 0};
  char err[256];
  int rc = kvl_sched_add_model(s, &sm, mid, err, sizeof(err));
  if (rc) fprintf(stderr, "%s\n", err);
  KVL_ASSERT(rc == 0);
  return s;
}

static int plen_of(int i) { return 5 + (i * 37) % 90; }

static void prompt_of(int i, int32_t *p, int n) {
  unsigned long long s = 1000 + (unsigned long long)i;
  for (int j = 0; j < n; j++) p[j] = (int32_t)(kvl_test_rand(&s) % 300);
  if (i % 3 == 0) for (int j = 0; j < n && j < 40; j++) p[j] = (int32_t)(j * 7 % 300); /* shared prefix */
}

static struct kvl_request req(int mid, const int32_t *p, int n, int max_tokens) {
  struct kvl_request r = {.model = mid, .prompt = p, .n_prompt = n, .max_tokens = max_tokens};
  kvl_sampler_params_init(&r.sampling);
  r.sampling.temperature = 0;
  return r;
}

/* ---- the synchronous reference ------------------------------------------------------ */

struct ref {
  int32_t toks[N][MAXT];
  int n[N];
};

static void on_ref_token(void *ud, uint64_t id, const struct kvl_token_event *ev) {
  struct ref *o = ud;
  int i = (int)(id - 1);
  KVL_ASSERT(i >= 0 && i < N);
  if (ev->token >= 0 && o->n[i] < MAXT) o->toks[i][o->n[i]++] = ev->token;
}

/* The same N requests, submitted to a scheduler and stepped on this thread. */
static void reference(kvl_model_t *m, struct ref *ref) {
  memset(ref, 0, sizeof(*ref));
  int mid;
  kvl_sched_t *s = sched(m, 256, &mid);
  static int32_t p[N][128];
  char err[256];
  uint64_t id;
  for (int i = 0; i < N; i++) {
    prompt_of(i, p[i], plen_of(i));
    struct kvl_request r = req(mid, p[i], plen_of(i), MAX_TOKENS);
    KVL_ASSERT(kvl_sched_submit(s, &r, on_ref_token, ref, &id, err, sizeof(err)) == 0);
  }
  while (!kvl_sched_idle(s)) KVL_ASSERT(kvl_sched_step(s) >= 0);
  kvl_sched_free(s);
}

/* ---- streaming through the engine ------------------------------------------------------ */

struct run {
  kvl_engine_t *e;
  uv_timer_t timer;
  int mid;
  int bursts;                     /* timer ticks so far */
  int n_req;                      /* requests submitted (indices 0 .. n_req-1) */
  int expect;                     /* final events expected in all */
  uint64_t id[MAXR];
  int idx_of_id[4 * MAXR];        /* engine id -> request index */
  int32_t p[MAXR][128];
  int32_t toks[MAXR][MAXT];
  int n[MAXR];
  int finals[MAXR];
  int events_after_final;
  enum kvl_finish_reason why[MAXR];
  int status[MAXR];
  char msg[MAXR][256];
  struct kvl_usage usage[MAXR];
  double ttft[MAXR], queue[MAXR];
  bool cancel_sent[MAXR];
  int total_finals;
  int in_flight_at_burst[3];      /* earlier requests still running when a burst came */
  int off_thread;                 /* callbacks that ran elsewhere than on the loop thread */
  bool closed;
  kvl_engine_t *closed_e;
};

/* Indices N and N+1: queued then cancelled at once; refused by the scheduler. */
enum { I_QCANCEL = N, I_REFUSED = N + 1, CANCEL_AT = 2 };
static bool cancel_mid_stream(int i) { return i == 4 || i == 17; }

static struct run *g_run; /* for the close callback, which gets no user data */

static void on_closed(kvl_engine_t *e) {
  struct run *r = g_run;
  if (!pthread_equal(pthread_self(), loop_thread)) r->off_thread++;
  r->closed = true;
  r->closed_e = e;
}

static void on_event(void *ud, const struct kvl_engine_event *ev) {
  struct run *r = ud;
  if (!pthread_equal(pthread_self(), loop_thread)) r->off_thread++;
  KVL_ASSERT(ev->id > 0 && ev->id < 4 * MAXR);
  int i = r->idx_of_id[ev->id];
  KVL_ASSERT(i >= 0 && i < r->n_req);
  if (r->finals[i]) { r->events_after_final++; return; }
  if (ev->tok.token >= 0) {
    CHECK_EQ_INT(ev->tok.index, r->n[i]);
    if (r->n[i] < MAXT) r->toks[i][r->n[i]++] = ev->tok.token;
  }
  if (!ev->tok.final) {
    CHECK_EQ_INT(ev->status, 0);
    CHECK(ev->message == NULL);
    if (cancel_mid_stream(i) && ev->tok.index == CANCEL_AT) {
      CHECK_EQ_INT(kvl_engine_cancel(r->e, r->id[i]), 0);
      CHECK_EQ_INT(kvl_engine_cancel(r->e, r->id[i]), 0); /* a second one is a no-op */
      r->cancel_sent[i] = true;
    }
    return;
  }
  r->finals[i]++;
  r->total_finals++;
  r->why[i] = ev->tok.finish;
  r->status[i] = ev->status;
  if (ev->message) snprintf(r->msg[i], sizeof(r->msg[i]), "%s", ev->message);
  r->usage[i] = ev->tok.usage;
  r->ttft[i] = ev->tok.ttft_ms;
  r->queue[i] = ev->tok.queue_ms;
  if (i == 0) CHECK_EQ_INT(kvl_engine_cancel(r->e, r->id[0]), 0); /* finished: a no-op */
  if (r->total_finals == r->expect) kvl_engine_stop(r->e, on_closed);
}

static void submit_one(struct run *r, int i, int n_prompt, int max_tokens) {
  struct kvl_request q = req(r->mid, r->p[i], n_prompt, max_tokens);
  char err[256];
  int rc = kvl_engine_submit(r->e, &q, on_event, r, &r->id[i], err, sizeof(err));
  if (rc) fprintf(stderr, "submit %d: %s\n", i, err);
  KVL_ASSERT(rc == 0);
  r->idx_of_id[r->id[i]] = i;
  r->n_req = i + 1 > r->n_req ? i + 1 : r->n_req;
}

static void on_tick(uv_timer_t *t) {
  struct run *r = t->data;
  if (!pthread_equal(pthread_self(), loop_thread)) r->off_thread++;
  int b = r->bursts++;
  for (int i = 0; i < r->n_req; i++) r->in_flight_at_burst[b] += !r->finals[i];
  for (int i = b * BURST; i < (b + 1) * BURST; i++) {
    prompt_of(i, r->p[i], plen_of(i));
    submit_one(r, i, plen_of(i), MAX_TOKENS);
  }
  if (b == 1) {
    char err[256];
    uint64_t id = 0;
    /* refused at once, nothing queued, no callback */
    struct kvl_request q = req(r->mid, r->p[0], 0, 4);
    CHECK_EQ_INT(kvl_engine_submit(r->e, &q, on_event, r, &id, err, sizeof(err)), KVL_EINVAL);
    CHECK_STR_CONTAINS(err, "empty");
    q = req(r->mid, r->p[0], 3, 0);
    CHECK_EQ_INT(kvl_engine_submit(r->e, &q, on_event, r, &id, err, sizeof(err)), KVL_EINVAL);
    CHECK_STR_CONTAINS(err, "max_tokens");
    CHECK_EQ_INT(kvl_engine_cancel(r->e, 12345), 0); /* never issued: a no-op */
    /* queued and cancelled in the same breath: CANCELLED without a token */
    prompt_of(I_QCANCEL, r->p[I_QCANCEL], 20);
    submit_one(r, I_QCANCEL, 20, MAX_TOKENS);
    CHECK_EQ_INT(kvl_engine_cancel(r->e, r->id[I_QCANCEL]), 0);
    /* only the scheduler knows the vocabulary: refused as a final event */
    prompt_of(I_REFUSED, r->p[I_REFUSED], 10);
    r->p[I_REFUSED][3] = 999;
    submit_one(r, I_REFUSED, 10, MAX_TOKENS);
  }
  if (r->bursts * BURST >= N) uv_close((uv_handle_t *)t, NULL);
}

static void test_stream(void) {
  void *buf;
  kvl_model_t *m = tiny(&buf);
  struct ref *ref = malloc(sizeof(*ref));
  reference(m, ref);

  uv_loop_t loop;
  CHECK_EQ_INT(uv_loop_init(&loop), 0);
  struct run *r = calloc(1, sizeof(*r));
  g_run = r;
  r->expect = N + 2;
  kvl_sched_t *s = sched(m, 256, &r->mid);
  CHECK_EQ_INT(kvl_engine_start(&loop, s, &r->e), 0);
  CHECK_EQ_INT(uv_timer_init(&loop, &r->timer), 0);
  r->timer.data = r;
  CHECK_EQ_INT(uv_timer_start(&r->timer, on_tick, 1, 3), 0); /* a burst every 3 ms */
  CHECK_EQ_INT(uv_run(&loop, UV_RUN_DEFAULT), 0);
  CHECK_EQ_INT(uv_loop_close(&loop), 0);

  CHECK(r->closed && r->closed_e == r->e);
  CHECK_EQ_INT(r->off_thread, 0);
  CHECK_EQ_INT(r->events_after_final, 0);
  CHECK_EQ_INT(r->n_req, N + 2);
  int bad = 0, cancelled = 0;
  for (int i = 0; i < r->n_req; i++) CHECK_EQ_INT(r->finals[i], 1);
  for (int i = 0; i < N; i++) {
    CHECK_EQ_INT(r->usage[i].prompt_tokens, plen_of(i));
    CHECK_EQ_INT(r->usage[i].generated, r->n[i]);
    CHECK(r->queue[i] > 0 && r->ttft[i] >= r->queue[i]);
    /* every output is a prefix of the reference; uncancelled ones are all of it */
    bool prefix = r->n[i] <= ref->n[i] && !memcmp(r->toks[i], ref->toks[i], sizeof(int32_t) * (size_t)r->n[i]);
    if (cancel_mid_stream(i)) {
      CHECK(r->cancel_sent[i]);
      CHECK(prefix);
      if (r->why[i] == KVL_DONE_CANCELLED) {
        cancelled++;
        CHECK_EQ_INT(r->status[i], KVL_ECANCELED);
        CHECK(r->n[i] >= CANCEL_AT + 1);
      } else { /* the cancel came after its last step: legal, unlikely */
        CHECK_EQ_INT(r->why[i], KVL_DONE_LENGTH);
      }
      continue;
    }
    CHECK_EQ_INT(r->why[i], KVL_DONE_LENGTH);
    CHECK_EQ_INT(r->status[i], 0);
    bad += !prefix || r->n[i] != ref->n[i] || r->n[i] != MAX_TOKENS;
  }
  CHECK_EQ_INT(r->why[I_QCANCEL], KVL_DONE_CANCELLED);
  CHECK_EQ_INT(r->status[I_QCANCEL], KVL_ECANCELED);
  CHECK_EQ_INT(r->n[I_QCANCEL], 0);
  CHECK_EQ_INT(r->why[I_REFUSED], KVL_DONE_ERROR);
  CHECK_EQ_INT(r->status[I_REFUSED], KVL_EINVAL);
  CHECK_STR_CONTAINS(r->msg[I_REFUSED], "outside the vocabulary");
  CHECK_EQ_INT(r->n[I_REFUSED], 0);
  printf("  %d requests in 3 bursts (%d and %d earlier ones still running at bursts 2 and 3): %d outputs differ from "
         "the synchronous run, %d of 2 cancelled mid-stream (after %d and %d tokens)\n",
         N, r->in_flight_at_burst[1], r->in_flight_at_burst[2], bad, cancelled, r->n[4], r->n[17]);
  CHECK_EQ_INT(bad, 0);

  free(r);
  free(ref);
  kvl_model_free(m);
  free(buf);
}

/* ---- stop with requests in flight ------------------------------------------------------- */

struct stop_run {
  kvl_engine_t *e;
  int mid;
  int32_t p[8][64];
  uint64_t id[8];
  int finals[8], tokens[8], events_after_final;
  enum kvl_finish_reason why[8];
  int off_thread;
  bool stopped, closed;
};
static struct stop_run *g_stop;

static void on_stop_closed(kvl_engine_t *e) {
  (void)e;
  if (!pthread_equal(pthread_self(), loop_thread)) g_stop->off_thread++;
  g_stop->closed = true;
}

static void on_stop_event(void *ud, const struct kvl_engine_event *ev) {
  struct stop_run *r = ud;
  if (!pthread_equal(pthread_self(), loop_thread)) r->off_thread++;
  int i = (int)(ev->id - 1);
  KVL_ASSERT(i >= 0 && i < 8);
  if (r->finals[i]) { r->events_after_final++; return; }
  if (ev->tok.token >= 0) r->tokens[i]++;
  if (ev->tok.final) { r->finals[i]++; r->why[i] = ev->tok.finish; }
  if (!r->stopped) {
    r->stopped = true;
    kvl_engine_stop(r->e, on_stop_closed);
    /* after stop: submit is refused, cancel is a no-op */
    struct kvl_request q = req(r->mid, r->p[0], 10, 4);
    char err[256];
    uint64_t id;
    CHECK_EQ_INT(kvl_engine_submit(r->e, &q, on_stop_event, r, &id, err, sizeof(err)), KVL_ECANCELED);
    CHECK_EQ_INT(kvl_engine_cancel(r->e, r->id[1]), 0);
  }
}

static void test_stop_in_flight(void) {
  void *buf;
  kvl_model_t *m = tiny(&buf);
  uv_loop_t loop;
  CHECK_EQ_INT(uv_loop_init(&loop), 0);
  struct stop_run *r = calloc(1, sizeof(*r));
  g_stop = r;
  kvl_sched_t *s = sched(m, 256, &r->mid);
  CHECK_EQ_INT(kvl_engine_start(&loop, s, &r->e), 0);
  char err[256];
  for (int i = 0; i < 8; i++) {
    prompt_of(100 + i, r->p[i], 60);
    struct kvl_request q = req(r->mid, r->p[i], 60, 40);
    CHECK_EQ_INT(kvl_engine_submit(r->e, &q, on_stop_event, r, &r->id[i], err, sizeof(err)), 0);
  }
  CHECK_EQ_INT(uv_run(&loop, UV_RUN_DEFAULT), 0);
  CHECK_EQ_INT(uv_loop_close(&loop), 0);
  CHECK(r->closed);
  CHECK_EQ_INT(r->off_thread, 0);
  CHECK_EQ_INT(r->events_after_final, 0);
  int cancelled = 0;
  for (int i = 0; i < 8; i++) {
    CHECK_EQ_INT(r->finals[i], 1);
    CHECK(r->why[i] == KVL_DONE_CANCELLED || r->why[i] == KVL_DONE_LENGTH);
    cancelled += r->why[i] == KVL_DONE_CANCELLED;
  }
  printf("  stop after the first token: %d of 8 requests ended CANCELLED, each with one final event\n", cancelled);
  CHECK(cancelled > 0);
  free(r);
  kvl_model_free(m);
  free(buf);
}

/* ---- idle: the compute thread sleeps --------------------------------------------------- */

static double cpu_ms(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e3 + (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1e-3;
}

struct idle_run {
  kvl_engine_t *e;
  double cpu0;
  double cpu_used;
  bool closed;
};
static struct idle_run *g_idle;

static void on_idle_closed(kvl_engine_t *e) {
  (void)e;
  g_idle->closed = true;
}

static void on_idle_timer(uv_timer_t *t) {
  struct idle_run *r = t->data;
  r->cpu_used = cpu_ms() - r->cpu0;
  kvl_engine_stop(r->e, on_idle_closed);
  uv_close((uv_handle_t *)t, NULL);
}

static void test_idle_sleeps(void) {
  void *buf;
  kvl_model_t *m = tiny(&buf);
  uv_loop_t loop;
  CHECK_EQ_INT(uv_loop_init(&loop), 0);
  struct idle_run r = {0};
  g_idle = &r;
  int mid;
  kvl_sched_t *s = sched(m, 16, &mid);
  CHECK_EQ_INT(kvl_engine_start(&loop, s, &r.e), 0);
  uv_timer_t t;
  CHECK_EQ_INT(uv_timer_init(&loop, &t), 0);
  t.data = &r;
  r.cpu0 = cpu_ms();
  CHECK_EQ_INT(uv_timer_start(&t, on_idle_timer, 200, 0), 0);
  CHECK_EQ_INT(uv_run(&loop, UV_RUN_DEFAULT), 0);
  CHECK_EQ_INT(uv_loop_close(&loop), 0);
  printf("  200 ms idle: %.1f ms of CPU\n", r.cpu_used);
  CHECK(r.cpu_used < 50);
  CHECK(r.closed);
  kvl_model_free(m);
  free(buf);
}

int main(void) {
  loop_thread = pthread_self();
  RUN(test_stream);
  RUN(test_stop_in_flight);
  RUN(test_idle_sleeps);
  return TEST_EXIT();
}
