/* common/zmq_curve: key files, their errors, and real CURVE handshakes over loopback
 * TCP with the ZAP handler allowing one client key and refusing others. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <cmocka.h>
#include <zmq.h>

#include "common/zmq_curve.h"

typedef struct pair {
        char pub[41], sec[41];
} pair;

static pair new_pair(void) {
        pair p;
        assert_int_equal(zmq_curve_keypair(p.pub, p.sec), 0);
        return p;
}

/* A temp file holding `text`; the caller unlinks and frees the path. */
static char *temp_file(const char *text) {
        char *path = strdup("/tmp/tsr-curve-XXXXXX");
        int fd = mkstemp(path);
        assert_true(fd >= 0);
        assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
        close(fd);
        return path;
}

static void test_load_and_errors(void **state) {
        tsr_curve c;
        char err[512], text[512];
        pair me = new_pair(), peer = new_pair();
        (void)state;

        /* off: neither file */
        assert_int_equal(tsr_curve_load(&c, NULL, NULL, err, sizeof(err)), TSR_OK);
        assert_false(c.enabled);
        /* a bare key, and peers with a comment, a blank line and an endpoint line */
        char *sec = temp_file(me.sec);
        snprintf(text, sizeof(text), "# workers\n\n%s  # any worker\ntcp://10.0.0.7:8100 %s\n", peer.pub, me.pub);
        char *peers = temp_file(text);
        assert_int_equal(tsr_curve_load(&c, sec, peers, err, sizeof(err)), TSR_OK);
        assert_true(c.enabled);
        assert_string_equal(c.public_key, me.pub);      /* derived from the secret */
        assert_int_equal(c.n_peers, 2);
        assert_string_equal(tsr_curve_server_key(&c, "tcp://10.0.0.7:8100"), me.pub);
        assert_string_equal(tsr_curve_server_key(&c, "tcp://10.0.0.8:8100"), peer.pub);
        assert_true(tsr_curve_peer_allowed(&c, peer.pub));
        assert_false(tsr_curve_peer_allowed(&c, new_pair().pub));
        tsr_curve_done(&c);
        assert_int_equal(c.secret[0], 0);

        /* '#' inside a key is part of the key; after a space it starts a comment
         * (Z85 never puts '#' first: 85^4 * 84 > 2^32) */
        pair hashy;
        do
                hashy = new_pair();
        while (!strchr(hashy.pub, '#'));
        snprintf(text, sizeof(text), "%s #comment\n#%s\n", hashy.pub, " a comment");
        char *hash_peers = temp_file(text);
        assert_int_equal(tsr_curve_load(&c, sec, hash_peers, err, sizeof(err)), TSR_OK);
        assert_int_equal(c.n_peers, 1);
        assert_true(tsr_curve_peer_allowed(&c, hashy.pub));
        tsr_curve_done(&c);
        unlink(hash_peers);
        free(hash_peers);

        /* a czmq certificate as the secret file */
        snprintf(text, sizeof(text), "#   ZeroMQ CURVE **Secret** Certificate\nmetadata\ncurve\n"
                                     "    public-key = \"%s\"\n    secret-key = \"%s\"\n", me.pub, me.sec);
        char *cert = temp_file(text);
        assert_int_equal(tsr_curve_load(&c, cert, peers, err, sizeof(err)), TSR_OK);
        assert_string_equal(c.public_key, me.pub);
        tsr_curve_done(&c);

        /* errors name the flag, the file and the line */
        assert_int_equal(tsr_curve_load(&c, sec, NULL, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "--zmq-curve-peers-file is missing"));
        assert_int_equal(tsr_curve_load(&c, "/nonexistent/key", peers, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "--zmq-curve-secret-file /nonexistent/key: No such file"));
        char *bad_sec = temp_file("\n# c\nnot-a-key\n");
        assert_int_equal(tsr_curve_load(&c, bad_sec, peers, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, ":3: not a 40-character Z85 secret key"));
        char *empty = temp_file("# nothing\n");
        assert_int_equal(tsr_curve_load(&c, empty, peers, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "no secret key"));
        assert_int_equal(tsr_curve_load(&c, sec, empty, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, "no public key"));
        snprintf(text, sizeof(text), "%s\nhttp://x:1 %s\n", peer.pub, peer.pub);
        char *bad_peers = temp_file(text);
        assert_int_equal(tsr_curve_load(&c, sec, bad_peers, err, sizeof(err)), TSR_E_INVAL);
        assert_non_null(strstr(err, ":2: expected a 40-character Z85 public key"));
        assert_false(c.enabled);
        assert_null(c.peers);

        assert_false(tsr_curve_key_valid("short"));
        assert_false(tsr_curve_key_valid("~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~"));   /* 40, not Z85 */
        assert_true(tsr_curve_key_valid(me.pub));
        char *files[] = {sec, peers, cert, bad_sec, empty, bad_peers};
        for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
                unlink(files[i]);
                free(files[i]);
        }
}

/* Connect a DEALER client with `client` keys trusting `server_pub`, send one message,
 * and report whether the server's ROUTER received it within `ms`. */
