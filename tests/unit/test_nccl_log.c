/* worker/parallel/nccl_log: NCCL's channel lines counted by transport (issue #18).
 *
 * The lines are written in the formats of NCCL's source (reference/distributed.md,
 * "Which line tells the transport": transport/net.cc, p2p.cc, shm.cc, coll_net.cc,
 * init.cc, and the "host:pid:tid [dev] NCCL INFO " prefix of debug.cc). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include "worker/parallel/nccl_log.h"

/* Two nodes of 2 GPUs each, InfiniBand with GPUDirect RDMA between them. */
static const char TWO_NODES_IB[] =
        "gpu-a:4101:4101 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>\n"
        "gpu-a:4101:4101 [0] NCCL INFO NCCL version 2.28.9+cuda13.0\n"
        "gpu-a:4101:4130 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [RO]; OOB eth0:10.0.0.1<0>\n"
        "gpu-a:4101:4130 [0] NCCL INFO Using network IB\n"
        "gpu-a:4101:4130 [0] NCCL INFO Channel 00/02 : 0 1 2 3\n"
        "gpu-a:4101:4131 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
        "gpu-a:4101:4132 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/IB/0/GDRDMA\n"
        "gpu-a:4101:4132 [1] NCCL INFO Channel 01/0 : 1[1] -> 2[0] [send] via NET/IB/1/GDRDMA\n"
        "gpu-a:4101:4131 [0] NCCL INFO Channel 00/0 : 3[1] -> 0[0] [receive] via NET/IB/0/GDRDMA\r\n"
        "gpu-a:4101:4131 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
        "gpu-a:4101:4131 [0] NCCL INFO Connected all rings, use ring PXN 0 GDR 1\n"
        "gpu-a:4101:4101 [0] NCCL INFO ncclCommInitRankConfig comm 0x55d0 rank 0 nranks 4 cudaDev 0 nvmlDev 0 "
        "busId 18000 commId 0x7a3f - Init COMPLETE\n";

static void test_two_nodes_ib(void **state) {
        (void)state;
        tsr_nccl_log log;
        tsr_nccl_log_init(&log);
        tsr_nccl_log_scan(&log, TWO_NODES_IB, strlen(TWO_NODES_IB));
        assert_string_equal(log.version, "2.28.9+cuda13.0");
        assert_string_equal(log.network, "IB");
        assert_int_equal(log.connections, 5);   /* the ring line "Channel 00/02 : 0 1 2 3" has no "via" */
        assert_int_equal(log.by_kind[TSR_NCCL_NET_IB_GDR], 3);
        assert_int_equal(log.by_kind[TSR_NCCL_P2P], 2);
        assert_int_equal(log.by_kind[TSR_NCCL_NET_SOCKET], 0);
        assert_int_equal(log.n_transports, 3);
        assert_string_equal(log.transports[0].text, "P2P/CUMEM/read");
        assert_int_equal(log.transports[0].count, 2);
        assert_string_equal(log.transports[1].text, "NET/IB/0/GDRDMA");   /* the \r\n line trimmed */
        assert_int_equal(log.transports[1].count, 2);
        assert_string_equal(log.transports[2].text, "NET/IB/1/GDRDMA");
        assert_int_equal(log.warnings, 0);
}

