/* httpreq.h - the request side of the metrics listener's HTTP/1.x, as a pure
 * function from the bytes a client sent to what to answer, so that it is
 * tested without a socket. Only GET and HEAD of /metrics are served. */
#ifndef MOKD_HTTPREQ_H
#define MOKD_HTTPREQ_H

#include <stddef.h>

/* The longest request (line and headers) read; longer ones get 431. */
#define MOKD_HTTP_MAX_REQUEST 4096

typedef struct mokd_http_req {
  int status;  /* 200, 400, 404, 405, 431 or 505 */
  int head;    /* HEAD: headers only */
} mokd_http_req;

/* 0 while the request is incomplete (no blank line yet, and len under
 * MOKD_HTTP_MAX_REQUEST); else 1 with the answer in *out. */
int mokd_http_parse(const char *buf, size_t len, mokd_http_req *out);
const char *mokd_http_reason(int status);

#endif
