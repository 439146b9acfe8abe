/*
 * weft-oci-hook, native: the same contract as hooks/weft_oci_hook.py, without an interpreter to start.
 *
 * runc starts the hook for every container of the weft handler, at createRuntime and poststop, and waits
 * for it: the Python hook's cost there is mostly the interpreter's start-up (`weft bench hook`). This
 * program does what the Python one does, message for message (tests/hooks/test_native_hook.py runs both on
 * the same inputs): no weft.io/lease in the OCI state on stdin: exit 0 at once; with one, bind the lease
 * to the container's PID and cgroup (createRuntime) or release it (poststop) over the broker's hook socket
 * (<broker socket>.hook, one JSON line each way), retrying until a bounded deadline; createRuntime fails
 * the container when the broker refuses or stays unreachable, poststop never does; an unknown stage warns
 * and exits 0.
 *
 * Standard C and POSIX only, built static (hooks/native.py), so it runs on any Linux host of its
 * architecture whatever its C library. The JSON reader below reads the whole document (a malformed state is
 * refused as the Python hook refuses it) and keeps only the strings the hook needs.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define LEASE_ANNOTATION "weft.io/lease"
#define DEFAULT_BROKER_SOCKET "/run/weft/broker.sock"
#define CONNECT_TIMEOUT_S 5.0
#define MAX_INPUT (64u << 20)
#define MAX_DEPTH 512

/* -- growable byte buffer ------------------------------------------------------------------------- */
typedef struct {
    char *p;
    size_t n, cap;
} buf_t;

static void die_oom(void) {
    fputs("weft-oci-hook: out of memory\n", stderr);
    exit(1);
}

static void buf_add(buf_t *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) die_oom();
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void buf_str(buf_t *b, const char *s) { buf_add(b, s, strlen(s)); }

static void buf_clear(buf_t *b) {
    b->n = 0;
    buf_add(b, "", 0);
}

static void buf_fmt(buf_t *b, const char *fmt, ...) {
    char tmp[64];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0) buf_add(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

/* A JSON string, escaped as Python's json.dumps escapes it (ASCII out, \uXXXX beyond), NULs included. */
static void buf_json_str(buf_t *b, const buf_t *str) {
    buf_add(b, "\"", 1);
    const unsigned char *u = (const unsigned char *)str->p, *end = u + str->n;
    while (u < end) {
        unsigned c = *u;
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            buf_add(b, e, 2);
            u++;
        } else if (c == '\n') { buf_str(b, "\\n"); u++; }
        else if (c == '\r') { buf_str(b, "\\r"); u++; }
        else if (c == '\t') { buf_str(b, "\\t"); u++; }
        else if (c == '\b') { buf_str(b, "\\b"); u++; }
        else if (c == '\f') { buf_str(b, "\\f"); u++; }
        else if (c < 0x20) { buf_fmt(b, "\\u%04x", c); u++; }
        else if (c < 0x80) { buf_add(b, (const char *)u, 1); u++; }
        else {
            /* UTF-8 the reader checked; should a sequence still be cut short, U+FFFD, never past the end. */
            uint32_t cp;
            int len;
            if (c >= 0xf0) { cp = c & 0x07; len = 4; }
            else if (c >= 0xe0) { cp = c & 0x0f; len = 3; }
            else { cp = c & 0x1f; len = 2; }
            if (end - u < len) { cp = 0xfffd; len = 1; }
            else for (int i = 1; i < len; i++) cp = (cp << 6) | (u[i] & 0x3f);
            u += len;
            if (cp >= 0x10000) {
                cp -= 0x10000;
                buf_fmt(b, "\\u%04x\\u%04x", 0xd800 + (cp >> 10), 0xdc00 + (cp & 0x3ff));
            } else {
                buf_fmt(b, "\\u%04x", cp);
            }
        }
    }
    buf_add(b, "\"", 1);
}

