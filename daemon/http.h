/* http.h - the --metrics listener: a minimal HTTP/1.1 responder on the loop
 * for GET /metrics, on a Unix socket path or on 127.0.0.1:PORT. One request
 * per connection; each connection has a deadline, the request a size bound,
 * and the connections a count bound, so slow or hostile clients cost the
 * loop neither time nor memory. */
#ifndef MOKD_HTTP_H
#define MOKD_HTTP_H

#include <stddef.h>
#include <uv.h>

typedef struct mokd_http mokd_http;

/* The body of a 200: malloc'ed into *out; 0 or a MOK_* code. */
typedef int (*mokd_http_render)(void *arg, char **out, size_t *len);

/* addr: an absolute path (a Unix socket, made mode 0660; anything at the
 * path must be gone already) or 127.0.0.1:PORT / localhost:PORT. */
int mokd_http_start(uv_loop_t *loop, const char *addr, mokd_http_render render, void *arg,
                    mokd_http **out, char *err, size_t errlen);
/* Closes the listener and every connection; freed once their handles are. */
void mokd_http_stop(mokd_http *h);

#endif
