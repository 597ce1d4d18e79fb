/* zmq_curve.c - CurveZMQ keys, socket set-up and the ZAP handler (see zmq_curve.h). */
#include "common/zmq_curve.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "common/log.h"

#define ZAP_ENDPOINT "inproc://zeromq.zap.01"   /* fixed by RFC 27 */

static const char z85_chars[] =
        "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";

bool tsr_curve_key_valid(const char *key) {
        if (!key || strlen(key) != TSR_CURVE_KEY_LEN)
                return false;
        for (size_t i = 0; i < TSR_CURVE_KEY_LEN; i++)
                if (!strchr(z85_chars, key[i]))
                        return false;
        /* every 5 characters must decode to a value below 2^32 */
        uint8_t raw[32];
        return zmq_z85_decode(raw, key) != NULL;
}

/* A word starting at p that is a whole Z85 key (keys may contain and start with '#'). */
static bool key_word_at(const char *p) {
        char word[TSR_CURVE_KEY_LEN + 1];
        if (strcspn(p, " \t\r\n") != TSR_CURVE_KEY_LEN)
                return false;
        memcpy(word, p, TSR_CURVE_KEY_LEN);
        word[TSR_CURVE_KEY_LEN] = '\0';
        return tsr_curve_key_valid(word);
}

/* Trim spaces and a comment in place; returns the first non-space char.  A comment
 * is a '#' at the start of the line or after a space, unless it begins a key. */
static char *trim_line(char *line) {
        for (char *h = strchr(line, '#'); h; h = strchr(h + 1, '#'))
                if ((h == line || h[-1] == ' ' || h[-1] == '\t') && !key_word_at(h)) {
                        *h = '\0';
                        break;
                }
        while (*line == ' ' || *line == '\t')
                line++;
        size_t n = strlen(line);
        while (n && (line[n - 1] == ' ' || line[n - 1] == '\t' || line[n - 1] == '\n' || line[n - 1] == '\r'))
                line[--n] = '\0';
        return line;
}

/* `secret-key = "KEY"` (czmq certificate) or a bare KEY; NULL if neither. */
static const char *key_of_secret_line(char *line) {
        char *eq, *q1, *q2;
        if (strncmp(line, "secret-key", 10) != 0)
                return line;
        eq = strchr(line, '=');
        q1 = eq ? strchr(eq, '"') : NULL;
        q2 = q1 ? strchr(q1 + 1, '"') : NULL;
        if (!q2)
                return NULL;
        *q2 = '\0';
        return q1 + 1;
}

static tsr_status load_secret(tsr_curve *c, const char *path, char *err, size_t errlen) {
        FILE *f = fopen(path, "r");
        char line[512];
        unsigned lineno = 0;
        bool found = false;
        if (!f) {
                tsr_errf(err, errlen, "--zmq-curve-secret-file %s: %s", path, strerror(errno));
                return TSR_E_INVAL;
        }
        while (!found && fgets(line, sizeof(line), f)) {
                char *t = trim_line(line);
                const char *key;
                lineno++;
                /* A key is one word (Z85 has '=' and '#' but no spaces); lines of more
                 * words, and the section names, are the rest of a czmq certificate. */
                if (!*t || strcmp(t, "curve") == 0 || strcmp(t, "metadata") == 0 ||
                    (strpbrk(t, " \t") && strncmp(t, "secret-key", 10) != 0))
                        continue;
                key = key_of_secret_line(t);
                if (!key || !tsr_curve_key_valid(key)) {
                        fclose(f);
                        tsr_errf(err, errlen, "--zmq-curve-secret-file %s:%u: not a 40-character Z85 secret key",
                                 path, lineno);
                        return TSR_E_INVAL;
                }
                memcpy(c->secret, key, TSR_CURVE_KEY_LEN + 1);
                found = true;
        }
        fclose(f);
        memset(line, 0, sizeof(line));
        if (!found) {
                tsr_errf(err, errlen, "--zmq-curve-secret-file %s: no secret key in the file", path);
                return TSR_E_INVAL;
        }
        if (zmq_curve_public(c->public_key, c->secret) != 0) {
                tsr_errf(err, errlen, "--zmq-curve-secret-file %s: cannot derive the public key: %s", path,
                         zmq_strerror(zmq_errno()));
                return TSR_E_INVAL;
        }
        return TSR_OK;
}