/* -- JSON reader ------------------------------------------------------------------------------------ */
typedef struct {
    const char *start, *p, *end;
    char err[160];
} reader_t;

static int fail(reader_t *r, const char *what) {
    if (!r->err[0]) snprintf(r->err, sizeof r->err, "%s at byte %ld", what, (long)(r->p - r->start));
    return 0;
}

static void ws(reader_t *r) {
    while (r->p < r->end && (*r->p == ' ' || *r->p == '\t' || *r->p == '\n' || *r->p == '\r')) r->p++;
}

static int hex4(reader_t *r, uint32_t *out) {
    if (r->end - r->p < 4) return fail(r, "truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        char c = r->p[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (uint32_t)(c - 'A' + 10);
        else return fail(r, "bad \\u escape");
    }
    r->p += 4;
    *out = v;
    return 1;
}

static void put_utf8(buf_t *b, uint32_t cp) {
    char o[4];
    size_t n;
    if (cp < 0x80) { o[0] = (char)cp; n = 1; }
    else if (cp < 0x800) { o[0] = (char)(0xc0 | (cp >> 6)); o[1] = (char)(0x80 | (cp & 0x3f)); n = 2; }
    else if (cp < 0x10000) {
        o[0] = (char)(0xe0 | (cp >> 12)); o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        o[2] = (char)(0x80 | (cp & 0x3f)); n = 3;
    } else {
        o[0] = (char)(0xf0 | (cp >> 18)); o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
        o[2] = (char)(0x80 | ((cp >> 6) & 0x3f)); o[3] = (char)(0x80 | (cp & 0x3f)); n = 4;
    }
    buf_add(b, o, n);
}

/* The length of the well-formed UTF-8 sequence at p (as Python's strict decoder takes it), 0 if there is none. */
static int utf8_len(const unsigned char *p, const unsigned char *end) {
    unsigned c = p[0];
    int len;
    unsigned lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) len = 2;
    else if (c >= 0xe0 && c <= 0xef) {
        len = 3;
        if (c == 0xe0) lo = 0xa0;
        if (c == 0xed) hi = 0x9f;  /* no surrogates */
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4;
        if (c == 0xf0) lo = 0x90;
        if (c == 0xf4) hi = 0x8f;  /* nothing past U+10FFFF */
    } else return 0;
    if (end - p < len) return 0;
    if (p[1] < lo || p[1] > hi) return 0;
    for (int i = 2; i < len; i++)
        if (p[i] < 0x80 || p[i] > 0xbf) return 0;
    return len;
}

/* A string at r->p (its opening quote); its decoded UTF-8 into out when out is not NULL. */
static int read_string(reader_t *r, buf_t *out) {
    if (r->p >= r->end || *r->p != '"') return fail(r, "expected a string");
    r->p++;
    if (out) buf_clear(out);
    while (r->p < r->end) {
        unsigned char c = (unsigned char)*r->p;
        if (c == '"') { r->p++; return 1; }
        if (c < 0x20) return fail(r, "control character in a string");
        if (c != '\\') {
            const char *start = r->p;
            while (r->p < r->end && *r->p != '"' && *r->p != '\\' && (unsigned char)*r->p >= 0x20) {
                if ((unsigned char)*r->p < 0x80) { r->p++; continue; }
                int n = utf8_len((const unsigned char *)r->p, (const unsigned char *)r->end);
                if (!n) return fail(r, "invalid UTF-8 in a string");
                r->p += n;
            }
            if (out) buf_add(out, start, (size_t)(r->p - start));
            continue;
        }
        r->p++;
        if (r->p >= r->end) break;
        char e = *r->p++;
        uint32_t cp;
        switch (e) {
            case '"': cp = '"'; break;
            case '\\': cp = '\\'; break;
            case '/': cp = '/'; break;
            case 'b': cp = '\b'; break;
            case 'f': cp = '\f'; break;
            case 'n': cp = '\n'; break;
            case 'r': cp = '\r'; break;
            case 't': cp = '\t'; break;
            case 'u':
                if (!hex4(r, &cp)) return 0;
                if (cp >= 0xd800 && cp < 0xdc00 && r->end - r->p >= 6 && r->p[0] == '\\' && r->p[1] == 'u') {
                    const char *back = r->p;
                    uint32_t lo;
                    r->p += 2;
                    if (!hex4(r, &lo)) return 0;
                    if (lo >= 0xdc00 && lo < 0xe000) cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
                    else r->p = back;
                }
                /* A lone surrogate stays one (three bytes, as WTF-8 has it): the request escapes it again. */
                break;
            default: return fail(r, "bad escape in a string");
        }
        if (out) put_utf8(out, cp);
    }
    return fail(r, "unterminated string");
}

