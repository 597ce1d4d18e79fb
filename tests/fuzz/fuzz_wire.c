/* fuzz_wire.c - bytes from the network -> tsr_wire_unpack, and back out through pack.
 *
 * The first input byte is a selector, the rest is the frame:
 *   bit 7   unpack under a small max_len (1..64 bytes, from bits 0-5) instead of the
 *           default, so the size cap is hit from both sides;
 *   bit 6   give unpack an error buffer of 7 bytes (allocated to size, so ASan sees a
 *           message written past it) instead of 256.
 * Properties: the status is one unpack documents; a frame over max_len is TSR_E_LIMIT;
 * a failure writes a NUL-terminated reason; a success validates again with
 * tsr_wire_check, packs, unpacks again (with the default cap) and validates, and packing
 * that second copy gives the same bytes as the first pack (pack . unpack is the identity
 * on what pack produces, which is what a relaying peer relies on).
 *
 * A frame accepted never holds an unknown field numbered 0: protobuf-c 1.4 keeps one
 * whose tag is written in two or more bytes and re-packs it as a one-byte tag it then
 * rejects, so wire.c refuses it (finding 1 of docs/fuzzing.md; the inputs that showed it
 * are in tests/fuzz/regressions/wire/).  The walk below is the harness's own, written
 * independently of wire.c's. */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/wire.h"
#include "fuzz.h"

static void check_failure(tsr_status st, const char *err, size_t errlen) {
        FUZZ_CHECK(st == TSR_E_LIMIT || st == TSR_E_PROTO || st == TSR_E_INVAL || st == TSR_E_NOMEM);
        FUZZ_CHECK(memchr(err, '\0', errlen) != NULL);
        /* Small buffers may hold only a prefix, but never nothing: the caller logs it. */
        FUZZ_CHECK(errlen < 2 || err[0] != '\0');
}

/* Whether `m` or any message inside it kept an unknown field numbered 0, found through
 * the descriptors so that every message type (and map entry) is covered. */
static bool has_field0(const ProtobufCMessage *m) {
        const ProtobufCMessageDescriptor *d = m->descriptor;
        const char *base = (const char *)m;

        for (unsigned i = 0; i < m->n_unknown_fields; i++)
                if (m->unknown_fields[i].tag == 0)
                        return true;
        for (unsigned i = 0; i < d->n_fields; i++) {
                const ProtobufCFieldDescriptor *f = &d->fields[i];

                if (f->type != PROTOBUF_C_TYPE_MESSAGE)
                        continue;
                if (f->label == PROTOBUF_C_LABEL_REPEATED) {
                        size_t n = *(const size_t *)(base + f->quantifier_offset);
                        ProtobufCMessage *const *v = *(ProtobufCMessage *const *const *)(base + f->offset);

                        for (size_t k = 0; k < n; k++)
                                if (v[k] && has_field0(v[k]))
                                        return true;
                        continue;
                }
                if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
                    *(const uint32_t *)(base + f->quantifier_offset) != f->id)
                        continue;
                if (*(ProtobufCMessage *const *)(base + f->offset) &&
                    has_field0(*(ProtobufCMessage *const *)(base + f->offset)))
                        return true;
        }
        return false;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        tsr_envelope *env = NULL, *again = NULL;
        uint8_t *packed = NULL, *repacked = NULL;
        size_t packed_len = 0, repacked_len = 0, max_len = 0, errlen;
        char *err;
        uint8_t sel;
        tsr_status st;

        if (size < 1)
                return 0;
        sel = data[0];
        data++;
        size--;
        if (sel & 0x80)
                max_len = 1 + (sel & 0x3f);
        errlen = (sel & 0x40) ? 7 : 256;
        err = malloc(errlen);
        FUZZ_CHECK(err != NULL);
        err[0] = '\0';

        st = tsr_wire_unpack(data, size, max_len, &env, err, errlen);
        if (max_len && size > max_len)
                FUZZ_CHECK(st == TSR_E_LIMIT);
        if (st != TSR_OK) {
                check_failure(st, err, errlen);
                free(err);
                return 0;
        }
        FUZZ_CHECK(env != NULL);
        FUZZ_CHECK(env->msg_case != TESSERA__V1__ENVELOPE__MSG__NOT_SET);
        FUZZ_CHECK(strcmp(tsr_wire_msg_name(env), "none") != 0);
        FUZZ_CHECK(tsr_wire_check(env, err, errlen) == TSR_OK);
        FUZZ_CHECK(!has_field0(&env->base));

        /* The way back out: what came in valid must go out and come back valid. */
        FUZZ_CHECK(tsr_wire_pack(env, &packed, &packed_len) == TSR_OK);
        st = tsr_wire_unpack(packed, packed_len, 0, &again, err, errlen);
        if (st != TSR_OK)
                fprintf(stderr, "re-unpack of a packed valid envelope failed: %s (%s)\n", tsr_status_str(st), err);
        FUZZ_CHECK(st == TSR_OK);
        FUZZ_CHECK(again->msg_case == env->msg_case);
        FUZZ_CHECK(again->protocol_version == TSR_PROTO_VERSION);
        FUZZ_CHECK(tsr_wire_pack(again, &repacked, &repacked_len) == TSR_OK);
        FUZZ_CHECK(repacked_len == packed_len);
        FUZZ_CHECK(memcmp(repacked, packed, packed_len) == 0);

        tsr_wire_free(again);
        tsr_wire_free(env);
        free(repacked);
        free(packed);
        free(err);
        return 0;
}
