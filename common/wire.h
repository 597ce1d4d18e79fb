/* wire.h - framing of the router <-> worker protocol (proto/tessera.proto).
 *
 * One ZeroMQ frame = one Envelope.  tsr_wire_unpack is the only way bytes from the
 * network become protocol structs, and it is strict: an oversized frame, bytes that
 * are not a valid Envelope, another major version, an empty oneof, or a message whose
 * fields are out of range is rejected with a status and a reason (the caller logs it
 * once and drops the frame; nothing here logs above debug or aborts).
 *
 * Thread-safe (no state).  Envelopes returned by unpack belong to the caller
 * (tsr_wire_free). */
#ifndef TSR_WIRE_H
#define TSR_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "tessera.pb-c.h"
#include "tsr_status.h"

#define TSR_PROTO_MAJOR 1u
#define TSR_PROTO_MINOR 3u   /* 1.1: Heartbeat, ERROR_ROUTER_REAPED; 1.2: Resync; 1.3: NodeHello/Setup */
#define TSR_PROTO_VERSION (TSR_PROTO_MAJOR * 1000u + TSR_PROTO_MINOR)

/* Largest frame either side accepts (ModelInfo carries tokenizers of tens of MB).
 * Also set as ZMQ_MAXMSGSIZE on every socket. */
#define TSR_WIRE_MAX_FRAME (64u << 20)
/* Field limits checked by unpack. */
#define TSR_WIRE_MAX_ID_LEN 256u              /* request/worker/router ids */
#define TSR_WIRE_MAX_PROMPT_TOKENS (1u << 22) /* 4 Mi tokens */
#define TSR_WIRE_MAX_TOKEN_ID 0x7fffffffu
#define TSR_WIRE_MAX_LOGPROBS 1024
#define TSR_WIRE_MAX_HEARTBEAT_MS 60000u      /* Heartbeat.interval_ms */
#define TSR_WIRE_MAX_NODES 64u                /* NodeHello.nnodes (TSR_COMM_MAX_RANKS) */

typedef Tessera__V1__Envelope tsr_envelope;

/* Serialise `env` (protocol_version is filled in) into a malloc'd buffer.
 * ret and ret_len are written only on success; free the buffer after sending. */
tsr_status tsr_wire_pack(tsr_envelope *env, uint8_t **ret, size_t *ret_len);

/* Parse and validate one frame.  `max_len` = 0 means TSR_WIRE_MAX_FRAME.
 * Returns TSR_OK and writes ret, or TSR_E_LIMIT (too big), TSR_E_PROTO (not an Envelope,
 * other major version, no message), TSR_E_INVAL (a field out of range), with a
 * one-line reason in err (may be NULL). */
tsr_status tsr_wire_unpack(const uint8_t *p, size_t len, size_t max_len, tsr_envelope **ret,
                           char *err, size_t errlen);
void tsr_wire_free(tsr_envelope *env);

/* Field checks of single messages, used by unpack; exposed for tests and for
 * senders that want to check before sending. */
tsr_status tsr_wire_check(const tsr_envelope *env, char *err, size_t errlen);

/* "submit", "status", ... for log lines; "none" when no message is set. */
const char *tsr_wire_msg_name(const tsr_envelope *env);

#endif