static int read_number(reader_t *r, long long *out) {
    const char *s = r->p;
    if (r->p < r->end && *r->p == '-') r->p++;
    if (r->p >= r->end || *r->p < '0' || *r->p > '9') return fail(r, "expected a value");
    if (*r->p == '0') r->p++;
    else while (r->p < r->end && *r->p >= '0' && *r->p <= '9') r->p++;
    int integral = 1;
    if (r->p < r->end && *r->p == '.') {
        integral = 0;
        r->p++;
        if (r->p >= r->end || *r->p < '0' || *r->p > '9') return fail(r, "bad number");
        while (r->p < r->end && *r->p >= '0' && *r->p <= '9') r->p++;
    }
    if (r->p < r->end && (*r->p == 'e' || *r->p == 'E')) {
        integral = 0;
        r->p++;
        if (r->p < r->end && (*r->p == '+' || *r->p == '-')) r->p++;
        if (r->p >= r->end || *r->p < '0' || *r->p > '9') return fail(r, "bad number");
        while (r->p < r->end && *r->p >= '0' && *r->p <= '9') r->p++;
    }
    if (out) {
        char tmp[32];
        size_t n = (size_t)(r->p - s);
        *out = 0;
        if (integral && n < sizeof tmp) {
            memcpy(tmp, s, n);
            tmp[n] = 0;
            *out = strtoll(tmp, NULL, 10);
        }
    }
    return 1;
}

static int literal(reader_t *r, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(r->end - r->p) < n || memcmp(r->p, word, n) != 0) return fail(r, "expected a value");
    r->p += n;
    return 1;
}

/* What a value turned out to be, for the few the hook reads. */
enum kind { K_NONE, K_STRING, K_NUMBER, K_TRUE, K_FALSE, K_NULL, K_OBJECT, K_ARRAY };

static int skip_value(reader_t *r, int depth, enum kind *kind, buf_t *str, long long *num);

/* An object's members: on_member(key, r) reads each value (or skips it). */
typedef int (*member_fn)(reader_t *r, const buf_t *key, void *ctx, int depth);

/* Keys compared whole, NULs and all (a key "weft.io/lease\u0000x" is not the lease's). */
static int key_is(const buf_t *key, const char *name) {
    size_t n = strlen(name);
    return key->n == n && memcmp(key->p, name, n) == 0;
}

static int read_object(reader_t *r, int depth, member_fn on_member, void *ctx) {
    if (depth > MAX_DEPTH) return fail(r, "nested too deep");
    r->p++; /* '{' */
    ws(r);
    if (r->p < r->end && *r->p == '}') { r->p++; return 1; }
    buf_t key = {0};
    for (;;) {
        ws(r);
        if (!read_string(r, &key)) { free(key.p); return 0; }
        ws(r);
        if (r->p >= r->end || *r->p != ':') { free(key.p); return fail(r, "expected ':'"); }
        r->p++;
        ws(r);
        int ok = on_member ? on_member(r, &key, ctx, depth + 1) : skip_value(r, depth + 1, NULL, NULL, NULL);
        if (!ok) { free(key.p); return 0; }
        ws(r);
        if (r->p < r->end && *r->p == ',') { r->p++; continue; }
        if (r->p < r->end && *r->p == '}') { r->p++; free(key.p); return 1; }
        free(key.p);
        return fail(r, "expected ',' or '}'");
    }
}

