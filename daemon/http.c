/* http.c - see http.h. */
#include "http.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "httpreq.h"
#include "log.h"
#include "mok_errno.h"

#define HTTP_MAX_CONNS 16
#define HTTP_DEADLINE_MS 5000 /* a connection's whole life: read, answer, written */

typedef union stream {
  uv_handle_t handle;
  uv_stream_t stream;
  uv_tcp_t tcp;
  uv_pipe_t pipe;
} stream;

typedef struct conn {
  stream s;
  uv_timer_t timer;
  uv_write_t wr;
  mokd_http *h;
  char req[MOKD_HTTP_MAX_REQUEST];
  size_t len;
  char *resp;
  int closing;
  int open_handles;
  struct conn *next, *prev;
} conn;

struct mokd_http {
  uv_loop_t *loop;
  stream listener;
  int is_pipe;
  mokd_http_render render;
  void *arg;
  conn *conns;
  int nconns;
  int stopping;
  int open_handles; /* the listener, then each conn's count */
};

static void maybe_free(mokd_http *h)
{
  if (h->stopping && h->open_handles == 0 && h->conns == NULL)
    free(h);
}

static void on_conn_handle_closed(uv_handle_t *handle)
{
  conn *c = handle->data;
  mokd_http *h = c->h;
  if (--c->open_handles > 0)
    return;
  if (c->prev != NULL)
    c->prev->next = c->next;
  else
    h->conns = c->next;
  if (c->next != NULL)
    c->next->prev = c->prev;
  h->nconns--;
  free(c->resp);
  free(c);
  maybe_free(h);
}

static void conn_close(conn *c)
{
  if (c->closing)
    return;
  c->closing = 1;
  uv_close(&c->s.handle, on_conn_handle_closed);
  uv_close((uv_handle_t *)&c->timer, on_conn_handle_closed);
}

static void on_deadline(uv_timer_t *t)
{
  conn_close(t->data);
}

static void on_written(uv_write_t *w, int status)
{
  conn *c = w->data;
  (void)status;
  conn_close(c);
}

static void respond(conn *c, const mokd_http_req *r)
{
  char *body = NULL, hdr[256];
  size_t blen = 0;
  int status = r->status, n;

  uv_read_stop(&c->s.stream);
  if (status == 200 && c->h->render(c->h->arg, &body, &blen) != 0)
    status = 500;
  if (status != 200) {
    char msg[128];
    snprintf(msg, sizeof msg, "%d %s%s\n", status, mokd_http_reason(status),
             status == 404 ? ": the metrics are at /metrics" : "");
    body = strdup(msg);
    blen = body != NULL ? strlen(body) : 0;
  }
  n = snprintf(hdr, sizeof hdr,
               "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%s"
               "Connection: close\r\n\r\n",
               status, mokd_http_reason(status),
               status == 200 ? "text/plain; version=0.0.4; charset=utf-8"
                             : "text/plain; charset=utf-8",
               blen, status == 405 ? "Allow: GET, HEAD\r\n" : "");
  if (r->head)
    blen = 0;
  c->resp = malloc((size_t)n + blen);
  if (c->resp == NULL) {
    free(body);
    conn_close(c);
    return;
  }
  memcpy(c->resp, hdr, (size_t)n);
  if (blen > 0)
    memcpy(c->resp + n, body, blen);
  free(body);
  uv_buf_t b = uv_buf_init(c->resp, (unsigned)((size_t)n + blen));
  c->wr.data = c;
  if (uv_write(&c->wr, &c->s.stream, &b, 1, on_written) != 0)
    conn_close(c);
}

static void on_alloc(uv_handle_t *handle, size_t suggested, uv_buf_t *b)
{
  conn *c = handle->data;
  (void)suggested;
  *b = uv_buf_init(c->req + c->len, (unsigned)(sizeof c->req - c->len));
}

static void on_read(uv_stream_t *st, ssize_t n, const uv_buf_t *b)
{
  conn *c = st->data;
  mokd_http_req r;
  (void)b;

  if (n < 0) {
    conn_close(c); /* EOF before a whole request, or an error */
    return;
  }
  c->len += (size_t)n;
  if (mokd_http_parse(c->req, c->len, &r))
    respond(c, &r);
}