/* The same pair of nodes without InfiniBand: NCCL falls back to sockets. */
static void test_sockets_and_shm(void **state) {
        (void)state;
        static const char text[] =
                "gpu-b:77:77 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.2<0>\n"
                "gpu-b:77:77 [0] NCCL INFO Using network Socket\n"
                "gpu-b:77:90 [0] NCCL INFO Channel 00/0 : 2[0] -> 3[1] via SHM/direct/direct\n"
                "gpu-b:77:90 [0] NCCL INFO Channel 00 : 2[0] -> 3[1] via SHM/direct/direct\n"
                "gpu-b:77:91 [1] NCCL INFO Channel 00/0 : 3[1] -> 0[0] [send] via NET/Socket/0\n"
                "gpu-b:77:91 [1] NCCL INFO Channel 01/0 : 3[1] -> 0[0] [send] via NET/Socket/0\n"
                "gpu-b:77:90 [0] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [receive] via NET/Socket/0\n"
                "gpu-b:77:77 [0] NCCL WARN Call to ibv_open_device failed\n"
                "gpu-b:77:77 [0] NCCL WARN NET/IB : no device found\n"
                "INFO 11-28 14:02:11 [engine] not a line of NCCL's via NET/IB/0\n";   /* no "NCCL INFO": a bare line */
        tsr_nccl_log log;
        tsr_nccl_log_init(&log);
        tsr_nccl_log_scan(&log, text, sizeof(text) - 1);
        assert_string_equal(log.network, "Socket");
        assert_string_equal(log.version, "");
        assert_int_equal(log.by_kind[TSR_NCCL_NET_SOCKET], 3);
        assert_int_equal(log.by_kind[TSR_NCCL_SHM], 2);
        assert_int_equal(log.by_kind[TSR_NCCL_NET_IB_GDR] + log.by_kind[TSR_NCCL_NET_IB], 0);
        assert_int_equal(log.connections, 5);
        assert_int_equal(log.warnings, 2);
        assert_string_equal(log.first_warning, "Call to ibv_open_device failed");
}

static void test_classify(void **state) {
        (void)state;
        static const struct {
                const char *t;
                tsr_nccl_transport_kind k;
        } cases[] = {
                {"NET/IB/0/GDRDMA", TSR_NCCL_NET_IB_GDR},
                {"NET/IB/0(1)/GDRDMA/Shared", TSR_NCCL_NET_IB_GDR},     /* the proxy variant */
                {"NET/IB/3(PCI)/GDRDMA", TSR_NCCL_NET_IB_GDR},
                {"NET/IB/1", TSR_NCCL_NET_IB},
                {"NET/IB/1/Shared", TSR_NCCL_NET_IB},
                {"NET/Socket/0", TSR_NCCL_NET_SOCKET},
                {"NET/Socket/1/Shared", TSR_NCCL_NET_SOCKET},
                {"NET/AWS Libfabric/0/GDRDMA", TSR_NCCL_NET_OTHER},
                {"P2P/direct pointer", TSR_NCCL_P2P},
                {"P2P/CUMEM/read", TSR_NCCL_P2P},
                {"P2P/IPC/read", TSR_NCCL_P2P},
                {"P2P/MNNVL/CE", TSR_NCCL_P2P},
                {"P2P/indirect/2[2]", TSR_NCCL_P2P},
                {"SHM/direct/direct", TSR_NCCL_SHM},
                {"COLLNET/IB/0/GDRDMA", TSR_NCCL_COLLNET},
                {"something new", TSR_NCCL_OTHER},
        };
        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
                if (tsr_nccl_transport_classify(cases[i].t) != cases[i].k)
                        fail_msg("%s: %s, want %s", cases[i].t,
                                 tsr_nccl_transport_kind_name(tsr_nccl_transport_classify(cases[i].t)),
                                 tsr_nccl_transport_kind_name(cases[i].k));
        }
        assert_string_equal(tsr_nccl_transport_kind_name(TSR_NCCL_NET_SOCKET), "TCP sockets");
        assert_string_equal(tsr_nccl_transport_kind_name(TSR_NCCL_KINDS), "?");
}

/* A line is a connection only as "Channel ..." or "CollNet ..." with a transport after
 * " via "; the P2P transport with a space in it is kept whole. */