static int skip_value(reader_t *r, int depth, enum kind *kind, buf_t *str, long long *num) {
    enum kind k = K_NONE;
    if (depth > MAX_DEPTH) return fail(r, "nested too deep");
    ws(r);
    if (r->p >= r->end) return fail(r, "expected a value");
    char c = *r->p;
    int ok;
    if (c == '{') { k = K_OBJECT; ok = read_object(r, depth, NULL, NULL); }
    else if (c == '[') {
        k = K_ARRAY;
        r->p++;
        ws(r);
        ok = 1;
        if (r->p < r->end && *r->p == ']') r->p++;
        else for (;;) {
            if (!skip_value(r, depth + 1, NULL, NULL, NULL)) { ok = 0; break; }
            ws(r);
            if (r->p < r->end && *r->p == ',') { r->p++; continue; }
            if (r->p < r->end && *r->p == ']') { r->p++; break; }
            ok = fail(r, "expected ',' or ']'");
            break;
        }
    }
    else if (c == '"') { k = K_STRING; ok = read_string(r, str); }
    else if (c == 't') { k = K_TRUE; ok = literal(r, "true"); }
    else if (c == 'f') { k = K_FALSE; ok = literal(r, "false"); }
    else if (c == 'n') { k = K_NULL; ok = literal(r, "null"); }
    else { k = K_NUMBER; ok = read_number(r, num); }
    if (kind) *kind = k;
    return ok;
}

/* -- the OCI state ---------------------------------------------------------------------------------- */
typedef struct {
    buf_t id, lease, sandbox, name;
    long long pid;
    enum kind lease_kind;  /* K_NONE: no such annotation */
} state_t;

/* A string member (or its absence): the last one wins, as in Python's json. */
static int string_member(reader_t *r, buf_t *into, int depth, enum kind *kind) {
    enum kind k;
    buf_t tmp = {0};
    if (!skip_value(r, depth, &k, &tmp, NULL)) { free(tmp.p); return 0; }
    buf_clear(into);
    if (k == K_STRING) buf_add(into, tmp.p, tmp.n);
    free(tmp.p);
    if (kind) *kind = k;
    return 1;
}

static int annotation_member(reader_t *r, const buf_t *key, void *ctx, int depth) {
    state_t *st = ctx;
    if (key_is(key, LEASE_ANNOTATION)) return string_member(r, &st->lease, depth, &st->lease_kind);
    if (key_is(key, "io.kubernetes.cri.sandbox-id")) return string_member(r, &st->sandbox, depth, NULL);
    if (key_is(key, "io.kubernetes.cri.container-name")) return string_member(r, &st->name, depth, NULL);
    return skip_value(r, depth, NULL, NULL, NULL);
}

static int state_member(reader_t *r, const buf_t *key, void *ctx, int depth) {
    state_t *st = ctx;
    if (key_is(key, "id")) return string_member(r, &st->id, depth, NULL);
    if (key_is(key, "pid")) {
        enum kind k;
        long long n = 0;
        if (!skip_value(r, depth, &k, NULL, &n)) return 0;
        st->pid = k == K_NUMBER ? n : 0;
        return 1;
    }
    if (key_is(key, "annotations")) {
        /* A later "annotations" replaces an earlier one, as in Python; anything but an object holds none. */
        buf_clear(&st->lease);
        buf_clear(&st->sandbox);
        buf_clear(&st->name);
        st->lease_kind = K_NONE;
        ws(r);
        if (r->p < r->end && *r->p == '{') return read_object(r, depth, annotation_member, st);
        return skip_value(r, depth, NULL, NULL, NULL);
    }
    return skip_value(r, depth, NULL, NULL, NULL);
}