static tsr_status load_peers(tsr_curve *c, const char *path, char *err, size_t errlen) {
        FILE *f = fopen(path, "r");
        char line[1024];
        unsigned lineno = 0;
        if (!f) {
                tsr_errf(err, errlen, "--zmq-curve-peers-file %s: %s", path, strerror(errno));
                return TSR_E_INVAL;
        }
        while (fgets(line, sizeof(line), f)) {
                char *t = trim_line(line), *sp, *endpoint = NULL, *key = t;
                tsr_curve_peer *grown;
                lineno++;
                if (!*t)
                        continue;
                sp = strpbrk(t, " \t");
                if (sp) {
                        *sp = '\0';
                        endpoint = t;
                        key = sp + 1;
                        while (*key == ' ' || *key == '\t')
                                key++;
                }
                if (!tsr_curve_key_valid(key) || (endpoint && strncmp(endpoint, "tcp://", 6) != 0)) {
                        fclose(f);
                        tsr_errf(err, errlen,
                                 "--zmq-curve-peers-file %s:%u: expected a 40-character Z85 public key, "
                                 "optionally after a tcp://HOST:PORT endpoint", path, lineno);
                        return TSR_E_INVAL;
                }
                grown = realloc(c->peers, (c->n_peers + 1) * sizeof(*grown));
                if (!grown || (endpoint && !(endpoint = strdup(endpoint)))) {
                        if (grown)
                                c->peers = grown;
                        fclose(f);
                        tsr_errf(err, errlen, "out of memory");
                        return TSR_E_NOMEM;
                }
                c->peers = grown;
                c->peers[c->n_peers].endpoint = endpoint;
                memcpy(c->peers[c->n_peers].key, key, TSR_CURVE_KEY_LEN + 1);
                c->n_peers++;
        }
        fclose(f);
        if (c->n_peers == 0) {
                tsr_errf(err, errlen, "--zmq-curve-peers-file %s: no public key in the file", path);
                return TSR_E_INVAL;
        }
        return TSR_OK;
}

tsr_status tsr_curve_load(tsr_curve *c, const char *secret_file, const char *peers_file, char *err,
                          size_t errlen) {
        tsr_status st;
        memset(c, 0, sizeof(*c));
        if (!secret_file && !peers_file)
                return TSR_OK;
        if (!secret_file || !peers_file) {
                tsr_errf(err, errlen, "--zmq-curve-secret-file and --zmq-curve-peers-file go together (%s is missing)",
                         secret_file ? "--zmq-curve-peers-file" : "--zmq-curve-secret-file");
                return TSR_E_INVAL;
        }
        if (!zmq_has("curve")) {
                tsr_errf(err, errlen, "--zmq-curve-secret-file: this libzmq is built without CURVE (libsodium)");
                return TSR_E_INVAL;
        }
        if ((st = load_secret(c, secret_file, err, errlen)) != TSR_OK ||
            (st = load_peers(c, peers_file, err, errlen)) != TSR_OK) {
                tsr_curve_done(c);
                return st;
        }
        c->enabled = true;
        return TSR_OK;
}

void tsr_curve_done(tsr_curve *c) {
        if (!c)
                return;
        for (size_t i = 0; i < c->n_peers; i++)
                free(c->peers[i].endpoint);
        free(c->peers);
        /* volatile so the wipe of the secret is not optimised away */
        for (volatile char *p = c->secret; p < c->secret + sizeof(c->secret); p++)
                *p = 0;
        memset(c, 0, sizeof(*c));
}

tsr_status tsr_curve_server(const tsr_curve *c, void *sock) {
        int one = 1;
        if (!c || !c->enabled)
                return TSR_OK;
        if (zmq_setsockopt(sock, ZMQ_CURVE_SERVER, &one, sizeof(one)) != 0 ||
            zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, c->secret, TSR_CURVE_KEY_LEN + 1) != 0 ||
            zmq_setsockopt(sock, ZMQ_ZAP_DOMAIN, "tessera", 7) != 0)
                return TSR_E_INTERNAL;
        return TSR_OK;
}

const char *tsr_curve_server_key(const tsr_curve *c, const char *endpoint) {
        const char *fallback = NULL;
        for (size_t i = 0; i < c->n_peers; i++) {
                if (c->peers[i].endpoint && endpoint && strcmp(c->peers[i].endpoint, endpoint) == 0)
                        return c->peers[i].key;
                if (!c->peers[i].endpoint && !fallback)
                        fallback = c->peers[i].key;
        }
        return fallback;
}

tsr_status tsr_curve_client(const tsr_curve *c, void *sock, const char *endpoint) {
        const char *server_key;
        if (!c || !c->enabled)
                return TSR_OK;
        server_key = tsr_curve_server_key(c, endpoint);
        if (!server_key)
                return TSR_E_NOTFOUND;
        if (zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, server_key, TSR_CURVE_KEY_LEN + 1) != 0 ||
            zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, c->public_key, TSR_CURVE_KEY_LEN + 1) != 0 ||
            zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, c->secret, TSR_CURVE_KEY_LEN + 1) != 0)
                return TSR_E_INTERNAL;
        return TSR_OK;
}

bool tsr_curve_peer_allowed(const tsr_curve *c, const char *client_key_z85) {
        for (size_t i = 0; i < c->n_peers; i++)
                if (strcmp(c->peers[i].key, client_key_z85) == 0)
                        return true;
        return false;
}