static void test_lines(void **state) {
        (void)state;
        tsr_nccl_log log;
        tsr_nccl_log_init(&log);
        assert_true(tsr_nccl_log_line(&log, "h:1:2 [0] NCCL INFO Channel 02/0 : 0[0] -> 1[0] via P2P/direct pointer  \n"));
        assert_string_equal(log.transports[0].text, "P2P/direct pointer");
        assert_true(tsr_nccl_log_line(&log, "h:1:2 [0] NCCL INFO CollNet 00/0 : 0 [send] via COLLNET/IB/0/GDRDMA"));
        assert_int_equal(log.by_kind[TSR_NCCL_COLLNET], 1);
        assert_true(tsr_nccl_log_line(&log, "Channel 00/0 : 0[0] -> 1[1] via P2P/IPC"));     /* no prefix */
        assert_false(tsr_nccl_log_line(&log, "h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via "));
        assert_false(tsr_nccl_log_line(&log, "h:1:2 [0] NCCL INFO Channel 00/32 :    0   1"));
        assert_false(tsr_nccl_log_line(&log, "h:1:2 [0] NCCL INFO Trees [0] 1/-1/-1->0->-1"));
        assert_false(tsr_nccl_log_line(&log, "h:1:2 [0] NCCL INFO comm 0x1 rank 0 nRanks 2 via nothing"));
        assert_false(tsr_nccl_log_line(&log, ""));
        assert_int_equal(log.connections, 3);
        /* a later version line replaces an earlier one (one process, one NCCL) */
        tsr_nccl_log_line(&log, "h:1:1 [0] NCCL INFO NCCL version 2.27.3+cuda12.9");
        assert_string_equal(log.version, "2.27.3+cuda12.9");
}

/* More distinct transports than the table holds: the last row collects the rest. */
static void test_table_full(void **state) {
        (void)state;
        tsr_nccl_log log;
        tsr_nccl_log_init(&log);
        char line[128];
        for (int i = 0; i < TSR_NCCL_LOG_TRANSPORTS + 5; i++) {
                snprintf(line, sizeof(line), "Channel 00/0 : 0[0] -> 1[1] [send] via NET/IB/%d/GDRDMA", i);
                assert_true(tsr_nccl_log_line(&log, line));
        }
        assert_int_equal(log.n_transports, TSR_NCCL_LOG_TRANSPORTS);
        assert_int_equal(log.connections, TSR_NCCL_LOG_TRANSPORTS + 5);
        assert_int_equal(log.by_kind[TSR_NCCL_NET_IB_GDR], TSR_NCCL_LOG_TRANSPORTS + 5);
        assert_string_equal(log.transports[TSR_NCCL_LOG_TRANSPORTS - 1].text, "(others)");
        assert_int_equal(log.transports[TSR_NCCL_LOG_TRANSPORTS - 1].count, 6);
        assert_string_equal(log.transports[0].text, "NET/IB/0/GDRDMA");
}

/* scan reads exactly len bytes: no NUL needed, a last line without a newline counts, and
 * bytes past len are not read. */
static void test_scan_bounds(void **state) {
        (void)state;
        static const char text[] = "a:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct\n"
                                   "a:1:1 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/IPC"
                                   "a:1:1 [0] NCCL INFO Channel 02/0 : 0[0] -> 1[1] via NET/Socket/0\n";
        size_t first_two = strlen(text) - strlen("a:1:1 [0] NCCL INFO Channel 02/0 : 0[0] -> 1[1] via NET/Socket/0\n");
        tsr_nccl_log log;
        tsr_nccl_log_init(&log);
        tsr_nccl_log_scan(&log, text, first_two);
        assert_int_equal(log.connections, 2);
        assert_int_equal(log.by_kind[TSR_NCCL_NET_SOCKET], 0);
        assert_string_equal(log.transports[1].text, "P2P/IPC");
        tsr_nccl_log_scan(&log, text, 0);
        assert_int_equal(log.connections, 2);
}

int main(void) {
        const struct CMUnitTest tests[] = {
                cmocka_unit_test(test_two_nodes_ib),
                cmocka_unit_test(test_sockets_and_shm),
                cmocka_unit_test(test_classify),
                cmocka_unit_test(test_lines),
                cmocka_unit_test(test_table_full),
                cmocka_unit_test(test_scan_bounds),
        };
        return cmocka_run_group_tests(tests, NULL, NULL);
}