static const char *kind_name(enum kind k) {
    switch (k) {
        case K_STRING: return "str";
        case K_NUMBER: return "number";
        case K_TRUE: case K_FALSE: return "bool";
        case K_NULL: return "NoneType";
        case K_ARRAY: return "list";
        default: return "value";
    }
}

/* 1: a state object read into st; 0: not JSON, or not an object (message in err). */
static int read_state(const char *text, size_t n, state_t *st, char *err, size_t errlen) {
    reader_t r = {text, text, text + n, {0}};
    ws(&r);
    int ok;
    if (r.p < r.end && *r.p == '{') ok = read_object(&r, 0, state_member, st);
    else {
        enum kind k = K_NONE;
        ok = skip_value(&r, 0, &k, NULL, NULL);
        if (ok) {
            ws(&r);
            if (r.p != r.end) { fail(&r, "extra data"); ok = 0; }
            else {
                snprintf(err, errlen, "expected a JSON object, got %s", kind_name(k));
                return 0;
            }
        }
    }
    if (ok) {
        ws(&r);
        if (r.p != r.end) ok = fail(&r, "extra data");
    }
    if (!ok) snprintf(err, errlen, "%s", r.err[0] ? r.err : "not JSON");
    return ok;
}

/* -- the broker's answer ---------------------------------------------------------------------------- */
typedef struct {
    int ok;
    buf_t error, code;
} answer_t;

static int text_member(reader_t *r, buf_t *into, int depth) {
    /* A string's text; anything else as its JSON text; absent stays "None" (what the Python hook prints). */
    ws(r);
    const char *start = r->p;
    enum kind k;
    buf_t tmp = {0};
    if (!skip_value(r, depth, &k, &tmp, NULL)) { free(tmp.p); return 0; }
    buf_clear(into);
    if (k == K_STRING) buf_add(into, tmp.p, tmp.n);
    else if (k == K_NULL) buf_str(into, "None");
    else buf_add(into, start, (size_t)(r->p - start));
    free(tmp.p);
    return 1;
}

static int answer_member(reader_t *r, const buf_t *key, void *ctx, int depth) {
    answer_t *a = ctx;
    if (key_is(key, "ok")) {
        enum kind k;
        if (!skip_value(r, depth, &k, NULL, NULL)) return 0;
        a->ok = k == K_TRUE;
        return 1;
    }
    if (key_is(key, "error")) return text_member(r, &a->error, depth);
    if (key_is(key, "code")) return text_member(r, &a->code, depth);
    return skip_value(r, depth, NULL, NULL, NULL);
}

/* -- talking to the broker -------------------------------------------------------------------------- */
static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void set_timeout(int fd, double seconds) {
    if (seconds < 0.05) seconds = 0.05;
    struct timeval tv = {(time_t)seconds, (suseconds_t)((seconds - (double)(time_t)seconds) * 1e6)};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);  /* a unix connect() waits this long too */
}

/* One try: 1 and the answer line in out, or 0 and why in last. */
static int ask_once(const char *path, const buf_t *request, double deadline, buf_t *out, char *last, size_t lastlen) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path) {
        snprintf(last, lastlen, "AF_UNIX path too long");
        return 0;
    }
    memcpy(addr.sun_path, path, strlen(path) + 1);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        snprintf(last, lastlen, "[Errno %d] %s", errno, strerror(errno));
        return 0;
    }
    set_timeout(fd, deadline - now_s());
    int ok = 0;
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) goto oserr;
    for (size_t sent = 0; sent < request->n;) {
        ssize_t w = send(fd, request->p + sent, request->n - sent, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            goto oserr;
        }
        sent += (size_t)w;
    }
    out->n = 0;
    while (out->n == 0 || out->p[out->n - 1] != '\n') {
        char chunk[65536];
        set_timeout(fd, deadline - now_s());  /* the whole answer within the deadline, however it trickles */
        ssize_t got = recv(fd, chunk, sizeof chunk, 0);
        if (got < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                snprintf(last, lastlen, "timed out");
                goto done;
            }
            goto oserr;
        }
        if (got == 0) {
            snprintf(last, lastlen, "the broker closed the connection without answering");
            goto done;
        }
        if (out->n + (size_t)got > MAX_INPUT) {
            snprintf(last, lastlen, "the broker's answer is too long");
            goto done;
        }
        buf_add(out, chunk, (size_t)got);
    }
    ok = 1;
    goto done;