static void on_connection(uv_stream_t *l, int status)
{
  mokd_http *h = l->data;
  conn *c;
  int rc;

  if (status < 0)
    return;
  if ((c = calloc(1, sizeof *c)) == NULL)
    return;
  c->h = h;
  rc = h->is_pipe ? uv_pipe_init(h->loop, &c->s.pipe, 0) : uv_tcp_init(h->loop, &c->s.tcp);
  if (rc != 0) {
    free(c);
    return;
  }
  c->s.handle.data = c;
  uv_timer_init(h->loop, &c->timer);
  c->timer.data = c;
  c->open_handles = 2;
  c->next = h->conns;
  if (h->conns != NULL)
    h->conns->prev = c;
  h->conns = c;
  h->nconns++;
  if (uv_accept(l, &c->s.stream) != 0 || h->nconns > HTTP_MAX_CONNS) {
    /* taken off the backlog and closed: a crowd of scrapers waits for none */
    LOG_DEBUG(NET, "metrics: connection refused (%d open, at most %d)", h->nconns - 1,
              HTTP_MAX_CONNS);
    conn_close(c);
    return;
  }
  uv_timer_start(&c->timer, on_deadline, HTTP_DEADLINE_MS, 0);
  if (uv_read_start(&c->s.stream, on_alloc, on_read) != 0)
    conn_close(c);
}

/* "127.0.0.1:PORT" or "localhost:PORT": the port, else 0 */
static int parse_port(const char *addr)
{
  const char *colon = strrchr(addr, ':');
  char *end;
  long port;

  if (colon == NULL || !((colon - addr == 9 && strncmp(addr, "127.0.0.1", 9) == 0) ||
                         (colon - addr == 9 && strncmp(addr, "localhost", 9) == 0)))
    return 0;
  port = strtol(colon + 1, &end, 10);
  return *end == 0 && end != colon + 1 && port > 0 && port < 65536 ? (int)port : 0;
}

static void on_listener_closed(uv_handle_t *handle)
{
  mokd_http *h = handle->data;
  h->open_handles--;
  maybe_free(h);
}

int mokd_http_start(uv_loop_t *loop, const char *addr, mokd_http_render render, void *arg,
                    mokd_http **out, char *err, size_t errlen)
{
  mokd_http *h = calloc(1, sizeof *h);
  int rc, port = 0;

  *out = NULL;
  if (h == NULL)
    return MOK_ENOMEM;
  h->loop = loop;
  h->render = render;
  h->arg = arg;
  h->is_pipe = addr[0] == '/';
  if (!h->is_pipe && (port = parse_port(addr)) == 0) {
    snprintf(err, errlen, "metrics: \"%s\" is neither an absolute socket path nor "
             "127.0.0.1:PORT or localhost:PORT", addr);
    free(h);
    return MOK_EINVAL;
  }
  rc = h->is_pipe ? uv_pipe_init(loop, &h->listener.pipe, 0) : uv_tcp_init(loop, &h->listener.tcp);
  if (rc != 0) {
    snprintf(err, errlen, "metrics: %s", uv_strerror(rc));
    free(h);
    return MOK_EIO;
  }
  h->listener.handle.data = h;
  h->open_handles = 1;
  if (h->is_pipe) {
    mode_t old = umask(0117);
    rc = uv_pipe_bind(&h->listener.pipe, addr);
    umask(old);
  } else {
    struct sockaddr_in sa;
    uv_ip4_addr("127.0.0.1", port, &sa);
    rc = uv_tcp_bind(&h->listener.tcp, (const struct sockaddr *)&sa, 0);
  }
  if (rc == 0)
    rc = uv_listen(&h->listener.stream, 16, on_connection);
  if (rc != 0) {
    snprintf(err, errlen, "metrics: cannot listen on %s: %s", addr, uv_strerror(rc));
    h->stopping = 1;
    uv_close(&h->listener.handle, on_listener_closed);
    return MOK_EIO;
  }
  *out = h;
  return 0;
}

void mokd_http_stop(mokd_http *h)
{
  if (h == NULL)
    return;
  h->stopping = 1;
  for (conn *c = h->conns; c != NULL; c = c->next)
    conn_close(c);
  uv_close(&h->listener.handle, on_listener_closed);
}
