/* zmq_curve.h - optional CurveZMQ encryption and authentication between routers and
 * workers (--zmq-curve-secret-file, --zmq-curve-peers-file).  Off by default: on one
 * host or a private network the plain TCP of ZeroMQ is what vLLM's own ZMQ sockets
 * use too; across nodes on a shared network, turn it on.
 *
 * Roles: the worker's ROUTER and Status PUB are CURVE servers (they bind); the
 * router's DEALER and SUB are CURVE clients.  Keys are Z85 text (40 characters), as
 * zmq_curve_keypair makes them; `tessera curve-keygen` writes a pair.
 *
 *   secret file  this process's secret key: a line holding the 40-character key, or
 *                a czmq certificate's `secret-key = "..."` line.  The public key is
 *                derived from it.
 *   peers file   one public key per line, optionally preceded by an endpoint:
 *                  worker:  the routers allowed to connect (every other client is
 *                           refused by the ZAP handler, before any message flows)
 *                  router:  the workers it trusts: `tcp://HOST:PORT KEY` for one
 *                           worker, or a bare `KEY` for every worker without its
 *                           own line.  A worker whose key is not in the file cannot
 *                           be connected to.
 *                `#` at the start of a line or after a space starts a comment (keys
 *                contain `#` themselves); blank lines are ignored.
 *
 * libzmq in Debian 12 (4.3.4) is built with libsodium: zmq_has("curve") is true;
 * tsr_curve_load checks it and fails clearly otherwise. */
#ifndef TSR_ZMQ_CURVE_H
#define TSR_ZMQ_CURVE_H

#include <stdbool.h>
#include <stddef.h>

#include "common/tsr_status.h"

#define TSR_CURVE_KEY_LEN 40           /* Z85 characters of a 32-byte key */

typedef struct tsr_curve_peer {
        char *endpoint;                /* NULL: any endpoint (router) / n.a. (worker) */
        char key[TSR_CURVE_KEY_LEN + 1];
} tsr_curve_peer;

typedef struct tsr_curve {
        bool enabled;                  /* both files given and loaded */
        char secret[TSR_CURVE_KEY_LEN + 1];
        char public_key[TSR_CURVE_KEY_LEN + 1];
        tsr_curve_peer *peers;
        size_t n_peers;
} tsr_curve;

/* Load the two files (both NULL: CURVE off, TSR_OK).  One without the other, an
 * unreadable file or a malformed line is TSR_E_INVAL with `err` naming the file, the
 * line and what is wrong. */
tsr_status tsr_curve_load(tsr_curve *c, const char *secret_file, const char *peers_file, char *err,
                          size_t errlen);
/* Wipe the secret and free.  Accepts a zeroed struct. */
void tsr_curve_done(tsr_curve *c);

/* A public key is Z85 of 32 bytes: 40 characters of the Z85 alphabet. */
bool tsr_curve_key_valid(const char *key);

/* Make a bound socket a CURVE server (call before zmq_bind). */
tsr_status tsr_curve_server(const tsr_curve *c, void *sock);
/* Make a socket a CURVE client of the server at `endpoint` (call before
 * zmq_connect).  TSR_E_NOTFOUND when the peers file has no key for it. */
tsr_status tsr_curve_client(const tsr_curve *c, void *sock, const char *endpoint);
/* The trusted key for a server endpoint: its own line, else the bare key; NULL if none. */
const char *tsr_curve_server_key(const tsr_curve *c, const char *endpoint);
/* Whether a client's public key is in the peers file (the worker's ZAP decision). */
bool tsr_curve_peer_allowed(const tsr_curve *c, const char *client_key_z85);

/* The ZAP handler (RFC 27) of a context: a thread answering libzmq's authentication
 * requests for every CURVE server socket of `zctx`, allowing exactly the peers'
 * keys.  Start it before binding; stop it before zmq_ctx_term. */
typedef struct tsr_curve_zap tsr_curve_zap;
tsr_status tsr_curve_zap_start(void *zctx, const tsr_curve *c, tsr_curve_zap **out);
/* Accepts NULL; clears *z.  Joins the thread. */
void tsr_curve_zap_stop(tsr_curve_zap **z);
/* Clients refused so far (tests, logs). */
unsigned long tsr_curve_zap_denied(const tsr_curve_zap *z);

#endif