static int delivered(void *zctx, const char *endpoint, const pair *client, const char *server_pub, void *server,
                     int ms) {
        tsr_curve cc = {.enabled = true};
        tsr_curve_peer trusted = {.endpoint = NULL};
        void *dealer = zmq_socket(zctx, ZMQ_DEALER);
        int linger = 0, got = 0;

        memcpy(cc.secret, client->sec, 41);
        memcpy(cc.public_key, client->pub, 41);
        memcpy(trusted.key, server_pub, 41);
        cc.peers = &trusted;
        cc.n_peers = 1;
        zmq_setsockopt(dealer, ZMQ_LINGER, &linger, sizeof(linger));
        assert_int_equal(tsr_curve_client(&cc, dealer, endpoint), TSR_OK);
        assert_int_equal(zmq_connect(dealer, endpoint), 0);
        zmq_send(dealer, "hello", 5, ZMQ_DONTWAIT);
        zmq_pollitem_t it = {.socket = server, .events = ZMQ_POLLIN};
        if (zmq_poll(&it, 1, ms) > 0) {
                char id[256], body[16];
                assert_true(zmq_recv(server, id, sizeof(id), 0) > 0);
                assert_int_equal(zmq_recv(server, body, sizeof(body), 0), 5);
                got = memcmp(body, "hello", 5) == 0;
        }
        zmq_close(dealer);
        return got;
}

static void test_handshake_and_zap(void **state) {
        void *zctx = zmq_ctx_new();
        pair server_keys = new_pair(), allowed = new_pair(), stranger = new_pair();
        tsr_curve sc = {.enabled = true};
        tsr_curve_peer allow = {.endpoint = NULL};
        tsr_curve_zap *zap = NULL;
        char endpoint[128];
        size_t len = sizeof(endpoint);
        int linger = 0;
        (void)state;

        memcpy(sc.secret, server_keys.sec, 41);
        memcpy(sc.public_key, server_keys.pub, 41);
        memcpy(allow.key, allowed.pub, 41);
        sc.peers = &allow;
        sc.n_peers = 1;
        assert_int_equal(tsr_curve_zap_start(zctx, &sc, &zap), TSR_OK);
        void *server = zmq_socket(zctx, ZMQ_ROUTER);
        zmq_setsockopt(server, ZMQ_LINGER, &linger, sizeof(linger));
        assert_int_equal(tsr_curve_server(&sc, server), TSR_OK);
        assert_int_equal(zmq_bind(server, "tcp://127.0.0.1:*"), 0);
        assert_int_equal(zmq_getsockopt(server, ZMQ_LAST_ENDPOINT, endpoint, &len), 0);

        /* the allowed client with the right server key gets through */
        assert_true(delivered(zctx, endpoint, &allowed, server_keys.pub, server, 5000));
        /* a client whose key is not a peer is refused by ZAP: nothing arrives */
        assert_false(delivered(zctx, endpoint, &stranger, server_keys.pub, server, 500));
        assert_true(tsr_curve_zap_denied(zap) >= 1);
        /* an allowed client trusting the wrong server key cannot complete the handshake */
        assert_false(delivered(zctx, endpoint, &allowed, stranger.pub, server, 500));
        /* a plain (non-CURVE) client gets nothing either */
        void *plain = zmq_socket(zctx, ZMQ_DEALER);
        zmq_setsockopt(plain, ZMQ_LINGER, &linger, sizeof(linger));
        zmq_connect(plain, endpoint);
        zmq_send(plain, "hello", 5, ZMQ_DONTWAIT);
        zmq_pollitem_t it = {.socket = server, .events = ZMQ_POLLIN};
        assert_int_equal(zmq_poll(&it, 1, 500), 0);
        zmq_close(plain);
        /* and the allowed one still works after all that */
        assert_true(delivered(zctx, endpoint, &allowed, server_keys.pub, server, 5000));

        zmq_close(server);
        tsr_curve_zap_stop(&zap);
        assert_null(zap);
        zmq_ctx_term(zctx);
}

static void test_off_is_a_no_op(void **state) {
        tsr_curve off = {0};
        tsr_curve_zap *zap = (tsr_curve_zap *)1;
        (void)state;
        assert_int_equal(tsr_curve_server(&off, NULL), TSR_OK);
        assert_int_equal(tsr_curve_client(&off, NULL, "tcp://x:1"), TSR_OK);
        assert_int_equal(tsr_curve_zap_start(NULL, &off, &zap), TSR_OK);
        assert_null(zap);
        tsr_curve_zap_stop(&zap);
        /* no key for an endpoint: refused before connecting */
        pair p = new_pair();
        tsr_curve on = {.enabled = true};
        tsr_curve_peer only = {.endpoint = "tcp://10.0.0.1:8100"};
        memcpy(only.key, p.pub, 41);
        on.peers = &only;
        on.n_peers = 1;
        void *zctx = zmq_ctx_new();
        void *s = zmq_socket(zctx, ZMQ_DEALER);
        assert_int_equal(tsr_curve_client(&on, s, "tcp://10.0.0.2:8100"), TSR_E_NOTFOUND);
        zmq_close(s);
        zmq_ctx_term(zctx);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_load_and_errors),
                cmocka_unit_test(test_handshake_and_zap),
                cmocka_unit_test(test_off_is_a_no_op),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
