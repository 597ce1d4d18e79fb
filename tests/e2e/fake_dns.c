/* fake_dns.c - a getaddrinfo() for LD_PRELOAD, so the e2e tests of --worker-dns can
 * change what a name resolves to while the router runs (test_worker_dns.py).
 *
 * TSR_FAKE_DNS_FILE names a file of lines "NAME [IPV4 ...]", reread on every call (the
 * test replaces it atomically).  A NAME listed there answers its addresses in order,
 * or EAI_NONAME when the line has none; any other name goes to the real getaddrinfo.
 * Each answer node is one malloc (the addrinfo, its sockaddr_in behind it, no
 * canonical name), which is how glibc's freeaddrinfo expects to free it.
 *
 * Any thread: libuv calls it from its thread pool.  Test code only; never installed. */
#ifndef _GNU_SOURCE           /* RTLD_NEXT; meson passes it already */
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

typedef int (*getaddrinfo_fn)(const char *, const char *, const struct addrinfo *, struct addrinfo **);

/* Append one IPv4 answer; 0, or EAI_MEMORY. */
static int push(struct addrinfo ***tail, const struct in_addr *ip, int port, const struct addrinfo *hints) {
        struct addrinfo *ai = calloc(1, sizeof(*ai) + sizeof(struct sockaddr_in));
        struct sockaddr_in *sa;
        if (!ai)
                return EAI_MEMORY;
        sa = (struct sockaddr_in *)(ai + 1);
        sa->sin_family = AF_INET;
        sa->sin_port = htons((unsigned short)port);
        sa->sin_addr = *ip;
        ai->ai_family = AF_INET;
        ai->ai_socktype = hints && hints->ai_socktype ? hints->ai_socktype : SOCK_STREAM;
        ai->ai_protocol = hints ? hints->ai_protocol : 0;
        ai->ai_addrlen = sizeof(*sa);
        ai->ai_addr = (struct sockaddr *)sa;
        **tail = ai;
        *tail = &ai->ai_next;
        return 0;
}

/* 1: `node` is in the file and *res (maybe NULL) / *rc hold its answer; 0: not ours. */
static int from_file(const char *node, const char *service, const struct addrinfo *hints, struct addrinfo **res,
                     int *rc) {
        const char *path = getenv("TSR_FAKE_DNS_FILE");
        char line[1024];
        FILE *f;
        int found = 0;

        if (!path || !node || !(f = fopen(path, "r")))
                return 0;
        while (!found && fgets(line, sizeof(line), f)) {
                char *save = NULL, *tok = strtok_r(line, " \t\r\n", &save);
                struct addrinfo *head = NULL, **tail = &head;
                if (!tok || strcmp(tok, node) != 0)
                        continue;
                found = 1;
                *rc = 0;
                while (*rc == 0 && (tok = strtok_r(NULL, " \t\r\n", &save))) {
                        struct in_addr ip;
                        if (inet_pton(AF_INET, tok, &ip) == 1)
                                *rc = push(&tail, &ip, service ? atoi(service) : 0, hints);
                }
                if (*rc == 0 && !head)
                        *rc = EAI_NONAME;
                if (*rc != 0)
                        freeaddrinfo(head);
                else
                        *res = head;
        }
        fclose(f);
        return found;
}

int getaddrinfo(const char *node, const char *service, const struct addrinfo *hints, struct addrinfo **res) {
        getaddrinfo_fn real;
        int rc;

        if (from_file(node, service, hints, res, &rc))
                return rc;
        real = (getaddrinfo_fn)dlsym(RTLD_NEXT, "getaddrinfo");
        return real ? real(node, service, hints, res) : EAI_SYSTEM;
}