/* ------------------------------------------------------------------ ZAP handler */

struct tsr_curve_zap {
        void *rep;
        pthread_t thread;
        atomic_bool stop;
        atomic_ulong denied;
        const tsr_curve *curve;
};

/* Receive one ZAP request (RFC 27: version, request id, domain, address, routing id,
 * mechanism, credentials...) into frames[]; returns the frame count, -1 on error. */
static int recv_request(void *rep, zmq_msg_t *frames, int max) {
        int n = 0, more = 1;
        while (more) {
                zmq_msg_t scratch, *m = n < max ? &frames[n] : &scratch;
                zmq_msg_init(m);
                if (zmq_msg_recv(m, rep, 0) < 0) {
                        zmq_msg_close(m);
                        for (int i = 0; i < n && i < max; i++)
                                zmq_msg_close(&frames[i]);
                        return -1;
                }
                more = zmq_msg_more(m);
                if (m == &scratch)
                        zmq_msg_close(m);
                n++;
        }
        return n;
}

static void send_frame(void *rep, const void *data, size_t len, bool more) {
        zmq_send(rep, data, len, more ? ZMQ_SNDMORE : 0);
}

/* One request: 200 for a CURVE client whose key is a peer, 400 otherwise. */
static void zap_answer(tsr_curve_zap *z) {
        zmq_msg_t f[8];
        int n = recv_request(z->rep, f, 8);
        char key[TSR_CURVE_KEY_LEN + 1] = "";
        bool ok = false;
        const char *version = "1.0";

        if (n < 0)
                return;
        if (n >= 7 && zmq_msg_size(&f[5]) == 5 && memcmp(zmq_msg_data(&f[5]), "CURVE", 5) == 0 &&
            zmq_msg_size(&f[6]) == 32 && zmq_z85_encode(key, zmq_msg_data(&f[6]), 32))
                ok = tsr_curve_peer_allowed(z->curve, key);
        send_frame(z->rep, version, 3, true);
        if (n >= 2)
                send_frame(z->rep, zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), true);   /* request id */
        else
                send_frame(z->rep, "", 0, true);
        send_frame(z->rep, ok ? "200" : "400", 3, true);
        const char *why = ok ? "OK" : "client key not in --zmq-curve-peers-file";
        send_frame(z->rep, why, strlen(why), true);
        send_frame(z->rep, ok ? key : "", ok ? TSR_CURVE_KEY_LEN : 0, true);            /* user id */
        send_frame(z->rep, "", 0, false);                                                /* metadata */
        if (!ok) {
                unsigned long d = atomic_fetch_add(&z->denied, 1) + 1;
                if (d <= 10 || d % 1000 == 0)
                        log_warn("zmq curve: refused a client (key %s; %lu refused so far)", key[0] ? key : "(none)",
                                 d);
        }
        for (int i = 0; i < n && i < 8; i++)
                zmq_msg_close(&f[i]);
}

static void *zap_main(void *arg) {
        tsr_curve_zap *z = arg;
        tsr_log_set_thread("zap");
        while (!atomic_load(&z->stop)) {
                zmq_pollitem_t it = {.socket = z->rep, .events = ZMQ_POLLIN};
                int rc = zmq_poll(&it, 1, 100);     /* wake to see `stop` */
                if (rc < 0 && zmq_errno() == ETERM)
                        break;
                if (rc > 0)
                        zap_answer(z);
        }
        return NULL;
}

tsr_status tsr_curve_zap_start(void *zctx, const tsr_curve *c, tsr_curve_zap **out) {
        tsr_curve_zap *z;
        int linger = 0;
        *out = NULL;
        if (!c || !c->enabled)
                return TSR_OK;
        z = calloc(1, sizeof(*z));
        if (!z)
                return TSR_E_NOMEM;
        z->curve = c;
        z->rep = zmq_socket(zctx, ZMQ_REP);
        if (!z->rep || zmq_setsockopt(z->rep, ZMQ_LINGER, &linger, sizeof(linger)) != 0 ||
            zmq_bind(z->rep, ZAP_ENDPOINT) != 0) {
                if (z->rep)
                        zmq_close(z->rep);
                free(z);
                return TSR_E_INTERNAL;
        }
        if (pthread_create(&z->thread, NULL, zap_main, z) != 0) {
                zmq_close(z->rep);
                free(z);
                return TSR_E_INTERNAL;
        }
        *out = z;
        return TSR_OK;
}

void tsr_curve_zap_stop(tsr_curve_zap **zp) {
        tsr_curve_zap *z;
        if (!zp || !*zp)
                return;
        z = *zp;
        atomic_store(&z->stop, true);
        pthread_join(z->thread, NULL);
        zmq_close(z->rep);
        free(z);
        *zp = NULL;
}

unsigned long tsr_curve_zap_denied(const tsr_curve_zap *z) { return z ? atomic_load(&z->denied) : 0; }