oserr:
    if (errno == EAGAIN || errno == EWOULDBLOCK) snprintf(last, lastlen, "timed out");
    else snprintf(last, lastlen, "[Errno %d] %s", errno, strerror(errno));
done:
    close(fd);
    return ok;
}

static double hook_timeout(void) {
    /* WEFT_HOOK_TIMEOUT_S: how long to wait for a broker that is not up (or restarting); tests shorten it. */
    const char *v = getenv("WEFT_HOOK_TIMEOUT_S");
    if (v && *v) {
        char *end;
        double t = strtod(v, &end);
        if (*end == 0 && t > 0 && t <= 60) return t;
    }
    return CONNECT_TIMEOUT_S;
}

/* -- main ------------------------------------------------------------------------------------------- */
static char *read_all(FILE *f, size_t *n) {
    buf_t b = {0};
    char chunk[65536];
    size_t got;
    buf_add(&b, "", 0);
    while ((got = fread(chunk, 1, sizeof chunk, f)) > 0) {
        if (b.n + got > MAX_INPUT) {
            fputs("weft-oci-hook: cannot read the OCI state on stdin: longer than 64 MiB\n", stderr);
            exit(1);
        }
        buf_add(&b, chunk, got);
    }
    if (ferror(f)) {
        fputs("weft-oci-hook: cannot read the OCI state on stdin: a read failed\n", stderr);
        exit(1);
    }
    *n = b.n;
    return b.p;
}

static void cgroup_of(long long pid, buf_t *out) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%lld/cgroup", pid);
    FILE *f = fopen(path, "re");
    buf_clear(out);
    if (!f) return;
    size_t n;
    char *text = read_all(f, &n);
    fclose(f);
    buf_t unified = {0};
    buf_clear(&unified);
    for (char *line = text, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        char *c1 = strchr(line, ':');
        char *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2) continue;
        *c2 = 0;
        const char *controllers = c1 + 1, *cg = c2 + 1;
        if (*controllers == 0) { buf_clear(&unified); buf_str(&unified, cg); continue; }
        for (const char *c = controllers; c;) {
            const char *comma = strchr(c, ',');
            size_t len = comma ? (size_t)(comma - c) : strlen(c);
            if (len == 6 && memcmp(c, "memory", 6) == 0) {
                buf_str(out, cg);
                free(text);
                free(unified.p);
                return;
            }
            c = comma ? comma + 1 : NULL;
        }
    }
    buf_add(out, unified.p, unified.n);
    free(text);
    free(unified.p);
}

static const char *short_id(const char *id, char *into) {
    /* The first 12 characters (the IDs are ASCII hex), as the Python hook's container[:12]. */
    snprintf(into, 13, "%s", id);
    return into;
}

