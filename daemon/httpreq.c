/* httpreq.c - see httpreq.h. */
#include "httpreq.h"

#include <string.h>

const char *mokd_http_reason(int status)
{
  switch (status) {
  case 200: return "OK";
  case 400: return "Bad Request";
  case 404: return "Not Found";
  case 405: return "Method Not Allowed";
  case 431: return "Request Header Fields Too Large";
  case 505: return "HTTP Version Not Supported";
  default: return "Internal Server Error";
  }
}

/* the end of the head: a blank line, CRLF or bare LF */
static const char *head_end(const char *buf, size_t len)
{
  for (size_t i = 0; i + 1 < len; i++) {
    if (buf[i] == '\n' && buf[i + 1] == '\n')
      return buf + i;
    if (i + 3 < len && memcmp(buf + i, "\r\n\r\n", 4) == 0)
      return buf + i;
  }
  return NULL;
}

static int token_char(char c)
{
  return c > ' ' && c < 0x7f;
}

int mokd_http_parse(const char *buf, size_t len, mokd_http_req *out)
{
  const char *end = head_end(buf, len), *line_end, *p, *m, *t, *v;
  size_t mlen, tlen, vlen;

  out->status = 400;
  out->head = 0;
  if (end == NULL) {
    if (len < MOKD_HTTP_MAX_REQUEST)
      return 0;
    out->status = 431;
    return 1;
  }
  for (const char *c = buf; c < end; c++)
    if (*c == 0)
      return 1; /* NUL bytes have no place in a head */
  /* the request line, without its CR: METHOD SP TARGET SP HTTP/1.x */
  line_end = memchr(buf, '\n', (size_t)(end - buf) + 2); /* end + 1 < len */
  if (line_end > buf && line_end[-1] == '\r')
    line_end--;
  p = buf;
  for (m = p; p < line_end && token_char(*p); p++)
    ;
  mlen = (size_t)(p - m);
  if (mlen == 0 || p == line_end || *p++ != ' ')
    return 1;
  for (t = p; p < line_end && token_char(*p); p++)
    ;
  tlen = (size_t)(p - t);
  if (tlen == 0 || p == line_end || *p++ != ' ')
    return 1;
  for (v = p; p < line_end && token_char(*p); p++)
    ;
  vlen = (size_t)(p - v);
  if (p != line_end || vlen < 8 || memcmp(v, "HTTP/", 5) != 0)
    return 1;
  if (vlen != 8 || memcmp(v, "HTTP/1.", 7) != 0) {
    out->status = 505;
    return 1;
  }
  if (!((mlen == 3 && memcmp(m, "GET", 3) == 0) || (mlen == 4 && memcmp(m, "HEAD", 4) == 0))) {
    out->status = 405;
    return 1;
  }
  out->head = mlen == 4;
  /* /metrics, with or without a query string */
  if ((tlen == 8 || (tlen > 8 && t[8] == '?')) && memcmp(t, "/metrics", 8) == 0)
    out->status = 200;
  else
    out->status = 404;
  return 1;
}