int main(int argc, char **argv) {
    size_t n;
    char *raw = read_all(stdin, &n);
    if (!memmem(raw, n, LEASE_ANNOTATION, strlen(LEASE_ANNOTATION))) return 0;  /* the fast path */

    const char *stage = "", *broker = getenv("WEFT_BROKER_SOCKET");
    if (!broker) broker = DEFAULT_BROKER_SOCKET;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--broker-socket") == 0) {
            if (i + 1 < argc) broker = argv[++i];
        } else if (strncmp(argv[i], "--broker-socket=", 16) == 0) {
            broker = argv[i] + 16;
        } else if (!*stage) {
            stage = argv[i];
        }
    }

    state_t st = {0};
    buf_clear(&st.id);
    buf_clear(&st.lease);
    buf_clear(&st.sandbox);
    buf_clear(&st.name);
    char err[200];
    if (!read_state(raw, n, &st, err, sizeof err)) {
        fprintf(stderr, "weft-oci-hook: cannot read the OCI state on stdin: %s\n", err);
        return 1;
    }
    if (st.lease_kind == K_NONE || st.lease_kind == K_NULL || st.lease_kind == K_FALSE ||
        (st.lease_kind == K_STRING && !st.lease.n))
        return 0;
    if (st.lease_kind != K_STRING) {
        fprintf(stderr, "weft-oci-hook: cannot read the OCI state on stdin: annotation %s is not a string\n",
                LEASE_ANNOTATION);
        return 1;
    }
    char id12[13];
    short_id(st.id.p, id12);
    int create = strcmp(stage, "createRuntime") == 0;
    buf_t req = {0};
    if (create) {
        buf_t cg = {0};
        cgroup_of(st.pid, &cg);
        buf_str(&req, "{\"op\": \"bind\", \"lease_id\": ");
        buf_json_str(&req, &st.lease);
        buf_str(&req, ", \"container_id\": ");
        buf_json_str(&req, &st.id);
        buf_fmt(&req, ", \"pid\": %lld, \"cgroup\": ", st.pid);
        buf_json_str(&req, &cg);
        free(cg.p);
    } else if (strcmp(stage, "poststop") == 0) {
        buf_str(&req, "{\"op\": \"release\", \"lease_id\": ");
        buf_json_str(&req, &st.lease);
        buf_str(&req, ", \"reason\": \"poststop\"");
    } else {
        fprintf(stderr, "weft-oci-hook: unknown hook stage '%s'; doing nothing\n", stage);
        return 0;
    }
    /* containerd's own annotations say whose container this is; the broker checks them against the lease. */
    buf_str(&req, ", \"sandbox_id\": ");
    buf_json_str(&req, &st.sandbox);
    buf_str(&req, ", \"container\": ");
    buf_json_str(&req, &st.name);
    buf_str(&req, "}\n");

    buf_t path = {0};
    buf_str(&path, broker);
    buf_str(&path, ".hook");
    double timeout = hook_timeout(), deadline = now_s() + timeout;
    buf_t line = {0};
    buf_clear(&line);
    char last[256] = "";
    for (;;) {
        if (ask_once(path.p, &req, deadline, &line, last, sizeof last)) break;
        if (now_s() >= deadline) {
            fprintf(stderr, "weft-oci-hook %s: container %s, lease %s: GPU broker at %s unreachable for %.0fs: %s\n",
                    stage, id12, st.lease.p, broker, timeout, last);
            return create ? 1 : 0;
        }
        usleep(100000);
    }
    answer_t a = {0};
    buf_str(&a.error, "None");
    buf_str(&a.code, "None");
    reader_t r = {line.p, line.p, line.p + line.n, {0}};
    ws(&r);
    int ok = r.p < r.end && *r.p == '{' && read_object(&r, 0, answer_member, &a);
    if (ok) {
        ws(&r);
        if (r.p != r.end) ok = fail(&r, "extra data");
    }
    if (!ok) {
        fprintf(stderr, "weft-oci-hook %s: container %s, lease %s: the GPU broker's answer is not a JSON object: %s\n",
                stage, id12, st.lease.p, r.err[0] ? r.err : "not an object");
        return create ? 1 : 0;
    }
    if (!a.ok) {
        fprintf(stderr, "weft-oci-hook %s: the GPU broker refused lease %s for container %s: %s (%s)\n",
                stage, st.lease.p, id12, a.error.p, a.code.p);
        return create ? 1 : 0;
    }
    return 0;
}
